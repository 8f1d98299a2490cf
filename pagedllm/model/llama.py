"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM2) over the paged KV cache.

It sees one flat batch of new tokens (no padding, no request objects); attention reads and writes the
per-layer KV pools through the AttentionMetadata.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention import AttentionBackend, AttentionMetadata
from pagedllm.attention.metadata import per_layer
from pagedllm.kernels import current_mode
from pagedllm.model.base import Attention, CausalLM
from pagedllm.model.config import ModelConfig
from pagedllm.model.fused_layer import can_fuse, fused_layer_op
from pagedllm.model.kv_cache import KVCache
from pagedllm.model.layers import RMSNorm, RotaryEmbedding
from pagedllm.model.linear import Linear, LinearMethod
from pagedllm.model.mlp import GatedMLP


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, method: LinearMethod | None = None,
                 window: int | None = None):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = Attention(cfg, dtype, method, window=window)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, method)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        h = h + self.attn(self.input_norm(h), cos, sin, kv_cache, meta, backend)
        return h + self.mlp(self.post_norm(h))

    def forward_fused(self, op, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                      meta: AttentionMetadata) -> None:
        """The same layer as one C++ call (decoder_layer.cpp), updating h in place: for bf16 batches on the C++
        attention backend, where forward()'s ~50 torch ops cost more than half of a decode token's time (their
        dispatch) and ~20% of a prefill (their passes over fp32 temporaries)."""
        c = self.attn.cfg
        op(h, *self._fused_weights(), cos, sin, kv_cache[0], kv_cache[1], meta.slot_mapping, meta.block_tables,
           meta.seq_lens, meta.query_start_loc, c.num_heads, c.rms_norm_eps, self.attn.scale, current_mode().invariant)

    def linears(self) -> tuple[Linear, ...]:
        return self.attn.qkv, self.attn.o, self.mlp.gate_up, self.mlp.down

    def _fused_weights(self) -> tuple:
        """The op's weight arguments in its order, gathered once (the Parameters stay the same objects when
        weights are loaded, only their data changes): dense matrices for decoder_layer_bf16, (tensors, ggml
        types) pairs for decoder_layer_quant."""
        if not hasattr(self, "_weights_for_op"):
            a = self.attn
            q_norm, k_norm = (a.q_norm.weight, a.k_norm.weight) if a.cfg.qk_norm else (None, None)
            segmented = any(lin.method.segmented for lin in self.linears())
            w = {lin: lin.method.fused_segments(lin) if segmented else (lin.weight,) for lin in self.linears()}
            self._weights_for_op = (self.input_norm.weight, *w[a.qkv], a.qkv.bias, q_norm, k_norm, *w[a.o],
                                    a.o.bias, self.post_norm.weight, *w[self.mlp.gate_up], *w[self.mlp.down])
        return self._weights_for_op


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 attention_backend: AttentionBackend | str = "auto", linear_method: LinearMethod | None = None):
        super().__init__(cfg, dtype, attention_backend, linear_method)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, linear_method, cfg.layer_window(i))
                                    for i in range(cfg.num_layers))
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.fused_layers = True  # one C++ call per layer for bf16 batches where the kernels allow
        # ... and where the model's structure allows it (fused_layer.py decides, per forward)
        self._fused_capable = can_fuse(cfg, (m for m in self.modules() if isinstance(m, Linear)))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata | list[AttentionMetadata]) -> torch.Tensor:
        """input_ids [T], positions [T] -> final-normed hidden states [T, H] (meta: one, or one per layer)."""
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, self.dtype)
        fused = fused_layer_op(self, h, kv_caches)
        for layer, kv, m in zip(self.layers, kv_caches, per_layer(meta, len(self.layers)), strict=True):
            if fused is not None:
                layer.forward_fused(fused, h, cos, sin, kv, m)
            else:
                h = layer(h, cos, sin, kv, m, self.attn_backend)
        return self.norm(h)
