"""Fixtures shared across test files."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own load of the embedded SmolLM2 GGUF (~35 s to convert): once per test session."""
    from transformers import AutoModelForCausalLM

    from pagedllm.model.loader import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


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

    with scripted_server(make_agent_model(tmp_path_factory.mktemp("agent")), weather_script,
                         reasoning_parser="qwen3") as live:
        yield live
