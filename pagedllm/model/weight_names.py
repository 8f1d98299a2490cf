"""Checkpoint tensor names -> our parameters: one declarative table per architecture family, one column per
checkpoint format (HF safetensors, GGUF).

A target is a parameter path inside the model ("layers.{i}.mlp.down.weight"), or (path, shard) for a piece of a
fused parameter: shard k of a Linear built with output_sizes [s0, s1, ...] is rows sum(s[:k]) .. + s[k].
"{i}" stands for the layer index. Names whose target the model does not have (a bias the config does not use,
the lm_head copy of a tied checkpoint) are handled by the loader (weight_loading.py).
"""

from __future__ import annotations

Target = str | tuple[str, int]

Q, K, V = 0, 1, 2  # shards of attn.qkv
GATE, UP = 0, 1  # shards of mlp.gate_up
ALL = -1  # a checkpoint tensor that is every shard of a fused parameter, stacked by rows (Phi-3's qkv_proj)

# (HF safetensors name, GGUF name, our parameter)
Row = tuple[str, str, Target]

# what every family here shares: embeddings, final norm, output head, attention and MLP projections
_COMMON: list[Row] = [
    ("model.embed_tokens.weight", "token_embd.weight", "embed"),
    ("model.norm.weight", "output_norm.weight", "norm.weight"),
    ("lm_head.weight", "output.weight", "lm_head.weight"),
    ("model.layers.{i}.self_attn.q_proj.weight", "blk.{i}.attn_q.weight", ("layers.{i}.attn.qkv.weight", Q)),
    ("model.layers.{i}.self_attn.k_proj.weight", "blk.{i}.attn_k.weight", ("layers.{i}.attn.qkv.weight", K)),
    ("model.layers.{i}.self_attn.v_proj.weight", "blk.{i}.attn_v.weight", ("layers.{i}.attn.qkv.weight", V)),
    ("model.layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight", "layers.{i}.attn.o.weight"),
    ("model.layers.{i}.self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight", "layers.{i}.attn.q_norm.weight"),
    ("model.layers.{i}.self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight", "layers.{i}.attn.k_norm.weight"),
    ("model.layers.{i}.mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight", ("layers.{i}.mlp.gate_up.weight", GATE)),
    ("model.layers.{i}.mlp.up_proj.weight", "blk.{i}.ffn_up.weight", ("layers.{i}.mlp.gate_up.weight", UP)),
    ("model.layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight", "layers.{i}.mlp.down.weight"),
]

# Llama, Mistral, Qwen2, Qwen3, SmolLM2: pre-norm layers, optional attention biases
LLAMA: list[Row] = _COMMON + [
    ("model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight", "layers.{i}.input_norm.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight", "layers.{i}.post_norm.weight"),
    ("model.layers.{i}.self_attn.q_proj.bias", "blk.{i}.attn_q.bias", ("layers.{i}.attn.qkv.bias", Q)),
    ("model.layers.{i}.self_attn.k_proj.bias", "blk.{i}.attn_k.bias", ("layers.{i}.attn.qkv.bias", K)),
    ("model.layers.{i}.self_attn.v_proj.bias", "blk.{i}.attn_v.bias", ("layers.{i}.attn.qkv.bias", V)),
    ("model.layers.{i}.self_attn.o_proj.bias", "blk.{i}.attn_output.bias", "layers.{i}.attn.o.bias"),
]

# Phi-3 / Phi-4-mini: the Llama layer with q|k|v and gate|up each one checkpoint tensor (GGUF: ffn_up is gate|up)
_FUSED_PROJECTIONS = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"}
PHI3: list[Row] = [row for row in LLAMA if not any(f".{p}." in row[0] for p in _FUSED_PROJECTIONS)] + [
    ("model.layers.{i}.self_attn.qkv_proj.weight", "blk.{i}.attn_qkv.weight", ("layers.{i}.attn.qkv.weight", ALL)),
    ("model.layers.{i}.mlp.gate_up_proj.weight", "blk.{i}.ffn_up.weight", ("layers.{i}.mlp.gate_up.weight", ALL)),
]

# the mixture-of-experts MLP (Qwen3-MoE, OLMoE; GGUF: every MoE family): a router and E experts, "{e}" the expert
# index. GGUF stacks the experts of a layer in one 3-D tensor, split by the loader (weight_loading.py).
_MOE_ROUTER = "layers.{i}.mlp.router.weight"
_EXPERT_GATE_UP, _EXPERT_DOWN = "layers.{i}.mlp.experts.{e}.gate_up.weight", "layers.{i}.mlp.experts.{e}.down.weight"
LLAMA_MOE: list[Row] = LLAMA + [
    ("model.layers.{i}.mlp.gate.weight", "blk.{i}.ffn_gate_inp.weight", _MOE_ROUTER),
    ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "blk.{i}.ffn_gate_exps.weight", (_EXPERT_GATE_UP, GATE)),
    ("model.layers.{i}.mlp.experts.{e}.up_proj.weight", "blk.{i}.ffn_up_exps.weight", (_EXPERT_GATE_UP, UP)),
    ("model.layers.{i}.mlp.experts.{e}.down_proj.weight", "blk.{i}.ffn_down_exps.weight", _EXPERT_DOWN),
]
# Mixtral's HF names (w1 gate, w3 up, w2 down); its GGUF names are LLAMA_MOE's
MIXTRAL: list[Row] = LLAMA + [
    ("model.layers.{i}.block_sparse_moe.gate.weight", "blk.{i}.ffn_gate_inp.weight", _MOE_ROUTER),
    ("model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight", "blk.{i}.ffn_gate_exps.weight",
     (_EXPERT_GATE_UP, GATE)),
    ("model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight", "blk.{i}.ffn_up_exps.weight",
     (_EXPERT_GATE_UP, UP)),
    ("model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight", "blk.{i}.ffn_down_exps.weight", _EXPERT_DOWN),
]

# gpt-oss: the MoE layer with attention sinks, biases everywhere, and llama.cpp's name for the MLP's norm. The HF
# names are those model/gpt_oss.py's adapter writes: transformers stacks the experts (transposed, gate and up
# interleaved), as one tensor per layer; the adapter splits and transposes them, as llama.cpp's converter does.
_EXPERTS = "model.layers.{i}.mlp.experts"
GPT_OSS: list[Row] = [row for row in LLAMA if "post_attention_layernorm" not in row[0]] + [
    ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.post_attention_norm.weight",
     "layers.{i}.post_norm.weight"),
    ("model.layers.{i}.self_attn.sinks", "blk.{i}.attn_sinks.weight", "layers.{i}.attn.sinks"),
    ("model.layers.{i}.mlp.router.weight", "blk.{i}.ffn_gate_inp.weight", _MOE_ROUTER),
    ("model.layers.{i}.mlp.router.bias", "blk.{i}.ffn_gate_inp.bias", "layers.{i}.mlp.router.bias"),
] + [(f"{_EXPERTS}.{proj}_proj.{kind}", f"blk.{{i}}.ffn_{proj}_exps.{kind}",
      (path.replace(".weight", f".{kind}"), shard) if shard is not None else path.replace(".weight", f".{kind}"))
     for kind in ("weight", "bias")
     for proj, path, shard in (("gate", _EXPERT_GATE_UP, GATE), ("up", _EXPERT_GATE_UP, UP),
                               ("down", _EXPERT_DOWN, None))]

# Gemma 3: norms before and after both attention and MLP (HF's "post_attention_layernorm" is not Llama's)
GEMMA3: list[Row] = _COMMON + [
    ("model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight", "layers.{i}.input_norm.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.post_attention_norm.weight",
     "layers.{i}.post_attn_norm.weight"),
    ("model.layers.{i}.pre_feedforward_layernorm.weight", "blk.{i}.ffn_norm.weight",
     "layers.{i}.pre_mlp_norm.weight"),
    ("model.layers.{i}.post_feedforward_layernorm.weight", "blk.{i}.post_ffw_norm.weight",
     "layers.{i}.post_mlp_norm.weight"),
]


def by_format(rows: list[Row]) -> tuple[dict[str, Target], dict[str, Target]]:
    """(HF name -> target, GGUF name -> target)."""
    return {hf: t for hf, _, t in rows}, {gguf: t for _, gguf, t in rows}


# Checkpoint entries that carry no weight of ours: rotary tables (recomputed), GGUF rope_freqs and LongRoPE factors
# (folded into the config), and an lm_head copy stored next to tied embeddings.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rope_freqs.weight", "rope_factors_long.weight",
                    "rope_factors_short.weight")
TIED_COPIES = ("lm_head.weight",)


def expand(table: dict[str, Target], num_layers: int, num_experts: int = 0) -> dict[str, tuple[str, int | None]]:
    """The table with "{i}" spelled out for every layer and "{e}" for every expert, each target as (path, shard or
    None). A target that keeps "{e}" (its name has none) is a stack of every expert's tensor."""
    out: dict[str, tuple[str, int | None]] = {}
    for name, target in table.items():
        path, shard = (target, None) if isinstance(target, str) else target
        layers = range(num_layers) if "{i}" in name else (0,)
        experts = range(num_experts) if "{e}" in name else (None,)
        for i in layers:
            for e in experts:
                key, where = name.replace("{i}", str(i)), path.replace("{i}", str(i))
                if e is not None:
                    key, where = key.replace("{e}", str(e)), where.replace("{e}", str(e))
                out[key] = (where, shard)
    return out
