"""Builds the C++ kernels (csrc/) on first use with torch.utils.cpp_extension and loads them as torch.ops.pagedllm_cpu.

Build: ninja, -O3 -fopenmp. When the CPU has AVX-512 (F/BW/DQ/VL) the AVX-512 code is compiled with explicit
-mavx512* flags (plus -mavx512bf16 where present); otherwise the portable code only, with -mavx2 -mfma where the
CPU has them and no ISA flags at all if not. Never -march=native, so a cached build is only reused on a CPU with
the same flags: the build directory (under paths.cache_dir(), else the temp dir) is keyed by the source hash and
the variant. $PAGEDLLM_KERNEL_VARIANT forces a lesser variant (VARIANTS). Callers that cannot do without the kernels
(the "cpu" attention backend) see the build error; the others (dispatch.kernel_op) get None and keep a torch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
from pathlib import Path

import torch

from pagedllm.paths import cache_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# one extension, one torch.ops namespace; headers are hashed with the sources (a change to one rebuilds)
SOURCES = sorted(CSRC.glob("*.cpp"))
HEADERS = sorted(CSRC.glob("*.h"))
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


# Build variants, best first: (name, CPU flags it needs, compiler flags). Each later one is a subset of the earlier.
_AVX512_ISA = ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"]
VARIANTS: list[tuple[str, tuple[str, ...], list[str]]] = [
    ("avx512bf16vnni", ("fma", *_AVX512_FLAGS, "avx512_bf16", "avx512_vnni"),
     [*_AVX512_ISA, "-mavx512bf16", "-mavx512vnni"]),
    ("avx512bf16", ("fma", *_AVX512_FLAGS, "avx512_bf16"), [*_AVX512_ISA, "-mavx512bf16"]),
    ("avx512vnni", ("fma", *_AVX512_FLAGS, "avx512_vnni"), [*_AVX512_ISA, "-mavx512vnni"]),  # quant GEMMs' vpdpbusd
    ("avx512", ("fma", *_AVX512_FLAGS), _AVX512_ISA),
    ("avx2", ("avx2", "fma"), ["-mavx2", "-mfma"]),  # the portable code, auto-vectorised for AVX2
    ("portable", (), []),  # no ISA flags at all
]
VARIANT_ENV = "PAGEDLLM_KERNEL_VARIANT"


def native_bf16() -> bool:
    """Whether the kernels this process loads compute bf16 in hardware (else bf16 is converted in software)."""
    return "bf16" in build_variant(forced=os.environ.get(VARIANT_ENV))[0]


def build_variant(flags: set[str] | None = None, forced: str | None = None) -> tuple[str, list[str]]:
    """(variant name, compiler ISA flags): the best variant this CPU runs, or `forced` (load_ops passes
    $PAGEDLLM_KERNEL_VARIANT: a lesser build on a better CPU, which is how the avx2 and portable builds are tested)."""
    flags = cpu_flags() if flags is None else flags
    names = [v[0] for v in VARIANTS]
    if forced and forced not in names:
        raise ValueError(f"{VARIANT_ENV}={forced!r}: not a build variant (one of {', '.join(names)})")
    for name, needs, isa in VARIANTS:
        if forced and name != forced:
            continue
        missing = [f for f in needs if f not in flags]
        if missing and forced:
            raise RuntimeError(f"{VARIANT_ENV}={forced}: this CPU lacks {', '.join(missing)}")
        if not missing:
            # fp16 block scales (every AVX-512 CPU has F16C; -mf16c only where the CPU says so)
            return name, isa + (["-mf16c"] if name.startswith("avx512") and "f16c" in flags else [])
    raise AssertionError("the portable variant needs no CPU flag")


def _build_dir(name: str) -> Path:
    build_dir = cache_dir() / "cpu_kernel" / name
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
    except OSError:  # read-only home (some CI runners): a per-user temp dir
        build_dir = Path(tempfile.gettempdir()) / f"pagedllm-{os.getuid()}" / "cpu_kernel" / name
        build_dir.mkdir(parents=True, exist_ok=True)
    return build_dir


def load_ops():
    """Build (once per source hash and variant, cached on disk) and load the kernels; returns the torch.ops
    namespace. Raises if they cannot be built (and again on later calls, without retrying)."""
    global _ops, _build_error
    with _lock:
        if _ops is not None:
            return _ops
        if _build_error is not None:
            raise RuntimeError(f"the C++ kernels failed to build earlier: {_build_error}") from _build_error
        try:
            from torch.utils import cpp_extension

            variant, isa = build_variant(forced=os.environ.get(VARIANT_ENV) or None)
            code = b"".join(p.name.encode() + p.read_bytes() for p in SOURCES + HEADERS)
            digest = hashlib.sha256(code + " ".join(isa).encode()).hexdigest()[:12]
            # PAGEDLLM_KERNEL_DEV=1 (kernel development): one fixed build directory, so that ninja recompiles
            # only the changed sources
            name = f"pagedllm_cpu_{variant}_" + ("dev" if os.environ.get("PAGEDLLM_KERNEL_DEV") else digest)
            build_dir = _build_dir(name)
            if not (build_dir / f"{name}.so").exists():
                logger.warning("building the C++ kernels for this CPU (first run only, ~1 min)...")
            cpp_extension.load(
                name=name, sources=[str(p) for p in SOURCES], build_directory=str(build_dir), is_python_module=False,
                extra_cflags=["-O3", "-fopenmp", *isa], extra_ldflags=["-fopenmp"], verbose=False)
            _ops = torch.ops.pagedllm_cpu
            logger.info("C++ kernels loaded (%s, %s)", variant, build_dir)
            return _ops
        except Exception as e:  # compiler missing, ninja missing, bad flags...
            _build_error = e
            raise
