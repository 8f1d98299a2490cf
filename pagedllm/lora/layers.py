"""A Linear's LoRA slots, and the batch's adapter rows they read: Punica's batched LoRA (SGMV) for a CPU.

Each Linear that takes LoRA holds every slot's adapter: A [slots, C, in] and B transposed [slots, C, out] in fp32,
where C = shards x max_rank (shard k's ranks at k x max_rank, its B rows over that shard's output columns only),
and per (slot, rank) the output columns it writes (lo, hi; empty for an unused rank). One kernel call per layer
(csrc/lora.cpp: lora_apply) adds B A x to every row that has an adapter, each row with its own slot's weights: the
base GEMM ran once for all rows, each adapter's low-rank product runs on its own rows only, and a row is computed
by itself, so its result does not depend on the rest of the batch or on which slot its adapter sits in. A
base-model row (slot -1) gets nothing added. Without the kernel (no C++ build), torch does the same per slot.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pagedllm.kernels import kernel_op


@dataclass
class LoRABatch:
    """The adapters of one forward's rows: `row_slot` [rows] int64 (-1: the base model), and the slots used."""

    row_slot: torch.Tensor
    slots: frozenset[int]


_current: contextvars.ContextVar[LoRABatch | None] = contextvars.ContextVar("pagedllm_lora_batch", default=None)


@contextlib.contextmanager
def lora_batch(batch: LoRABatch | None) -> Iterator[None]:
    """Every LoRA layer called inside reads `batch` (None: no row has an adapter)."""
    token = _current.set(batch)
    try:
        yield
    finally:
        _current.reset(token)


def make_batch(row_slots: list[int]) -> LoRABatch | None:
    """row_slots: per row, its adapter's slot, or -1 for the base model (None: no row has an adapter)."""
    slots = frozenset(s for s in row_slots if s >= 0)
    return LoRABatch(torch.tensor(row_slots, dtype=torch.int64), slots) if slots else None


class LoRAStack:
    """The LoRA slots of one Linear (input_size -> output_sizes shards)."""

    def __init__(self, input_size: int, output_sizes: list[int], num_slots: int, max_rank: int) -> None:
        self.output_sizes, self.max_rank = output_sizes, max_rank
        ranks = len(output_sizes) * max_rank
        self.a = torch.zeros(num_slots, ranks, input_size)
        self.bt = torch.zeros(num_slots, ranks, sum(output_sizes))
        self.lo = torch.zeros(num_slots, ranks, dtype=torch.int32)
        self.hi = torch.zeros(num_slots, ranks, dtype=torch.int32)
        self.filled: set[int] = set()  # slots holding a non-empty adapter for this layer

    def set_slot(self, slot: int, shards: dict[int, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """Put an adapter's (A [r, in], B [shard rows, r]) per shard into `slot` (None or {}: it adds nothing)."""
        for t in (self.a, self.bt, self.lo, self.hi):
            t[slot].zero_()
        self.filled.discard(slot)
        for k, (a, b) in (shards or {}).items():
            c, r, col = k * self.max_rank, a.shape[0], sum(self.output_sizes[:k])
            self.a[slot, c:c + r] = a.float()
            self.bt[slot, c:c + r, col:col + b.shape[0]] = b.float().T
            self.lo[slot, c:c + r], self.hi[slot, c:c + r] = col, col + b.shape[0]
            self.filled.add(slot)

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (x's base projection) plus each adapter row's low-rank product, in place."""
        batch = _current.get()
        if batch is None or not (batch.slots & self.filled):
            return out
        op = kernel_op("lora_apply")
        if op is not None and x.dtype in (torch.float32, torch.bfloat16) and out.is_contiguous():
            op(out, x.contiguous(), self.a, self.bt, self.lo, self.hi, batch.row_slot)
            return out
        for s in batch.slots & self.filled:
            rows = (batch.row_slot == s).nonzero().squeeze(1)
            out.index_add_(0, rows, ((x[rows].float() @ self.a[s].T) @ self.bt[s]).to(out.dtype))
        return out
