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


def rope_inv_freq(dim: int, theta: float, scaling: dict[str, Any] | None, long: bool = False) -> torch.Tensor:
    """Inverse frequencies of `dim` rotated dims, including llama3, linear, YaRN and LongRoPE scaling (long:
    LongRoPE's long factors, else its short ones); the same formulas as transformers."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "longrope":
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * theta ** exponents)
    if rope_type == "yarn":
        return _yarn_inv_freq(dim, theta, scaling, exponents)
    inv_freq = 1.0 / (theta ** exponents)
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


def _yarn_inv_freq(dim: int, theta: float, scaling: dict[str, Any], exponents: torch.Tensor) -> torch.Tensor:
    """YaRN: the high frequencies (more than beta_fast rotations over the original context) kept, the low ones
    (fewer than beta_slow) interpolated by the factor, a linear ramp between; `truncate` rounds the ramp's ends
    to whole dims (transformers' default and llama.cpp's; gpt-oss turns it off)."""
    factor, original = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])

    def dim_of(rotations: float) -> float:  # the dim whose wavelength fits `rotations` times in the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(float(scaling.get("beta_fast") or 32)), dim_of(float(scaling.get("beta_slow") or 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    extrapolation = 1 - ramp  # the share of each frequency kept as it is
    pos_freqs = theta ** exponents
    return 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


def rotary_row_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order in which to store each head's q/k rows so that partial rotary becomes full rotate-half: HF rotates
    pairs (i, i + r/2) of the first r dims and passes the rest; stored as [rot[:r/2], pass[:half], rot[r/2:],
    pass[half:]], the pairs are (i, i + D/2) and the passed dims pair with each other under a rotation by angle 0.
    q.k is unchanged (q and k are reordered alike), so every attention kernel runs it as it is."""
    r, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return torch.cat((torch.arange(r), torch.arange(rotary_dim, rotary_dim + rest), torch.arange(r, rotary_dim),
                      torch.arange(rotary_dim + rest, head_dim)))


class RotaryEmbedding(nn.Module):
    TABLE_STEP = 1024  # the tables grow to the next multiple of this many positions

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None, rotary_dim: int | None = None):
        """rotary_dim < head_dim: the q/k rows are in rotary_row_order, the other dims rotate by angle 0.
        LongRoPE: a second table of the long factors, used for the tokens of sequences longer than `switch`.
        LongRoPE and YaRN: cos/sin (of the rotated dims) scaled by the attention factor."""
        super().__init__()
        rot = rotary_dim or head_dim
        longrope = (scaling or {}).get("rope_type") == "longrope"

        def padded(inv_freq: torch.Tensor) -> torch.Tensor:  # the passed dims' frequency is 0: cos 1, sin 0
            return torch.cat((inv_freq, torch.zeros((head_dim - rot) // 2)))

        self.register_buffer("inv_freq", padded(rope_inv_freq(rot, theta, scaling)), persistent=False)
        self.long_inv_freq = padded(rope_inv_freq(rot, theta, scaling, long=True)) if longrope else None
        self.switch = int(scaling["original_max_position_embeddings"]) if longrope else None
        rotated = (torch.arange(head_dim) % (head_dim // 2)) < rot // 2
        factor = float((scaling or {}).get("attention_factor", 1.0))  # (LongRoPE, YaRN)
        self._scale = torch.where(rotated, factor, 1.0) if factor != 1.0 else None
        self._tables: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}  # long -> float32 cos, sin of positions 0..

    def _table(self, long: bool, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.inv_freq.device  # (a buffer: it follows the model to its device)
        cached = self._tables.get(long)  # built on first use, even for a step with no token (a [0, D] table)
        if cached is None or needed > cached[0].shape[0] or cached[0].device != device:
            size = -(-needed // self.TABLE_STEP) * self.TABLE_STEP
            inv_freq = (self.long_inv_freq if long else self.inv_freq).to(device)
            freqs = torch.arange(size, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :].float()
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
            if self._scale is not None:
                scale = self._scale.to(device)
                cos, sin = cos * scale, sin * scale
            self._tables[long] = cached = cos, sin
        return cached

    def forward(self, positions: torch.Tensor, dtype: torch.dtype, seq_lens: torch.Tensor | None = None,
                max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, D] (broadcast over heads), once per forward for all layers: rows gathered from
        tables of every position so far, the same values as computing them per position, in two calls where
        computing them took eight in every decode step. seq_lens [T] (LongRoPE): each token's sequence length
        after this step; a token of a sequence longer than the switch takes the long factors' row, as
        transformers chooses them by the length of the sequence it computes. max_position: a bound on the positions
        + 1 known on the host (the metadata's max_seq_len), else read from them."""
        # max_position (the host's longest sequence): no read back of a device tensor, nothing that stops a CUDA
        # graph's capture
        if max_position is not None:
            needed = max_position
        else:
            needed = int(positions.max()) + 1 if positions.numel() else 0
        cos, sin = self._table(False, needed)
        cos, sin = cos.index_select(0, positions), sin.index_select(0, positions)
        if self.switch is not None and seq_lens is not None:
            long = seq_lens > self.switch
            if bool(long.any()):
                long_cos, long_sin = self._table(True, needed)
                cos = torch.where(long[:, None], long_cos.index_select(0, positions), cos)
                sin = torch.where(long[:, None], long_sin.index_select(0, positions), sin)
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], rotate-half convention (the HF layout; GGUF Q/K are un-permuted into it at load)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
