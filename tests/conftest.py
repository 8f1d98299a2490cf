"""Fixtures shared across test files (helpers shared by the engine tests are in tiny_models.py)."""

from __future__ import annotations

import os

import pytest
import torch

# Nothing in the tests may reach for a hub (no internet here): set once, before any test module imports
# transformers or huggingface_hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The tests' default model is the 135M, where speed matters more than answers (this process and the servers and
# CLIs it starts); tests of the real default name it (test_default_model.py).
os.environ.setdefault("PAGEDLLM_DEFAULT_MODEL", "smollm2-135m-instruct")
# Without CUDA the Triton attention kernels run in Triton's interpreter, chosen when a function is decorated, also
# triton.language's own when it is first imported: set before any test module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The tiny seeded Llama (a real HF directory with a BPE tokenizer) most engine tests run on."""
    from tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama", seed=3)


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own load of the embedded SmolLM2 GGUF (~35 s to convert): once per test session."""
    from tiny_models import hf_model_from_gguf

    from pagedllm.model.loader import default_model_path

    return hf_model_from_gguf(default_model_path(), torch.float32)


@pytest.fixture
def batch_invariant_kernels():
    """The kernels' batch-invariant mode (the engine's default) for a test that calls kernels directly."""
    from pagedllm.kernels import kernel_mode

    with kernel_mode(invariant=True):
        yield


@pytest.fixture
def batch_dependent_kernels():
    """The batch-dependent fast paths (small GEMM, fused layer, bf16 attention paths) for the tests of those."""
    from pagedllm.kernels import kernel_mode

    with kernel_mode(invariant=False):
        yield


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory):
    """A live server on a tiny Qwen3-style model whose tokens spell agent_harness.weather_script (one per module)."""
    from agent_harness import make_agent_model, scripted_server, weather_script

    # (some tests send their own chat template: the server trusts request templates)
    with scripted_server(make_agent_model(tmp_path_factory.mktemp("agent")), weather_script,
                         reasoning_parser="qwen3", trust_request_chat_template=True) as live:
        yield live
