"""Building blocks of the Llama family: RMSNorm, rotary embedding, the bf16 linear. Written to match transformers'
arithmetic (norms in float32, cos/sin computed in float32 then cast) so float32 logits agree to ~1e-6."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.dispatch import current_mode, kernel_op, small_gemm_max_rows


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except: in batch-invariant mode (the forward's KernelMode) a GEMM whose rows do not depend on
    the batch (oneDNN's do; every build has one); else for decode-sized bf16 batches, where oneDNN reads the
    weights at a fraction of the memory bandwidth, a kernel that streams each weight row once."""
    if current_mode().invariant and x.dim() == 2 and x.dtype == w.dtype and x.dtype in (torch.float32, torch.bfloat16):
        gemm = kernel_op("gemm_invariant")
        if gemm is not None:
            out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
            gemm(out, x.contiguous(), w.contiguous())
            return out if bias is None else out + bias
    if x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] <= small_gemm_max_rows():
        gemm = kernel_op("small_gemm_bf16")
        if gemm is not None:
            out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
            gemm(out, x.contiguous(), w)
            return out if bias is None else out + bias
    return F.linear(x, w, bias)


def frozen_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = frozen_param(dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies, including llama3 and linear scaling (same formulas as transformers)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "freq_factors":  # GGUF stores llama3 scaling as one divisor per frequency
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if rope_type != "llama3":
        return inv_freq
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    TABLE_STEP = 1024  # the tables grow to the next multiple of this many positions

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        self._cos = self._sin = torch.empty(0, 2 * self.inv_freq.numel())  # float32 rows of positions 0, 1, ...

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, D] (broadcast over heads), once per forward for all layers: rows gathered from
        tables of every position so far, the same values as computing them per position, in two calls where
        computing them took eight in every decode step."""
        needed = int(positions.max()) + 1 if positions.numel() else 0
        if needed > self._cos.shape[0]:
            size = -(-needed // self.TABLE_STEP) * self.TABLE_STEP
            freqs = torch.arange(size, dtype=torch.float32)[:, None] * self.inv_freq[None, :].float()
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos, self._sin = emb.cos(), emb.sin()
        cos, sin = self._cos.index_select(0, positions), self._sin.index_select(0, positions)
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], rotate-half convention (the HF layout; GGUF Q/K are un-permuted into it at load)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
