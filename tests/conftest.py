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
