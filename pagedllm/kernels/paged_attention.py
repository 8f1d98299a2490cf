"""Python entries to the paged-attention kernel (csrc/paged_attention.cpp) and the int8 K/V write (kv_write.cpp)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedllm.kernels.build import load_ops

if TYPE_CHECKING:  # the kernels sit below attention/: the type only
    from pagedllm.attention.metadata import AttentionMetadata


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, *, portable: bool = False, min_items: int = 0, invariant: bool | None = None,
                    out: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Attention of q [T,Hq,D] over the paged context described by meta (K/V already written). -> [T,Hq,D].
    invariant: batch-invariant arithmetic (None: the process-wide mode, kernels.batch_invariant()).
    window: each query sees only its `window` most recent keys, itself included (None: all of them)."""
    if invariant is None:
        from pagedllm.kernels import batch_invariant

        invariant = batch_invariant()
    ops = load_ops()
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    ops.paged_attention(out, q, k_cache, v_cache, _int32(meta.block_tables), _int32(meta.seq_lens),
                        _int32(meta.query_start_loc), float(scale), int(portable) | int(invariant) << 1, int(min_items),
                        int(window or 0))
    return out


def rounds_int8_queries(head_dim: int, portable: bool = False) -> bool:
    """Whether paged_attention over an int8 KV cache runs on integers for this head size (VNNI q . k and p . V:
    q rounded to int8, see attention/kv_quant.round_queries, and each chunk's probabilities to 15 bits) rather
    than dequantizing K and V."""
    return not portable and bool(load_ops().attention_rounds_int8_queries(head_dim))


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
