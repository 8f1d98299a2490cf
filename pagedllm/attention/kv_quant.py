"""Int8 KV cache rows: symmetric int8 values with one float16 scale per (token, KV head), stored together.

An int8 pool is [num_blocks, block_size, num_kv_heads, head_dim + SCALE_BYTES] int8: each (token, head) row holds
its head_dim values, then the two bytes of its float16 scale (value = q * scale). A block therefore carries its
own scales: block copies, copy-on-write, prefix-cache hits and preemption need nothing beyond what they do for
float pools, and a kernel finds a row's scale right after the row. float16 (not float32) scales keep a row at
head_dim + 2 bytes: 1.94x fewer bytes than bf16 at head_dim 64.

Quantization rounds in float32 whatever the input dtype (scale = f16(max|x| / 127), q = round_half_even(x / scale)),
exactly as the C++ write (kernels/csrc/kv_write.cpp), so both write the same bytes. Dequantized values are exact
in float32 (8-bit integer times an 11-bit mantissa), so the oracle and the kernels attend over the same numbers.
"""

from __future__ import annotations

import math

import torch

SCALE_BYTES = 2  # a float16 scale at the end of every row
QMAX = 127.0  # symmetric: -127..127
F16_MAX = 65504.0


def is_int8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def row_elems(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Elements of one (token, KV head) row in a pool of kv_dtype."""
    return head_dim + SCALE_BYTES if kv_dtype == torch.int8 else head_dim


def cache_head_dim(cache: torch.Tensor) -> int:
    return cache.shape[-1] - SCALE_BYTES if is_int8(cache) else cache.shape[-1]


def quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D + SCALE_BYTES] int8 rows (values, then the float16 scale's bytes)."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    scale = (amax / QMAX).clamp(max=F16_MAX).to(torch.float16)
    s = scale.float()
    q = torch.where(s > 0, x / s, 0.0).round().clamp(-QMAX, QMAX).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], -1)


def dequantize(rows: torch.Tensor) -> torch.Tensor:
    """[..., D + SCALE_BYTES] int8 rows -> [..., D] float32."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float16).float()
    return rows[..., :d].float() * scale


def round_queries(q: torch.Tensor, scale: float, block: int = 32) -> torch.Tensor:
    """q [..., D] as the C++ kernel's int8 dot path sees it over an int8 cache (kernels/csrc/attention_dot_int8.cpp):
    times scale * log2(e) in float32, rounded to int8 per block of 32 (block scale max|x| / 127), and back. The
    oracle on these queries is what that path computes, to rounding (of the fp32 sums and of each chunk's
    probabilities, which that path rounds to 15 bits). -> float64, in q's units."""
    qscale = torch.tensor(scale, dtype=torch.float32) * torch.tensor(math.log2(math.e), dtype=torch.float32)
    x = (q.float() * qscale).unflatten(-1, (-1, block))
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, QMAX / amax, 0.0)
    codes = (x * inv).round()
    return (codes.double() * (amax / QMAX).double() / qscale.double()).flatten(-2)


def as_float(cache_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a pool (int8 or float) in dtype: the attention oracle's view of the cache."""
    return (dequantize(cache_rows) if is_int8(cache_rows) else cache_rows).to(dtype)


def random_pool(shape: tuple[int, ...], kv_dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A pool of fresh random K or V (shape with head_dim last) in kv_dtype: for tests and benchmarks."""
    x = torch.randn(*shape, generator=gen)
    return quantize(x) if kv_dtype == torch.int8 else x.to(kv_dtype)
