"""Iteration-level continuous batching with chunked prefill, preemption by recompute and draft tokens.

Each step has a token budget. Running requests are served first (a decode costs one token plus its draft
tokens, an unfinished prefill continues with the next chunk); then waiting requests are admitted in arrival
order, each taking its cached prefix first. When a running request cannot get a block it first drops its draft
tokens, then the most recently admitted running request is preempted: its blocks are freed and it goes back to
the head of the waiting queue, to be recomputed.

After the model runs, `update_from_output` is the one place a step changes the sequences' state: it appends the
sampled tokens, keeps the accepted draft tokens and rolls back the rejected ones, forks the other samples of an
n > 1 request once its prompt is done, advances beam searches, and finishes sequences on EOS, a stop token, a
grammar's end or length (stop strings are found by the engine's detokenizer, which finishes through
`finish_requests`).

Liveness: admission (`check_fits`) rejects a request whose prompt + max_tokens could never fit in the whole
cache, so the oldest running request can always run to its end alone, preempting the others; the engine
therefore always makes progress (tests/core/test_scheduler.py holds this as a property).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedllm.core.admission import check_fits
from pagedllm.core.beam_search import BeamStep
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.step import SamplerOutput, SequenceUpdate

POLICIES = ("fcfs", "priority")
_MAX_PREFILL_CANDIDATES = 512  # waiting requests looked up in the prefix cache per step, at most


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    watermark: float = 0.01  # fraction of blocks kept free when admitting a new request
    policy: str = "fcfs"  # or "priority": Request.priority first (lower first), as vLLM's --scheduling-policy
    prefill_order: str = "shortest"  # prompts closest to done get the budget first; "fcfs": arrival order
    max_loras: int = 1  # distinct LoRA adapters among the running requests, at most (the runner's slots)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {POLICIES}, got {self.policy!r}")
        if self.prefill_order not in ("shortest", "fcfs"):
            raise ValueError(f"prefill_order must be 'shortest' or 'fcfs', got {self.prefill_order!r}")
        if not self.enable_chunked_prefill:
            # Without chunking a whole prompt must fit in one step.
            self.max_num_batched_tokens = max(self.max_num_batched_tokens, self.max_model_len)


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens run through the model this step, draft tokens included
    draft_token_ids: list[int] = field(default_factory=list)  # the last len(...) of the new tokens
    samples: bool = False  # the step reaches the end of the known tokens: logits for the last 1 + drafts rows
    block_ids: list[list[int]] = field(default_factory=list)  # the request's block table per KV group
    # n > 1: the samples forked once this step completes the prompt (fixed when the step is scheduled)
    num_forks: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.samples and not self.request.output_token_ids:
            self.num_forks = len(self.request.fork_ids)

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)

    @property
    def num_logits(self) -> int:
        return 1 + len(self.draft_token_ids) if self.samples and not self.request.prefill_only else 0

    @property
    def forks(self) -> bool:
        """The step completes the prompt of an n > 1 request: its logits row is sampled once per sample."""
        return self.num_forks > 0

    @property
    def num_rows(self) -> int:
        """Sampler rows: one per sample when it forks, else one per logits row."""
        return 1 + self.num_forks if self.forks else self.num_logits


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
        self._prompt_work = 0  # prompt tokens scheduled so far: the clock prompts age by (not wall time)
        self.kv_tier = None  # core/kv_tier.TierCoordinator when a disk tier backs the prefix cache
        self._watermark_blocks = max(1, math.ceil(config.watermark * kv_cache_manager.num_blocks))

    # ---- admission -------------------------------------------------------------------------------
    @property
    def num_streams(self) -> int:
        """Requests running or waiting, at most max_num_seqs: the rows of a decode step once their prompts are in."""
        return min(len(self.running) + len(self.waiting), self.config.max_num_seqs)

    def capacity_tokens(self) -> int:
        """Tokens one request can hold with the whole cache to itself."""
        if self.kv.kv_layout == "contiguous":
            return self.config.max_model_len
        return self.kv.capacity_tokens(self.config.max_num_batched_tokens, self.config.max_model_len)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int | None = None, *, prefill_only: bool = False) -> int:
        """What a request may generate, or ValueError for one that could never run (core/admission.py)."""
        return check_fits(self.config.max_model_len, self.config.max_num_batched_tokens, self.kv,
                          self.capacity_tokens(), num_prompt_tokens, max_tokens, prefill_only=prefill_only)

    def add_request(self, request: Request) -> None:
        """Queue a request; its grammar matcher is made here from `new_grammar` (as each forked sample's is)."""
        self.check_fits(request.num_prompt_tokens, prefill_only=request.prefill_only)
        if request.grammar is None and request.new_grammar is not None:
            request.grammar = request.new_grammar()
        request.status = RequestStatus.WAITING
        request.prompt_work_at_arrival = self._prompt_work
        self.waiting.append(request)

    def fork(self, parent: Request, child: Request) -> None:
        """The child (a new sample or beam of the parent) shares the parent's blocks and runs right after it."""
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        self.kv.fork(parent, child)
        child.status = RequestStatus.RUNNING
        self.running.insert(self.running.index(parent) + 1, child)

    # ---- one step --------------------------------------------------------------------------------
    def schedule(self, prefill_budget: int | None = None) -> SchedulerOutput:
        """One step's work. Every decode runs (within max_num_batched_tokens); prompt tokens up to
        `prefill_budget` more (None, or chunked prefill off: the rest of max_num_batched_tokens), the prompts
        closest to done first."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.kv_tier is not None:  # requests whose prefix came back from disk: first in line again
            self.waiting.extendleft(reversed(self.kv_tier.take_loaded()))
        if self.config.policy == "priority":  # the tail, where preemption takes from, is the lowest priority
            self.running.sort(key=lambda r: (r.priority, r.arrival_time))

        # 1. Decodes (and their drafts), oldest (highest priority) first; preempt from the tail when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining != 1:  # still prefilling: its prompt competes with the waiting ones below
                i += 1
                continue
            drafts = req.spec_token_ids
            if drafts:  # only after the last known token, within the budget and the context
                del drafts[max(0, min(len(drafts), budget - 1, self.config.max_model_len - req.num_tokens)):]
            copies = self.kv.allocate_slots(req, 1 + len(drafts))
            if copies is None and drafts:
                drafts.clear()
                copies = self.kv.allocate_slots(req, 1)
            while copies is None:
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is req:
                    break
                copies = self.kv.allocate_slots(req, 1)
            if copies is None:
                break
            out.scheduled.append(ScheduledRequest(req, 1 + len(drafts), list(drafts), True))
            out.block_copies.extend(copies)
            budget -= 1 + len(drafts)
            i += 1

        # 2. Prompts, in prefill order. Prompts do not preempt each other, unless every running request is a
        # prompt and none found blocks (they hold the pool between them): then the last in line gives its blocks
        # back, as it would to a decode, until one can go on.
        if prefill_budget is not None and self.config.enable_chunked_prefill:
            budget = min(budget, max(1, prefill_budget))
        self._schedule_prompts(out, budget)
        while not out.scheduled and len(self.running) > 1:
            self._preempt(self.running.pop(), out)
            self._schedule_prompts(out, budget)
        for s in out.scheduled:  # after every allocation of the step (a preemption frees, CoW replaces blocks)
            s.block_ids = self.kv.get_group_block_ids(s.request)
        return out

    def _schedule_prompts(self, out: SchedulerOutput, budget: int) -> None:
        """The running prompts and the waiting ones, in prefill order, within `budget` tokens; new requests are
        admitted unless this step preempted or a running prompt found no blocks."""
        blocked = bool(out.preempted)
        adapters = {r.lora_id for r in self.running if r.lora_id is not None}
        for req in self._prefill_order():
            if budget <= 0:
                continue
            if req.status == RequestStatus.RUNNING:
                num_new = min(req.num_tokens - req.num_computed_tokens, budget)
                copies = self.kv.allocate_slots(req, num_new)
                if copies is None:  # no preemption here: decodes already scheduled hold what it could take
                    blocked = True
                    continue
                samples = req.num_computed_tokens + num_new == req.num_tokens
            else:
                if blocked or len(self.running) >= self.config.max_num_seqs:
                    continue
                if req.lora_id is not None and req.lora_id not in adapters:
                    if len(adapters) >= self.config.max_loras:  # its adapter waits for a slot; others go on
                        continue
                    adapters.add(req.lora_id)
                loading = self._load_from_tier(req)
                if loading is not None:  # off the queue while its prefix loads; or no room for it yet
                    blocked = blocked or not loading
                    continue
                admitted = self._admit(req, budget)
                if admitted is None:
                    blocked = True
                    continue
                num_new, copies = admitted
                samples = req.num_computed_tokens + num_new == req.num_tokens
            self._prompt_work += num_new
            out.scheduled.append(ScheduledRequest(req, num_new, [], samples))
            out.block_copies.extend(copies)
            budget -= num_new

    def _prefill_order(self) -> list[Request]:
        """Prompts to compute, in the order they get the step's budget: by priority (the priority policy), then
        the fewest prompt tokens left less the prompt tokens computed since the request arrived (the first token
        comes soonest on average, and a newcomer overtakes a waiting prompt only if it is shorter by more than the
        work done while that one waited: no prompt starves; "fcfs": arrival order), then arrival."""
        cfg = self.config
        prompts = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        waiting = sorted(self.waiting, key=lambda r: (r.priority if cfg.policy == "priority" else 0, r.arrival_time))
        prompts += waiting[:_MAX_PREFILL_CANDIDATES]

        def aged_left(r: Request) -> int:
            if cfg.prefill_order != "shortest":
                return 0
            left = r.num_tokens - (r.num_computed_tokens if r.status == RequestStatus.RUNNING
                                   else self.kv.get_computed_blocks(r)[1])
            return left - (self._prompt_work - r.prompt_work_at_arrival)

        return sorted(prompts, key=lambda r: (r.priority if cfg.policy == "priority" else 0, aged_left(r),
                                              r.arrival_time))

    def _load_from_tier(self, req: Request) -> bool | None:
        """The disk tier's answer for a waiting request (core/kv_tier.py): None, admit it as usual; True, a load of
        more of its prefix started (it leaves the queue until loaded); False, the pool cannot take that load now."""
        if self.kv_tier is None:
            return None
        _, num_cached = self.kv.get_computed_blocks(req)
        loading = self.kv_tier.maybe_load(req, num_cached, self._watermark_blocks if self.running else 0)
        if loading:
            self.waiting.remove(req)
        return loading

    def _admit(self, req: Request, budget: int) -> tuple[int, list[tuple[int, int]]] | None:
        """A waiting request's first chunk (after its cached prefix), or None if its blocks do not fit now."""
        cached_blocks, num_cached = self.kv.get_computed_blocks(req)
        num_new = req.num_tokens - num_cached
        if num_new > budget and not self.config.enable_chunked_prefill:
            return None
        num_new = min(num_new, budget)
        reserve = self._watermark_blocks if self.running else 0
        copies = self.kv.allocate_slots(req, num_new, cached_blocks, num_reserved_blocks=reserve)
        if copies is None:
            return None
        self.waiting.remove(req)
        if req.status == RequestStatus.WAITING:  # first admission (not a preempted one)
            req.num_cached_tokens = num_cached
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_cached
        self.running.append(req)
        return num_new, copies

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids.clear()
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def update_from_output(self, out: SchedulerOutput, sampled: SamplerOutput) -> list[SequenceUpdate]:
        """Apply a step's sampled rows (`out.scheduled` entries in order, `num_rows` each). Sequences finished
        while the step ran (aborted) are skipped. Returns what each sequence took, forks right after their
        parent; beams are the beam search's (core/beam_search.py) and not reported."""
        updates: list[SequenceUpdate] = []
        pooled: list[Request] = []  # prefill-only sequences whose prompt is done: they end here
        row = 0
        for s in out.scheduled:
            rows = list(range(row, row + s.num_rows))
            row += s.num_rows
            req = s.request
            if req.status != RequestStatus.RUNNING:
                continue
            req.num_computed_tokens += s.num_new_tokens - s.num_draft_tokens
            if not s.samples:
                continue
            if req.prefill_only:
                pooled.append(req)
                updates.append(SequenceUpdate(req, [], []))
                continue
            if req.beam is not None:
                self._apply_beam_step(req.beam.take_row(req, sampled, rows[0]))
            elif s.forks:
                children = [self._fork_sample(req, child_id, i) for i, child_id in enumerate(req.fork_ids, 1)]
                req.fork_ids = []
                for seq, r in zip([req, *children], rows, strict=True):
                    updates.append(self._take_tokens(seq, sampled, [r], [], forked_from=None if seq is req else req))
            else:
                updates.append(self._take_tokens(req, sampled, rows, s.draft_token_ids))
        self.finish_requests(pooled, RequestStatus.FINISHED_STOPPED)
        return updates

    def _apply_beam_step(self, step: BeamStep | None) -> None:
        """A beam group's advance (None: it still waits for rows): forks first, while every parent still has only
        its old tokens, then the dropped beams are freed, then each kept beam takes its token."""
        if step is None:
            return
        for parent, child in step.forks:
            self.fork(parent, child)
        self.finish_requests(step.dropped, RequestStatus.FINISHED_STOPPED)
        for seq, token in step.appends:
            seq.append_output_token(token)

    def _fork_sample(self, parent: Request, child_id: str, index: int) -> Request:
        """Sample `index` of an n > 1 request: the parent's prompt blocks, its own seed and grammar matcher."""
        child = Request(child_id, parent.prompt_token_ids, parent.cache_salt, parent.arrival_time,
                        sampling_params=parent.sampling_params,
                        seed=None if parent.seed is None else parent.seed + index, max_tokens=parent.max_tokens,
                        eos_token_ids=parent.eos_token_ids, stop_token_ids=parent.stop_token_ids,
                        new_grammar=parent.new_grammar, lora_id=parent.lora_id,
                        grammar=parent.new_grammar() if parent.new_grammar is not None else None)
        self.fork(parent, child)
        return child

    def _take_tokens(self, req: Request, sampled: SamplerOutput, rows: list[int], drafts: list[int],
                     forked_from: Request | None = None) -> SequenceUpdate:
        """Row j's token is taken while the rows before it sampled their draft token exactly (rejection sampling
        for a deterministic proposer: greedy keeps the longest prefix equal to the argmax, plus one token), and
        until the sequence ends."""
        update = SequenceUpdate(req, [], [], len(drafts), forked_from=forked_from)
        for j, r in enumerate(rows):
            token = sampled.token_ids[r]
            ended = self._append_token(req, token)
            if req.status != RequestStatus.FINISHED_ABORTED:  # (a token the grammar rejected is not taken)
                update.token_ids.append(token)
                update.rows.append(r)
            if ended or j == len(drafts) or token != drafts[j]:
                break
            if getattr(req.grammar, "mask_changed", False):
                break  # the rows after it were masked for the grammar's old state: sample them again
            update.num_accepted_tokens += 1
        if drafts:
            self.accept_draft_tokens(req, update.num_accepted_tokens)
        return update

    def _append_token(self, req: Request, token: int) -> bool:
        """Append one token; True (and the sequence finished, its blocks freed) when it ends the sequence."""
        # (a grammar complete from the start, a schema that only refers to itself, allows nothing but a stop token,
        # which its stopped matcher no longer accepts: the sequence ends below)
        if req.grammar is not None and not req.grammar.is_terminated() and not req.grammar.accept(token):
            req.error = f"structured outputs: the grammar rejected token {token} (an empty mask?)"
            self.finish_requests([req], RequestStatus.FINISHED_ABORTED)
            return True
        req.append_output_token(token)
        status = None
        if token in req.stop_token_ids:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif token in req.eos_token_ids or (req.grammar is not None and req.grammar.is_terminated()):
            status = RequestStatus.FINISHED_STOPPED  # (a complete grammar: only a stop token could follow)
        elif ((req.max_tokens is not None and req.num_output_tokens >= req.max_tokens)
              or req.num_tokens >= self.config.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self.finish_requests([req], status)
        return status is not None

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """A proposer's draft tokens by request id (as vLLM v1's): the running requests named get them for their
        next step, an empty list clearing any they had; ids no longer running are ignored."""
        if not draft_token_ids:
            return
        for req in self.running:
            drafts = draft_token_ids.get(req.request_id)
            if drafts is not None:
                req.spec_token_ids = list(drafts)

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
