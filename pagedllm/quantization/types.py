"""The one table of GGUF tensor types: ggml id, block geometry, whether the C++ kernels run it as stored.

The kernels' side of each quantized type is its traits struct in kernels/csrc/quant_types.h (decoding, packed
layout, dispatch); `tests/test_quant_kernel.py` holds this table equal to the one the extension reports
(`quant_type_table`). Adding a type is one row here plus one traits specialisation there.
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
    GGMLType("Q2_K", 10, 256, 84, False),
    GGMLType("Q3_K", 11, 256, 110, False),
    GGMLType("Q4_K", 12, 256, 144, True),
    GGMLType("Q5_K", 13, 256, 176, True),
    GGMLType("Q6_K", 14, 256, 210, True),
    GGMLType("IQ4_NL", 20, 32, 18, True),
    GGMLType("IQ4_XS", 23, 256, 136, True),
)
BY_ID: dict[int, GGMLType] = {t.id: t for t in TYPES}
BY_NAME: dict[str, GGMLType] = {t.name: t for t in TYPES}
FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})
KERNEL_TYPES: tuple[GGMLType, ...] = tuple(t for t in TYPES if t.kernel)
