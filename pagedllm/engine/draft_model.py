"""Draft-model proposer: a second, smaller model with the target's tokenizer, its own KV pool and block tables,
run ahead k greedy steps for each speculating request.

Each target request has a mirror request here. Before proposing, the mirror takes the target's tokens; its K/V
stays valid up to the first position where they differ from what it had (its own drafts the target rejected), so
its table is rolled back there and only the rest is computed: the catch-up and the first draft token in one
forward over all requests, then one forward per further draft token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import ScheduledRequest
from pagedllm.model.loader import load_model
from pagedllm.worker.model_runner import ModelRunner


@dataclass(eq=False)
class _Mirror:
    request: Request
    num_known: int = 0  # tokens copied from the target at the last proposal (the rest are own drafts)


class DraftModelProposer:
    def __init__(self, path: str, dtype: str, num_blocks: int, block_size: int, attention_backend: str,
                 vocab_size: int) -> None:
        loaded = load_model(path, dtype, load_tokenizer=False)
        if loaded.config.vocab_size != vocab_size:
            raise ValueError(f"draft model {path} has a vocabulary of {loaded.config.vocab_size} tokens, the "
                             f"target {vocab_size}: a draft model must share the target's tokenizer")
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(loaded.model, loaded.config, num_blocks, block_size, loaded.dtype,
                                  attention_backend)
        self._mirrors: dict[str, _Mirror] = {}

    def retain(self, live_ids: set[str]) -> None:
        for rid in [r for r in self._mirrors if r not in live_ids]:
            self._drop(rid)

    def _drop(self, rid: str) -> None:
        m = self._mirrors.pop(rid)
        if self.kv.has_request(m.request):
            self.kv.free(m.request)

    def _sync(self, target: Request) -> Request:
        """The mirror of target, holding target's tokens, its K/V rolled back to where they still agree."""
        m = self._mirrors.get(target.request_id)
        tokens = target.all_token_ids
        if m is None:
            m = self._mirrors[target.request_id] = _Mirror(Request(target.request_id, list(tokens)))
        else:
            own, agree = m.request.all_token_ids, m.num_known
            while agree < min(len(own), len(tokens)) and own[agree] == tokens[agree]:
                agree += 1
            m.request.all_token_ids = list(tokens)
            m.request.num_computed_tokens = min(m.request.num_computed_tokens, agree)
            if self.kv.has_request(m.request):
                self.kv.truncate(m.request, m.request.num_computed_tokens)
        m.num_known = len(tokens)
        return m.request

    @torch.inference_mode()
    def propose(self, wanted: list[tuple[Request, int]]) -> None:
        drafts: dict[str, list[int]] = {}
        active = [(self._sync(target), k, target) for target, k in wanted]
        while active:
            batch = []
            for m, k, target in active:
                copies = self.kv.allocate_slots(m, m.num_tokens - m.num_computed_tokens)
                if copies is None:  # the draft pool is full: this request goes without drafts this step
                    self._drop(m.request_id)
                    drafts.pop(m.request_id, None)
                    continue
                batch.append((m, k, target))
            if not batch:
                break
            scheduled = [ScheduledRequest(m, m.num_tokens - m.num_computed_tokens, [], True) for m, _, _ in batch]
            logits = self.runner.execute(scheduled, [[self.kv.get_block_ids(m) for m, _, _ in batch]], [])
            next_tokens = logits.argmax(-1).tolist()
            active = []
            for (m, k, target), s, tok in zip(batch, scheduled, next_tokens, strict=True):
                m.num_computed_tokens += s.num_new_tokens
                m.all_token_ids.append(tok)
                own = drafts.setdefault(m.request_id, [])
                own.append(tok)
                if len(own) < k:
                    active.append((m, k, target))
        for target, _ in wanted:
            target.spec_token_ids = drafts.get(target.request_id, [])
