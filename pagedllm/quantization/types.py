"""The one table of GGUF tensor types: ggml id, block geometry, whether the C++ kernels run it as stored.

The kernels' side of each quantized type is its traits struct in kernels/csrc/quant_types.h (decoding, packed
layout, dispatch); `tests/kernels/test_quant_kernel.py` holds this table equal to the one the extension
reports (`quant_type_table`). Adding a type is one row here plus one traits specialisation there.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GGMLType:
    name: str
    id: int      # the ggml type id a GGUF file stores
    block: int   # elements per block
    bytes: int   # bytes per block
    kernel: bool  # the quantized GEMM runs it as stored (and packs it into 16-row groups at load)

    def row_bytes(self, cols: int) -> int:
        return cols // self.block * self.bytes


TYPES: tuple[GGMLType, ...] = (
    GGMLType("F32", 0, 1, 4, False),
    GGMLType("F16", 1, 1, 2, False),
    GGMLType("BF16", 30, 1, 2, False),
    GGMLType("Q4_0", 2, 32, 18, True),
    GGMLType("Q4_1", 3, 32, 20, True),
    GGMLType("Q5_0", 6, 32, 22, True),
    GGMLType("Q5_1", 7, 32, 24, True),
    GGMLType("Q8_0", 8, 32, 34, True),
    GGMLType("Q2_K", 10, 256, 84, True),
    GGMLType("Q3_K", 11, 256, 110, True),
    GGMLType("Q4_K", 12, 256, 144, True),
    GGMLType("Q5_K", 13, 256, 176, True),
    GGMLType("Q6_K", 14, 256, 210, True),
    GGMLType("IQ4_NL", 20, 32, 18, True),
    GGMLType("IQ4_XS", 23, 256, 136, True),
    GGMLType("MXFP4", 39, 32, 17, True),  # e8m0 scale byte, 16 bytes of 4-bit e2m1 codes (gpt-oss's experts)
)
BY_ID: dict[int, GGMLType] = {t.id: t for t in TYPES}
# Types a GGUF file may hold that pagedllm does not load (name, id, block, bytes): their geometry lets the reader
# check every tensor's byte size before it refuses the file by name.
OTHER_TYPES: tuple[tuple[str, int, int, int], ...] = (
    ("Q8_1", 9, 32, 40), ("Q8_K", 15, 256, 292), ("IQ2_XXS", 16, 256, 66), ("IQ2_XS", 17, 256, 74),
    ("IQ3_XXS", 18, 256, 98), ("IQ1_S", 19, 256, 50), ("IQ3_S", 21, 256, 110), ("IQ2_S", 22, 256, 82),
    ("I8", 24, 1, 1), ("I16", 25, 1, 2), ("I32", 26, 1, 4), ("I64", 27, 1, 8), ("F64", 28, 1, 8),
    ("IQ1_M", 29, 256, 56), ("TQ1_0", 34, 256, 54), ("TQ2_0", 35, 256, 66), ("NVFP4", 40, 64, 36),
    ("Q1_0", 41, 128, 18),
)
# every ggml type id -> (name, elements per block, bytes per block); tests hold it to the gguf package's sizes
GEOMETRY: dict[int, tuple[str, int, int]] = {**{t.id: (t.name, t.block, t.bytes) for t in TYPES},
                                             **{i: (n, b, nb) for n, i, b, nb in OTHER_TYPES}}
BY_NAME: dict[str, GGMLType] = {t.name: t for t in TYPES}
FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})
KERNEL_TYPES: tuple[GGMLType, ...] = tuple(t for t in TYPES if t.kernel)
