"""A Linear's LoRA slots, and the batch's adapter rows they read: Punica's batched LoRA (S-LoRA's unified pages
aside) done with two dense GEMMs per layer on a CPU.

Each Linear that takes LoRA holds every slot's A and B stacked: A [slots x C, in], B [out, slots x C], where a
slot's C columns hold its shards' ranks side by side (shard k at k x max_rank), zeros elsewhere. A step computes
u = x A^T for its adapter rows (every slot at once), zeroes in each row the columns of the other slots, and adds
u B^T: the base GEMM ran once for every row, each adapter's low-rank product applies to its own rows only.

One row, one answer: a row's u columns are its own dot products, and its other slots' columns are exact zeros, so
the second GEMM's sum for it holds the same non-zero terms in the same lanes whichever slot its adapter sits in
and whatever the other slots hold (C is a multiple of 32: the batch-invariant GEMM's lane pattern, kernels/csrc/
gemm.cpp, repeats every 16 fp32 / 32 bf16 columns). A base-model row in a mixed batch gets nothing added.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pagedllm.model.layers import linear

_ALIGN = 32  # a slot's columns: whole lanes of the invariant GEMM (fp32: 16, bf16 pairs: 32)


@dataclass
class LoRABatch:
    """The adapter rows of one forward: `rows` (indices of the rows that have an adapter; None: every row), and
    `onehot` [len(rows), slots] of the compute dtype, 1 at each row's slot."""

    rows: torch.Tensor | None
    onehot: torch.Tensor
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


def make_batch(row_slots: list[int], num_slots: int, dtype: torch.dtype) -> LoRABatch | None:
    """row_slots: per row, its adapter's slot, or -1 for the base model."""
    with_adapter = [i for i, s in enumerate(row_slots) if s >= 0]
    if not with_adapter:
        return None
    slots = torch.tensor([row_slots[i] for i in with_adapter], dtype=torch.int64)
    onehot = torch.zeros(len(with_adapter), num_slots, dtype=dtype)
    onehot[torch.arange(len(with_adapter)), slots] = 1
    rows = None if len(with_adapter) == len(row_slots) else torch.tensor(with_adapter, dtype=torch.int64)
    return LoRABatch(rows, onehot, frozenset(slots.tolist()))


class LoRAStack:
    """The LoRA slots of one Linear (input_size -> output_sizes shards)."""

    def __init__(self, input_size: int, output_sizes: list[int], num_slots: int, max_rank: int,
                 dtype: torch.dtype) -> None:
        self.output_sizes = output_sizes
        self.num_slots, self.max_rank = num_slots, max_rank
        self.cols = -(-len(output_sizes) * max_rank // _ALIGN) * _ALIGN
        self.a = torch.zeros(num_slots * self.cols, input_size, dtype=dtype)
        self.b = torch.zeros(sum(output_sizes), num_slots * self.cols, dtype=dtype)
        self.filled: set[int] = set()  # slots holding a non-empty adapter for this layer

    def set_slot(self, slot: int, shards: dict[int, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """Put an adapter's (A, B) per shard into `slot` (None or {}: the slot adds nothing here)."""
        base = slot * self.cols
        self.a[base:base + self.cols].zero_()
        self.b[:, base:base + self.cols].zero_()
        self.filled.discard(slot)
        for k, (a, b) in (shards or {}).items():
            col, row = base + k * self.max_rank, sum(self.output_sizes[:k])
            self.a[col:col + a.shape[0]] = a
            self.b[row:row + b.shape[0], col:col + a.shape[0]] = b
            self.filled.add(slot)

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (x's base projection) plus each adapter row's low-rank product."""
        batch = _current.get()
        if batch is None or not (batch.slots & self.filled):
            return out
        xs = x if batch.rows is None else x.index_select(0, batch.rows)
        u = linear(xs, self.a)
        u.view(len(xs), self.num_slots, self.cols).mul_(batch.onehot.unsqueeze(-1))
        delta = linear(u, self.b)
        return out.add_(delta) if batch.rows is None else out.index_add_(0, batch.rows, delta)
