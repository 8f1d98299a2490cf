"""Decode steps on static buffers, replayed from CUDA graphs (as vLLM's CUDA graphs for decode).

At batch 1 a decode step is a few hundred small kernels; launched one by one from Python, the launches, not the
GPU, set the pace. A decode step (every request one new token) here runs on static device buffers instead: token
ids, positions, slot mapping, sequence lengths and block tables of a bucket of batch sizes (1, 2, 4, 8, then steps
of 8 or 16 up to max_num_seqs), the batch padded to its bucket. On a GPU each bucket's model forward is captured
once as a CUDA graph (on its first step) and replayed after; the host only fills the buffers, and the logits and the
sampler run after the replay as in any step.

Padding rows write their K/V into a scratch block past the block manager's pool (the runner allocates one more
block than the manager hands out) and attend over it alone: they never touch a request's blocks. Without a GPU the
same static-buffer forward runs eagerly (capture=False): that is how the tests check the padding and the static
metadata against the ordinary path.

What a captured forward may not do: read a device tensor back, or make a decision from values that change between
steps. The Triton decode launch depends only on shapes (the table width here is fixed: max_model_len's blocks),
rotary tables are grown to max_model_len before the capture (the metadata's max_seq_len is that bound), and models
whose forward reads values back (mixtures of experts, LongRoPE's switch) or backends that build per-step host
structures (FlexAttention's block mask) run eagerly.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata, build_attention_metadata

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def batch_buckets(max_num_seqs: int) -> list[int]:
    return [b for b in BUCKETS if b < max_num_seqs] + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches, layer_group: list[int], num_groups: int,
                 block_size: int, max_num_seqs: int, max_model_len: int, scratch_block: int, device: torch.device,
                 capture: bool) -> None:
        self.model, self.kv_caches, self.layer_group = model, kv_caches, layer_group
        self.block_size, self.max_model_len, self.scratch = block_size, max_model_len, scratch_block
        self.capture = capture
        self.buckets = batch_buckets(max_num_seqs)
        rows, self.width = self.buckets[-1], -(-max_model_len // block_size)
        pin = device.type == "cuda"

        def pair(*shape: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # (host, device)
            return (torch.zeros(*shape, dtype=dtype, pin_memory=pin), torch.zeros(*shape, dtype=dtype, device=device))

        self.ids, self.pos = pair(rows, dtype=torch.int64), pair(rows, dtype=torch.int64)
        self.seq_lens = pair(rows, dtype=torch.int32)
        # per KV group: its block tables and its slots (a group's table holds its own block ids)
        self.tables = [pair(rows, self.width, dtype=torch.int32) for _ in range(num_groups)]
        self.slots = [pair(rows, dtype=torch.int64) for _ in range(num_groups)]
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)  # one token per row
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def bucket(self, num_new: list[int], tables: list[list[list[int]]]) -> int | None:
        """The bucket of a step that fits the static buffers (every request one new token, tables within the
        width), else None (the step runs the ordinary way)."""
        if not num_new or len(num_new) > self.buckets[-1] or any(n != 1 for n in num_new):
            return None
        if any(len(t) > self.width for group in tables for t in group):
            return None
        return next(b for b in self.buckets if b >= len(num_new))

    def _fill(self, b: int, token_ids: list[int], positions: np.ndarray, tables: list[list[list[int]]]) -> list[int]:
        """The step's rows (each group's metadata as build_attention_metadata makes it), then padding rows (scratch
        slot, a context of one token in the scratch block), copied to the static device buffers (the first b
        rows). -> the rows' sequence lengths."""
        n = len(token_ids)
        ids, pos, lens = (h.numpy() for h, _ in (self.ids, self.pos, self.seq_lens))
        ids[:n], pos[:n] = token_ids, positions
        ids[n:b] = pos[n:b] = 0
        for g in range(len(self.tables)):
            meta = build_attention_metadata(tables[g], positions.tolist(), [1] * n, self.block_size, positions)
            table, slots = self.tables[g][0].numpy(), self.slots[g][0].numpy()
            width = meta.block_tables.shape[1]
            table[:n, :width], table[:n, width:], table[n:b] = meta.block_tables.numpy(), 0, 0
            table[n:b, 0] = self.scratch
            slots[:n], slots[n:b] = meta.slot_mapping.numpy(), self.scratch * self.block_size
        lens[:n], lens[n:b] = meta.seq_lens.numpy(), 1
        for host, dev in (self.ids, self.pos, self.seq_lens, *self.tables, *self.slots):
            dev[:b].copy_(host[:b], non_blocking=True)
        return meta.seq_lens_list

    def _metas(self, b: int, seq_lens: list[int]) -> list[AttentionMetadata]:
        """The static metadata of bucket b per layer: views of the buffers; max_seq_len is the bound the rotary
        tables were grown to (no value of this step decides anything in the captured forward)."""
        lens = seq_lens + [1] * (b - len(seq_lens))
        groups = [AttentionMetadata(slots[:b], self.query_start_loc[:b + 1], self.seq_lens[1][:b], table[:b],
                                    [1] * b, lens, 1, self.max_model_len, self.block_size)
                  for (_, table), (_, slots) in zip(self.tables, self.slots, strict=True)]
        return groups[0] if len(groups) == 1 else [groups[g] for g in self.layer_group]

    def _forward(self, b: int, seq_lens: list[int]) -> torch.Tensor:
        return self.model(self.ids[1][:b], self.pos[1][:b], self.kv_caches, self._metas(b, seq_lens))

    def run(self, b: int, token_ids: list[int], positions: np.ndarray,
            tables: list[list[list[int]]]) -> torch.Tensor:
        """Hidden states [n, H] of the step's n rows (a view of a static buffer: read before the next step)."""
        seq_lens = self._fill(b, token_ids, positions, tables)
        if not self.capture:
            return self._forward(b, seq_lens)[:len(token_ids)]
        if b not in self.graphs:
            self.graphs[b] = self._capture(b, seq_lens)
        graph, hidden = self.graphs[b]
        graph.replay()
        return hidden[:len(token_ids)]

    def _capture(self, b: int, seq_lens: list[int]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Two warm-up forwards on a side stream (Triton compiles, the rotary tables and the allocator settle; they
        write this step's own K/V into its own slots, as the replay will again), then the capture."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(b, seq_lens)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self._forward(b, seq_lens)
        return graph, hidden
