"""The model registry, the weight-name tables, the LinearMethod seam and the dtype table (no kernels, no files)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.dtypes import DTYPES, resolve_dtype
from pagedllm.engine.args import EngineArgs
from pagedllm.model import ModelConfig, registry
from pagedllm.model.linear import DENSE, DenseLinearMethod, Linear
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.weight_loading import load_weights


def tiny_config(**kw) -> ModelConfig:
    base = dict(architecture="llama", num_layers=2, hidden_size=32, intermediate_size=48, num_heads=4,
                num_kv_heads=2, head_dim=8, vocab_size=50, max_position_embeddings=256)
    return ModelConfig(**{**base, **kw})


def hf_checkpoint(cfg: ModelConfig, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Random tensors for every HF name a Llama model of cfg needs, each shaped as the checkpoint stores it."""
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size), "model.norm.weight": (cfg.hidden_size,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (cfg.hidden_size,),
                   p + "post_attention_layernorm.weight": (cfg.hidden_size,),
                   p + "self_attn.q_proj.weight": (cfg.q_size, cfg.hidden_size),
                   p + "self_attn.k_proj.weight": (cfg.kv_size, cfg.hidden_size),
                   p + "self_attn.v_proj.weight": (cfg.kv_size, cfg.hidden_size),
                   p + "self_attn.o_proj.weight": (cfg.hidden_size, cfg.q_size),
                   p + "mlp.gate_proj.weight": (cfg.intermediate_size, cfg.hidden_size),
                   p + "mlp.up_proj.weight": (cfg.intermediate_size, cfg.hidden_size),
                   p + "mlp.down_proj.weight": (cfg.hidden_size, cfg.intermediate_size)}
        if cfg.qkv_bias:
            shapes |= {p + f"self_attn.{x}_proj.bias": (n,)
                       for x, n in (("q", cfg.q_size), ("k", cfg.kv_size), ("v", cfg.kv_size))}
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def test_lookup_by_checkpoint_names():
    assert registry.spec_for_hf(["Qwen2ForCausalLM"], None).name == "qwen2"
    assert registry.spec_for_hf([], "mistral").name == "mistral"
    assert registry.spec_for_gguf("qwen3").always_qk_norm
    with pytest.raises(registry.UnsupportedModelError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        registry.spec_for_hf(["GPT2LMHeadModel"], "gpt2")
    with pytest.raises(registry.UnsupportedModelError, match="'bert'.*supported: llama"):
        registry.spec_for_gguf("bert")
    assert registry.spec("llama").model_cls() is LlamaForCausalLM


def test_features_and_fused_gate():
    assert tiny_config().features() == set()
    assert tiny_config(qkv_bias=True, qk_norm=True, tie_word_embeddings=True).features() == {
        registry.QKV_BIAS, registry.QK_NORM, registry.TIED_EMBEDDINGS}
    assert tiny_config(sliding_window=256).features() == set()  # a window no context exceeds changes nothing
    assert tiny_config(sliding_window=64).features() == {registry.SLIDING_WINDOW}
    llama = registry.spec("llama")
    assert llama.runs_fused_layer(tiny_config(qkv_bias=True).features())
    assert llama.runs_fused_layer(tiny_config(sliding_window=64).features())  # the stack passes each its window
    assert registry.spec("gemma3").runs_fused_layer({registry.QK_NORM, registry.SLIDING_WINDOW})
    assert not llama.runs_fused_layer({"a_feature_the_stack_lacks"})
    with pytest.raises(registry.UnsupportedModelError, match="gemma3 models with qkv_bias"):
        registry.spec("gemma3").check_features(tiny_config(qkv_bias=True).features())
    assert LlamaForCausalLM(tiny_config())._fused_capable
    assert LlamaForCausalLM(tiny_config(sliding_window=64))._fused_capable


class DoublingMethod(DenseLinearMethod):
    """A method of another kind: computes 2 x W (so a test sees it ran) and keeps no fused-layer weight."""

    runs_fused_layer = False

    def apply(self, layer, x, bias):
        return 2 * super().apply(layer, x, bias)


def test_linear_method_seam_reaches_every_projection():
    cfg = tiny_config()
    g = torch.Generator().manual_seed(0)
    ckpt = hf_checkpoint(cfg, g)
    table = registry.spec("llama").hf_names
    plain, doubled = LlamaForCausalLM(cfg), LlamaForCausalLM(cfg, linear_method=DoublingMethod())
    for m in (plain, doubled):
        load_weights(m, ckpt.items(), table, cfg.num_layers)
    linears = [m for m in doubled.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * cfg.num_layers + 1 and all(isinstance(m.method, DoublingMethod) for m in linears)
    assert not doubled._fused_capable and plain._fused_capable
    x = torch.randn(3, cfg.hidden_size, generator=g)
    assert torch.equal(doubled.layers[1].mlp.down(x[:, :1].repeat(1, cfg.intermediate_size)),
                       2 * plain.layers[1].mlp.down(x[:, :1].repeat(1, cfg.intermediate_size)))
    assert torch.equal(doubled.compute_logits(x), 2 * plain.compute_logits(x))


def test_weight_table_places_every_shard():
    cfg = tiny_config(qkv_bias=True)
    ckpt = hf_checkpoint(cfg, torch.Generator().manual_seed(1))
    model = LlamaForCausalLM(cfg)
    load_weights(model, ckpt.items(), registry.spec("qwen2").hf_names, cfg.num_layers)
    attn, p = model.layers[1].attn, "model.layers.1."
    want = torch.cat([ckpt[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(attn.qkv.weight, want)
    assert torch.equal(attn.qkv.bias, torch.cat([ckpt[p + f"self_attn.{x}_proj.bias"] for x in "qkv"]))
    gate_up = torch.cat([ckpt[p + "mlp.gate_proj.weight"], ckpt[p + "mlp.up_proj.weight"]])
    assert torch.equal(model.layers[1].mlp.gate_up.weight, gate_up)
    assert torch.equal(model.embed, ckpt["model.embed_tokens.weight"])


def test_weight_table_errors():
    cfg = tiny_config()
    table = registry.spec("llama").hf_names
    ckpt = hf_checkpoint(cfg, torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.0.self_attn.q_proj.bias'"):
        load_weights(LlamaForCausalLM(cfg), [*ckpt.items(), ("model.layers.0.self_attn.q_proj.bias",
                                                              torch.zeros(cfg.q_size))], table, cfg.num_layers)
    with pytest.raises(ValueError, match="unexpected weight 'vision.tower'"):
        load_weights(LlamaForCausalLM(cfg), [("vision.tower", torch.zeros(1))], table, cfg.num_layers)
    short = {k: v for k, v in ckpt.items() if k != "model.layers.1.self_attn.v_proj.weight"}
    with pytest.raises(ValueError, match="missing 1 weight.*v_proj"):
        load_weights(LlamaForCausalLM(cfg), short.items(), table, cfg.num_layers)
    bad = {**ckpt, "model.layers.0.self_attn.k_proj.weight": torch.zeros(cfg.q_size, cfg.hidden_size)}
    with pytest.raises(ValueError, match="k_proj.*shape"):
        load_weights(LlamaForCausalLM(cfg), bad.items(), table, cfg.num_layers)
    tied = tiny_config(tie_word_embeddings=True)  # a tied checkpoint's lm_head copy is skipped, not an error
    load_weights(LlamaForCausalLM(tied), hf_checkpoint(cfg, torch.Generator()).items(), table, cfg.num_layers)


def test_one_dtype_table():
    assert resolve_dtype("auto") is torch.bfloat16 and resolve_dtype("float32") is torch.float32
    assert resolve_dtype(torch.bfloat16) is torch.bfloat16
    assert set(DTYPES) == {"float32", "bfloat16", "float16", "auto"}  # (float16: the device path only, placement.py)
    assert resolve_dtype("float16") is torch.float16
    for bad in ("float64", torch.float64, torch.int8):
        with pytest.raises(ValueError, match="dtype"):
            resolve_dtype(bad)
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineArgs(dtype="fp8")
    assert DENSE.runs_fused_layer
