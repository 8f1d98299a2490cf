"""ModelConfig from GGUF metadata, trusting nothing: every number is range-checked (config_checks.py), the
vocabulary is checked against the embedding, and the config against the shapes of the tensors that size the
model, all before the model allocates anything."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from pagedllm.model import registry, weight_names
from pagedllm.model.config import ModelConfig, arch_moe_options, nope_every, pattern_layer_types, yarn_scaling
from pagedllm.model.config_checks import check_head_layout, check_token_id, checked_float, checked_int
from pagedllm.model.errors import UnsupportedModelError
from pagedllm.model.gguf_reader import GGUFFile, StringArray

_MISSING = object()
# the tokenizer's special token ids (each must name a token of the vocabulary)
SPECIAL_TOKEN_KEYS = tuple(f"tokenizer.ggml.{k}_token_id" for k in
                           ("bos", "eos", "eot", "eom", "unknown", "padding", "seperator", "cls", "mask"))
_VOCAB_ARRAYS = ("tokenizer.ggml.scores", "tokenizer.ggml.token_type")
_LAYER = re.compile(r"blk\.(\d+)\.")


def config_from_gguf(f: GGUFFile) -> ModelConfig:
    """InvalidModelError (or its UnsupportedModelError) naming the field of f.path at fault."""
    m = f.metadata
    arch = f.architecture
    spec = registry.spec_for_gguf(arch)
    fail = f.field_error

    def get(key: str, default: Any = _MISSING) -> Any:
        value = m.get(f"{arch}.{key}", default)
        if value is _MISSING:
            raise fail(f"{arch}.{key}", "missing from the metadata")
        return value

    def num(key: str, field: str, default: Any = _MISSING) -> int:
        return checked_int(get(key, default), field, f"{arch}.{key}", fail)

    _check_types_supported(f)
    hidden = num("embedding_length", "hidden_size")
    heads = num("attention.head_count", "num_heads")
    kv_heads = _kv_heads(f, get("attention.head_count_kv", heads), f"{arch}.attention.head_count_kv")
    num_layers = num("block_count", "num_layers")
    ffn = num("feed_forward_length", "intermediate_size")
    head_dim = num("attention.key_length", "head_dim", hidden // heads or 1)
    vocab = _vocab_size(f, get("vocab_size", None))
    context = num("context_length", "max_position_embeddings", 2048)
    names = {"num_heads": f"{arch}.attention.head_count", "num_kv_heads": f"{arch}.attention.head_count_kv",
             "head_dim": f"{arch}.attention.key_length"}
    check_head_layout(heads, kv_heads, head_dim, names, fail)
    eps = checked_float(get("attention.layer_norm_rms_epsilon", 1e-6), "rms_norm_eps",
                        f"{arch}.attention.layer_norm_rms_epsilon", fail)
    theta = checked_float(get("rope.freq_base", 10000.0), "rope_theta", f"{arch}.rope.freq_base", fail)
    window = get("attention.sliding_window", None)
    window = checked_int(window, "sliding_window", f"{arch}.attention.sliding_window", fail) if window else None
    softcap = get("final_logit_softcapping", None)
    if softcap is not None:
        softcap = checked_float(softcap, "final_logit_softcapping", f"{arch}.final_logit_softcapping", fail)
    if get("attn_logit_softcapping", None):
        raise UnsupportedModelError("attention logit softcapping is not supported", path=f.path,
                                    field=f"{arch}.attn_logit_softcapping")
    _check_layers(f, num_layers)
    experts = _experts(f, spec, num_layers, ffn, num)
    dims = {f"{arch}.embedding_length": hidden, f"{arch}.attention.head_count": heads,
            f"{arch}.attention.head_count_kv": kv_heads, f"{arch}.attention.key_length": head_dim,
            f"{arch}.feed_forward_length": ffn, "vocabulary": vocab}
    if experts:
        dims |= {f"{arch}.expert_count": experts["num_experts"],
                 f"{arch}.expert_feed_forward_length": experts["moe_intermediate_size"]}
    q, kv = heads * head_dim, kv_heads * head_dim
    rotary = num("rope.dimension_count", "head_dim", head_dim)
    if rotary > head_dim or rotary % 2:
        raise fail(f"{arch}.rope.dimension_count", f"{rotary} rotary dims do not fit a head of {head_dim} in pairs")
    fused_gate_up = isinstance(spec.gguf_names.get("blk.{i}.ffn_up.weight"), tuple) and \
        spec.gguf_names["blk.{i}.ffn_up.weight"][1] == weight_names.ALL
    want = _tensor_shapes(vocab=vocab, hidden=hidden, q=q, kv=kv, ffn=ffn, fused_gate_up=fused_gate_up,
                          qk_norm=(q, kv) if spec.qk_norm_whole else (head_dim, head_dim),
                          experts=experts.get("num_experts", 0), expert_ffn=experts.get("moe_intermediate_size", 0))
    _check_shapes(f, dims, want)
    pattern = spec.sliding_window_pattern
    eos = [check_token_id(m[k], vocab, k, fail) for k in ("tokenizer.ggml.eos_token_id",
                                                         "tokenizer.ggml.eot_token_id") if k in m]
    bos = m.get("tokenizer.ggml.bos_token_id")
    config = ModelConfig(
        architecture=spec.name,
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        max_position_embeddings=context,
        rms_norm_eps=eps,
        rope_theta=theta,
        rope_scaling=_rope_scaling(f, arch, rotary),
        rotary_dim=rotary if rotary < head_dim else None,
        nope_layers=nope_every(spec.nope_interval, num_layers) if spec.nope_interval else [],
        tie_word_embeddings="output.weight" not in f.tensors,
        qkv_bias="blk.0.attn_q.bias" in f.tensors,
        o_bias="blk.0.attn_output.bias" in f.tensors,
        attention_sinks=spec.attention_sinks,
        qk_norm="blk.0.attn_q_norm.weight" in f.tensors,
        sliding_window=window,
        layer_types=pattern_layer_types(num_layers, pattern) if window and pattern else None,
        rope_local_theta=spec.gguf_rope_local_theta,
        final_logit_softcapping=softcap,
        qk_norm_whole=spec.qk_norm_whole,
        **experts,
        **_multipliers(f, spec),
        eos_token_ids=list(dict.fromkeys(eos)),
        bos_token_id=None if bos is None else check_token_id(bos, vocab, "tokenizer.ggml.bos_token_id", fail),
    )
    spec.check_features(config.features())
    return config


def _check_types_supported(f: GGUFFile) -> None:
    from pagedllm.model.gguf_loader import GGML_TYPES, type_name

    for t in f.tensors.values():  # fail before dequantising anything
        if t.ggml_type not in GGML_TYPES:
            supported = ", ".join(v.name for v in GGML_TYPES.values())
            raise UnsupportedModelError(f"uses ggml type {type_name(t.ggml_type)}, which pagedllm cannot "
                                        f"dequantise; supported: {supported}", path=f.path,
                                        field=f"tensor {t.name!r}")


def _kv_heads(f: GGUFFile, value: Any, key: str) -> int:
    """head_count_kv: one number, or one per layer (all equal here: the model has one layout)."""
    if isinstance(value, np.ndarray):
        if value.size == 0 or value.dtype.kind not in "iu":
            raise f.field_error(key, "must be an integer or a non-empty integer array")
        if int(value.min()) != int(value.max()):
            raise UnsupportedModelError("a different number of KV heads per layer is not supported", path=f.path,
                                        field=key)
        value = int(value[0])
    return checked_int(value, "num_kv_heads", key, f.field_error)


def _vocab_size(f: GGUFFile, declared: Any) -> int:
    """The vocabulary size, which the embedding's rows, the token list and every per-token array must agree on."""
    m, fail = f.metadata, f.field_error
    embd = f.tensors.get("token_embd.weight")
    if embd is None:
        raise fail("tensor 'token_embd.weight'", "missing")
    if len(embd.shape) != 2:
        raise fail("tensor 'token_embd.weight'", f"shape {embd.shape} is not a matrix")
    rows = checked_int(embd.shape[0], "vocab_size", "tensor 'token_embd.weight' rows", fail)
    if declared is not None:
        key = f"{f.architecture}.vocab_size"
        if checked_int(declared, "vocab_size", key, fail) != rows:
            raise fail(key, f"{declared} does not match the {rows} rows of token_embd.weight")
    tokens = m.get("tokenizer.ggml.tokens")
    if tokens is not None:
        if not isinstance(tokens, StringArray):
            raise fail("tokenizer.ggml.tokens", "must be an array of strings")
        if len(tokens) != rows:
            raise fail("tokenizer.ggml.tokens", f"{len(tokens)} tokens do not match the {rows} rows of "
                                                f"token_embd.weight")
        for key in _VOCAB_ARRAYS:
            arr = m.get(key)
            if arr is not None and not (isinstance(arr, np.ndarray) and arr.ndim == 1 and len(arr) == rows):
                raise fail(key, f"must be a numeric array with one entry per token ({rows})")
        scores = m.get("tokenizer.ggml.scores")
        if scores is not None and scores.dtype.kind == "f" and not np.isfinite(scores).all():
            raise fail("tokenizer.ggml.scores", "holds a value that is not finite")
    merges = m.get("tokenizer.ggml.merges")
    if merges is not None and not isinstance(merges, StringArray):
        raise fail("tokenizer.ggml.merges", "must be an array of strings")
    for key in SPECIAL_TOKEN_KEYS:
        if key in m:
            check_token_id(m[key], rows, key, fail)
    return rows


def _check_layers(f: GGUFFile, num_layers: int) -> None:
    """block_count must be the number of layers the tensors hold, numbered 0 .. block_count - 1."""
    found = {int(match.group(1)) for name in f.tensors if (match := _LAYER.match(name))}
    key = f"{f.architecture}.block_count"
    if found != set(range(num_layers)):
        extra = sorted(found - set(range(num_layers)))[:3]
        missing = sorted(set(range(num_layers)) - found)[:3]
        raise f.field_error(key, f"{num_layers} layers, but the tensors hold layers {sorted(found)[:3]}... "
                                 f"({len(found)} in all; unexpected {extra}, missing {missing})")


def _multipliers(f: GGUFFile, spec: registry.ArchSpec) -> dict[str, Any]:
    """Granite's multipliers, as llama.cpp's converter names them (its attention scale defaults to 1/sqrt(head_dim)
    there, as in every other architecture)."""
    if registry.MULTIPLIERS not in spec.supports:
        return {}
    arch, out = f.architecture, {}
    for key, field in (("embedding_scale", "embedding_multiplier"), ("residual_scale", "residual_multiplier"),
                       ("logit_scale", "logits_scaling"), ("attention.scale", "attention_multiplier")):
        value = f.metadata.get(f"{arch}.{key}")
        if value is not None:
            out[field] = checked_float(value, field, f"{arch}.{key}", f.field_error)
    return out


def _experts(f: GGUFFile, spec: registry.ArchSpec, num_layers: int, ffn: int, num) -> dict[str, Any]:
    """The mixture-of-experts fields (none for a dense file). A layer is sparse where it has a router
    (ffn_gate_inp); top-k must lie in [1, expert_count]; the weights are renormalised as llama.cpp's graph does for
    the architecture, unless the file says (expert_weights_norm)."""
    arch = f.architecture
    if not f.metadata.get(f"{arch}.expert_count"):
        if any(".ffn_gate_inp." in name or "_exps." in name for name in f.tensors):
            raise f.field_error(f"{arch}.expert_count", "missing, but the file holds expert tensors")
        return {}
    experts = num("expert_count", "num_experts")
    top_k = num("expert_used_count", "num_experts_per_tok")
    if top_k > experts:
        raise f.field_error(f"{arch}.expert_used_count", f"{top_k} experts per token, but {arch}.expert_count "
                                                         f"is {experts}")
    renormalize = f.metadata.get(f"{arch}.expert_weights_norm", spec.gguf_moe_renormalize)
    return dict(num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=num("expert_feed_forward_length", "moe_intermediate_size", ffn),
                norm_topk_prob=bool(renormalize),
                dense_layers=[i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in f.tensors],
                **arch_moe_options(spec))


def _tensor_shapes(*, vocab: int, hidden: int, q: int, kv: int, ffn: int, fused_gate_up: bool,
                   qk_norm: tuple[int, int], experts: int, expert_ffn: int) -> dict[str, tuple[int, ...]]:
    """Tensor name (within a layer) -> the shape the metadata implies (torch order: rows first; fused_gate_up:
    ffn_up holds gate|up, as Phi-3's does)."""
    want = {"token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden),
            "attn_q.weight": (q, hidden), "attn_k.weight": (kv, hidden), "attn_v.weight": (kv, hidden),
            "attn_qkv.weight": (q + 2 * kv, hidden), "attn_output.weight": (hidden, q),
            "ffn_gate.weight": (ffn, hidden), "ffn_up.weight": (2 * ffn if fused_gate_up else ffn, hidden),
            "ffn_down.weight": (hidden, ffn), "attn_q_norm.weight": (qk_norm[0],),
            "attn_k_norm.weight": (qk_norm[1],)}
    if experts:
        want |= {"ffn_gate_inp.weight": (experts, hidden), "ffn_gate_exps.weight": (experts, expert_ffn, hidden),
                 "ffn_up_exps.weight": (experts, expert_ffn, hidden),
                 "ffn_down_exps.weight": (experts, hidden, expert_ffn)}
    return want


def _check_shapes(f: GGUFFile, dims: dict[str, int], want: dict[str, tuple[int, ...]]) -> None:
    """The tensors that size the model have the shapes the metadata (`dims`, named as the file names them)
    implies."""
    for name, t in f.tensors.items():
        shape = want.get(name.split(".", 2)[2] if _LAYER.match(name) else name)
        if shape is not None and tuple(t.shape) != shape:
            said = ", ".join(f"{k}={v}" for k, v in dims.items())
            raise f.field_error(f"tensor {name!r}", f"shape {tuple(t.shape)} does not match the {shape} the "
                                                   f"metadata implies ({said})")


def _rope_scaling(f: GGUFFile, arch: str, rotary: int) -> dict[str, Any] | None:
    """The RoPE scaling of a file: per-frequency divisors (rope_freqs: llama3-style), LongRoPE's short and long
    factors (rope_factors_short / _long: Phi-3), or a linear factor; `rotary`: the dims rotated per head."""
    m = f.metadata
    kind = m.get(f"{arch}.rope.scaling.type")
    if "rope_freqs.weight" in f.tensors:  # llama3-style scaling stored as per-frequency divisors
        return {"rope_type": "freq_factors", "factors": _rope_factors(f, "rope_freqs.weight", rotary)}
    if "rope_factors_long.weight" in f.tensors or "rope_factors_short.weight" in f.tensors:
        key = f"{arch}.rope.scaling.original_context_length"
        if key not in m:
            raise f.field_error(key, "missing (the context length where LongRoPE switches to the long factors)")
        attn_key = f"{arch}.rope.scaling.attn_factor"
        return {"rope_type": "longrope",
                "original_max_position_embeddings": checked_int(m[key], "max_position_embeddings", key, f.field_error),
                "short_factor": _rope_factors(f, "rope_factors_short.weight", rotary),
                "long_factor": _rope_factors(f, "rope_factors_long.weight", rotary),
                "attention_factor": checked_float(m.get(attn_key, 1.0), "rope_scaling.factor", attn_key,
                                                  f.field_error)}
    if kind == "linear":
        key = f"{arch}.rope.scaling.factor"
        return {"rope_type": "linear", "factor": checked_float(m.get(key), "rope_scaling.factor", key,
                                                               f.field_error)}
    if kind == "yarn":
        return _yarn(f, arch)
    if kind not in (None, "none"):
        raise UnsupportedModelError(f"rope scaling {kind!r} is not supported", path=f.path,
                                    field=f"{arch}.rope.scaling.type")
    return None


def _yarn(f: GGUFFile, arch: str) -> dict[str, Any]:
    """YaRN as llama.cpp runs a file: ramp ends rounded to whole dims, cos/sin scaled by 0.1 ln(factor) + 1 (or
    the ratio that yarn_log_multiplier gives) times the file's attn_factor."""
    m, prefix = f.metadata, f"{arch}.rope.scaling."

    def number(key: str, default: Any = _MISSING) -> float:
        value = m.get(prefix + key, default)
        if value is _MISSING:
            raise f.field_error(prefix + key, "missing (YaRN needs it)")
        return checked_float(value, "rope_scaling.factor", prefix + key, f.field_error)

    original = checked_int(m.get(prefix + "original_context_length"), "max_position_embeddings",
                           prefix + "original_context_length", f.field_error)
    scaling = {"rope_type": "yarn", "factor": number("factor"), "original_max_position_embeddings": original,
               "beta_fast": number("yarn_beta_fast", 32.0), "beta_slow": number("yarn_beta_slow", 1.0)}
    log_mul = m.get(prefix + "yarn_log_multiplier")
    if log_mul:
        scaling |= {"mscale": 1.0, "mscale_all_dim": number("yarn_log_multiplier")}
    scaling = yarn_scaling(scaling, original)
    scaling["attention_factor"] *= number("attn_factor", 1.0)
    return scaling


def _rope_factors(f: GGUFFile, name: str, rotary: int) -> list[float]:
    """One finite, positive factor per rotated pair, from tensor `name`."""
    from pagedllm.model.gguf_loader import dequantize

    t = f.tensors.get(name)
    if t is None:
        raise f.field_error(f"tensor {name!r}", "missing")
    if t.shape != (rotary // 2,):
        raise f.field_error(f"tensor {name!r}", f"shape {t.shape} is not ({rotary // 2},) (one per rotated pair)")
    factors = dequantize(f, t).float()
    if not (factors.isfinite().all() and (factors > 0).all()):
        raise f.field_error(f"tensor {name!r}", "holds a factor that is not finite and positive")
    return factors.tolist()
