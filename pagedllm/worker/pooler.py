"""Pools prefill-only requests' hidden states into one vector each, across the chunks of a chunked prefill: what
the pooling needs is kept between steps (sums per KV block for mean, the first row for CLS), the last token's row
is taken when the prompt's last chunk runs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.core.request import Request
from pagedllm.core.scheduler import ScheduledRequest
from pagedllm.model.pooling_config import PoolingConfig


def finish_embedding(pooled: torch.Tensor, config: PoolingConfig, params) -> list[float]:
    """Matryoshka truncation to the request's `dimensions`, then L2 normalisation where asked (so a truncated
    vector is re-normalised)."""
    if params.dimensions is not None:
        pooled = pooled[:params.dimensions]  # (the engine checked it against the hidden size)
    normalize = config.normalize if params.normalize is None else params.normalize
    if normalize:
        pooled = F.normalize(pooled, dim=-1)
    return pooled.tolist()


class Pooler:
    def __init__(self, config: PoolingConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        # MEAN: request id -> ([blocks, H] row sums per KV block, tokens summed so far). Per block, because a
        # preempted request comes back at a block boundary (its own cached blocks) and recomputes what follows:
        # the sums from there on are dropped, the ones before are kept.
        self._sums: dict[str, tuple[torch.Tensor, int]] = {}
        self._first: dict[str, torch.Tensor] = {}  # CLS: request id -> its first row

    def __call__(self, scheduled: list[ScheduledRequest], hidden: torch.Tensor) -> list[tuple[Request, torch.Tensor]]:
        """The pooled float32 vector of every prefill-only entry whose prompt this step completes."""
        done: list[tuple[Request, torch.Tensor]] = []
        end = 0
        for s in scheduled:
            start, end = end, end + s.num_new_tokens
            req = s.request
            if not req.prefill_only:
                continue
            rows = hidden[start:end]
            kind = self.config.pooling_type
            if kind == "MEAN":
                self._add_rows(req, rows)
            elif kind == "CLS" and req.num_computed_tokens == 0:
                self._first[req.request_id] = rows[0].float()
            if not s.samples:  # not the prompt's last chunk yet
                continue
            if kind == "LAST":
                vector = rows[-1].float()
            elif kind == "MEAN":
                vector = self._sums.pop(req.request_id)[0].sum(0) / req.num_prompt_tokens
            else:
                vector = self._first.pop(req.request_id)
            done.append((req, vector))
        return done

    def _add_rows(self, req: Request, rows: torch.Tensor) -> None:
        first = req.num_computed_tokens
        sums, seen = self._sums.get(req.request_id, (None, 0))
        if sums is None:
            sums = rows.new_zeros(-(-req.num_prompt_tokens // self.block_size), rows.shape[1], dtype=torch.float32)
        elif first < seen:  # recomputing from a block boundary after a preemption
            sums[first // self.block_size:] = 0
        blocks = torch.arange(first, first + len(rows)) // self.block_size
        sums.index_add_(0, blocks, rows.float())
        self._sums[req.request_id] = (sums, first + len(rows))

    def forget(self, request_ids: list[str]) -> None:
        """Aborted requests' partial state."""
        for rid in request_ids:
            self._sums.pop(rid, None)
            self._first.pop(rid, None)
