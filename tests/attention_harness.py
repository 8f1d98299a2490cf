"""Random paged-attention batches and the float64 oracle, shared by the tests of the attention kernels (the C++
one in kernels/, the Triton one in attention/)."""

from __future__ import annotations

import dataclasses
import os

import torch

from pagedllm.attention import build_attention_metadata
from pagedllm.attention.kv_quant import SCALE_BYTES, is_int8, random_pool, round_queries
from pagedllm.attention.reference import ReferenceBackend

# the device kernels' tests run on the GPU too, when `pagedllm bench gpu` sets this
DEVICE = os.environ.get("PAGEDLLM_TEST_DEVICE", "cpu")


def make_batch(gen: torch.Generator, num_computed: list[int], num_new: list[int], block_size: int, hq: int,
               hkv: int, d: int, dtype: torch.dtype, kv_dtype: torch.dtype, spare_blocks: int = 7,
               device: str = "cpu"):
    """Random pool with scattered block tables: every request's blocks are a random subset of the pool (drawn on
    the CPU, then moved to `device` with the metadata's tensors)."""
    need = [-(-(c + n) // block_size) for c, n in zip(num_computed, num_new, strict=True)]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for nb in need:
        tables.append(perm[at:at + nb])
        at += nb
    meta = build_attention_metadata(tables, num_computed, num_new, block_size)
    k_cache = random_pool((num_blocks, block_size, hkv, d), kv_dtype, gen)
    v_cache = random_pool((num_blocks, block_size, hkv, d), kv_dtype, gen)
    t = sum(num_new)
    q = torch.randn(t, hq, d, generator=gen).to(dtype)
    k = torch.randn(t, hkv, d, generator=gen).to(dtype)
    v = torch.randn(t, hkv, d, generator=gen).to(dtype)
    if device != "cpu":
        q, k, v, k_cache, v_cache = (x.to(device) for x in (q, k, v, k_cache, v_cache))
        meta = dataclasses.replace(meta, **{f: getattr(meta, f).to(device) for f in
                                            ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")})
    return q, k, v, k_cache, v_cache, meta


def oracle(q, k, v, k_cache, v_cache, meta, scale, window=None, sinks=None, rounded_queries=False):
    """The reference backend in float64 on the values the pool holds (new K/V rounded to the cache dtype, or
    quantized into int8 rows and dequantized: exact in any float dtype). Writes the new K/V into the caches.
    rounded_queries: over int8 K/V, q rounded to int8 blocks first, as the C++ kernel's VNNI path does."""
    if is_int8(k_cache):
        if rounded_queries:
            q = round_queries(q, scale)
        return ReferenceBackend().forward(q.double(), k, v, k_cache, v_cache, meta, scale, window, sinks)
    kv = k_cache.dtype
    k64, v64 = k_cache.double(), v_cache.double()
    out = ReferenceBackend().forward(q.double(), k.to(kv).double(), v.to(kv).double(), k64, v64, meta, scale, window,
                                     sinks)
    k_cache.copy_(k64), v_cache.copy_(v64)
    return out


def poison(cache: torch.Tensor, block: int) -> None:
    """Garbage (NaN, or int8 rows with a NaN scale) in a block that must never be read."""
    if is_int8(cache):
        cache[block] = 127
        cache[block, ..., -SCALE_BYTES:] = torch.tensor([0x00, 0x7E], dtype=torch.uint8).view(torch.int8)  # f16 NaN
    else:
        cache[block] = float("nan")
