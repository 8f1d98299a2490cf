"""Bidirectional encoders: BERT, XLM-RoBERTa and NomicBERT (post-norm layers), with the classification head of
their cross-encoders. The forward takes the flat tokens of several sequences and attends each sequence to itself
alone: a sequence's rows never depend on what else is in the batch (in the batch-invariant kernel mode, the
default, each sequence's rows go through the GEMMs as a call of their own: `seq_linear`). No KV cache: an encoder
reads each prompt once and generates nothing."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.dispatch import current_mode
from pagedllm.model.encoder_config import EncoderConfig
from pagedllm.model.layers import RotaryEmbedding, apply_rope, frozen_param
from pagedllm.model.linear import DenseLinearMethod, Linear

_ACT = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu, "swiglu": F.silu,
        "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class LayerNorm(nn.Module):
    """Computed in float32 whatever the model's dtype, as the checkpoints were trained."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = frozen_param(dim, dtype=dtype)
        self.bias = frozen_param(dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), self.bias.float(), self.eps).to(x.dtype)


class Embeddings(nn.Module):
    def __init__(self, cfg: EncoderConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.word = frozen_param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        # rotary encoders (NomicBERT) have no position table
        self.position = (frozen_param(cfg.max_position_embeddings, cfg.hidden_size, dtype=dtype)
                         if cfg.rotary_base is None else None)
        self.token_type = (frozen_param(cfg.type_vocab_size, cfg.hidden_size, dtype=dtype)
                           if cfg.type_vocab_size else None)
        self.norm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        x = self.word[input_ids]
        if self.token_type is not None:
            x = x + self.token_type[token_type_ids]
        if self.position is not None:
            x = x + self.position[positions]
        return self.norm(x)


def seq_linear(layer: Linear, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
    """layer(x) for the flat rows of sequences of `seq_lens`, on torch's GEMM. Batch-invariant mode: one GEMM per
    sequence, so a sequence's rows depend on its own rows alone (a GEMM library's result depends on the call's row
    count, never on other calls), a few % slower than one call over all rows. Not the engine's invariant C++ GEMM:
    an encoder step multiplies thousands of rows, where that runs at a fraction of oneDNN's rate (1/5 on AVX2)."""
    if type(layer.method) is not DenseLinearMethod:
        return layer(x)  # (encoders load dense weights: a guard for other methods, which keep their own kernels)
    if not current_mode().invariant or len(seq_lens) == 1:
        return _dense(layer, x)
    out = x.new_empty(x.shape[0], layer.output_size)
    start = 0
    for n in seq_lens:  # rows start..start+n of `out` are a contiguous view: the GEMM writes them in place
        _dense(layer, x[start:start + n], out[start:start + n])
        start += n
    return out


def _dense(layer: Linear, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    w = layer.weight.t()
    if layer.bias is None:
        return torch.mm(x, w, out=out)
    return torch.addmm(layer.bias, x, w, out=out)


class EncoderLayer(nn.Module):
    """x = norm(x + attention(x)); x = norm(x + mlp(x))."""

    def __init__(self, cfg: EncoderConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, ff = cfg.hidden_size, cfg.intermediate_size
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = Linear(h, [h, h, h], cfg.bias, dtype)
        self.o = Linear(h, h, cfg.bias, dtype)
        self.attn_norm = LayerNorm(h, cfg.layer_norm_eps, dtype)
        self.up = Linear(h, [ff, ff] if cfg.gated else ff, cfg.bias, dtype)  # gated: [gate | up]
        self.down = Linear(ff, h, cfg.bias, dtype)
        self.out_norm = LayerNorm(h, cfg.layer_norm_eps, dtype)
        self.act = _ACT[cfg.hidden_act]
        self.gated = cfg.gated

    def forward(self, x: torch.Tensor, seq_lens: list[int], rope: tuple[torch.Tensor, torch.Tensor] | None
                ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = seq_linear(self.qkv, x, seq_lens).view(t, 3, self.num_heads, self.head_dim).unbind(1)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = torch.empty_like(q)
        start = 0
        for n in seq_lens:  # each sequence attends to itself only: [1, heads, n, d] (4-D: torch's flash kernel)
            s = slice(start, start + n)
            out[s] = F.scaled_dot_product_attention(q[s].transpose(0, 1)[None], k[s].transpose(0, 1)[None],
                                                    v[s].transpose(0, 1)[None])[0].transpose(0, 1)
            start += n
        x = self.attn_norm(x + seq_linear(self.o, out.view(t, -1), seq_lens))
        up = seq_linear(self.up, x, seq_lens)
        if self.gated:
            gate, up = up.chunk(2, dim=-1)
            up = self.act(gate) * up
        else:
            up = self.act(up)
        return self.out_norm(x + seq_linear(self.down, up, seq_lens))


class ClassifierHead(nn.Module):
    """The cross-encoder's head on the first token's row: (dense + tanh, BERT's pooler or RoBERTa's head) and the
    output projection to the labels."""

    def __init__(self, cfg: EncoderConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = Linear(cfg.hidden_size, cfg.hidden_size, True, dtype) if cfg.classifier_dense else None
        self.out = Linear(cfg.hidden_size, cfg.num_labels, True, dtype)

    def forward(self, first_rows: torch.Tensor) -> torch.Tensor:
        x = first_rows if self.dense is None else torch.tanh(self.dense(first_rows))
        return self.out(x)


class EncoderModel(nn.Module):
    def __init__(self, cfg: EncoderConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        self.embed = Embeddings(cfg, dtype)
        self.layers = nn.ModuleList(EncoderLayer(cfg, dtype) for _ in range(cfg.num_layers))
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rotary_base, None) if cfg.rotary_base is not None else None
        self.classifier = ClassifierHead(cfg, dtype) if cfg.is_cross_encoder else None
        self.dtype = dtype

    def positions(self, input_ids: list[int]) -> list[int]:
        """A sequence's position ids as transformers makes them: XLM-R's count the non-padding tokens from
        padding_idx + 1 (a padding token itself sits at padding_idx); the others are 0, 1, 2, ..."""
        offset = self.config.position_offset
        if not offset:
            return list(range(len(input_ids)))
        pad, seen, out = self.config.pad_token_id, 0, []
        for token in input_ids:
            seen += token != pad
            out.append(pad if token == pad else pad + seen)
        return out

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor,
                seq_lens: list[int]) -> torch.Tensor:
        """Flat [T] inputs of sequences of `seq_lens` tokens -> the last hidden states [T, H]."""
        x = self.embed(input_ids, positions, token_type_ids)
        rope = self.rotary(positions, x.dtype) if self.rotary is not None else None
        for layer in self.layers:
            x = layer(x, seq_lens, rope)
        return x

    @torch.inference_mode()
    def score(self, first_rows: torch.Tensor) -> torch.Tensor:
        """The classifier's logits [N, labels] of each sequence's first row (a cross-encoder only), float32."""
        return self.classifier(first_rows).float()
