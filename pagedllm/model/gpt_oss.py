"""gpt-oss's safetensors in the form the weight table reads (weight_names.GPT_OSS). Everything else of the model is
the Llama family's MoE layer with options (registry.py).

transformers keeps each layer's experts as one stacked tensor with the gate and up projections interleaved (gate
rows even, up rows odd), in one of two forms:
- dense, transposed ([E, in, out]): split and transposed here into [E, out, in] stacks, as llama.cpp's converter
  writes them;
- MXFP4 as OpenAI ships the model (`*_blocks` [E, out, in / 32, 16] holding two e2m1 codes per byte, element 2j in
  the low nibble, and `*_scales` [E, out, in / 32], the e8m0 byte): each expert becomes a QuantTensor of ggml's
  MXFP4 blocks (the scale byte, then element j in the low nibble and j + 16 in the high one), the same bytes
  reordered, run as stored or dequantized (quantization="none").
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

_EXPERTS = "mlp.experts."
_GATE_UP, _DOWN = _EXPERTS + "gate_up_proj", _EXPERTS + "down_proj"


def split_hf_experts(weights: Iterable[tuple[str, Any]], as_stored: bool = False) -> Iterator[tuple[str, Any]]:
    blocks: dict[str, torch.Tensor] = {}  # a layer's *_blocks, until its *_scales come
    for name, t in weights:
        prefix = name.rpartition(_EXPERTS)[0] + _EXPERTS
        if name.endswith("_blocks") and _EXPERTS in name:
            blocks[name.removesuffix("_blocks")] = t
            continue
        if name.endswith("_scales") and _EXPERTS in name:
            base = name.removesuffix("_scales")
            if base not in blocks:
                raise ValueError(f"weight {name!r} comes without its {base}_blocks")
            t = mxfp4_experts(blocks.pop(base), t, as_stored, base)
            name = base
        if name.endswith(_GATE_UP):  # rows gate0 up0 gate1 up1 ... (dense: columns, transposed)
            t = t.transpose(1, 2) if isinstance(t, torch.Tensor) else t
            yield prefix + "gate_proj.weight", _every_other(t, 0)
            yield prefix + "up_proj.weight", _every_other(t, 1)
        elif name.endswith(_GATE_UP + "_bias"):
            yield prefix + "gate_proj.bias", t[:, ::2].contiguous()
            yield prefix + "up_proj.bias", t[:, 1::2].contiguous()
        elif name.endswith(_DOWN):
            yield prefix + "down_proj.weight", t.transpose(1, 2).contiguous() if isinstance(t, torch.Tensor) else t
        elif name.endswith(_DOWN + "_bias"):
            yield prefix + "down_proj.bias", t
        else:
            yield name, t
    if blocks:
        raise ValueError(f"weight {next(iter(blocks))!r}_blocks comes without its _scales")


def _every_other(t: torch.Tensor | list, first: int) -> torch.Tensor | list:
    """Rows first, first + 2, ... of every expert (a stacked dense tensor, or a list of per-expert matrices)."""
    if isinstance(t, torch.Tensor):
        return t[:, first::2].contiguous()
    return [m[first::2].contiguous() if isinstance(m, torch.Tensor) else m.rows(torch.arange(first, m.shape[0], 2))
            for m in t]


def mxfp4_experts(blocks: torch.Tensor, scales: torch.Tensor, as_stored: bool, name: str) -> list:
    """HF MXFP4 experts -> per expert [rows, cols]: a QuantTensor of ggml MXFP4 rows (as_stored), else its float32
    values. InvalidModelError where a scale byte is 255 (NaN); ValueError where the shapes disagree."""
    from pagedllm.model.errors import InvalidModelError
    from pagedllm.quantization.dequant import first_invalid_block
    from pagedllm.quantization.tensor import QuantTensor, type_id

    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 4 or blocks.shape[-1] != 16 \
            or tuple(scales.shape) != tuple(blocks.shape[:3]):
        raise ValueError(f"weight {name!r}: MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales "
                         f"{tuple(scales.shape)} {scales.dtype} are not uint8 [E, rows, n, 16] and [E, rows, n]")
    experts, rows, n = scales.shape
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [E, rows, n, 32], element order
    ggml = torch.cat((scales.unsqueeze(-1), codes[..., :16] | (codes[..., 16:] << 4)), dim=-1)
    ggml = ggml.reshape(experts, rows, n * 17)
    found = first_invalid_block(ggml.numpy(), "MXFP4")
    if found:
        raise InvalidModelError(f"MXFP4 block {found[0]} of {experts * rows * n}: {found[1]}",
                                field=f"tensor {name!r}")
    quant = [QuantTensor(ggml[e].contiguous(), type_id("MXFP4"), n * 32) for e in range(experts)]
    return quant if as_stored else [q.dequantize() for q in quant]
