"""From sampled tokens to RequestOutputs: n > 1 fan-out, draft acceptance, logprobs, detokenisation, stops.

Naming: a user request is a `RequestState`; each of its n samples is a `SampleState` that owns one core
`Request` (the scheduler's unit, with its own block table). The core request id of sample i is
`sample_request_id(request_id, i)`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import ScheduledRequest, Scheduler
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured.reasoning_gate import GateWalk
from pagedllm.worker.sampler import SamplerOutput, SamplingRow

logger = logging.getLogger(__name__)


def sample_request_id(request_id: str, index: int) -> str:
    """Core request id of sample `index` (one-to-one: the index after the last '#' is an integer)."""
    return f"{request_id}#{index}"


@dataclass(eq=False)
class SampleState:
    """One of the n samples of a request: its core Request plus text, logprobs and how it ended."""

    request: Request
    index: int
    detokenizer: IncrementalDetokenizer
    seed: int | None  # the request's seed + this sample's index
    logprobs: list[dict[int, Logprob]] | None = None  # only when the request asked for logprobs
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    matcher: Any = None  # structured outputs: this sample's grammar matcher (pagedllm/structured)
    gate: GateWalk | None = None  # structured outputs after reasoning: whether the matcher sees the tokens yet
    gate_changed: bool = False  # the last appended token moved the gate

    def output(self) -> CompletionOutput:
        cumulative = self.cumulative_logprob if self.logprobs is not None else None
        return CompletionOutput(self.index, self.detokenizer.text, list(self.request.output_token_ids),
                                cumulative, self.logprobs, self.finish_reason, self.stop_reason)


@dataclass(eq=False)
class RequestState:
    """A user's request: its prompt, parameters and its samples (the first exists from the start, the other
    n - 1 fork from it once the prompt is prefilled)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    cache_salt: str | None = None
    samples: list[SampleState] = field(default_factory=list)
    error: str | None = None
    grammar: Future | None = None  # structured outputs: the compiled grammar
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # filled while the prompt is computed

    @property
    def finished(self) -> bool:
        return len(self.samples) == self.params.n and all(s.finish_reason for s in self.samples)

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [s.output() for s in self.samples], self.finished,
                             self.samples[0].request.num_cached_tokens, self.error, self.metrics,
                             self.prompt_logprobs)


@dataclass
class SamplingPlan:
    """The sampler's rows for one step: row r samples sample `row_samples[r]` from logits row `logit_rows[r]`.
    A sample with k draft tokens has k + 1 consecutive rows (row j conditions on the first j drafts)."""

    rows: list[SamplingRow] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)
    samples: list[tuple[RequestState, SampleState, list[int]]] = field(default_factory=list)  # with its drafts


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verification rounds (a sample with >= 1 draft token in a step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def as_dict(self) -> dict:
        d, t, a = self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens
        return {"num_drafts": d, "num_draft_tokens": t, "num_accepted_tokens": a,
                "acceptance_rate": a / t if t else 0.0,
                "mean_accepted_length": 1 + a / d if d else 0.0}  # tokens emitted per verification


class OutputProcessor:
    def __init__(self, tokenizer, scheduler: Scheduler, eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.requests: dict[str, RequestState] = {}
        self._samples: dict[str, tuple[RequestState, SampleState]] = {}  # core request id -> its sample
        self.spec_stats = SpecDecodeStats()
        self.on_verified: Callable[[Request, int, int], None] | None = None  # (request, drafts, accepted)
        self.num_prompt_logprobs = 0  # live requests that asked for prompt_logprobs

    # ---- requests in and out --------------------------------------------------------------------
    def add_request(self, state: RequestState, arrival_time: float | None) -> Request:
        """Register a request and return the core Request of its first sample (for the scheduler)."""
        req = Request(sample_request_id(state.request_id, 0), state.prompt_token_ids, state.cache_salt)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        state.metrics = RequestMetrics(req.arrival_time)
        if state.params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(state.prompt_token_ids)
            self.num_prompt_logprobs += 1
        self._add_sample(state, req)
        self.requests[state.request_id] = state
        return req

    def _add_sample(self, state: RequestState, req: Request) -> SampleState:
        p, index = state.params, len(state.samples)
        seed = None if p.seed is None else p.seed + index
        detok = IncrementalDetokenizer(self.tokenizer, state.prompt_token_ids, p.stop, p.skip_special_tokens,
                                       p.include_stop_str_in_output)
        sample = SampleState(req, index, detok, seed, [] if p.logprobs is not None else None)
        gate = p.structured_outputs.after_reasoning if p.structured_outputs is not None else None
        sample.gate = GateWalk(gate) if gate is not None else None
        state.samples.append(sample)
        self._samples[req.request_id] = (state, sample)
        return sample

    def sample_of(self, request: Request) -> tuple[RequestState, SampleState] | None:
        return self._samples.get(request.request_id)

    def prompt_logprobs_of(self, request: Request) -> tuple[int, list] | None:
        """(k, entries to fill) when `request` is the first sample of a request that asked for prompt_logprobs."""
        found = self._samples.get(request.request_id)
        if found is None or found[0].prompt_logprobs is None or found[1].index != 0:
            return None
        return found[0].params.prompt_logprobs, found[0].prompt_logprobs

    def mark_scheduled(self, scheduled: list[ScheduledRequest], now: float) -> None:
        for s in scheduled:
            found = self._samples.get(s.request.request_id)
            if found is not None and found[0].metrics.first_scheduled_time is None:
                found[0].metrics.first_scheduled_time = now

    def abort(self, request_id: str, error: str | None = None) -> RequestState | None:
        """Finish every sample of a request (freeing its blocks) and forget it."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        state.error = state.error or error
        for s in state.samples:
            s.finish_reason = s.finish_reason or "abort"
        self._release(state, RequestStatus.FINISHED_ABORTED)
        return state

    def _release(self, state: RequestState, status: RequestStatus) -> None:
        if state.prompt_logprobs is not None:
            self.num_prompt_logprobs -= 1
        self.scheduler.finish_requests([s.request for s in state.samples if not s.request.status.is_finished],
                                       status)
        for s in state.samples:
            self._samples.pop(s.request.request_id, None)

    # ---- one step -------------------------------------------------------------------------------
    def plan(self, sampling: list[ScheduledRequest]) -> SamplingPlan:
        """Sampler rows for the entries that sample this step (logits rows in their order); a request with
        n > 1 forks its other samples here, right after its prompt is prefilled."""
        plan = SamplingPlan()
        logit_row = 0
        for s in sampling:
            state, sample = self._samples[s.request.request_id]
            samples = [sample]
            if len(state.samples) < state.params.n:
                samples += self._fork_samples(state, sample.request)
            for smp in samples:
                out_ids = smp.request.output_token_ids
                drafts = s.draft_token_ids if smp is sample else []
                for j in range(len(drafts) + 1):
                    plan.rows.append(SamplingRow(state.params, state.prompt_token_ids,
                                                 out_ids + drafts[:j] if j else out_ids, smp.seed))
                    plan.logit_rows.append(logit_row + j)
                plan.samples.append((state, smp, drafts))
            logit_row += s.num_logits
        return plan

    def _fork_samples(self, state: RequestState, parent: Request) -> list[SampleState]:
        """n > 1: the other samples share the prefilled prompt's blocks (copy-on-write later)."""
        children = []
        for index in range(len(state.samples), state.params.n):
            child = Request(sample_request_id(state.request_id, index), state.prompt_token_ids,
                            parent.cache_salt, parent.arrival_time)
            self.scheduler.fork(parent, child)
            children.append(self._add_sample(state, child))
        return children

    def process(self, plan: SamplingPlan, sampled: SamplerOutput) -> list[RequestOutput]:
        """Accept draft tokens, append the new tokens, check stops and finish; one output per touched request.
        A failure while handling one request fails that request only."""
        touched: dict[str, RequestState] = {}
        row = 0
        for state, sample, drafts in plan.samples:
            touched[state.request_id] = state
            rows = range(row, row + len(drafts) + 1)
            row += len(drafts) + 1
            if state.error:
                continue
            try:
                self._advance(state, sample, drafts, sampled, rows)
            except Exception as e:
                logger.exception("request %s failed", state.request_id)
                state.error = f"{type(e).__name__}: {e}"
        outputs = []
        now = time.monotonic()
        for state in touched.values():
            m = state.metrics
            m.first_token_time = m.first_token_time or now
            m.last_token_time = now
            if state.error or state.finished:
                m.finished_time = now
            if state.error:
                self.abort(state.request_id)
            elif state.finished:
                self.requests.pop(state.request_id, None)
                self._release(state, RequestStatus.FINISHED_STOPPED)
            outputs.append(state.output())
        return outputs

    def _advance(self, state: RequestState, sample: SampleState, drafts: list[int], sampled: SamplerOutput,
                 rows: range) -> None:
        """Row j's token is accepted while the rows before it sampled their draft token exactly: sampling
        every row from its own (penalised, truncated) distribution and keeping tokens up to the first one that
        differs from its draft is rejection sampling for a deterministic proposer, so the output follows the
        target distribution exactly (greedy: the longest prefix equal to the argmax, plus the next token)."""
        num_accepted = 0
        for j, r in enumerate(rows):
            if self._append_token(state, sample, sampled, r):
                break
            if j == len(drafts) or sampled.token_ids[r] != drafts[j]:
                break
            if sample.gate is not None and sample.gate_changed:
                break  # the next rows were masked for the gate's old state: sample them again
            num_accepted += 1
        if drafts:
            self.spec_stats.num_drafts += 1
            self.spec_stats.num_draft_tokens += len(drafts)
            self.spec_stats.num_accepted_tokens += num_accepted
            if self.on_verified is not None:
                self.on_verified(sample.request, len(drafts), num_accepted)
            self.scheduler.accept_draft_tokens(sample.request, num_accepted)

    def _append_token(self, state: RequestState, sample: SampleState, sampled: SamplerOutput, r: int) -> bool:
        """Append row r's token to the sample; True when the sample is finished."""
        token = sampled.token_ids[r]
        req = sample.request
        to_grammar = True
        if sample.gate is not None:
            to_grammar, sample.gate_changed = sample.gate.route(token)
        if sample.matcher is not None and to_grammar and not sample.matcher.accept(token):
            raise RuntimeError(f"structured outputs: the grammar rejected token {token} (an empty mask?)")
        req.append_output_token(token)
        if sample.logprobs is not None:
            sample.cumulative_logprob += sampled.logprobs[r]
            entry = {token: Logprob(sampled.logprobs[r], sampled.ranks[r], self.decode_one(token))}
            k = state.params.logprobs or 0
            for rank, (tid, lp) in enumerate(zip(sampled.top_ids[r][:k], sampled.top_logprobs[r][:k],
                                                 strict=True) if k else (), start=1):
                entry.setdefault(tid, Logprob(lp, rank, self.decode_one(tid)))
            sample.logprobs.append(entry)
        p = state.params
        if token in p.stop_token_ids:
            sample.finish_reason, sample.stop_reason = "stop", token
        elif not p.ignore_eos and token in self.eos_token_ids:
            sample.finish_reason = "stop"
        elif (stop := sample.detokenizer.add_token(token, req.num_output_tokens >= p.min_tokens)) is not None:
            sample.finish_reason, sample.stop_reason = "stop", stop
        elif sample.matcher is not None and to_grammar and sample.matcher.is_terminated():
            sample.finish_reason = "stop"  # the grammar is complete: nothing but a stop token could follow
        elif req.num_output_tokens >= state.max_tokens or req.num_tokens >= self.max_model_len:
            sample.finish_reason = "length"
        if not sample.finish_reason:
            return False
        status = RequestStatus.FINISHED_LENGTH if sample.finish_reason == "length" else RequestStatus.FINISHED_STOPPED
        self.scheduler.finish_requests([req], status)
        return True

    def decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])
