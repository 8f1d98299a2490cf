"""Flat-batch attention metadata: where new K/V go and which blocks each request reads."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, where each new token's K/V is written
    query_start_loc: torch.Tensor  # [R+1] int32, cumulative new-token counts (flat batch, no padding)
    seq_lens: torch.Tensor  # [R] int32, context length after this step (cached + new)
    block_tables: torch.Tensor  # [R, max_blocks] int32, padded with 0
    query_lens_list: list[int]  # host copies for python-side loops per request
    seq_lens_list: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int = 16

    @property
    def num_requests(self) -> int:
        return len(self.query_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    def token_seq_lens(self) -> torch.Tensor:
        """[T]: the context length after this step of each new token's request."""
        return torch.repeat_interleave(self.seq_lens, torch.diff(self.query_start_loc), output_size=self.num_tokens)


def per_layer(meta: AttentionMetadata | list[AttentionMetadata], num_layers: int) -> list[AttentionMetadata]:
    """The metadata of each layer: one for all, or (hybrid KV groups: one block table per group) a list per layer."""
    return meta if isinstance(meta, list) else [meta] * num_layers


def compute_positions(num_computed: list[int], num_new: list[int]) -> np.ndarray:
    """Positions of all new tokens of the flat batch: request r contributes num_computed[r] + arange(num_new[r])."""
    computed = np.asarray(num_computed, dtype=np.int64)
    if all(n == 1 for n in num_new):  # a decode step: each request's one token sits at its computed length
        return computed
    new = np.asarray(num_new, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(new)[:-1])) if len(new) else np.zeros(0, np.int64)
    total = int(new.sum())
    offsets = np.arange(total, dtype=np.int64) - np.repeat(starts, new)
    return np.repeat(computed, new) + offsets


def build_attention_metadata(block_tables: list[list[int]], num_computed: list[int], num_new: list[int],
                             block_size: int, positions: np.ndarray | None = None) -> AttentionMetadata:
    """Vectorised (numpy) construction of the metadata of one flat batch; no per-token Python.

    Token t of request r (t counted from the request's start) lives in slot
    block_tables[r][t // block_size] * block_size + t % block_size.
    """
    num_reqs = len(block_tables)
    if not (len(num_computed) == len(num_new) == num_reqs):
        raise ValueError(f"block_tables, num_computed and num_new must have the same length, got "
                         f"{num_reqs}, {len(num_computed)}, {len(num_new)}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    computed = np.asarray(num_computed, dtype=np.int64).reshape(num_reqs)
    new = np.asarray(num_new, dtype=np.int64).reshape(num_reqs)
    if (computed < 0).any() or (new < 0).any():
        raise ValueError("num_computed and num_new must be non-negative")
    seq_lens = computed + new
    lens = np.fromiter((len(bt) for bt in block_tables), dtype=np.int64, count=num_reqs)
    needed = -(-seq_lens // block_size)
    short = np.nonzero(lens < needed)[0]
    if len(short):
        r = int(short[0])
        raise ValueError(f"request {r}: block table has {lens[r]} blocks but {seq_lens[r]} tokens need "
                         f"{needed[r]} blocks of {block_size}")
    max_blocks = max(int(lens.max()) if num_reqs else 0, 1)
    table = np.zeros((num_reqs, max_blocks), dtype=np.int64)
    if num_reqs:
        flat = np.fromiter((b for bt in block_tables for b in bt), dtype=np.int64, count=int(lens.sum()))
        mask = np.arange(max_blocks)[None, :] < lens[:, None]
        table[mask] = flat  # row-major fill keeps each request's order

    if positions is None:  # the model runner passes the positions it computed for the model
        positions = compute_positions(computed.tolist(), new.tolist())
    req_idx = np.repeat(np.arange(num_reqs), new)
    slots = table[req_idx, positions // block_size] * block_size + positions % block_size
    qsl = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(new, out=qsl[1:])
    return AttentionMetadata(
        slot_mapping=torch.from_numpy(slots.astype(np.int64)),
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
        block_tables=torch.from_numpy(table.astype(np.int32)),
        query_lens_list=new.tolist(),
        seq_lens_list=seq_lens.tolist(),
        max_query_len=int(new.max()) if num_reqs else 0,
        max_seq_len=int(seq_lens.max()) if num_reqs else 0,
        block_size=block_size,
    )
