"""GGUF weights: vectorised dequantisation, Q/K un-permuted back into the HF layout, block formats kept as stored.
The file is parsed and validated by gguf_reader.py, its config built and checked by gguf_config.py."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import torch

from pagedllm.model import registry
from pagedllm.model.config import ModelConfig
from pagedllm.model.errors import InvalidModelError, UnsupportedModelError
from pagedllm.model.gguf_reader import GGUFFile, GGUFTensorInfo
from pagedllm.quantization.types import BY_ID as GGML_TYPES
from pagedllm.quantization.types import FLOAT_TYPES, GEOMETRY


def dequantize(f: GGUFFile, t: GGUFTensorInfo) -> torch.Tensor:
    """float32 (or the stored float type) tensor of t's shape."""
    if t.ggml_type not in GGML_TYPES:
        supported = ", ".join(v.name for v in GGML_TYPES.values())
        raise UnsupportedModelError(f"uses ggml type {type_name(t.ggml_type)}, which pagedllm cannot dequantise; "
                                    f"supported: {supported}", path=f.path, field=f"tensor {t.name!r}")
    name = GGML_TYPES[t.ggml_type].name
    raw = f.blob[t.offset:t.offset + t.nbytes]
    if name in FLOAT_TYPES:
        dt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[name]
        return torch.frombuffer(bytearray(raw), dtype=dt).view(t.shape)
    from pagedllm.quantization import dequant

    return dequant.dequantize(raw, name, t.shape)


_CHECK_SLICE = 64 << 20  # bytes of a tensor checked between two page drops


def check_blocks(f: GGUFFile, t: GGUFTensorInfo) -> None:
    """InvalidModelError naming the tensor where its blocks hold a value the format leaves undefined (MXFP4's NaN
    scale): every tensor is checked before it is dequantized or packed. The pages checked are dropped as the check
    passes them, so that a large tensor is not resident whole before its packing reads it again."""
    from pagedllm.quantization.dequant import BLOCK_CHECKS, first_invalid_block

    name, _, block_bytes = GEOMETRY[t.ggml_type]
    if name not in BLOCK_CHECKS:
        return
    step = max(1, _CHECK_SLICE // block_bytes) * block_bytes
    for start in range(0, t.nbytes, step):
        n = min(step, t.nbytes - start)
        found = first_invalid_block(f.blob[t.offset + start:t.offset + start + n], name)
        f.release_pages(t.offset + start, n)
        if found:
            block, reason = found
            raise InvalidModelError(f"{name} block {start // block_bytes + block} of {t.nbytes // block_bytes}: "
                                    f"{reason}", path=f.path, field=f"tensor {t.name!r}")


def type_name(ggml_type: int) -> str:
    known = GEOMETRY.get(ggml_type)
    return f"{known[0]} ({ggml_type})" if known else str(ggml_type)


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's permute(): rows were reordered from [halves] to [interleaved pairs] per head."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


# llama.cpp's converter interleaved the rope pairs of these rows (for architectures with gguf_permuted_qk)
_PERMUTED_Q, _PERMUTED_K = ".attn_q.weight", ".attn_k.weight"


def _expert_views(f: GGUFFile, info: GGUFTensorInfo) -> list:
    """A stacked expert tensor [E, rows, cols] as stored: one QuantTensor per expert, a view of its own rows of
    the mapping (an owned copy where it will not be packed)."""
    from pagedllm.quantization.tensor import QuantTensor, bytes_view, row_bytes

    experts, rows, cols = info.shape
    nbytes = rows * row_bytes(info.ggml_type, cols)
    views = []
    for e in range(experts):
        offset = info.offset + e * nbytes
        view = QuantTensor(bytes_view(f.blob, offset, rows, nbytes // rows), info.ggml_type, cols,
                           partial(f.release_pages, offset, nbytes))
        if not view.packable:
            view = QuantTensor(view.data.clone(), info.ggml_type, cols)
            f.release_pages(offset, nbytes)
        views.append(view)
    return views


def iter_gguf_weights(f: GGUFFile, cfg: ModelConfig, as_stored: bool = False) -> Iterator[tuple[str, Any]]:
    """(GGUF name, tensor) pairs, Q/K rows back in the HF (rotate-half) order, norm weights back to what HF
    checkpoints store. Tensors are dequantised, except with as_stored, where matrices in a block format the
    quantized kernel reads stay QuantTensors: views of the mapped file for the loader to repack (released once
    packed), owned copies of the rest. Once loaded, the model reads nothing from the mapping, so a file truncated
    or rewritten under a running engine cannot fault it (SIGBUS) or change its weights."""
    from pagedllm.quantization.tensor import QuantTensor, bytes_view, row_bytes, runs_as_stored

    spec = registry.spec(cfg.architecture)
    permuted = spec.gguf_permuted_qk
    for name, info in f.tensors.items():
        check_blocks(f, info)
        if len(info.shape) == 3 and as_stored and runs_as_stored(info.ggml_type, info.shape[2]):
            yield name, _expert_views(f, info)  # each view releases its own pages once packed (or is copied)
            continue
        if as_stored and len(info.shape) == 2 and runs_as_stored(info.ggml_type, info.shape[1]):
            rows, cols = info.shape
            w = QuantTensor(bytes_view(f.blob, info.offset, rows, row_bytes(info.ggml_type, cols)),
                            info.ggml_type, cols, partial(f.release_pages, info.offset, info.nbytes))
        else:
            w = dequantize(f, info)
        if spec.gguf_norm_shift and name.endswith("norm.weight"):
            w = w.float() - spec.gguf_norm_shift
        heads = cfg.num_heads if name.endswith(_PERMUTED_Q) else cfg.num_kv_heads
        if permuted and name.endswith((_PERMUTED_Q, _PERMUTED_K)):
            w = w.rows(unpermute(torch.arange(w.shape[0]), heads)) if isinstance(w, QuantTensor) \
                else unpermute(w, heads)
        if isinstance(w, QuantTensor) and w.release_source is not None and not w.packable:
            w = QuantTensor(w.data.clone(), w.qtype, w.cols)  # kept as stored: own it
        yield name, w
        # the model holds its own copy by now (a view still to be packed releases its pages itself)
        if as_stored and not (isinstance(w, QuantTensor) and w.release_source is not None):
            f.release_pages(info.offset, info.nbytes)
