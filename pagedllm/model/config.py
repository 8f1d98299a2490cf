"""ModelConfig: the architecture facts the runtime needs, parsed from HF config.json or GGUF metadata."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.model import registry
from pagedllm.model.config_checks import checked_float, checked_int
from pagedllm.model.errors import InvalidModelError
from pagedllm.model.registry import UnsupportedModelError

# freq_factors: GGUF rope_freqs; longrope: Phi-3's short and long factors, chosen by the sequence's length
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "freq_factors", "longrope", "yarn")


@dataclass
class ModelConfig:
    architecture: str  # a registry name: "llama" | "mistral" | "qwen2" | "qwen3" | "gemma3"
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
    rotary_dim: int | None = None  # the leading dims of each head RoPE rotates (partial rotary: Phi); None: all
    nope_layers: list[int] = field(default_factory=list)  # layers without positional encoding (SmolLM3's NoPE)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v (Qwen2, Llama with attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama with attention_bias)
    qk_norm: bool = False  # RMSNorm on q and k per head before RoPE (Qwen3)
    sliding_window: int | None = None  # tokens a windowed layer attends to (itself included)
    layer_types: list[str] | None = None  # per layer "sliding_attention" | "full_attention"; None: all the same
    rope_local_theta: float | None = None  # RoPE base of the sliding layers where it differs (Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (Gemma); None: head_dim
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    qk_norm_whole: bool = False  # the q/k norm spans every head's projection at once (OLMoE), not one head
    # Granite's multipliers: embeddings x embedding_multiplier, each residual branch x residual_multiplier, logits /
    # logits_scaling, attention scaled by attention_multiplier (None: head_dim ** -0.5 as everywhere else)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention_multiplier: float | None = None
    # mixture of experts (0 experts: a dense model)
    num_experts: int = 0
    num_experts_per_tok: int = 0  # the top k each token uses
    moe_intermediate_size: int = 0  # one expert's width
    norm_topk_prob: bool = False  # the k chosen weights renormalised to sum to 1
    dense_layers: list[int] = field(default_factory=list)  # layers of an MoE model whose MLP is dense
    moe_bias: bool = False  # biases on the router and the experts' projections (gpt-oss)
    swiglu_limit: float | None = None  # the experts' SwiGLU clamped at this limit, its sigmoid sharpened by
    swiglu_alpha: float = 1.0  # this (gpt-oss); None: plain SwiGLU
    attention_sinks: bool = False  # a learned sink logit per query head in every layer's softmax (gpt-oss)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(f"rope scaling type {rope_type!r} is not supported; supported: "
                                        f"{', '.join(SUPPORTED_ROPE_TYPES)}", field="rope_scaling.rope_type")
        if not (self.rotary_dim is None or (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0)):
            raise InvalidModelError(f"{self.rotary_dim} rotary dims do not fit a head of {self.head_dim} in pairs",
                                    field="partial_rotary_factor")
        if self.qk_norm and self.rotates < self.head_dim:
            raise UnsupportedModelError("a per-head q/k norm with partial rotary is not supported")
        if rope_type == "longrope":
            check_longrope(self.rope_scaling, self.rotates)
        if rope_type == "yarn":
            check_yarn(self.rope_scaling)
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise InvalidModelError(f"{self.num_experts_per_tok} experts per token is outside [1, "
                                    f"{self.num_experts}] (the experts per layer)", field="num_experts_per_tok")

    @property
    def rotates(self) -> int:
        """The dims of each head RoPE rotates."""
        return self.rotary_dim or self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None where it attends to its whole context."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def attn_scale(self) -> float:
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def features(self) -> set[str]:
        """The optional features this checkpoint uses (registry names), checked against its architecture's."""
        used = {registry.QKV_BIAS: self.qkv_bias, registry.O_BIAS: self.o_bias, registry.QK_NORM: self.qk_norm,
                registry.TIED_EMBEDDINGS: self.tie_word_embeddings,
                registry.ROPE_SCALING: self.rope_scaling is not None,
                # a window no context can exceed changes nothing
                registry.SLIDING_WINDOW: any((self.layer_window(i) or self.max_position_embeddings)
                                             < self.max_position_embeddings for i in range(self.num_layers)),
                registry.MOE: self.num_experts > 0, registry.QK_NORM_WHOLE: self.qk_norm_whole,
                registry.PARTIAL_ROTARY: self.rotates < self.head_dim, registry.NOPE: bool(self.nope_layers),
                registry.ATTENTION_SINKS: self.attention_sinks, registry.MOE_BIAS: self.moe_bias,
                registry.CLAMPED_SWIGLU: self.swiglu_limit is not None,
                registry.MULTIPLIERS: (self.embedding_multiplier, self.residual_multiplier, self.logits_scaling,
                                       self.attention_multiplier) != (1.0, 1.0, 1.0, None)}
        return {name for name, on in used.items() if on}

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def check_longrope(scaling: dict[str, Any], rotates: int) -> None:
    """LongRoPE's parameters, complete and sane (InvalidModelError naming the field): one short and one long
    factor per rotated pair, the context they switch at, the cos/sin scale."""
    def fail(key: str, detail: str) -> InvalidModelError:
        return InvalidModelError(detail, field=f"rope_scaling.{key}")

    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if factors is None:
            raise fail(key, "missing (LongRoPE needs a short and a long factor per rotated pair)")
        if not (isinstance(factors, list | tuple) and len(factors) == rotates // 2):
            raise fail(key, f"must be a list of {rotates // 2} numbers (one per rotated pair)")
        for x in factors:
            checked_float(x, "rope_scaling.factor", f"rope_scaling.{key}", fail)
    if scaling.get("original_max_position_embeddings") is None:
        raise fail("original_max_position_embeddings", "missing (the context length where LongRoPE switches from "
                                                        "the short to the long factors)")
    checked_int(scaling["original_max_position_embeddings"], "max_position_embeddings",
                "original_max_position_embeddings", fail)
    checked_float(scaling.get("attention_factor", 1.0), "rope_scaling.factor", "attention_factor", fail)


def check_yarn(scaling: dict[str, Any]) -> None:
    """YaRN's parameters present and sane (InvalidModelError naming the field)."""
    def fail(key: str, detail: str) -> InvalidModelError:
        return InvalidModelError(detail, field=f"rope_scaling.{key}")

    for key in ("factor", "original_max_position_embeddings"):
        if scaling.get(key) is None:
            raise fail(key, "missing (YaRN needs its factor and the original context)")
    checked_int(scaling["original_max_position_embeddings"], "max_position_embeddings",
                "original_max_position_embeddings", fail)
    for key in ("factor", "attention_factor", "beta_fast", "beta_slow"):
        if scaling.get(key) is not None:
            checked_float(scaling[key], "rope_scaling.factor", key, fail)


def yarn_scaling(scaling: dict[str, Any], max_positions: int) -> dict[str, Any]:
    """YaRN as transformers reads it: the factor (where not given, max over original context) and the cos/sin
    scale (where not given, 0.1 ln(factor) + 1, or DeepSeek's ratio of two such terms with mscale and
    mscale_all_dim)."""
    out = dict(scaling)
    original = out.get("original_max_position_embeddings")
    if out.get("factor") is None and original:
        out["factor"] = max_positions / float(original)
    if out.get("attention_factor") is None and isinstance(out.get("factor"), int | float):
        def mscale(factor: float, m: float = 1.0) -> float:
            return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0

        factor, m, m_all = float(out["factor"]), out.get("mscale"), out.get("mscale_all_dim")
        out["attention_factor"] = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return out


def field_error(name: str, detail: str) -> InvalidModelError:
    """The error for config.json field `name` (config_checks' Fail)."""
    return InvalidModelError(detail, field=name)


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
    _check_hf_numbers(cfg)
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    # transformers 5 puts theta and scaling in rope_parameters (per layer type for Gemma 3); 4.x uses rope_theta +
    # rope_scaling (+ rope_local_base_freq)
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    local_rope = dict(rope.pop("sliding_attention", None) or {})
    rope = dict(rope.pop("full_attention", None) or rope)
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    local_theta = local_rope.get("rope_theta", cfg.get("rope_local_base_freq"))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    rotary = float(rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    scaling = _rope_scaling(rope)
    if scaling and scaling["rope_type"] == "longrope":
        scaling = _longrope(scaling, cfg)
    if scaling and scaling["rope_type"] == "yarn":
        # the original context, where neither the scaling nor the config gives it: the context (as transformers)
        positions = int(cfg.get("max_position_embeddings", 2048))
        original = cfg.get("original_max_position_embeddings") or positions
        scaling = yarn_scaling({"original_max_position_embeddings": original, **scaling}, positions)
    if _rope_scaling(local_rope):
        raise UnsupportedModelError("rope scaling on sliding-window layers is not supported")
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=True is not supported")
    if cfg.get("attn_logit_softcapping"):
        raise UnsupportedModelError("attention logit softcapping is not supported")
    if cfg.get("clip_qkv") is not None:
        raise UnsupportedModelError("clip_qkv is not supported")
    if cfg.get("shared_expert_intermediate_size"):
        raise UnsupportedModelError("shared experts are not supported")
    sliding = cfg.get("sliding_window")
    if spec.window_switch and not cfg.get(spec.window_switch, False):
        sliding = None
    num_layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types") if sliding else None
    if sliding and layer_types is None:
        layer_types = _default_layer_types(cfg, spec, num_layers)
    eos = _eos_list((generation_config or {}).get("eos_token_id")) or _eos_list(cfg.get("eos_token_id"))
    config = ModelConfig(
        architecture=spec.name,
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_dim=int(head_dim * rotary) if rotary != 1.0 else None,
        nope_layers=_hf_nope_layers(cfg, spec, num_layers),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=spec.always_qkv_bias or bool(cfg.get("attention_bias", False)),
        o_bias=not spec.always_qkv_bias and bool(cfg.get("attention_bias", False)),
        qk_norm=spec.always_qk_norm,
        sliding_window=int(sliding) if sliding else None,
        layer_types=list(layer_types) if layer_types else None,
        rope_local_theta=float(local_theta) if local_theta is not None else None,
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        eos_token_ids=eos,
        bos_token_id=cfg.get("bos_token_id"),
        qk_norm_whole=spec.qk_norm_whole,
        attention_sinks=spec.attention_sinks,
        **_hf_experts(cfg, spec, num_layers),
        **_hf_multipliers(cfg, spec),
    )
    spec.check_features(config.features())
    return config


def _longrope(scaling: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """LongRoPE as transformers reads it: the switch point from the scaling or the config's top level, and the
    cos/sin scale, where not given, from the context extension factor (max over original context)."""
    out = dict(scaling)
    original = out.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    if original is not None and "attention_factor" not in out:
        original = checked_int(original, "max_position_embeddings", "original_max_position_embeddings",
                               field_error)
        factor = float(out.get("factor") or int(cfg.get("max_position_embeddings", 2048)) / original)
        out["attention_factor"] = (math.sqrt(1 + math.log(factor) / math.log(original))
                                   if factor > 1.0 and original > 1 else 1.0)
    return out


def _hf_nope_layers(cfg: dict[str, Any], spec: registry.ArchSpec, num_layers: int) -> list[int]:
    """The layers without RoPE (SmolLM3): its `no_rope_layers` flags (1: the layer uses RoPE), or every
    `no_rope_layer_interval`-th layer (the architecture's default interval where the config gives neither)."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = cfg.get("no_rope_layer_interval", spec.nope_interval)
        if interval is None:
            return []
        interval = checked_int(interval, "num_layers", "no_rope_layer_interval",
                               field_error)
        return nope_every(interval, num_layers)
    if not (isinstance(flags, list) and len(flags) == num_layers and all(f in (0, 1) for f in flags)):
        raise InvalidModelError(f"must be {num_layers} flags of 0 or 1 (one per layer)", field="no_rope_layers")
    return [i for i, uses_rope in enumerate(flags) if not uses_rope]


def nope_every(interval: int, num_layers: int) -> list[int]:
    """Every interval-th layer without RoPE (SmolLM3: layers 3, 7, 11, ...)."""
    return [i for i in range(num_layers) if (i + 1) % interval == 0]


def _hf_multipliers(cfg: dict[str, Any], spec: registry.ArchSpec) -> dict[str, Any]:
    """Granite's multipliers (its attention is scaled by attention_multiplier, 1.0 unless given)."""
    if registry.MULTIPLIERS not in spec.supports:
        return {}
    out = {key: float(cfg.get(key, 1.0)) for key in ("embedding_multiplier", "residual_multiplier",
                                                       "logits_scaling", "attention_multiplier")}
    for key, value in out.items():
        checked_float(value, key, key, field_error)
    return out


def _hf_experts(cfg: dict[str, Any], spec: registry.ArchSpec, num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of a config.json (transformers 4.x `num_experts`, 5.x `num_local_experts`);
    none for a dense model."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not experts:
        return {}
    step = int(cfg.get("decoder_sparse_step") or 1)
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    renormalize = spec.moe_renormalize if spec.moe_renormalize is not None else bool(cfg.get("norm_topk_prob"))
    return dict(num_experts=int(experts), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
                norm_topk_prob=renormalize,
                dense_layers=[i for i in range(num_layers) if i in mlp_only or (i + 1) % step],
                **arch_moe_options(spec, cfg.get("swiglu_limit"), cfg.get("swiglu_alpha")))


def arch_moe_options(spec: registry.ArchSpec, limit: Any = None, alpha: Any = None) -> dict[str, Any]:
    """The MoE options an architecture fixes (gpt-oss: expert biases, a clamped SwiGLU whose limit and alpha a
    config may give)."""
    if spec.swiglu_clamp is None:
        return {"moe_bias": spec.moe_bias}
    limit = checked_float(spec.swiglu_clamp[0] if limit is None else limit, "swiglu", "swiglu_limit", field_error)
    alpha = checked_float(spec.swiglu_clamp[1] if alpha is None else alpha, "swiglu", "swiglu_alpha", field_error)
    return {"moe_bias": spec.moe_bias, "swiglu_limit": limit, "swiglu_alpha": alpha}


# config.json key -> config_checks field, for the numbers that size the model
_HF_INTS = {"num_hidden_layers": "num_layers", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
            "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
            "vocab_size": "vocab_size", "max_position_embeddings": "max_position_embeddings",
            "sliding_window": "sliding_window", "num_experts": "num_experts", "num_local_experts": "num_experts",
            "num_experts_per_tok": "num_experts_per_tok", "moe_intermediate_size": "moe_intermediate_size",
            "decoder_sparse_step": "decoder_sparse_step"}


def _check_hf_numbers(cfg: dict[str, Any]) -> None:
    """The numbers config.json gives, in sane ranges before anything is sized by them (InvalidModelError)."""
    for key, field_name in _HF_INTS.items():
        if cfg.get(key) is not None:
            checked_int(cfg[key], field_name, key, field_error)
        elif key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
            raise field_error(key, "missing")
    for key, field_name in (("rms_norm_eps", "rms_norm_eps"), ("rope_theta", "rope_theta")):
        if cfg.get(key) is not None:
            checked_float(cfg[key], field_name, key, field_error)


def _rope_scaling(rope: dict[str, Any]) -> dict[str, Any] | None:
    rope = {k: v for k, v in rope.items() if k != "rope_theta"}
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    if rope.get("rope_type") == "su":  # LongRoPE's first name (early Phi-3 configs)
        rope["rope_type"] = "longrope"
    return rope if rope.get("rope_type", "default") != "default" else None


def _default_layer_types(cfg: dict[str, Any], spec: registry.ArchSpec, num_layers: int) -> list[str] | None:
    """Which layers slide, for config.json files that do not list layer_types (transformers 4.x)."""
    pattern = cfg.get("sliding_window_pattern") or spec.sliding_window_pattern
    if pattern:
        return pattern_layer_types(num_layers, pattern)
    if spec.window_switch:  # Qwen: layers from max_window_layers on slide
        first = int(cfg.get("max_window_layers", num_layers))
        return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return None  # Mistral: every layer slides


def pattern_layer_types(num_layers: int, pattern: int) -> list[str]:
    """Every pattern-th layer global, the others sliding (Gemma 3: five local layers, then one global)."""
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
