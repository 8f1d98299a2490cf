"""The device path (what `device="cuda"` runs: torch ops only, inputs uploaded once per step, the pool on the device,
the torch sampler) run on the CPU through the same code, against the C++ path's tokens."""

from __future__ import annotations

import os

import pytest
import torch
from tiny_models import assert_no_leaks, make_llm, random_prompts, tokens
from torch.utils._python_dispatch import TorchDispatchMode

from pagedllm import SamplingParams
from pagedllm.attention import available_backends, register_backend
from pagedllm.attention.reference import ReferenceBackend
from pagedllm.engine.args import EngineArgs
from pagedllm.engine.placement import place, resolve_device
from pagedllm.structured.params import StructuredOutputsParams


class DeviceReference(ReferenceBackend):
    """The reference attention as a device backend: the runner's device path isolated from the device kernels."""

    name = "device-reference"
    cpu_kernels = False


register_backend("device-reference", DeviceReference, {"cpu": -1, "cuda": -1})
# the device kernels where they are installed (run on the CPU: Triton interpreted, FlexAttention eager)
BACKENDS = ["device-reference"] + [b for b in ("triton", "flex") if b in available_backends("cpu")]

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
DEVICE = os.environ.get("PAGEDLLM_TEST_DEVICE", "cpu")  # `pagedllm bench gpu` runs these on the GPU too


@pytest.fixture(scope="module")
def cpu_llm(tiny_dir):
    return make_llm(tiny_dir, enable_chunked_prefill=True, max_num_batched_tokens=48)


@pytest.mark.parametrize("backend", BACKENDS)
def test_device_path_generates_the_cpu_paths_tokens(tiny_dir, cpu_llm, backend):
    """Greedy over a mixed batch with chunked prefill and prefix-cache hits, seeded parallel samples (forks copy
    blocks on write) with logprobs, and a JSON-schema request (the grammar's bitmask applied on the device)."""
    llm = make_llm(tiny_dir, attention_backend=backend, enable_chunked_prefill=True, max_num_batched_tokens=48,
                   device=DEVICE)
    runner = llm.engine.runner
    assert runner.upload is not None and not runner.kernel_mode.cpu_kernels
    prompts = random_prompts(5, seed=7, lo=20, hi=70)
    prompts.append(prompts[0][:40] + [5, 6, 7])  # shares whole blocks with the first: a prefix hit
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == \
        tokens(cpu_llm.generate(prompts, GREEDY, use_tqdm=False))
    sampled = SamplingParams(n=3, temperature=0.9, top_p=0.9, seed=5, max_tokens=8, logprobs=2)
    dev, cpu = (x.generate(prompts[:2], sampled, use_tqdm=False) for x in (llm, cpu_llm))
    for d, c in zip(dev, cpu, strict=True):
        assert [o.token_ids for o in d.outputs] == [o.token_ids for o in c.outputs]
        for od, oc in zip(d.outputs, c.outputs, strict=True):
            for ld, lc in zip(od.logprobs, oc.logprobs, strict=True):
                assert ld.keys() == lc.keys()
                assert all(abs(ld[t].logprob - lc[t].logprob) < 1e-4 for t in ld)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    constrained = SamplingParams(temperature=0.0, max_tokens=20,
                                 structured_outputs=StructuredOutputsParams(json=schema))
    assert llm.generate(["x"], constrained, use_tqdm=False)[0].outputs[0].text == \
        cpu_llm.generate(["x"], constrained, use_tqdm=False)[0].outputs[0].text
    assert_no_leaks(llm)


def test_float16_on_the_device_path(tiny_dir, cpu_llm):
    """float16 weights, activations and KV (a GPU's other half-precision type) give the fp32 C++ path's greedy
    tokens on the tiny model (its logits are decisive), through the Triton kernels where installed; the CPU's
    kernels refuse it by name."""
    backend = "triton" if "triton" in BACKENDS else "device-reference"
    llm = make_llm(tiny_dir, attention_backend=backend, dtype="float16", device=DEVICE)
    assert llm.engine.runner.kv_caches.pool.dtype == torch.float16
    prompts = random_prompts(3, seed=11, lo=10, hi=40)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == tokens(cpu_llm.generate(prompts, GREEDY,
                                                                                              use_tqdm=False))
    with pytest.raises(ValueError, match="float16.*GPU"):
        place(EngineArgs(dtype="float16"))


def test_draft_model_speculation_on_the_device_path(tiny_dir, cpu_llm):
    """A draft model runs where the target runs, with its backend (on a GPU its weights and pool come out of the
    KV budget): greedy tokens equal the CPU path's without speculation, and drafts were accepted."""
    llm = make_llm(tiny_dir, attention_backend="device-reference", device=DEVICE, speculative_config={
        "method": "draft_model", "model": str(tiny_dir), "num_speculative_tokens": 3})
    draft = llm.engine.speculator.proposer.runner
    assert not draft.kernel_mode.cpu_kernels and draft.device == llm.engine.runner.device
    prompts = random_prompts(3, seed=13, lo=10, hi=40)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == tokens(cpu_llm.generate(prompts, GREEDY,
                                                                                              use_tqdm=False))
    assert llm.engine.spec_decode_stats()["num_accepted_tokens"] > 0


def test_profile_step_runs_the_largest_step_on_the_device_path(tiny_dir):
    """What a GPU's KV budget measures: one prompt of max_num_batched_tokens over a pool just large enough."""
    llm = make_llm(tiny_dir, attention_backend="device-reference", num_kv_blocks=64, device=DEVICE)
    llm.engine.runner.profile_step(64 * 8, 16)  # every block of the pool


def test_placement_refuses_what_cannot_run_there():
    with pytest.raises(ValueError, match="device must be"):
        EngineArgs(device="tpu")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineArgs(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="C\\+\\+ CPU kernels"):
        place(EngineArgs(attention_backend="device-reference", quantization="gguf"))
    assert place(EngineArgs(attention_backend="device-reference")).quantization == "none"
    assert not place(EngineArgs()).torch_path
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            resolve_device("cuda")
        assert resolve_device("auto").type == "cpu"


def test_server_with_speculation_on_the_device_path(tiny_dir, cpu_llm):
    """The OpenAI server over an engine on the device path, n-gram speculative decoding on: the real client's
    streamed greedy completion is the CPU path's text."""
    openai = pytest.importorskip("openai")
    from live_server import API_KEY, serving

    from pagedllm.engine.async_engine import AsyncEngine
    from pagedllm.entrypoints.openai.server import build_app

    llm = make_llm(tiny_dir, attention_backend="device-reference", device=DEVICE,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    engine = AsyncEngine(llm.engine)
    prompt = "the cat sat on the mat and the cat sat on the"
    want = cpu_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    with serving(engine, build_app(engine, api_key=API_KEY, served_model_name="tiny")) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY)
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0.0, stream=True)
        assert "".join(c.choices[0].text for c in stream) == want.text


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cli_names_a_missing_gpu_in_one_line(tiny_dir, capsys):
    from pagedllm.cli import main

    assert main(["generate", "--device", "cuda", "--model", str(tiny_dir), "Hi"]) == 2
    assert capsys.readouterr().err.strip() == ("pagedllm: error: device 'cuda': torch sees no CUDA GPU here "
                                               f"(torch {torch.__version__}); use device='cpu'")


READS_BACK = ("item", "_local_scalar_dense", "is_nonzero", "equal", "nonzero", "lift_fresh")


class HostReads(TorchDispatchMode):
    """The torch ops a CUDA graph cannot capture, dispatched inside it: a value read back to the host (.item(),
    int(), bool(): item or _local_scalar_dense, torch.equal, nonzero's data-dependent shape) or a tensor made from
    host data (torch.tensor(...): lift_fresh). Tensor .tolist() and .numpy() do not dispatch; their reads show up
    on a GPU only."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in READS_BACK:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


# the backend a GPU captures, interpreted here where Triton is installed (else the reference)
GRAPH_BACKEND = "triton" if DEVICE == "cuda" or "triton" in BACKENDS else "device-reference"


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3"])
def test_decode_graph_buffers_give_the_same_tokens(tmp_path_factory, arch):
    """The static-buffer decode steps a CUDA graph replays (worker/decode_graphs.py), run eagerly: batches padded to
    their bucket (padding rows in the scratch block), one block table per KV group (Gemma 3's sliding and full
    layers), forks, against the C++ path's tokens. With Triton's kernels (what a GPU captures) the forward also
    reads nothing back to the host. On a GPU the steps are captured (bench gpu runs this file there)."""
    from tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp(arch), arch, seed=4)
    prompts = random_prompts(3, seed=9, lo=10, hi=40)
    params = [GREEDY, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12)]
    want = [tokens(make_llm(path).generate(prompts, p, use_tqdm=False)) for p in params]
    # on a GPU: captured (the engine enables the graphs itself); here eager
    llm = make_llm(path, attention_backend=GRAPH_BACKEND, device=DEVICE, max_num_seqs=6)
    runner = llm.engine.runner
    if runner.decode_graphs is None:
        assert runner.enable_decode_graphs(6, llm.engine.max_model_len, capture=False)
    graphs, steps, reads = runner.decode_graphs, [], HostReads()
    run, forward = graphs.run, graphs._forward
    graphs.run = lambda b, *a: steps.append(b) or run(b, *a)
    if not graphs.capture and GRAPH_BACKEND == "triton":
        def guarded(*a):
            with reads:
                return forward(*a)
        graphs._forward = guarded
    got = [tokens(llm.generate(prompts, p, use_tqdm=False)) for p in params]
    assert got == want
    assert {4, 6} <= set(steps)  # padded buckets ran (3 requests: 4; 3 x 2 samples: 6)
    assert reads.seen == []
