"""The kernels' build variants and what names a build: the one table setup.py (install time) and build.py (run time)
both read. It imports nothing outside the standard library, so that setup.py can load it before torch or pagedllm
are importable.

A variant is a set of ISA flags the extension is compiled with. Never -march=native: a built variant runs on every
CPU that has its flags, which is what lets a wheel built on one machine run on another of its class.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
LIBRARY_PREFIX = "_pagedllm_cpu_"  # the built extensions: pagedllm/kernels/_pagedllm_cpu_*.<suffix> (library_stem)
VARIANT_ENV = "PAGEDLLM_KERNEL_VARIANT"  # run time: force a lesser variant (how avx2 and portable are tested)
INSTALL_VARIANTS_ENV = "PAGEDLLM_KERNEL_VARIANTS"  # install time: which variants to build ("all" or a list)
MATRIX_ENGINE_ENV = "PAGEDLLM_MATRIX_ENGINE"  # run time: 0 keeps the packed GEMM off AMX (the same bits, VNNI alone)
BUILD_ENV = "PAGEDLLM_BUILD_KERNELS"  # run time: build a missing or stale variant at first use (first_use_build.py)

_AVX512_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512vl")
_AVX512_ISA = ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"]
# The VNNI builds also carry the packed GEMM's AMX tile path (quant_packed.cpp), which runs only where the CPU has
# AMX and the kernel grants the tile state (checked at run time): the compiler never emits AMX code on its own, so
# the flags do not narrow which CPUs run the build.
_AMX_ISA = ["-mamx-tile", "-mamx-int8"]
# Build variants, best first: (name, CPU flags it needs, compiler flags). Each later one is a subset of the earlier.
VARIANTS: list[tuple[str, tuple[str, ...], list[str]]] = [
    ("avx512bf16vnni", ("fma", *_AVX512_FLAGS, "avx512_bf16", "avx512_vnni"),
     [*_AVX512_ISA, "-mavx512bf16", "-mavx512vnni", *_AMX_ISA]),
    ("avx512bf16", ("fma", *_AVX512_FLAGS, "avx512_bf16"), [*_AVX512_ISA, "-mavx512bf16"]),
    ("avx512vnni", ("fma", *_AVX512_FLAGS, "avx512_vnni"), [*_AVX512_ISA, "-mavx512vnni", *_AMX_ISA]),  # quant GEMMs' vpdpbusd
    ("avx512", ("fma", *_AVX512_FLAGS), _AVX512_ISA),
    # the packed quantized GEMM's vpmaddubsw path (F16C: its fp16 scales; every AVX2 CPU has it), elsewhere the
    # portable code auto-vectorised
    ("avx2", ("avx2", "fma", "f16c"), ["-mavx2", "-mfma", "-mf16c"]),
    ("portable", (), []),  # no ISA flags at all
]
VARIANT_NAMES = [v[0] for v in VARIANTS]
# every variant that is an AVX-512 one also gets -mf16c where the CPU has it (fp16 block scales); every AVX-512 CPU
# has F16C, so the flag does not narrow which CPUs run the build
_F16C = "-mf16c"
CXX_FLAGS = ["-O3", "-fopenmp"]
LD_FLAGS = ["-fopenmp"]


def cpu_flags() -> set[str]:
    """The flags line of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def isa_flags(name: str) -> list[str]:
    """The compiler ISA flags of variant `name`."""
    for variant, _needs, isa in VARIANTS:
        if variant == name:
            return isa + ([_F16C] if name.startswith("avx512") else [])
    raise ValueError(f"{name!r}: not a build variant (one of {', '.join(VARIANT_NAMES)})")


def runnable(flags: set[str]) -> list[str]:
    """The variants a CPU with these flags runs, best first (always ends with "portable")."""
    return [name for name, needs, _isa in VARIANTS if all(f in flags for f in needs)]


def build_variant(flags: set[str] | None = None, forced: str | None = None) -> tuple[str, list[str]]:
    """(variant name, compiler ISA flags): the best variant this CPU runs, or `forced` ($PAGEDLLM_KERNEL_VARIANT: a
    lesser build on a better CPU, which is how the avx2 and portable builds are tested)."""
    flags = cpu_flags() if flags is None else flags
    if forced and forced not in VARIANT_NAMES:
        raise ValueError(f"{VARIANT_ENV}={forced!r}: not a build variant (one of {', '.join(VARIANT_NAMES)})")
    if forced:
        missing = [f for f in dict(v[:2] for v in VARIANTS)[forced] if f not in flags]
        if missing:
            raise RuntimeError(f"{VARIANT_ENV}={forced}: this CPU lacks {', '.join(missing)}")
        return forced, isa_flags(forced)
    best = runnable(flags)[0]
    return best, isa_flags(best)


def install_variants(flags: set[str], requested: str | None) -> list[str]:
    """Which variants `pip install` builds: $PAGEDLLM_KERNEL_VARIANTS ("all", or names separated by commas), else the
    best one this CPU runs plus avx2 (where it runs) and portable, the two the tests force."""
    if requested:
        names = VARIANT_NAMES if requested.strip() == "all" else [n.strip() for n in requested.split(",") if n.strip()]
        for name in names:
            isa_flags(name)  # an unknown name fails the install with the list of known ones
        return names
    can = runnable(flags)
    return list(dict.fromkeys([can[0], *(n for n in ("avx2", "portable") if n in can)]))


def cpp_sources() -> list[Path]:
    """The extension's translation units, in a fixed order."""
    return sorted(CSRC.glob("*.cpp"))


def source_files() -> list[Path]:
    """The extension's sources and headers, in a fixed order."""
    return cpp_sources() + sorted(CSRC.glob("*.h"))


def source_digest(name: str) -> str:
    """What a build of variant `name` is made of: the sources, the headers and the flags. A built library whose
    digest differs from the tree's is stale."""
    code = b"".join(p.name.encode() + p.read_bytes() for p in source_files())
    flags = " ".join([*CXX_FLAGS, *isa_flags(name)]).encode()
    return hashlib.sha256(code + flags).hexdigest()[:16]


def library_stem(name: str) -> str:
    """The built library's module name for variant `name` from the sources as they are now: a library whose name
    has another digest was built from other sources (stale)."""
    return f"{LIBRARY_PREFIX}{name}_{source_digest(name)}"
