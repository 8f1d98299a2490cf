"""gpt-oss's safetensors in the form the weight table reads (weight_names.GPT_OSS): transformers stores each layer's
experts as stacked, transposed matrices ([E, in, out]) with the gate and up projections interleaved by column; they
are split and transposed here into [E, out, in] stacks, as llama.cpp's converter writes them. Everything else of the
model is the Llama family's MoE layer with options (registry.py)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

_GATE_UP, _DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


def split_hf_experts(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    for name, t in weights:
        prefix = name.rpartition("mlp.experts.")[0] + "mlp.experts."
        if name.endswith(_GATE_UP):  # [E, H, 2I], columns gate0 up0 gate1 up1 ...
            t = t.transpose(1, 2)
            yield prefix + "gate_proj.weight", t[:, ::2].contiguous()
            yield prefix + "up_proj.weight", t[:, 1::2].contiguous()
        elif name.endswith(_GATE_UP + "_bias"):
            yield prefix + "gate_proj.bias", t[:, ::2].contiguous()
            yield prefix + "up_proj.bias", t[:, 1::2].contiguous()
        elif name.endswith(_DOWN):  # [E, I, H]
            yield prefix + "down_proj.weight", t.transpose(1, 2).contiguous()
        elif name.endswith(_DOWN + "_bias"):
            yield prefix + "down_proj.bias", t
        else:
            yield name, t
