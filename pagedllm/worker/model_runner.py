"""Turns a scheduled batch into flat tensors, runs the model over the paged KV cache, returns logits."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm import kernels
from pagedllm.attention import copy_blocks, get_backend
from pagedllm.attention.metadata import build_attention_metadata
from pagedllm.core.scheduler import ScheduledRequest
from pagedllm.model.kv_cache import allocate_kv_caches


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config, num_blocks: int, block_size: int,
                 dtype: torch.dtype, attention_backend: str = "auto", batch_invariant: bool = False) -> None:
        self.model = model
        self.batch_invariant = batch_invariant
        self.block_size = block_size
        self.backend = get_backend(attention_backend)
        self.kv_caches = allocate_kv_caches(config, block_size, dtype, num_blocks=num_blocks)
        if hasattr(model, "set_attention_backend"):
            model.set_attention_backend(self.backend)
        # Logits land in one reused buffer: glibc maps every allocation over 32 MB afresh, so a fresh
        # [rows, vocab] float32 tensor per step would page-fault all of it in again at large batches
        # (the 256-running decode step of `pagedllm bench engine` measures it).
        self._logits = torch.empty(0)
        self.vocab_size = config.vocab_size

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest], block_tables: list[list[int]],
                block_copies: list[tuple[int, int]], sample_rows: list[int]) -> torch.Tensor:
        """Run one step; return float32 logits for the last new token of each request in sample_rows. The logits
        live in a buffer the next call overwrites."""
        kernels.set_batch_invariant(self.batch_invariant)  # per step: engines in one process may differ
        if block_copies:
            copy_blocks(self.kv_caches, block_copies)
        num_computed = np.fromiter((s.request.num_computed_tokens for s in scheduled), np.int64, len(scheduled))
        num_new = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, len(scheduled))
        token_ids: list[int] = []
        for s, c, n in zip(scheduled, num_computed.tolist(), num_new.tolist(), strict=True):
            token_ids.extend(s.request.all_token_ids[c:c + n])
        # positions: c, c+1, ..., c+n-1 for every request, without a Python loop per token
        starts = np.cumsum(num_new) - num_new
        positions = np.arange(int(num_new.sum())) - np.repeat(starts - num_computed, num_new)
        meta = build_attention_metadata(block_tables, num_computed.tolist(), num_new.tolist(), self.block_size)
        hidden = self.model(torch.tensor(token_ids, dtype=torch.int64), torch.from_numpy(positions),
                            self.kv_caches, meta)
        last = torch.from_numpy(np.cumsum(num_new)[sample_rows] - 1)
        if self._logits.shape[0] < len(last):
            self._logits = torch.empty(len(last), self.vocab_size, dtype=torch.float32)
        return self.model.compute_logits(hidden[last], out=self._logits[:len(last)])
