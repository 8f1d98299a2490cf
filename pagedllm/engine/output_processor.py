"""From the scheduler's per-sequence updates to RequestOutputs: detokenisation, stop strings, logprobs.

The scheduler has already appended each step's tokens, forked samples and finished sequences on EOS, stop tokens,
a grammar's end and length (Scheduler.update_from_output). Here they become text: the detokenizer finds stop
strings (a sequence that reaches one is reported back, in `Processed.stopped`, for the engine to finish; its
tokens after the stop are dropped), and each touched request gets one RequestOutput.

Naming: a user request is a `RequestState`; each of its n samples is a `SampleState` that follows one core
`Request` (the scheduler's unit, with its own block table). The core request id of sample i is
`sample_request_id(request_id, i)`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from pagedllm.core.request import Grammar, Request, RequestStatus
from pagedllm.core.scheduler import ScheduledRequest
from pagedllm.core.step import PromptLogprobs, RunnerOutput, SamplerOutput, SequenceUpdate
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.faults import is_request_fault
from pagedllm.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                   RequestStatus.FINISHED_ABORTED: "abort"}


def sample_request_id(request_id: str, index: int) -> str:
    """Core request id of sample `index` (one-to-one: the index after the last '#' is an integer)."""
    return f"{request_id}#{index}"


@dataclass(eq=False)
class SampleState:
    """One of the n samples of a request: the core Request it follows, plus text, logprobs and how it ended."""

    request: Request
    index: int
    detokenizer: IncrementalDetokenizer | None  # None for a pooling request or a model without a tokenizer
    logprobs: list[dict[int, Logprob]] | None = None  # only when the request asked for logprobs
    token_ids: list[int] = field(default_factory=list)  # the output: the core request's tokens up to a stop
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def output(self) -> CompletionOutput:
        cumulative = self.cumulative_logprob if self.logprobs is not None else None
        return CompletionOutput(self.index, self.detokenizer.text if self.detokenizer else "", list(self.token_ids), cumulative, self.logprobs,
                                self.finish_reason, self.stop_reason)


@dataclass(eq=False)
class RequestState:
    """A user's request: its prompt, parameters and its samples (the first exists from the start, the other
    n - 1 are forked by the scheduler once the prompt is prefilled)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    max_tokens: int
    cache_salt: str | None = None
    samples: list[SampleState] = field(default_factory=list)
    error: str | None = None
    grammar: Future | None = None  # structured outputs: the compiled grammar
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # filled while the prompt is computed
    embedding: list[float] | None = None  # a pooling request's, once its prompt is computed
    lora_id: int | None = None  # the LoRA adapter it runs with (engine/lora_registry.py)

    @property
    def finished(self) -> bool:
        """Every sample ended (an aborted request ends before its other samples were forked)."""
        ended = all(s.finish_reason for s in self.samples)
        return ended and (len(self.samples) == self.params.n or any(s.finish_reason == "abort" for s in self.samples))

    def output(self) -> RequestOutput | EmbeddingRequestOutput:
        if isinstance(self.params, PoolingParams):
            return EmbeddingRequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                                          None if self.embedding is None else EmbeddingOutput(self.embedding),
                                          self.finished, self.samples[0].request.num_cached_tokens, self.error,
                                          self.metrics)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [s.output() for s in self.samples], self.finished,
                             self.samples[0].request.num_cached_tokens, self.error, self.metrics,
                             self.prompt_logprobs)


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


@dataclass
class Processed:
    outputs: list[RequestOutput] = field(default_factory=list)  # one per request touched this step
    stopped: list[Request] = field(default_factory=list)  # sequences that reached a stop string: to finish
    aborted: list[Request] = field(default_factory=list)  # live sequences of requests that failed: to abort


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self._samples: dict[str, tuple[RequestState, SampleState]] = {}  # core request id -> its sample
        self.spec_stats = SpecDecodeStats()
        self.on_verified: Callable[[Request, int, int], None] | None = None  # (request, drafts, accepted)

    # ---- requests in and out --------------------------------------------------------------------
    def add_request(self, state: RequestState, arrival_time: float | None, *, priority: int = 0,
                    new_grammar: Callable[[], Grammar] | None = None) -> Request:
        """Register a request and return the core Request of its first sample (for the scheduler), complete:
        what the runner samples with, what the scheduler orders it by and stops on, and how its samples make their
        grammar matchers (structured outputs; the scheduler calls it once the grammar has compiled)."""
        p, n = state.params, state.params.n
        if isinstance(p, PoolingParams):
            return self._add_pooling_request(state, arrival_time, priority)
        req = Request(sample_request_id(state.request_id, 0), state.prompt_token_ids, state.cache_salt,
                      time.monotonic() if arrival_time is None else arrival_time,
                      sampling_params=p, seed=p.seed, max_tokens=state.max_tokens,
                      eos_token_ids=frozenset() if p.ignore_eos else p.eos_token_ids,
                      stop_token_ids=frozenset(p.stop_token_ids or ()),
                      fork_ids=[sample_request_id(state.request_id, i) for i in range(1, n)],
                      priority=priority, new_grammar=new_grammar, lora_id=state.lora_id)
        state.metrics = RequestMetrics(req.arrival_time)
        if p.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(state.prompt_token_ids)
        self._add_sample(state, req)
        self.requests[state.request_id] = state
        return req

    def _add_pooling_request(self, state: RequestState, arrival_time: float | None, priority: int) -> Request:
        """A prefill-only sequence (its params travel in `sampling_params`: the runner's pooler reads them)."""
        req = Request(sample_request_id(state.request_id, 0), state.prompt_token_ids, state.cache_salt,
                      time.monotonic() if arrival_time is None else arrival_time,
                      sampling_params=state.params, max_tokens=0, priority=priority, prefill_only=True,
                      lora_id=state.lora_id)
        state.metrics = RequestMetrics(req.arrival_time)
        self._add_sample(state, req)
        self.requests[state.request_id] = state
        return req

    def _add_sample(self, state: RequestState, req: Request) -> SampleState:
        p = state.params
        if isinstance(p, PoolingParams) or self.tokenizer is None:  # no text (a checkpoint without a tokenizer)
            if not isinstance(p, PoolingParams) and p.stop:
                raise ValueError("stop strings need a tokenizer, and this model has none: give stop_token_ids")
            sample = SampleState(req, len(state.samples), None, None if isinstance(p, PoolingParams) or
                                 p.logprobs is None else [])
        else:
            detok = IncrementalDetokenizer(self.tokenizer, state.prompt_token_ids, p.stop, p.skip_special_tokens,
                                           p.include_stop_str_in_output)
            sample = SampleState(req, len(state.samples), detok, [] if p.logprobs is not None else None)
        state.samples.append(sample)
        self._samples[req.request_id] = (state, sample)
        return sample

    def sample_of(self, request: Request) -> tuple[RequestState, SampleState] | None:
        return self._samples.get(request.request_id)

    def mark_scheduled(self, scheduled: list[ScheduledRequest], now: float) -> None:
        for s in scheduled:
            found = self._samples.get(s.request.request_id)
            if found is not None and found[0].metrics.first_scheduled_time is None:
                found[0].metrics.first_scheduled_time = now

    def abort(self, request_id: str, error: str | None = None) -> tuple[RequestState | None, list[Request]]:
        """Forget a request: every sample ends ("abort" where it had not ended). Returns its state and the
        core requests still live, for the scheduler to abort (freeing their blocks)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None, []
        state.error = state.error or error
        for s in state.samples:
            s.finish_reason = s.finish_reason or "abort"
        return state, self._forget(state)

    def _forget(self, state: RequestState) -> list[Request]:
        for s in state.samples:
            self._samples.pop(s.request.request_id, None)
        return [s.request for s in state.samples if not s.request.status.is_finished]

    # ---- one step -------------------------------------------------------------------------------
    def process(self, updates: list[SequenceUpdate], runner_out: RunnerOutput) -> Processed:
        """Text, logprobs and finish reasons of the step's updates; one output per touched request. A failure
        while handling one request fails that request only."""
        done = Processed()
        touched: dict[str, RequestState] = {}
        for rid, found in runner_out.prompt_logprobs.items():
            if rid in self._samples:
                state = self._samples[rid][0]
                self._fill_prompt_logprobs(state, found)
                touched[state.request_id] = state
        for u in updates:
            if u.forked_from is not None:
                parent = self._samples.get(u.forked_from.request_id)
                if parent is None:
                    continue
                self._add_sample(parent[0], u.request)
            found = self._samples.get(u.request.request_id)
            if found is None:
                continue
            state, sample = found
            touched[state.request_id] = state
            if state.error:
                continue
            if u.request.prefill_only:
                sample.finish_reason = "stop"
                state.embedding = runner_out.pooled.get(u.request.request_id)
                if state.embedding is None:  # (the runner pools every prefill-only entry it completes)
                    state.error = "the model step returned no embedding for this request"
                continue
            try:
                if self._advance(state, sample, u, runner_out.sampled):
                    done.stopped.append(u.request)
            except BaseException as e:  # (native panics included: the detokenizer is Rust)
                if not is_request_fault(e):
                    raise
                logger.exception("request %s failed", state.request_id)
                state.error = f"{type(e).__name__}: {e}"
        now = time.monotonic()
        for state in touched.values():
            m = state.metrics
            if any(s.token_ids for s in state.samples):
                m.first_token_time = m.first_token_time or now
                m.last_token_time = now
            if state.error or state.finished:
                m.finished_time = now
            if state.error:
                done.aborted += self.abort(state.request_id)[1]
            elif state.finished:
                self.requests.pop(state.request_id, None)
                self._forget(state)
            done.outputs.append(state.output())
        return done

    def _advance(self, state: RequestState, sample: SampleState, u: SequenceUpdate, sampled: SamplerOutput) -> bool:
        """Take the update's tokens into the sample; True when one of them reached a stop string (the tokens after
        it are dropped, and the sequence is still live in the scheduler)."""
        if u.num_draft_tokens:
            self.spec_stats.num_drafts += 1
            self.spec_stats.num_draft_tokens += u.num_draft_tokens
            self.spec_stats.num_accepted_tokens += u.num_accepted_tokens
            if self.on_verified is not None:
                self.on_verified(u.request, u.num_draft_tokens, u.num_accepted_tokens)
        p = state.params
        for token, row in zip(u.token_ids, u.rows, strict=True):
            sample.token_ids.append(token)
            if sample.logprobs is not None:
                self._append_logprobs(sample, token, row, sampled, p.logprobs or 0)
            if token in u.request.stop_token_ids or token in u.request.eos_token_ids:
                continue  # it ended the sequence: no text of its own (the scheduler finished it)
            if sample.detokenizer is None:
                continue
            stop = sample.detokenizer.add_token(token, len(sample.token_ids) >= p.min_tokens)
            if stop is not None:
                sample.finish_reason, sample.stop_reason = "stop", stop
                return not u.request.status.is_finished
        if u.request.status.is_finished:
            if u.request.error:
                state.error = u.request.error
            sample.finish_reason = _FINISH_REASONS[u.request.status]
            sample.stop_reason = u.request.stop_reason
        return False

    def _append_logprobs(self, sample: SampleState, token: int, row: int, sampled: SamplerOutput, k: int) -> None:
        sample.cumulative_logprob += sampled.logprobs[row]
        entry = {token: Logprob(sampled.logprobs[row], sampled.ranks[row], self.decode_one(token))}
        for rank, (tid, lp) in enumerate(zip(sampled.top_ids[row][:k], sampled.top_logprobs[row][:k],
                                             strict=True) if k else (), start=1):
            entry.setdefault(tid, Logprob(lp, rank, self.decode_one(tid)))
        sample.logprobs.append(entry)

    def _fill_prompt_logprobs(self, state: RequestState, found: PromptLogprobs) -> None:
        if state.prompt_logprobs is None:
            return
        for i, (tid, lp, rank) in enumerate(zip(found.token_ids, found.logprobs, found.ranks, strict=True)):
            entry = {tid: Logprob(lp, rank, self.decode_one(tid))}
            for r, (t, v) in enumerate(zip(found.top_ids[i], found.top_logprobs[i], strict=True), start=1):
                entry.setdefault(t, Logprob(v, r, self.decode_one(t)))
            state.prompt_logprobs[found.first_position + i] = entry

    def decode_one(self, token_id: int) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode([token_id])
