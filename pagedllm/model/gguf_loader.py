"""GGUF files: a small header parser (fast: the gguf package's reader needs ~2 s on the default model),
config from the metadata, vectorised dequantisation, and Q/K un-permuted back into the HF layout."""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from pagedllm.model import registry
from pagedllm.model.config import ModelConfig, UnsupportedModelError, pattern_layer_types
from pagedllm.quantization.types import BY_ID as GGML_TYPES
from pagedllm.quantization.types import FLOAT_TYPES

_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class CorruptGGUFError(ValueError):
    """The file is not a readable GGUF (bad magic, truncated, inconsistent offsets)."""


@dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (rows first)
    ggml_type: int
    offset: int  # absolute, in the file


@dataclass
class GGUFFile:
    path: str
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    blob: np.ndarray  # read-only memmap of the whole file

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]


@dataclass
class SkippedStrings:
    """A string array we did not decode (the vocabulary and merges: ~100k strings we never need here)."""

    count: int

    def __len__(self) -> int:
        return self.count


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> tuple:
        vals = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return vals

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype in _SCALAR_FMT:
            return self.unpack(_SCALAR_FMT[vtype])[0]
        if vtype == 8:
            return self.string()
        if vtype == 9:
            etype, count = self.unpack("<IQ")
            if etype in _SCALAR_FMT:
                fmt = _SCALAR_FMT[etype]
                vals = list(struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.pos))
                self.pos += count * struct.calcsize(fmt)
                return vals
            if etype == 8 and count > 1024:
                for _ in range(count):  # walk the lengths only
                    self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]
                return SkippedStrings(count)
            return [self.value(etype) for _ in range(count)]
        raise CorruptGGUFError(f"unknown GGUF metadata value type {vtype}")


def read_gguf(path: str) -> GGUFFile:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    blob = np.memmap(path, mode="r", dtype=np.uint8)
    try:
        cur = _Cursor(memoryview(blob))
        if bytes(blob[:4]) != b"GGUF":
            raise CorruptGGUFError(f"{path} is not a GGUF file (bad magic {bytes(blob[:4])!r})")
        version, n_tensors, n_kv = cur.unpack("<4xIQQ")
        if version not in (2, 3):
            raise CorruptGGUFError(f"{path}: unsupported GGUF version {version} (expected 2 or 3)")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            (vtype,) = cur.unpack("<I")
            metadata[key] = cur.value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            (ndim,) = cur.unpack("<I")
            dims = cur.unpack(f"<{ndim}Q")
            ggml_type, offset = cur.unpack("<IQ")
            infos.append((name, tuple(reversed(dims)), ggml_type, offset))
    except (struct.error, UnicodeDecodeError, IndexError, MemoryError, OverflowError) as e:
        raise CorruptGGUFError(f"{path} is truncated or corrupt: {e}") from e
    align = int(metadata.get("general.alignment", 32))
    data_start = -(-cur.pos // align) * align
    tensors = {}
    for name, shape, ggml_type, offset in infos:
        t = GGUFTensorInfo(name, shape, ggml_type, data_start + offset)
        if ggml_type in GGML_TYPES and t.offset + _nbytes(t) > len(blob):
            raise CorruptGGUFError(f"{path} is truncated: tensor {name!r} ends past the end of the file")
        tensors[name] = t
    if "general.architecture" not in metadata:
        raise CorruptGGUFError(f"{path} has no general.architecture in its metadata")
    return GGUFFile(path, metadata, tensors, blob)


def _nbytes(t: GGUFTensorInfo) -> int:
    gt = GGML_TYPES[t.ggml_type]
    return int(np.prod(t.shape)) // gt.block * gt.bytes


def dequantize(f: GGUFFile, t: GGUFTensorInfo) -> torch.Tensor:
    """float32 (or the stored float type) tensor of t's shape."""
    _require_supported(t)
    name = GGML_TYPES[t.ggml_type].name
    raw = f.blob[t.offset:t.offset + _nbytes(t)]
    if name in FLOAT_TYPES:
        dt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[name]
        return torch.frombuffer(bytearray(raw), dtype=dt).view(t.shape)
    from pagedllm.quantization import dequant

    return dequant.dequantize(raw, name, t.shape)


def _require_supported(t: GGUFTensorInfo) -> None:
    if t.ggml_type not in GGML_TYPES:
        supported = ", ".join(v.name for v in GGML_TYPES.values())
        raise UnsupportedModelError(f"tensor {t.name!r} uses ggml type {_type_name(t.ggml_type)}, which pagedllm "
                                    f"cannot dequantise; supported: {supported}")


def _type_name(ggml_type: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return f"{GGMLQuantizationType(ggml_type).name} ({ggml_type})"
    except (ImportError, ValueError):
        return str(ggml_type)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's permute(): rows were reordered from [halves] to [interleaved pairs] per head."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def config_from_gguf(f: GGUFFile) -> ModelConfig:
    m = f.metadata
    arch = f.architecture
    spec = registry.spec_for_gguf(arch)

    def get(key: str, default: Any = None) -> Any:
        return m.get(f"{arch}.{key}", default)

    for t in f.tensors.values():  # fail before dequantising anything
        _require_supported(t)

    try:
        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        kv_heads = get("attention.head_count_kv", heads)
        num_layers = int(get("block_count"))
        ffn = int(get("feed_forward_length"))
    except TypeError as e:
        raise CorruptGGUFError(f"{f.path}: missing {arch}.* model dimensions in the metadata") from e
    head_dim = int(get("attention.key_length") or hidden // heads)
    vocab = get("vocab_size") or len(m.get("tokenizer.ggml.tokens", [])) or f.tensors["token_embd.weight"].shape[0]
    scaling = None
    if "rope_freqs.weight" in f.tensors:  # llama3-style scaling stored as per-frequency divisors
        scaling = {"rope_type": "freq_factors",
                   "factors": dequantize(f, f.tensors["rope_freqs.weight"]).float().tolist()}
    elif get("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif get("rope.scaling.type") not in (None, "none"):
        raise UnsupportedModelError(f"GGUF rope scaling {get('rope.scaling.type')!r} is not supported")
    if get("attn_logit_softcapping"):
        raise UnsupportedModelError("attention logit softcapping is not supported")
    window = get("attention.sliding_window")
    pattern = spec.sliding_window_pattern
    eos = [m[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in m]
    config = ModelConfig(
        architecture=spec.name,
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_heads=heads,
        num_kv_heads=int(kv_heads if not isinstance(kv_heads, list) else max(kv_heads)),
        head_dim=head_dim,
        vocab_size=int(vocab),
        max_position_embeddings=int(get("context_length", 2048)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in f.tensors,
        qkv_bias="blk.0.attn_q.bias" in f.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in f.tensors,
        sliding_window=int(window) if window else None,
        layer_types=pattern_layer_types(num_layers, pattern) if window and pattern else None,
        rope_local_theta=spec.gguf_rope_local_theta,
        final_logit_softcapping=get("final_logit_softcapping"),
        eos_token_ids=list(dict.fromkeys(int(e) for e in eos)),
        bos_token_id=m.get("tokenizer.ggml.bos_token_id"),
    )
    spec.check_features(config.features())
    return config


# llama.cpp's converter interleaved the rope pairs of these rows (for architectures with gguf_permuted_qk)
_PERMUTED_Q, _PERMUTED_K = ".attn_q.weight", ".attn_k.weight"


def iter_gguf_weights(f: GGUFFile, cfg: ModelConfig, as_stored: bool = False) -> Iterator[tuple[str, Any]]:
    """(GGUF name, tensor) pairs, Q/K rows back in the HF (rotate-half) order, norm weights back to what HF
    checkpoints store. Tensors are dequantised, except with as_stored, where matrices in a block format the
    quantized kernel reads stay QuantTensors over the memory-mapped file (Q/K rows permuted into a same-size copy)."""
    from pagedllm.quantization.tensor import QuantTensor, bytes_view, row_bytes, runs_as_stored

    spec = registry.spec(cfg.architecture)
    permuted = spec.gguf_permuted_qk
    for name, info in f.tensors.items():
        if as_stored and len(info.shape) == 2 and runs_as_stored(info.ggml_type, info.shape[1]):
            rows, cols = info.shape
            w = QuantTensor(bytes_view(f.blob, info.offset, rows, row_bytes(info.ggml_type, cols)),
                            info.ggml_type, cols, partial(_release_pages, f.blob, info.offset, _nbytes(info)))
        else:
            w = dequantize(f, info)
        if spec.gguf_norm_shift and name.endswith("norm.weight"):
            w = w.float() - spec.gguf_norm_shift
        heads = cfg.num_heads if name.endswith(_PERMUTED_Q) else cfg.num_kv_heads
        if permuted and name.endswith((_PERMUTED_Q, _PERMUTED_K)):
            w = w.rows(_unpermute(torch.arange(w.shape[0]), heads)) if isinstance(w, QuantTensor) \
                else _unpermute(w, heads)
        yield name, w
        # the model holds its own copy by now (a view of the file is released when it is packed, or kept)
        if as_stored and not (isinstance(w, QuantTensor) and w.release_source is not None):
            _release_pages(f.blob, info.offset, _nbytes(info))


def _release_pages(blob: np.ndarray, offset: int, nbytes: int) -> None:
    """MADV_DONTNEED over the whole pages of blob[offset:offset + nbytes] (a read-only file mapping: a later read
    of a weight still kept as a view of the file faults its page back in from the page cache)."""
    mm = getattr(blob, "_mmap", None)
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if mm is None or advice is None:
        return
    page = mmap.PAGESIZE
    start, end = -(-offset // page) * page, (offset + nbytes) // page * page
    if end > start:
        mm.madvise(advice, start, end - start)
