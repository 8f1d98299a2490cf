"""Python entries to the paged-attention kernel (csrc/paged_attention.cpp) and the int8 K/V write (kv_write.cpp)."""

from __future__ import annotations

from typing import Protocol

import torch

from pagedllm.kernels.dispatch import KernelMode, current_mode
from pagedllm.kernels.library import load_ops


class PagedContext(Protocol):
    """What the kernel reads of a batch's attention metadata (attention.metadata.AttentionMetadata has it; the
    kernels sit below attention/ and name only the fields)."""

    block_tables: torch.Tensor  # [num_seqs, max_blocks] block ids
    seq_lens: torch.Tensor  # [num_seqs] context length after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] where each sequence's queries start in q


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedContext,
                    scale: float, *, mode: KernelMode | None = None, min_items: int = 0,
                    out: torch.Tensor | None = None, window: int | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [T,Hq,D] over the paged context described by meta (K/V already written). -> [T,Hq,D].
    mode: batch invariance and the portable path (None: the forward's, dispatch.current_mode()).
    window: each query sees only its `window` most recent keys, itself included (None: all of them).
    sinks [Hq]: a logit per query head in the softmax's denominator that adds no value (gpt-oss)."""
    mode = current_mode() if mode is None else mode
    ops = load_ops()
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    ops.paged_attention(out, q, k_cache, v_cache, _int32(meta.block_tables), _int32(meta.seq_lens),
                        _int32(meta.query_start_loc), float(scale), mode.portable, mode.invariant,
                        int(min_items), int(window or 0), None if sinks is None else sinks.float().contiguous())
    return out


def write_kv_int8(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Quantize the new K/V [T,Hkv,D] and scatter them into int8 pools at slot_mapping, in one pass (the same
    bytes as attention/kv_quant.quantize)."""
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    slots = slot_mapping if slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() else \
        slot_mapping.to(torch.int64).contiguous()
    load_ops().write_kv_int8(k, v, k_cache, v_cache, slots)


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()
