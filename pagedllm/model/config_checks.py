"""Sane ranges for the numbers a checkpoint's config gives, checked before anything is sized by them: a hostile
`block_count = 2^40` must fail here, not loop or allocate. One table for HF config.json and GGUF metadata; the
caller names the field as its file spells it."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from pagedllm.model.errors import InvalidModelError

# ModelConfig field -> inclusive range (far beyond any real model, far below what would exhaust a machine)
INT_LIMITS: dict[str, tuple[int, int]] = {
    "num_layers": (1, 1024),
    "hidden_size": (1, 1 << 16),
    "intermediate_size": (1, 1 << 20),
    "num_heads": (1, 1024),
    "num_kv_heads": (1, 1024),
    "head_dim": (2, 1024),
    "vocab_size": (1, 1 << 22),
    "max_position_embeddings": (1, 1 << 24),
    "sliding_window": (1, 1 << 24),
    "num_experts": (1, 1 << 12),
    "num_experts_per_tok": (1, 1 << 12),
    "moe_intermediate_size": (1, 1 << 20),
    "decoder_sparse_step": (1, 1024),
}
# field -> exclusive upper bound of a finite, positive float
FLOAT_LIMITS: dict[str, float] = {
    "rms_norm_eps": 1.0,
    "rope_theta": 1e12,
    "rope_local_theta": 1e12,
    "rope_scaling.factor": 1e6,
    "final_logit_softcapping": 1e6,
    "query_pre_attn_scalar": 1e9,
    "embedding_multiplier": 1e6,
    "residual_multiplier": 1e6,
    "logits_scaling": 1e6,
    "attention_multiplier": 1e6,
    "swiglu": 1e6,
}

Fail = Callable[[str, str], InvalidModelError]  # (field as the file names it, detail) -> the error to raise


def checked_int(value: Any, field: str, name: str, fail: Fail) -> int:
    """`value` as an int within INT_LIMITS[field] (`name`: the field as the file spells it)."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(name, f"must be an integer, got {_show(value)}")
    lo, hi = INT_LIMITS[field]
    if not lo <= value <= hi:
        raise fail(name, f"{value} is outside the sane range [{lo}, {hi}]")
    return value


def checked_float(value: Any, field: str, name: str, fail: Fail) -> float:
    """`value` as a finite float in (0, FLOAT_LIMITS[field])."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise fail(name, f"must be a number, got {_show(value)}")
    x = float(value)
    if not (math.isfinite(x) and 0 < x < FLOAT_LIMITS[field]):
        raise fail(name, f"{x!r} must be finite and in (0, {FLOAT_LIMITS[field]:g})")
    return x


def check_token_id(value: Any, vocab_size: int, name: str, fail: Fail) -> int:
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        raise fail(name, f"token id {_show(value)} is outside the vocabulary [0, {vocab_size})")
    return value


def check_head_layout(num_heads: int, num_kv_heads: int, head_dim: int, names: dict[str, str], fail: Fail) -> None:
    """The attention shapes must divide: query heads share KV heads evenly, RoPE rotates pairs."""
    if num_heads % num_kv_heads:
        raise fail(names["num_kv_heads"], f"{num_kv_heads} KV heads do not divide {num_heads} query heads "
                                          f"({names['num_heads']})")
    if head_dim % 2:
        raise fail(names["head_dim"], f"head dimension {head_dim} is odd (RoPE rotates pairs)")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
