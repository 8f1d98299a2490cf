"""Gemma 3 text models over the paged KV cache.

Against the Llama layer: RMSNorm scales by (1 + w) in float32; norms before and after both attention and MLP;
GeGLU (gelu tanh) MLP; q/k norms; embeddings scaled by sqrt(hidden); sliding-window (local) layers interleaved
with global ones, each kind with its own RoPE base; attention scaled by query_pre_attn_scalar ** -0.5.
Written to match transformers' Gemma3ForCausalLM arithmetic.
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
from pagedllm.model.layers import RotaryEmbedding, frozen_param
from pagedllm.model.linear import Linear, LinearMethod
from pagedllm.model.mlp import GatedMLP, geglu_tanh


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), all in float32, cast back at the end (checkpoints store w, not 1 + w)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = frozen_param(dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, method: LinearMethod | None, layer: int):
        super().__init__()
        window = cfg.layer_window(layer)
        self.sliding = window is not None
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_norm = GemmaRMSNorm(h, eps, dtype)
        self.attn = Attention(cfg, dtype, method, window=window, norm=GemmaRMSNorm)
        self.post_attn_norm = GemmaRMSNorm(h, eps, dtype)
        self.pre_mlp_norm = GemmaRMSNorm(h, eps, dtype)
        self.mlp = GatedMLP(h, cfg.intermediate_size, dtype, method, glu=geglu_tanh)
        self.post_mlp_norm = GemmaRMSNorm(h, eps, dtype)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        h = h + self.post_attn_norm(self.attn(self.input_norm(h), cos, sin, kv_cache, meta, backend))
        return h + self.post_mlp_norm(self.mlp(self.pre_mlp_norm(h)))

    def linears(self) -> tuple[Linear, ...]:
        return self.attn.qkv, self.attn.o, self.mlp.gate_up, self.mlp.down

    def fused_weights(self) -> tuple:
        """The layer's arguments to DecoderStack.add_layer (csrc/decoder_layer.cpp), in its order (see
        llama.DecoderLayer.fused_weights): the norm before the MLP in the post_norm place, the norms of the
        attention's and the MLP's outputs last."""
        a = self.attn
        w = {lin: lin.method.fused_segments(lin) for lin in self.linears()}
        return (self.input_norm.weight, *w[a.qkv], None, a.q_norm.weight, a.k_norm.weight, *w[a.o], None,
                self.pre_mlp_norm.weight, *w[self.mlp.gate_up], *w[self.mlp.down], a.window or 0,
                self.post_attn_norm.weight, self.post_mlp_norm.weight, None)


class Gemma3ForCausalLM(CausalLM):
    FUSED_STYLE = 1  # decoder_layer.cpp's Style: kGemma

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 attention_backend: AttentionBackend | str = "auto", linear_method: LinearMethod | None = None):
        super().__init__(cfg, dtype, attention_backend, linear_method, norm=GemmaRMSNorm)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, dtype, linear_method, i) for i in range(cfg.num_layers))
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.rope_local_theta or cfg.rope_theta, None)
        # transformers multiplies by sqrt(hidden) rounded to the model's dtype
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype)
        init_fused_layers(self)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata | list[AttentionMetadata]) -> torch.Tensor:
        """input_ids [T], positions [T] -> final-normed hidden states [T, H] (meta: one, or one per layer)."""
        h = self.embed_tokens(input_ids) * self.embed_scale
        seq_lens = per_layer(meta, 1)[0].token_seq_lens() if self.rotary.switch else None  # (LongRoPE)
        longest = per_layer(meta, 1)[0].max_seq_len
        rope = {False: self.rotary(positions, self.dtype, seq_lens, longest),
                True: self.rotary_local(positions, self.dtype, max_position=longest)}
        if fuses_layers(self, h, kv_caches):  # every layer and the final norm in C++, h updated in place
            run_fused_layers(self, h, [rope[layer.sliding] for layer in self.layers], kv_caches, meta)
            return h
        for layer, kv, m in zip(self.layers, kv_caches, per_layer(meta, len(self.layers)), strict=True):
            h = layer(h, *rope[layer.sliding], kv, m, self.attn_backend)
        return self.norm(h)
