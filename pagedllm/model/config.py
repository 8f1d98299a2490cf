"""ModelConfig: the architecture facts the runtime needs, parsed from HF config.json or GGUF metadata."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.model import registry
from pagedllm.model.registry import UnsupportedModelError

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "freq_factors")  # freq_factors: GGUF rope_freqs


@dataclass
class ModelConfig:
    architecture: str  # a registry name: "llama" | "mistral" | "qwen2" | "qwen3"
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3", "factor": ...} etc.
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v (Qwen2, Llama with attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama with attention_bias)
    qk_norm: bool = False  # RMSNorm on q and k per head before RoPE (Qwen3)
    sliding_window: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(f"rope scaling type {rope_type!r} is not supported; supported: "
                                        f"{', '.join(SUPPORTED_ROPE_TYPES)}")

    def features(self) -> set[str]:
        """The optional features this checkpoint uses (registry names), checked against its architecture's."""
        used = {registry.QKV_BIAS: self.qkv_bias, registry.O_BIAS: self.o_bias, registry.QK_NORM: self.qk_norm,
                registry.TIED_EMBEDDINGS: self.tie_word_embeddings,
                registry.ROPE_SCALING: self.rope_scaling is not None,
                # a window no context can exceed changes nothing
                registry.SLIDING_WINDOW: (self.sliding_window or self.max_position_embeddings)
                < self.max_position_embeddings}
        return {name for name, on in used.items() if on}

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def check_token_ids(token_ids: Iterable[int], vocab_size: int) -> None:
    """Raise ValueError naming the first id outside [0, vocab_size). Called by the engine at add_request."""
    bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise ValueError(f"token id {bad[0]!r} is outside the vocabulary [0, {vocab_size}) "
                         f"({len(bad)} invalid id(s))")


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def config_from_hf(cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json dict (transformers 4.x and 5.x spellings)."""
    spec = registry.spec_for_hf(cfg.get("architectures") or [], cfg.get("model_type"))
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    # transformers 5 puts theta and scaling in rope_parameters; 4.x uses rope_theta + rope_scaling
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = rope if rope.get("rope_type", "default") != "default" else None
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=True is not supported")
    sliding = cfg.get("sliding_window")
    if spec.window_switch and not cfg.get(spec.window_switch, False):
        sliding = None
    eos = _eos_list((generation_config or {}).get("eos_token_id")) or _eos_list(cfg.get("eos_token_id"))
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    if sliding and int(sliding) < max_pos and registry.SLIDING_WINDOW not in spec.supports:
        # attention here is always full: it equals sliding-window attention only while contexts fit the window
        logger.warning("sliding_window=%d is not implemented; capping the context at %d tokens to stay exact",
                       int(sliding), int(sliding))
        max_pos = int(sliding)
    config = ModelConfig(
        architecture=spec.name,
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=max_pos,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=spec.always_qkv_bias or bool(cfg.get("attention_bias", False)),
        o_bias=not spec.always_qkv_bias and bool(cfg.get("attention_bias", False)),
        qk_norm=spec.always_qk_norm,
        sliding_window=int(sliding) if sliding else None,
        eos_token_ids=eos,
        bos_token_id=cfg.get("bos_token_id"),
    )
    spec.check_features(config.features())
    return config
