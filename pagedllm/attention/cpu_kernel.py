"""The "cpu" attention backend: a C++ paged-attention kernel (csrc/paged_attention.cpp) built on first use.

The kernel reads K/V blocks in place through the block tables (no gathered copy), with an online softmax across
chunks of keys, all query heads of a KV head together (GQA), fp32 or bf16 KV, parallel over (request, KV head,
tile) with OpenMP and long contexts split across threads and merged.

Build: torch.utils.cpp_extension.load with ninja, -O3 -fopenmp. When the CPU has AVX-512 (F/BW/DQ/VL) the
AVX-512 variant is compiled with explicit -mavx512* flags (plus -mavx512bf16 where present); otherwise the portable
code only, with -mavx2 -mfma where the CPU has them and no ISA flags at all if not. Never -march=native, so
a cached build is only reused on a CPU with the same flags: the cache directory (per user, $PAGEDLLM_CACHE_DIR
or ~/.cache/pagedllm, else the temp dir) is keyed by the source hash and the variant.
If the build fails, get_backend("auto") logs a warning and falls back to the reference backend.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
from pathlib import Path

import torch

from pagedllm.attention import register_backend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.reference import copy_blocks, write_kv

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
SOURCE = _CSRC / "paged_attention.cpp"
# one extension, one torch.ops namespace; the header is hashed with the sources (a change to it rebuilds)
_QUANT = Path(__file__).parent.parent / "quantization" / "csrc"
SOURCES = [SOURCE, *(_CSRC / f for f in ("small_gemm.cpp", "sampler.cpp", "decoder_layer.cpp")), _QUANT / "quant_gemm.cpp"]
HEADERS = [_CSRC / "kernels.h", _QUANT / "quant_gemm.h"]
_AVX512_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512vl")
_lock = threading.Lock()
_ops = None
_build_error: Exception | None = None


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build_variant(flags: set[str] | None = None) -> tuple[str, list[str]]:
    """(variant name, compiler ISA flags) for this CPU."""
    flags = cpu_flags() if flags is None else flags
    if all(f in flags for f in _AVX512_FLAGS) and "fma" in flags:
        isa = ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"]
        name = "avx512"
        if "avx512_bf16" in flags:
            isa.append("-mavx512bf16")
            name += "bf16"
        if "avx512_vnni" in flags:  # the quantized GEMM's vpdpbusd
            isa.append("-mavx512vnni")
            name += "vnni"
        if "f16c" in flags:
            isa.append("-mf16c")
        return name, isa
    if "avx2" in flags and "fma" in flags:  # portable code, auto-vectorised for AVX2
        return "avx2", ["-mavx2", "-mfma"]
    return "portable", []


def cache_dir() -> Path:
    root = os.environ.get("PAGEDLLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pagedllm")
    return Path(root) / "cpu_kernel"


def load_ops():
    """Build (once per source hash and variant, cached on disk) and load the kernel; returns torch.ops namespace."""
    global _ops, _build_error
    with _lock:
        if _ops is not None:
            return _ops
        if _build_error is not None:
            raise RuntimeError(f"cpu attention kernel failed to build earlier: {_build_error}") from _build_error
        try:
            from torch.utils import cpp_extension

            variant, isa = build_variant()
            code = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
            digest = hashlib.sha256(code + " ".join(isa).encode()).hexdigest()[:12]
            name = f"pagedllm_cpu_{variant}_{digest}"
            build_dir = cache_dir() / name
            try:
                build_dir.mkdir(parents=True, exist_ok=True)
            except OSError:  # read-only home (some CI runners): a per-user temp dir
                build_dir = Path(tempfile.gettempdir()) / f"pagedllm-{os.getuid()}" / "cpu_kernel" / name
                build_dir.mkdir(parents=True, exist_ok=True)
            cpp_extension.load(
                name=name, sources=[str(p) for p in SOURCES], build_directory=str(build_dir), is_python_module=False,
                extra_cflags=["-O3", "-fopenmp", *isa], extra_ldflags=["-fopenmp"], verbose=False)
            _ops = torch.ops.pagedllm_cpu
            logger.info("cpu attention kernel loaded (%s, %s)", variant, build_dir)
            return _ops
        except Exception as e:  # compiler missing, ninja missing, bad flags...
            _build_error = e
            raise


_missing = object()
_op_cache: dict[str, object] = {}


def kernel_op(name: str):
    """The extension's op `name`, or None where the extension could not be built (no compiler): callers keep a
    torch path for that case."""
    op = _op_cache.get(name, _missing)
    if op is _missing:
        try:
            op = getattr(load_ops(), name)
        except Exception:
            op = None
        _op_cache[name] = op
    return op


def kernel_has_avx512() -> bool:
    return bool(load_ops().capabilities() & 1)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, *, portable: bool = False, min_items: int = 0,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [T,Hq,D] over the paged context described by meta (K/V already written). -> [T,Hq,D]."""
    ops = load_ops()
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    ops.paged_attention(out, q, k_cache, v_cache, _int32(meta.block_tables), _int32(meta.seq_lens),
                        _int32(meta.query_start_loc), float(scale), 1 if portable else 0, int(min_items))
    return out


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


class CpuAttentionBackend:
    """The C++ kernel behind the backend interface; constructing it builds (or loads) the kernel."""

    name = "cpu"
    copy_blocks = staticmethod(copy_blocks)

    def __init__(self, portable: bool = False) -> None:
        load_ops()
        self.portable = portable
        # the model may run whole decoder layers in C++ (decoder_layer.cpp), which call this kernel's fast path
        self.runs_fused_layers = not portable

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(q, k_cache, v_cache, meta, scale, portable=self.portable)


register_backend("cpu", CpuAttentionBackend, priority=20)
