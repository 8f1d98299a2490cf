"""The one dtype table: the names LLM(), the CLI, the engine and the loader accept. Torch-free at import (the
CLI parses arguments before torch loads)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# name -> torch dtype. "auto" is bfloat16 compute whatever the checkpoint stores: the engine's default (half the
# memory traffic of float32; the fused C++ layer and the small-GEMM kernel run only in bf16).
DTYPES: dict[str, str] = {"float32": "float32", "bfloat16": "bfloat16", "auto": "bfloat16"}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(map(repr, DTYPES))}, got {dtype!r}")
    return getattr(torch, DTYPES[dtype])
