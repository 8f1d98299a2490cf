"""Pools prefill-only requests' hidden states into one vector each, across the chunks of a chunked prefill: what
the pooling needs is kept between steps (a running sum for mean, the first row for CLS), the last token's row
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
        if params.dimensions > pooled.numel():
            raise ValueError(f"dimensions {params.dimensions} is more than the model's {pooled.numel()}")
        pooled = pooled[:params.dimensions]
    normalize = config.normalize if params.normalize is None else params.normalize
    if normalize:
        pooled = F.normalize(pooled, dim=-1)
    return pooled.tolist()


class Pooler:
    def __init__(self, config: PoolingConfig) -> None:
        self.config = config
        self._partial: dict[str, torch.Tensor] = {}  # request id -> the sum (MEAN) or first row (CLS) so far

    def __call__(self, scheduled: list[ScheduledRequest], hidden: torch.Tensor) -> list[tuple[Request, torch.Tensor]]:
        """The pooled float32 vector of every prefill-only entry whose prompt this step completes."""
        done: list[tuple[Request, torch.Tensor]] = []
        start = 0
        for s in scheduled:
            rows = hidden[start:start + s.num_new_tokens]
            start += s.num_new_tokens
            req = s.request
            if not req.prefill_only:
                continue
            rid = req.request_id
            if req.num_computed_tokens == 0:  # a fresh start (a preempted request recomputes from zero)
                self._partial.pop(rid, None)
            kind = self.config.pooling_type
            if kind == "MEAN":
                part = rows.float().sum(0)
                self._partial[rid] = part if rid not in self._partial else self._partial[rid] + part
            elif kind == "CLS" and req.num_computed_tokens == 0:
                self._partial[rid] = rows[0].float()
            if s.samples:  # the prompt's last chunk
                if kind == "LAST":
                    vector = rows[-1].float()
                elif kind == "MEAN":
                    vector = self._partial.pop(rid) / req.num_prompt_tokens
                else:
                    vector = self._partial.pop(rid)
                done.append((req, vector))
        return done

    def forget(self, request_ids: list[str]) -> None:
        """Aborted requests' partial state."""
        for rid in request_ids:
            self._partial.pop(rid, None)
