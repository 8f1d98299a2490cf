"""Random weights for tiny test checkpoints and bench models of real shapes."""

from __future__ import annotations

import torch


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Fresh weights with O(1) activations: norms near 1, biases small, matrices scaled by their width."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape))
            else:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape))
    return model.eval()
