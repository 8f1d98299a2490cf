"""The CMake flags that build llama.cpp (the benchmark peer) for the CPU at hand: `python -m
pagedllm_bench.llama_build` prints them (the Makefile's bench-setup passes them to both llama.cpp builds;
`--ik` prints ik_llama.cpp's).

GGML_NATIVE=OFF with each instruction set named from /proc/cpuinfo, and no AMX: llama.cpp's native build (the
llama-cpp-python default) crashed in its AMX matmul on an AMX Xeon, while an explicit AVX-512/VNNI/BF16 build ran.
"""

from __future__ import annotations

import sys

from pagedllm.kernels.variants import cpu_flags

# GGML CMake option -> the /proc/cpuinfo flags it needs (all of them)
GGML_ISA: dict[str, tuple[str, ...]] = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_BMI2": ("bmi2",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"),
    "GGML_AVX512_VBMI": ("avx512f", "avx512vbmi"),  # cpuinfo spells it without the underscore
    "GGML_AVX512_VNNI": ("avx512f", "avx512_vnni"),
    "GGML_AVX512_BF16": ("avx512f", "avx512_bf16"),
}
NEVER = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def cmake_flags(flags: set[str] | None = None, *, native: bool = False) -> list[str]:
    """-D options for llama.cpp's CMake: each ISA on where the CPU has it, AMX off; native detection off, or on for
    ik_llama.cpp (its IQK kernels follow -march=native, yet its AVX-512 paths also want each option named)."""
    flags = cpu_flags() if flags is None else flags
    out = [f"-DGGML_NATIVE={'ON' if native else 'OFF'}"]
    out += [f"-D{opt}={'ON' if all(f in flags for f in needs) else 'OFF'}" for opt, needs in GGML_ISA.items()]
    out += [f"-D{opt}=OFF" for opt in NEVER]
    return out


if __name__ == "__main__":
    print(" ".join(cmake_flags(native="--ik" in sys.argv[1:])))
    sys.exit(0)
