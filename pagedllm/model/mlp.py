"""The gated MLP: down(act(gate(x)) * up(x)), gate and up fused into one [2I, H] Linear."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.linear import Linear, LinearMethod


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class GatedMLP(nn.Module):
    """SwiGLU with act=F.silu (Llama family), GeGLU with act=gelu_tanh (Gemma)."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, method: LinearMethod | None = None,
                 act: Callable[[torch.Tensor], torch.Tensor] = F.silu):
        super().__init__()
        self.intermediate = intermediate
        self.act = act
        self.gate_up = Linear(hidden, [intermediate, intermediate], False, dtype, method)
        self.down = Linear(intermediate, hidden, False, dtype, method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up(x)
        return self.down(self.act(gu[:, :self.intermediate]) * gu[:, self.intermediate:])
