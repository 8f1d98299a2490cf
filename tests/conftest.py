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


def _kernel_mode(invariant: bool):
    from pagedllm import kernels

    before = kernels.batch_invariant()
    kernels.set_batch_invariant(invariant)
    yield
    kernels.set_batch_invariant(before)


@pytest.fixture
def batch_invariant_kernels():
    """The kernels' batch-invariant mode (the engine's default) for a test that calls kernels directly."""
    yield from _kernel_mode(True)


@pytest.fixture
def batch_dependent_kernels():
    """The batch-dependent fast paths (small GEMM, fused layer, bf16 attention paths) for the tests of those."""
    yield from _kernel_mode(False)
