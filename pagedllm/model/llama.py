"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM2) over the paged KV cache.

It sees one flat batch of new tokens (no padding, no request objects); attention reads and writes the
per-layer KV pools through the AttentionMetadata.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention import AttentionBackend, AttentionMetadata, get_backend
from pagedllm.kernels import batch_invariant
from pagedllm.model.config import ModelConfig
from pagedllm.model.layers import (
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    apply_rope,
    bf16_kernel_op,
    frozen_param,
    linear,
)

KVCache = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.qkv = frozen_param(cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size, dtype=dtype)  # fused q|k|v
        self.qkv_bias = frozen_param(cfg.q_size + 2 * cfg.kv_size, dtype=dtype) if cfg.qkv_bias else None
        self.o = frozen_param(cfg.hidden_size, cfg.q_size, dtype=dtype)
        self.o_bias = frozen_param(cfg.hidden_size, dtype=dtype) if cfg.o_bias else None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        c = self.cfg
        qkv = linear(x, self.qkv, self.qkv_bias)
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(-1, c.num_heads, c.head_dim)
        k = k.view(-1, c.num_kv_heads, c.head_dim)
        v = v.view(-1, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return linear(out.reshape(-1, c.q_size), self.o, self.o_bias)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = Attention(cfg, dtype)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype)

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
           meta.seq_lens, meta.query_start_loc, c.num_heads, c.rms_norm_eps, self.attn.scale)

    def _fused_weights(self) -> tuple:
        """The op's weight arguments in its order, gathered once (the Parameters stay the same objects when
        weights are loaded, only their data changes)."""
        if not hasattr(self, "_weights_for_op"):
            a = self.attn
            q_norm, k_norm = (a.q_norm.weight, a.k_norm.weight) if a.cfg.qk_norm else (None, None)
            self._weights_for_op = (self.input_norm.weight, a.qkv, a.qkv_bias, q_norm, k_norm, a.o, a.o_bias,
                                    self.post_norm.weight, self.mlp.gate_up, self.mlp.down)
        return self._weights_for_op


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 attention_backend: AttentionBackend | str = "auto"):
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.embed = frozen_param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else frozen_param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.set_attention_backend(attention_backend)
        self.fused_layers = True  # one C++ call per layer for bf16 batches where the kernels allow

    def set_attention_backend(self, backend: AttentionBackend | str) -> None:
        """A backend object, or a name resolved on first use (so that loading never builds a kernel the engine
        is about to replace)."""
        self._attn_backend = backend

    @property
    def attn_backend(self) -> AttentionBackend:
        if isinstance(self._attn_backend, str):
            self._attn_backend = get_backend(self._attn_backend)
        return self._attn_backend

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids [T], positions [T] -> final-normed hidden states [T, H]."""
        h = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary(positions, self.dtype)
        fused = self._fused_layer_op(h, kv_caches)
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            if fused is not None:
                layer.forward_fused(fused, h, cos, sin, kv, meta)
            else:
                h = layer(h, cos, sin, kv, meta, self.attn_backend)
        return self.norm(h)

    def _fused_layer_op(self, h: torch.Tensor, kv_caches: list[KVCache]):
        """The fused decoder-layer op when this batch can use it (bf16 weights and KV, the C++ attention kernel as
        backend, a CPU with avx512_bf16), else None."""
        # (not in batch-invariant mode: the fused layer's GEMMs switch kernels with the row count)
        if not (self.fused_layers and not batch_invariant() and h.dtype == torch.bfloat16 and h.shape[0] > 0
                and kv_caches and kv_caches[0][0].dtype == torch.bfloat16
                and getattr(self.attn_backend, "runs_fused_layers", False)):
            return None
        return bf16_kernel_op("decoder_layer_bf16")

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, H] -> float32 logits [N, V], into `out` when given."""
        w = self.embed if self.lm_head is None else self.lm_head
        if out is None:
            return linear(hidden, w).float()
        if hidden.dtype == torch.float32 and not batch_invariant():
            return torch.mm(hidden, w.t(), out=out)
        return out.copy_(linear(hidden, w))

    # ---- weights -------------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take HF-named tensors, fusing q/k/v and gate/up at load time. Unfused tensors are adopted without a
        copy when their dtype already matches. Raises on missing, unknown or mis-shaped weights."""
        c = self.config
        slices = {"q_proj": (0, c.q_size), "k_proj": (c.q_size, c.kv_size),
                  "v_proj": (c.q_size + c.kv_size, c.kv_size),
                  "gate_proj": (0, c.intermediate_size), "up_proj": (c.intermediate_size, c.intermediate_size)}
        expected = self._expected_names()
        seen: set[str] = set()
        pending: dict[int, dict[int, torch.Tensor]] = {}  # fused param -> {row offset: piece}
        for name, tensor in weights:
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied checkpoints sometimes store the copy anyway
            if name not in expected:
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            param = self._target(name)
            leaf = name.split(".")[-2]
            off, rows = slices.get(leaf, (0, param.shape[0]))
            want = (rows, *param.shape[1:])
            if tuple(tensor.shape) != want:
                raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} does not match the config ({want})")
            seen.add(name)
            if leaf not in slices:
                param.data = tensor.to(param.dtype).contiguous()
                continue
            parts = pending.setdefault(id(param), {})
            parts[off] = tensor
            if sum(p.shape[0] for p in parts.values()) == param.shape[0]:
                param.data = torch.cat([parts[o] for o in sorted(parts)]).to(param.dtype)
                del pending[id(param)]
        missing = sorted(expected - seen)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weight(s), e.g. {missing[:3]}")

    def _expected_names(self) -> set[str]:
        c = self.config
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if self.lm_head is not None:
            names.add("lm_head.weight")
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            names |= {p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                      "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                      "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                      "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")}
            if c.qkv_bias:
                names |= {p + f"self_attn.{x}_proj.bias" for x in "qkv"}
            if c.o_bias:
                names.add(p + "self_attn.o_proj.bias")
            if c.qk_norm:
                names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        return names

    def _target(self, name: str) -> nn.Parameter:
        if name == "model.embed_tokens.weight":
            return self.embed
        if name == "model.norm.weight":
            return self.norm.weight
        if name == "lm_head.weight":
            return self.lm_head
        parts = name.split(".")  # model.layers.{i}.{module}.{leaf}.{weight|bias}
        layer = self.layers[int(parts[2])]
        sub, leaf, kind = parts[3], parts[4], parts[-1]
        if sub == "input_layernorm":
            return layer.input_norm.weight
        if sub == "post_attention_layernorm":
            return layer.post_norm.weight
        if sub == "mlp":
            return layer.mlp.down if leaf == "down_proj" else layer.mlp.gate_up
        attn = layer.attn
        if leaf in ("q_norm", "k_norm"):
            return getattr(attn, leaf).weight
        if leaf == "o_proj":
            return attn.o if kind == "weight" else attn.o_bias
        return attn.qkv if kind == "weight" else attn.qkv_bias
