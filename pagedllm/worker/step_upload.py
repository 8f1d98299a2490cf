"""A step's inputs on the model's device in one copy (the device path: a GPU, or the CPU under a device attention
backend, which is how the tests run this code).

The host builds token ids, positions and every KV group's attention metadata as it always does (numpy, no
per-token Python); they are packed into one int64 host buffer, pinned on a GPU so that the copy is a single DMA,
and copied once per step. The tensors the model reads are views of that one device buffer. The buffer is reused
from step to step: the previous step's copy has finished by then, since its sampled tokens were read back.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata


class StepUpload:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pin = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.int64)

    def _buffer(self, n: int) -> torch.Tensor:
        if self._host.numel() < n:  # grown by doubling: a handful of allocations over a run
            self._host = torch.empty(max(n, 2 * self._host.numel()), dtype=torch.int64, pin_memory=self._pin)
        return self._host[:n]

    def __call__(self, token_ids: list[int], positions: np.ndarray, metas: list[AttentionMetadata]
                 ) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata]]:
        """-> token ids [T], positions [T] and the metadata, their tensors on the device (host lists kept)."""
        parts: list[np.ndarray] = [np.asarray(token_ids, dtype=np.int64), positions]
        for m in metas:
            parts += [m.slot_mapping.numpy(), m.query_start_loc.numpy(), m.seq_lens.numpy(),
                      m.block_tables.numpy().reshape(-1)]
        sizes = [len(p) for p in parts]
        host = self._buffer(sum(sizes))
        np.concatenate(parts, out=host.numpy(), casting="same_kind")
        views = iter(host.to(self.device, non_blocking=True).split(sizes))
        ids, pos = next(views), next(views)
        moved = []
        for m in metas:
            slots, qsl, seq_lens, tables = next(views), next(views), next(views), next(views)
            moved.append(dataclasses.replace(
                m, slot_mapping=slots, query_start_loc=qsl.to(torch.int32), seq_lens=seq_lens.to(torch.int32),
                block_tables=tables.view(m.block_tables.shape).to(torch.int32)))
        return ids, pos, moved
