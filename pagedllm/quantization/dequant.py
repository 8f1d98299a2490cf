"""Vectorised dequantisation of ggml block formats to float32 torch tensors.

The common 32-element formats (Q4_0, Q4_1, Q8_0, MXFP4) are done in torch (multi-threaded, ~5x faster than the
gguf package's numpy code here); everything else goes through gguf.quants.dequantize, which is vectorised numpy.
Blocks holding a value no format defines (MXFP4's NaN scale) are found by `first_invalid_block` before either the
dequantizer or the kernels' packing reads them.
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


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> uint8 [n, 32]: low nibbles are elements 0..15, high nibbles 16..31."""
    q = torch.empty(qs.shape[0], 2, 16, dtype=torch.uint8)
    torch.bitwise_and(qs, 0x0F, out=q[:, 0])
    torch.bitwise_right_shift(qs, 4, out=q[:, 1])
    return q.view(-1, 32)


def _nibbles_float(qs: torch.Tensor) -> torch.Tensor:
    return _nibbles(qs).float()


def _q4_0(raw: np.ndarray) -> torch.Tensor:
    b = _blocks(raw, 18)
    return _nibbles_float(b[:, 2:]).sub_(8.0).mul_(_f16(b, 0))  # (q - 8) * d


def _q4_1(raw: np.ndarray) -> torch.Tensor:
    b = _blocks(raw, 20)
    return _nibbles_float(b[:, 4:]).mul_(_f16(b, 0)).add_(_f16(b, 2))  # q * d + m


def _q8_0(raw: np.ndarray) -> torch.Tensor:
    b = _blocks(raw, 34)
    return b[:, 2:].view(torch.int8).float().mul_(_f16(b, 0))


# MXFP4's e2m1 values doubled, so that they are integers; its scale is halved to match (ggml's kvalues_mxfp4)
E2M1X2 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
_MXFP4_BYTES, _E8M0_NAN = 17, 255


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """e8m0 exponent bytes as float32 2^(e - 128), exactly (subnormal below e = 2). e = 255 (NaN) is not read."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.bitwise_left_shift(0x00200000, e), (e - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(raw: np.ndarray) -> torch.Tensor:
    b = _blocks(raw, _MXFP4_BYTES)
    values = torch.tensor(E2M1X2, dtype=torch.float32)[_nibbles(b[:, 1:]).long()]
    return values.mul_(e8m0_half(b[:, :1]))


_TORCH_DEQUANT = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "MXFP4": _mxfp4}


def _mxfp4_nan_scales(raw: np.ndarray) -> np.ndarray:
    return np.asarray(raw).reshape(-1, _MXFP4_BYTES)[:, 0] == _E8M0_NAN


# per type whose blocks can hold a value the format leaves undefined: which blocks do (bool per block), and why
BLOCK_CHECKS = {"MXFP4": (_mxfp4_nan_scales, "its scale byte is 255, which e8m0 defines as NaN")}


def first_invalid_block(raw: np.ndarray, type_name: str) -> tuple[int, str] | None:
    """(index, reason) of the first block of `raw` (uint8 blocks of `type_name`) that cannot be loaded, or None:
    the loader checks every tensor's data with it before dequantizing or packing it (the kernels decode no NaN)."""
    if type_name not in BLOCK_CHECKS:
        return None
    check, reason = BLOCK_CHECKS[type_name]
    bad = check(raw)
    return (int(np.argmax(bad)), reason) if bad.any() else None


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
