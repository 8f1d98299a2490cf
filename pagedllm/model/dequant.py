"""Vectorised dequantisation of ggml block formats to float32 torch tensors."""

from __future__ import annotations

import numpy as np
import torch


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """raw: the tensor's bytes (uint8); returns float32 of `shape` (rows first)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    qtype = GGMLQuantizationType[type_name]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    out = gguf_dequantize(np.asarray(raw).reshape(rows, -1), qtype)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).view(shape)
