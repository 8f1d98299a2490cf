"""A weight matrix in a ggml block format, as stored (a view of the memory-mapped GGUF file, or owned bytes), and
the ops that read it: the quantized GEMM kernel, row gathers for embeddings, dequantization for the oracle."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.kernels.dispatch import kernel_op
from pagedllm.quantization.types import BY_ID, BY_NAME

# The kernel repacks every type it runs into 16-row interleaved groups at load (quant_packed.cpp: the file's
# bytes per row, a few % more where the file packs 6-bit scales); a packed matrix has type PACKED_BASE + its
# file type.
PACKED_BASE = 1000


def type_id(name: str) -> int:
    return BY_NAME[name].id


def runs_as_stored(ggml_type: int, cols: int) -> bool:
    """Whether the kernel reads this type directly (rows of whole blocks)."""
    t = BY_ID.get(ggml_type)
    return t is not None and t.kernel and cols % t.block == 0


def row_bytes(ggml_type: int, cols: int) -> int:
    return BY_ID[ggml_type].row_bytes(cols)


def bytes_view(blob: np.ndarray, offset: int, rows: int, nbytes_per_row: int) -> torch.Tensor:
    """uint8 [rows, bytes] over a read-only memory map without a copy (the kernels never write weights)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given NumPy array is not writable"
        return torch.from_numpy(blob[offset:offset + rows * nbytes_per_row]).view(rows, nbytes_per_row)


@dataclass
class QuantTensor:
    """rows x cols weights in ggml type `qtype`; data is uint8 [rows, row_bytes] (a packed table may hold a few
    zero rows more: `num_rows`, its own count, where its vocabulary is not whole 16-row groups)."""

    data: torch.Tensor
    qtype: int
    cols: int
    # for a view of a memory-mapped file: drops the view's pages from the process once a packed copy exists
    release_source: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    num_rows: int | None = None  # where data holds zero rows past the matrix's own (packed(): whole 16-row groups)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0] if self.num_rows is None else self.num_rows, self.cols)

    @property
    def is_packed(self) -> bool:
        return self.qtype >= PACKED_BASE

    @property
    def file_type(self) -> int:
        """The ggml type of the file this matrix came from."""
        return self.qtype - PACKED_BASE if self.is_packed else self.qtype

    @property
    def type_name(self) -> str:
        return BY_ID[self.file_type].name

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def numel(self) -> int:
        return self.data.shape[0] * self.cols

    def replace_parameter(self, owner: torch.nn.Module, leaf: str, name: str) -> None:
        """Take the place of the dense Parameter owner.<leaf> (an embedding table), after checking its shape."""
        want = tuple(getattr(owner, leaf).shape)
        if self.shape != want:
            raise ValueError(f"weight {name!r}: shape {self.shape} does not match the config ({want})")
        delattr(owner, leaf)
        setattr(owner, leaf, self)

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rows at ids, dequantized to dtype (F.embedding for a table kept in blocks)."""
        if self.is_packed:
            return required_op("quant_packed_rows")(self.data, self.qtype, self.cols, ids.reshape(-1)).to(dtype)
        return self.rows(ids).dequantize().to(dtype)

    def rows(self, index: torch.Tensor) -> QuantTensor:
        """The rows at `index` (a copy, which releases the source's pages once packed): for Q/K row orders and for
        embedding lookups."""
        if self.is_packed:
            raise ValueError("rows() reads a matrix in its file layout; this one is packed")
        return QuantTensor(self.data[index], self.qtype, self.cols, self.release_source)

    def split_rows(self, sizes: list[int]) -> list[QuantTensor]:
        """Consecutive row ranges of these sizes (a fused q|k|v or gate|up as its checkpoint shards): views that
        release the whole source's pages once packed, copies where they will not be packed."""
        parts, start = [], 0
        for n in sizes:
            part = QuantTensor(self.data[start:start + n], self.qtype, self.cols, self.release_source)
            parts.append(part if part.packable or part.release_source is None
                         else QuantTensor(part.data.clone(), self.qtype, self.cols))
            start += n
        if self.release_source is not None and not any(p.release_source for p in parts):
            self.release_source()  # every part is a copy
        return parts

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols]: the oracle's weights."""
        if self.is_packed:
            return self.embedding(torch.arange(self.shape[0]), torch.float32)
        from pagedllm.quantization import dequant

        return dequant.dequantize(self.data.numpy().reshape(-1), self.type_name, self.shape)

    @property
    def packable(self) -> bool:
        """Whether the kernel has a 16-row interleaved form for this matrix's type and shape."""
        rows, cols = self.shape
        return (not self.is_packed and runs_as_stored(self.qtype, cols) and rows % 16 == 0
                and kernel_available())

    def packed(self) -> QuantTensor:
        """This matrix in the kernel's 16-row interleaved form (an owned copy), where its type and shape have
        one; otherwise itself. The packed form is what runs fast at every batch size. A table whose rows are not
        whole groups (Granite's 49,159-token vocabulary, a tied head) is packed with zero rows added (a zero
        block is zero weights in every type): the head's GEMV at the packed kernel's speed, not the row kernel's."""
        if self.packable:
            return pack_stacked([self])
        pad = -self.shape[0] % 16
        if self.is_packed or not pad or not runs_as_stored(self.qtype, self.cols) or not kernel_available():
            return self
        whole = self.shape[0] - (16 - pad)  # the rows of whole groups, packed straight from the file's pages
        tail = torch.cat([self.data[whole:], self.data.new_zeros(pad, self.data.shape[1])])
        parts = [QuantTensor(self.data[:whole], self.qtype, self.cols, self.release_source)] if whole else []
        out = pack_stacked(parts + [QuantTensor(tail, self.qtype, self.cols)])  # (which releases the file's pages)
        if not whole and self.release_source is not None:
            self.release_source()
        out.num_rows = self.shape[0]
        return out

    def matmul(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, cols] (bf16 or fp32) @ W^T -> [M, rows] of x's dtype (or into out, which may be a column slice)."""
        n = self.shape[0]
        if n != self.data.shape[0]:  # computed whole, the padding's columns dropped
            full = torch.empty(x.shape[0], self.data.shape[0], dtype=x.dtype)
            required_op("quant_gemm")(full, x.contiguous(), self.data, self.qtype)
            return full[:, :n] if out is None else out.copy_(full[:, :n])
        if out is None:
            out = torch.empty(x.shape[0], self.data.shape[0], dtype=x.dtype)
        required_op("quant_gemm")(out, x.contiguous(), self.data, self.qtype)
        return out


def required_op(name: str):
    """The extension's op `name`; a clear error where it cannot be built (the caller has no torch path)."""
    found = kernel_op(name)
    if found is None:
        raise RuntimeError("the quantized GEMM kernel is not available (the C++ extension failed to build); "
                           "load with quantization='none'")
    return found


def kernel_available() -> bool:
    return kernel_op("quant_gemm") is not None


def quantize_q8_0(w: torch.Tensor) -> QuantTensor:
    """Q8_0 blocks of a float matrix (cols a multiple of 32): per 32 weights an fp16 scale amax/127 and int8
    codes rounded to nearest. Used for `quantization="int8"` on HF checkpoints."""
    rows, cols = w.shape
    if cols % 32:
        raise ValueError(f"int8 quantization needs input sizes that are multiples of 32, got {cols}")
    blocks = w.float().reshape(rows, cols // 32, 32)
    d = (blocks.abs().amax(-1, keepdim=True) / 127.0).to(torch.float16)
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = torch.round(blocks * inv).clamp_(-127, 127).to(torch.int8)
    data = torch.cat([d.view(torch.uint8), q.view(torch.uint8)], dim=-1).reshape(rows, -1).contiguous()
    return QuantTensor(data, type_id("Q8_0"), cols)


def pack_stacked(parts: list[QuantTensor]) -> QuantTensor:
    """Packable matrices of one type and width packed into one matrix, their rows stacked in order: a fused
    q|k|v or gate|up is written once, straight from the memory-mapped file into its final buffer."""
    first = parts[0]
    if any(p.qtype != first.qtype or p.cols != first.cols or not p.packable for p in parts):
        raise ValueError("pack_stacked: the matrices must be packable, of one type and width")
    mapped = all(p.release_source is not None for p in parts)  # views of the mapped file: dropped as packed
    data = required_op("quant_pack")([p.data.contiguous() for p in parts], first.qtype, first.cols, mapped)
    for p in parts:
        if p.release_source is not None:
            p.release_source()
    return QuantTensor(data, PACKED_BASE + first.qtype, first.cols)
