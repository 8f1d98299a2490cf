"""Paged decode through FlexAttention with a paged block mask, compiled by torch.compile (the candidate that lost).

Measured against the C++ kernel by `pagedllm bench kernel --flex`; see BENCHMARKS.md. Not an attention
backend: it only covers decode (one query per request), needs static shapes (one compile per batch
size / pool size / context bucket, 10-25 s each on this CPU) and reads the pool through a transposed view.

The pool [num_blocks, B, Hkv, D] is seen as one KV "sequence" [1, Hkv, num_blocks*B, D] shared by all requests;
request r's block-mask row lists its physical blocks (the block table) so flex only visits those, the full blocks
unmasked and the last partial block through mask_mod (physical slot -> logical position < seq_len).
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

_compiled = None


def _flex():
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def paged_block_mask(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int,
                     block_size: int) -> BlockMask:
    """Decode block mask over the physical pool: row r visits the blocks of its table, up to its length."""
    r, maxb = block_tables.shape
    tables = block_tables.to(torch.int32)
    nfull = (seq_lens // block_size).to(torch.int32)
    ntot = ((seq_lens + block_size - 1) // block_size).to(torch.int32)
    # the partial tail block (if any) is the only one that needs mask_mod
    has_tail = ntot > nfull
    tail = torch.gather(tables, 1, (ntot - 1).clamp(min=0).long()[:, None])
    # index tensors must span the whole pool (flex derives the transposed q-indices from them)
    kv_indices = torch.zeros((r, num_blocks), dtype=torch.int32)
    kv_indices[:, :1] = torch.where(has_tail[:, None], tail, torch.zeros_like(tail))
    full_indices = torch.zeros((r, num_blocks), dtype=torch.int32)
    full_indices[:, :maxb] = tables
    kv_num = has_tail.to(torch.int32)
    # physical block -> (request-local) logical index, for the mask_mod of the tail block
    phys_to_logical = torch.full((r, num_blocks), -1, dtype=torch.int32)
    phys_to_logical.scatter_(1, tables.long(), torch.arange(maxb, dtype=torch.int32).expand(r, maxb).contiguous())
    lens = seq_lens.to(torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        logical = phys_to_logical[b, kv_idx // block_size] * block_size + kv_idx % block_size
        return (logical >= 0) & (logical < lens[b])

    return BlockMask.from_kv_blocks(
        kv_num[:, None, None], kv_indices[:, None, None, :],
        nfull[:, None, None], full_indices[:, None, None, :],
        BLOCK_SIZE=(1, block_size), mask_mod=mask_mod, seq_lengths=(1, num_blocks * block_size))


class FlexPagedDecode:
    """Callable: q [R, Hq, D] -> [R, Hq, D], attending each request's single query to its paged context."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, seq_len: int,
                 num_heads: int, scale: float) -> None:
        nb, bs, hkv, d = k_cache.shape
        r = block_tables.shape[0]
        self.k = k_cache.view(1, nb * bs, hkv, d).transpose(1, 2)  # [1, Hkv, slots, D], no copy
        self.v = v_cache.view(1, nb * bs, hkv, d).transpose(1, 2)
        seq_lens = torch.full((r,), seq_len, dtype=torch.int32)
        self.mask = paged_block_mask(block_tables, seq_lens, nb, bs)
        self.scale = scale
        self.gqa = num_heads != hkv

    def __call__(self, q: torch.Tensor) -> torch.Tensor:
        out = _flex()(q[:, :, None, :], self.k, self.v, block_mask=self.mask, scale=self.scale,
                      enable_gqa=self.gqa)
        return out[:, :, 0, :]
