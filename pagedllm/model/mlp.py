"""The gated MLP: down(glu(gate(x), up(x))), gate and up fused into one [2I, H] Linear."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.linear import Linear, LinearMethod

Glu = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (gate, up) -> the down projection's input


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


swiglu.kernel_form = (0, 0.0, 0.0)  # what csrc/moe.cpp calls it: (kind, limit, alpha)


def geglu_tanh(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


def clamped_swiglu(limit: float, alpha: float) -> Glu:
    """gpt-oss's SwiGLU: the gate clamped above at `limit`, up to [-limit, limit], the gate's sigmoid sharpened by
    `alpha`, and 1 added to up."""
    def glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))
    glu.kernel_form = (1, float(limit), float(alpha))
    return glu


class GatedMLP(nn.Module):
    """SwiGLU (Llama family), GeGLU with gelu tanh (Gemma), clamped SwiGLU with biases (gpt-oss's experts)."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, method: LinearMethod | None = None,
                 glu: Glu = swiglu, bias: bool = False):
        super().__init__()
        self.intermediate = intermediate
        self.glu = glu
        self.gate_up = Linear(hidden, [intermediate, intermediate], bias, dtype, method)
        self.down = Linear(intermediate, hidden, bias, dtype, method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up(x)
        return self.down(self.glu(gu[:, :self.intermediate], gu[:, self.intermediate:]))
