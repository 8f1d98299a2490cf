"""The one dtype table: the names LLM(), the CLI, the engine and the loader accept. Torch-free at import (the
CLI parses arguments before torch loads)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# name -> torch dtype; "auto" (the default) is decided per CPU and weight format by auto_dtype. float16 runs on the
# device path only (a GPU: engine/placement.py); the CPU's kernels compute in fp32 and bf16.
DTYPES: dict[str, str] = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "auto": "auto"}


def auto_dtype(quantized: bool) -> str:
    """The faster compute dtype here. bf16 where the kernels compute in bf16 (avx512_bf16 / AMX). Without it bf16
    is emulated: dense weights still gain more from half the bytes than they lose, but weights run as stored read
    the same bytes either way and fp32 activations are faster (BENCHMARKS.md has the measurements)."""
    from pagedllm.kernels.library import native_bf16

    return "bfloat16" if native_bf16() or not quantized else "float32"


def resolve_dtype(dtype: str | torch.dtype, quantized: bool = False) -> torch.dtype:
    """`quantized`: the linears run quantized blocks (GGUF as stored, or int8), which is what "auto" depends on."""
    import torch

    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(map(repr, DTYPES))}, got {dtype!r}")
    return getattr(torch, auto_dtype(quantized) if dtype == "auto" else DTYPES[dtype])
