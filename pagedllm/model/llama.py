"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM2, SmolLM3, Granite, Phi-3; with a
mixture-of-experts MLP: Qwen3-MoE, Mixtral, OLMoE, gpt-oss) over the paged KV cache.

It sees one flat batch of new tokens (no padding, no request objects); attention reads and writes the
per-layer KV pools through the AttentionMetadata.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention import AttentionBackend, AttentionMetadata
from pagedllm.attention.metadata import per_layer
from pagedllm.model.base import Attention, CausalLM
from pagedllm.model.config import ModelConfig
from pagedllm.model.fused_layer import fuses_layers, init_fused_layers, run_fused_layers
from pagedllm.model.kv_cache import KVCache
from pagedllm.model.layers import RMSNorm, RotaryEmbedding
from pagedllm.model.linear import Linear, LinearMethod
from pagedllm.model.mlp import GatedMLP, clamped_swiglu, swiglu
from pagedllm.model.moe import SparseMoE


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, method: LinearMethod | None = None,
                 window: int | None = None, moe: bool = False):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = Attention(cfg, dtype, method, window=window)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.residual_multiplier = cfg.residual_multiplier
        glu = swiglu if cfg.swiglu_limit is None else clamped_swiglu(cfg.swiglu_limit, cfg.swiglu_alpha)
        self.mlp = (SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                              cfg.norm_topk_prob, dtype, method, glu, cfg.moe_bias) if moe
                    else GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, method))

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        attn = self.attn(self.input_norm(h), cos, sin, kv_cache, meta, backend)
        if self.residual_multiplier != 1.0:  # (Granite)
            attn = attn * self.residual_multiplier
        h = h + attn
        mlp = self.mlp(self.post_norm(h))
        return h + (mlp * self.residual_multiplier if self.residual_multiplier != 1.0 else mlp)

    def linears(self) -> tuple[Linear, ...]:
        """The layer's own linears (of a mixture of experts: the router; its experts are in its table)."""
        mlp = self.mlp
        return (self.attn.qkv, self.attn.o, *((mlp.router,) if isinstance(mlp, SparseMoE) else (mlp.gate_up, mlp.down)))

    def fused_weights(self) -> tuple:
        """The layer's arguments to DecoderStack.add_layer (csrc/decoder_layer.cpp), in its order: each linear as
        (segment tensors, ggml types; 0 for a dense matrix). A mixture of experts gives no gate_up and down: its
        experts follow (SparseMoE.fused_experts)."""
        a = self.attn
        q_norm, k_norm = (a.q_norm.weight, a.k_norm.weight) if a.cfg.qk_norm else (None, None)
        w = {lin: lin.method.fused_segments(lin) for lin in self.linears()}
        mlp = ([], [], [], []) if isinstance(self.mlp, SparseMoE) else (*w[self.mlp.gate_up], *w[self.mlp.down])
        return (self.input_norm.weight, *w[a.qkv], a.qkv.bias, q_norm, k_norm, *w[a.o], a.o.bias,
                self.post_norm.weight, *mlp, a.window or 0, None, None, a.sinks)


class LlamaForCausalLM(CausalLM):
    FUSED_STYLE = 0  # decoder_layer.cpp's Style: kLlama

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 attention_backend: AttentionBackend | str = "auto", linear_method: LinearMethod | None = None):
        super().__init__(cfg, dtype, attention_backend, linear_method)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, linear_method, cfg.layer_window(i), cfg.is_moe_layer(i))
                                    for i in range(cfg.num_layers))
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.rotary_dim)
        init_fused_layers(self)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata | list[AttentionMetadata]) -> torch.Tensor:
        """input_ids [T], positions [T] -> final-normed hidden states [T, H] (meta: one, or one per layer)."""
        h = self.embed_tokens(input_ids)
        if self.config.embedding_multiplier != 1.0:  # (Granite)
            h = h * self.config.embedding_multiplier
        metas = per_layer(meta, len(self.layers))
        rope = self.rotary(positions, self.dtype, metas[0].token_seq_lens() if self.rotary.switch else None,
                           metas[0].max_seq_len)
        ropes = [rope] * len(self.layers)
        if self.config.nope_layers:  # (SmolLM3) a rotation by angle 0: exactly no positional encoding
            identity = torch.ones_like(rope[0]), torch.zeros_like(rope[1])
            for i in self.config.nope_layers:
                ropes[i] = identity
        if fuses_layers(self, h, kv_caches):  # every layer and the final norm in C++, h updated in place
            run_fused_layers(self, h, ropes, kv_caches, meta)
            return h
        for layer, (cos, sin), kv, m in zip(self.layers, ropes, kv_caches, metas, strict=True):
            h = layer(h, cos, sin, kv, m, self.attn_backend)
        return self.norm(h)
