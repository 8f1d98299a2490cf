"""Iteration-level continuous batching with chunked prefill and preemption by recompute.

Each step has a token budget. Running requests are served first (a decode costs one token, an unfinished
prefill continues with the next chunk); then waiting requests are admitted in arrival order, each taking its
cached prefix first. When a running request cannot get a block, the most recently admitted running request
is preempted: its blocks are freed and it goes back to the head of the waiting queue, to be recomputed.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedllm.core.kv_cache_manager import KVCacheManager
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
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

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
        self._watermark_blocks = max(1, math.ceil(config.watermark * kv_cache_manager.num_blocks))

    # ---- admission -------------------------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int) -> None:
        """Reject at add time what could never run, instead of letting it wait forever."""
        if num_prompt_tokens < 1:
            raise ValueError("prompt must contain at least one token")
        if num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt is {num_prompt_tokens} tokens, which leaves no room to generate within "
                f"max_model_len={self.config.max_model_len}")
        if self.kv.kv_layout == "contiguous":  # reserves the whole context up front
            needed = math.ceil(self.config.max_model_len / self.kv.block_size)
        else:
            needed = math.ceil((num_prompt_tokens + 1) / self.kv.block_size)
        if needed > self.kv.num_blocks:
            raise ValueError(
                f"prompt of {num_prompt_tokens} tokens needs {needed} KV blocks but the cache has only "
                f"{self.kv.num_blocks}; raise kv_cache_memory or num_kv_blocks")

    def add_request(self, request: Request) -> None:
        self.check_fits(request.num_prompt_tokens)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def add_running(self, request: Request, after: Request) -> None:
        """Put a forked request into the running batch right after its parent."""
        request.status = RequestStatus.RUNNING
        self.running.insert(self.running.index(after) + 1, request)

    # ---- one step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        # 1. Running requests, oldest first; preempt from the newest end when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:  # nothing to compute (should not happen for a live request)
                i += 1
                continue
            copies = self.kv.allocate_slots(req, num_new)
            while copies is None:
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is req:
                    break
                copies = self.kv.allocate_slots(req, num_new)
            if copies is None:
                break
            out.scheduled.append(ScheduledRequest(req, num_new))
            out.block_copies.extend(copies)
            budget -= num_new
            i += 1

        # 2. Waiting requests in arrival order, unless this step already had to preempt.
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            cached_blocks, num_cached = self.kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_cached
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            reserve = self._watermark_blocks if self.running else 0
            copies = self.kv.allocate_slots(req, num_new, cached_blocks, num_reserved_blocks=reserve)
            if copies is None:
                break
            self.waiting.popleft()
            if req.status == RequestStatus.WAITING:  # first admission (not a preempted one)
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new))
            out.block_copies.extend(copies)
            budget -= num_new
        return out

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def update_after_step(self, out: SchedulerOutput) -> list[Request]:
        """Advance computed-token counts; return the requests whose last token now has logits."""
        ready = []
        for s in out.scheduled:
            req = s.request
            if req.status != RequestStatus.RUNNING:
                continue
            req.num_computed_tokens += s.num_new_tokens
            if req.num_computed_tokens == req.num_tokens:
                ready.append(req)
        return ready

    # ---- ending ----------------------------------------------------------------------------------
    def finish_requests(self, requests: Iterable[Request], status: RequestStatus) -> None:
        """Stop requests (stop, length or abort): their blocks are freed at once."""
        finished = {id(r) for r in requests}
        if not finished:
            return
        for req in list(self.running) + list(self.waiting):
            if id(req) in finished:
                if req.status == RequestStatus.RUNNING:
                    self.kv.free(req)
                req.status = status
        self.running = [r for r in self.running if id(r) not in finished]
        self.waiting = deque(r for r in self.waiting if id(r) not in finished)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)
