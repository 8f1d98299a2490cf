"""What every decoder here shares: the attention block over the paged KV cache, and the causal-LM shell
(embeddings, final norm, output head, attention backend, logits)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention import AttentionBackend, AttentionMetadata, get_backend
from pagedllm.kernels import current_mode
from pagedllm.model.config import ModelConfig
from pagedllm.model.kv_cache import KVCache
from pagedllm.model.layers import RMSNorm, apply_rope, frozen_param, linear, rotary_row_order
from pagedllm.model.linear import DenseLinearMethod, Linear, LinearMethod
from pagedllm.quantization.tensor import QuantTensor


class Attention(nn.Module):
    """q|k|v projection, optional per-head q/k norm, RoPE, paged attention (over a sliding window where the layer
    has one; with a sink logit per head where the model has them), output projection."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, method: LinearMethod | None = None, *,
                 window: int | None = None, norm: type[nn.Module] = RMSNorm):
        super().__init__()
        self.cfg = cfg
        self.qkv = Linear(cfg.hidden_size, [cfg.q_size, cfg.kv_size, cfg.kv_size], cfg.qkv_bias, dtype, method,
                          row_orders=_partial_rotary_orders(cfg))
        self.o = Linear(cfg.q_size, cfg.hidden_size, cfg.o_bias, dtype, method)
        if cfg.qk_norm:  # per head, or over every head's projection at once (qk_norm_whole)
            whole = cfg.qk_norm_whole
            self.q_norm = norm(cfg.q_size if whole else cfg.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = norm(cfg.kv_size if whole else cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.scale = cfg.attn_scale
        self.window = window
        self.sinks = frozen_param(cfg.num_heads, dtype=torch.float32) if cfg.attention_sinks else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        c = self.cfg
        q, k, v = self.qkv(x).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        if c.qk_norm and c.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(-1, c.num_heads, c.head_dim)
        k = k.reshape(-1, c.num_kv_heads, c.head_dim)
        v = v.reshape(-1, c.num_kv_heads, c.head_dim)
        if c.qk_norm and not c.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, window=self.window,
                              sinks=self.sinks)
        return self.o(out.reshape(-1, c.q_size))


def _partial_rotary_orders(cfg: ModelConfig) -> list[torch.Tensor | None] | None:
    """With partial rotary, the q and k rows of every head kept in rotary_row_order (RotaryEmbedding's layout)."""
    if cfg.rotates == cfg.head_dim:
        return None
    per_head = rotary_row_order(cfg.head_dim, cfg.rotates)
    return [(torch.arange(heads)[:, None] * cfg.head_dim + per_head).flatten()
            for heads in (cfg.num_heads, cfg.num_kv_heads)] + [None]


class CausalLM(nn.Module):
    """The shell of a decoder-only model; subclasses add `layers` and `forward`. Built as
    cls(cfg, dtype, attention_backend, linear_method)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, attention_backend: AttentionBackend | str,
                 linear_method: LinearMethod | None, norm: type[nn.Module] = RMSNorm):
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.embed = frozen_param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.norm = norm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, False, dtype,
                                                                   linear_method)
        self.set_attention_backend(attention_backend)

    def set_attention_backend(self, backend: AttentionBackend | str) -> None:
        """A backend object, or a name resolved on first use (so that loading never builds a kernel the engine
        is about to replace)."""
        self._attn_backend = backend

    @property
    def attn_backend(self) -> AttentionBackend:
        if isinstance(self._attn_backend, str):
            self._attn_backend = get_backend(self._attn_backend)
        return self._attn_backend

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> embeddings [T, H] in the model's dtype (a table kept in GGUF blocks is gathered row by
        row and dequantized)."""
        if isinstance(self.embed, QuantTensor):
            return self.embed.embedding(input_ids, self.dtype)
        return F.embedding(input_ids, self.embed)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, H] -> float32 logits [N, V], into `out` when given (and shaped for them)."""
        head = self.lm_head
        if head is None and isinstance(self.embed, QuantTensor):  # tied, kept in GGUF blocks: fp32 from the kernel
            shape = (hidden.shape[0], self.embed.shape[0])  # straight into `out` (no temporary, no copy)
            into = out is not None and out.shape == shape and out.dtype == torch.float32
            logits = self.embed.matmul(hidden, out if into else torch.empty(shape))
        elif head is None or type(head.method) is DenseLinearMethod:  # (a subclass may compute otherwise)
            w = self.embed if head is None else head.weight
            if out is not None and hidden.dtype == torch.float32 and not current_mode().invariant:
                logits = torch.mm(hidden, w.t(), out=out)  # no [N, V] temporary
            else:
                logits = linear(hidden, w).float()
        else:
            logits = head(hidden).float()
        if out is not None and logits.data_ptr() != out.data_ptr() and out.shape == logits.shape:
            logits = out.copy_(logits)
        if self.config.logits_scaling != 1.0:  # (Granite)
            logits.div_(self.config.logits_scaling)
        cap = self.config.final_logit_softcapping
        if cap:
            logits.div_(cap).tanh_().mul_(cap)
        return logits
