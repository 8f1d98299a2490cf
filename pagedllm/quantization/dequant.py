"""Vectorised dequantisation of ggml block formats to float32 torch tensors.

The common 32-element formats (Q4_0, Q4_1, Q8_0) are done in torch (multi-threaded, ~5x faster than the gguf
package's numpy code here); everything else goes through gguf.quants.dequantize, which is vectorised numpy.
"""

from __future__ import annotations

import numpy as np
import torch


def _blocks(raw: np.ndarray, block_bytes: int) -> torch.Tensor:
    # a private copy of the (read-only, memory-mapped) bytes: cheap next to the float32 output
    return torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True)).view(-1, block_bytes)


def _f16(b: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 scale stored at byte `start` of every block, as float32 [nblocks, 1]."""
    return b[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles_float(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> float32 [n, 32]: low nibbles are elements 0..15, high nibbles 16..31."""
    q = torch.empty(qs.shape[0], 2, 16, dtype=torch.uint8)
    torch.bitwise_and(qs, 0x0F, out=q[:, 0])
    torch.bitwise_right_shift(qs, 4, out=q[:, 1])
    return q.view(-1, 32).float()


def _q4_0(raw: np.ndarray) -> torch.Tensor:
    b = _blocks(raw, 18)
    return _nibbles_float(b[:, 2:]).sub_(8.0).mul_(_f16(b, 0))  # (q - 8) * d


def _q4_1(raw: np.ndarray) -> torch.Tensor:
    b = _blocks(raw, 20)
    return _nibbles_float(b[:, 4:]).mul_(_f16(b, 0)).add_(_f16(b, 2))  # q * d + m


def _q8_0(raw: np.ndarray) -> torch.Tensor:
    b = _blocks(raw, 34)
    return b[:, 2:].view(torch.int8).float().mul_(_f16(b, 0))


_TORCH_DEQUANT = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0}


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """raw: the tensor's bytes (uint8); returns float32 of `shape` (rows first)."""
    fn = _TORCH_DEQUANT.get(type_name)
    if fn is not None:
        return fn(raw).view(shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    out = gguf_dequantize(np.asarray(raw).reshape(rows, -1), GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).view(shape)
