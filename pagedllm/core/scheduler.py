"""Iteration-level continuous batching with chunked prefill, preemption by recompute and draft tokens.

Each step has a token budget. Running requests are served first (a decode costs one token plus its draft
tokens, an unfinished prefill continues with the next chunk); then waiting requests are admitted in arrival
order, each taking its cached prefix first. When a running request cannot get a block it first drops its draft
tokens, then the most recently admitted running request is preempted: its blocks are freed and it goes back to
the head of the waiting queue, to be recomputed.

Liveness: admission (`check_fits`) rejects a request whose prompt + max_tokens could never fit in the whole
cache, so the oldest running request can always run to its end alone, preempting the others; the engine
therefore always makes progress (tests/test_scheduler.py holds this as a property).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_cache_utils import cdiv
from pagedllm.core.request import Request, RequestStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    watermark: float = 0.01  # fraction of blocks kept free when admitting a new request

    def __post_init__(self) -> None:
        if not self.enable_chunked_prefill:
            # Without chunking a whole prompt must fit in one step.
            self.max_num_batched_tokens = max(self.max_num_batched_tokens, self.max_model_len)


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens run through the model this step, draft tokens included
    draft_token_ids: list[int] = field(default_factory=list)  # the last len(...) of the new tokens
    samples: bool = False  # the step reaches the end of the known tokens: logits for the last 1 + drafts rows

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)

    @property
    def num_logits(self) -> int:
        return 1 + len(self.draft_token_ids) if self.samples else 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.kv_tier = None  # core/kv_tier.TierCoordinator when a disk tier backs the prefix cache
        self._watermark_blocks = max(1, math.ceil(config.watermark * kv_cache_manager.num_blocks))

    # ---- admission -------------------------------------------------------------------------------
    def capacity_tokens(self) -> int:
        """Tokens one request can hold with the whole cache to itself."""
        if self.kv.kv_layout == "contiguous":
            return self.config.max_model_len
        return self.kv.capacity_tokens(self.config.max_num_batched_tokens, self.config.max_model_len)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int | None = None) -> int:
        """Reject at add time what could never run (instead of letting it wait, or stall the queue, forever).
        Returns the number of tokens the request may generate: max_tokens, or with max_tokens None as many as
        the context and the cache can hold (the request then finishes with "length" at capacity)."""
        max_len = self.config.max_model_len
        if num_prompt_tokens < 1:
            raise ValueError("prompt must contain at least one token")
        if num_prompt_tokens >= max_len:
            raise ValueError(
                f"prompt is {num_prompt_tokens} tokens, which leaves no room to generate within "
                f"max_model_len={max_len}")
        if self.kv.kv_layout == "contiguous" and cdiv(max_len, self.kv.block_size) > self.kv.num_blocks:
            raise ValueError(
                f"the contiguous layout reserves {cdiv(max_len, self.kv.block_size)} KV blocks per request but "
                f"the cache has only {self.kv.num_blocks}; raise kv_cache_memory or num_kv_blocks")
        capacity = self.capacity_tokens()
        # The last generated token never needs a slot: prompt + max_tokens - 1 slots at most.
        room = min(max_len - num_prompt_tokens, capacity + 1 - num_prompt_tokens)
        if room < 1:
            raise ValueError(
                f"prompt of {num_prompt_tokens} tokens needs "
                f"{self.kv.request_blocks(num_prompt_tokens, self.config.max_num_batched_tokens)} KV blocks but the "
                f"cache has only {self.kv.num_blocks} of {self.kv.block_size} tokens; raise kv_cache_memory or "
                f"num_kv_blocks")
        if max_tokens is None:
            return room
        max_tokens = min(max_tokens, max_len - num_prompt_tokens)
        if num_prompt_tokens + max_tokens - 1 > capacity:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) needs "
                f"{num_prompt_tokens + max_tokens - 1} KV slots but the whole cache holds {capacity} "
                f"({self.kv.num_blocks} blocks of {self.kv.block_size}); lower max_tokens to at most {room} "
                f"or raise kv_cache_memory / num_kv_blocks")
        return max_tokens

    def add_request(self, request: Request) -> None:
        self.check_fits(request.num_prompt_tokens)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def fork(self, parent: Request, child: Request) -> None:
        """The child (a new sample or beam of the parent) shares the parent's blocks and runs right after it."""
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        self.kv.fork(parent, child)
        child.status = RequestStatus.RUNNING
        self.running.insert(self.running.index(parent) + 1, child)

    # ---- one step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.kv_tier is not None:  # requests whose prefix came back from disk: first in line again
            self.waiting.extendleft(reversed(self.kv_tier.take_loaded()))

        # 1. Running requests, oldest first; preempt from the newest end when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            remaining = req.num_tokens - req.num_computed_tokens
            num_new = min(remaining, budget)
            if num_new <= 0:  # nothing to compute (should not happen for a live request)
                i += 1
                continue
            drafts = req.spec_token_ids
            if drafts:  # only after the last known token, within the budget and the context
                k = min(len(drafts), budget - num_new, self.config.max_model_len - req.num_tokens)
                del drafts[max(0, k) if num_new == remaining else 0:]
            copies = self.kv.allocate_slots(req, num_new + len(drafts))
            if copies is None and drafts:
                drafts.clear()
                copies = self.kv.allocate_slots(req, num_new)
            while copies is None:
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is req:
                    break
                copies = self.kv.allocate_slots(req, num_new)
            if copies is None:
                break
            out.scheduled.append(ScheduledRequest(req, num_new + len(drafts), list(drafts), num_new == remaining))
            out.block_copies.extend(copies)
            budget -= num_new + len(drafts)
            i += 1

        # 2. Waiting requests in arrival order, unless this step already had to preempt.
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            cached_blocks, num_cached = self.kv.get_computed_blocks(req)
            reserve = self._watermark_blocks if self.running else 0
            if self.kv_tier is not None:  # more of its prefix on disk: it waits (off the queue) while it loads
                loading = self.kv_tier.maybe_load(req, num_cached, reserve)
                if loading is False:
                    break
                if loading:
                    self.waiting.popleft()
                    continue
            num_new = req.num_tokens - num_cached
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            copies = self.kv.allocate_slots(req, num_new, cached_blocks, num_reserved_blocks=reserve)
            if copies is None:
                break
            self.waiting.popleft()
            if req.status == RequestStatus.WAITING:  # first admission (not a preempted one)
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new, [], num_cached + num_new == req.num_tokens))
            out.block_copies.extend(copies)
            budget -= num_new
        return out

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids.clear()
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def update_after_step(self, out: SchedulerOutput) -> list[ScheduledRequest]:
        """Advance computed-token counts past the step's known tokens (draft tokens wait for
        accept_draft_tokens); return the entries that now sample, in the order of their logits rows."""
        sampling = []
        for s in out.scheduled:
            req = s.request
            if req.status != RequestStatus.RUNNING:
                continue
            req.num_computed_tokens += s.num_new_tokens - s.num_draft_tokens
            if s.samples:
                sampling.append(s)
        return sampling

    def accept_draft_tokens(self, request: Request, num_accepted: int) -> None:
        """After verification: the first num_accepted draft tokens (now appended to the request's tokens)
        keep their K/V; the slots of the rejected ones are released (blocks holding only them go back)."""
        request.spec_token_ids = []
        if request.status != RequestStatus.RUNNING:
            return
        request.num_computed_tokens += num_accepted
        self.kv.truncate(request, request.num_computed_tokens)

    # ---- ending ----------------------------------------------------------------------------------
    def finish_requests(self, requests: Iterable[Request], status: RequestStatus) -> None:
        """Stop requests (stop, length or abort): their blocks are freed at once."""
        requests = list(requests)
        finished = {id(r) for r in requests}
        if not finished:
            return
        if self.kv_tier is not None:
            for req in self.kv_tier.cancel(requests):
                req.status = status
        for req in list(self.running) + list(self.waiting):
            if id(req) in finished:
                if req.status == RequestStatus.RUNNING:
                    self.kv.free(req)
                req.status = status
        self.running = [r for r in self.running if id(r) not in finished]
        self.waiting = deque(r for r in self.waiting if id(r) not in finished)
