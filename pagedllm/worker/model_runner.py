"""Turns a scheduled batch into flat tensors, runs the model over the paged KV cache, returns logits."""

from __future__ import annotations

import torch

from pagedllm.attention import copy_blocks, get_backend
from pagedllm.attention.metadata import build_attention_metadata, compute_positions
from pagedllm.core.kv_groups import KVGroupLayout
from pagedllm.core.scheduler import ScheduledRequest
from pagedllm.kernels import KernelMode, forward_context
from pagedllm.model.kv_cache import allocate_kv_caches


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config, num_blocks: int, block_size: int,
                 kv_dtype: torch.dtype, attention_backend: str = "auto", batch_invariant: bool = True,
                 layout: KVGroupLayout | None = None) -> None:
        """kv_dtype: the KV pool's dtype (the compute dtype, or torch.int8: model/kv_cache.resolve_kv_dtype).
        layout: the KV groups (core/kv_groups.py; None: one group of every layer)."""
        self.model = model
        self.kernel_mode = KernelMode(invariant=batch_invariant)  # every forward runs in it (engines may differ)
        self.block_size = block_size
        self.backend = get_backend(attention_backend)
        self.kv_caches = allocate_kv_caches(config, block_size, kv_dtype, num_blocks=num_blocks, layout=layout)
        self.num_groups = layout.num_groups if layout else 1
        if hasattr(model, "set_attention_backend"):
            model.set_attention_backend(self.backend)
        # Logits land in one reused buffer: glibc maps every allocation over 32 MB afresh, so a fresh
        # [rows, vocab] float32 tensor per step would page-fault all of it in again at large batches
        # (the 256-running decode step of `pagedllm bench engine` measures it).
        self.vocab_size = config.vocab_size
        self._logits = torch.empty(0, self.vocab_size)  # 2-D even when empty: a step may sample no row

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest], block_tables: list[list[list[int]]],
                block_copies: list[tuple[int, int]]) -> torch.Tensor:
        """Run one step; return float32 logits for the rows that sample (each entry with `samples`: its last
        1 + draft tokens, in order). The logits live in a buffer the next call overwrites.
        block_tables[g][r]: the block table of request r in KV group g."""
        with forward_context(self.kernel_mode):
            return self._execute(scheduled, block_tables, block_copies)

    def _execute(self, scheduled: list[ScheduledRequest], block_tables: list[list[list[int]]],
                 block_copies: list[tuple[int, int]]) -> torch.Tensor:
        if block_copies:
            copy_blocks(self.kv_caches, block_copies)
        num_computed = [s.request.num_computed_tokens for s in scheduled]
        num_new = [s.num_new_tokens for s in scheduled]
        token_ids: list[int] = []
        logit_rows: list[int] = []
        for s, c in zip(scheduled, num_computed, strict=True):
            token_ids.extend(s.request.all_token_ids[c:c + s.num_new_tokens - s.num_draft_tokens])
            token_ids.extend(s.draft_token_ids)
            logit_rows.extend(range(len(token_ids) - s.num_logits, len(token_ids)))
        positions = compute_positions(num_computed, num_new)
        if len(block_tables) != self.num_groups:
            raise ValueError(f"{len(block_tables)} block tables per request for {self.num_groups} KV groups")
        metas = [build_attention_metadata(t, num_computed, num_new, self.block_size, positions) for t in block_tables]
        meta = metas[0] if len(metas) == 1 else [metas[g] for g in self.kv_caches.layer_group]
        hidden = self.model(torch.tensor(token_ids, dtype=torch.int64), torch.from_numpy(positions),
                            self.kv_caches, meta)
        self.last_hidden = hidden  # every new token's hidden state, in scheduled order (prompt_logprobs)
        if not logit_rows:  # a step of prefill chunks only
            return torch.empty(0, self.vocab_size)
        if self._logits.shape[0] < len(logit_rows):
            self._logits = torch.empty(len(logit_rows), self.vocab_size, dtype=torch.float32)
        rows = torch.tensor(logit_rows, dtype=torch.int64)
        return self.model.compute_logits(hidden[rows], out=self._logits[:len(logit_rows)])
