"""LLMEngine: add_request / step / abort over the scheduler, the KV cache manager and the model runner."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedllm.engine.args import EngineArgs, parse_bytes
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.model.config import check_token_ids
from pagedllm.model.kv_cache import num_blocks_for_budget
from pagedllm.model.loader import load_model
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured.gate import GrammarGate
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.sampler import Sampler, SamplingRow, TokenBitmask

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(eq=False)
class Sequence:
    """One of the n outputs of a request: its scheduler-side Request plus text and logprobs."""

    request: Request
    index: int
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    logprobs: list[dict[int, Logprob]] | None = None  # only when the request asked for logprobs
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    matcher: Any = None  # structured outputs: this sample's grammar matcher

    def output(self) -> CompletionOutput:
        cumulative = self.cumulative_logprob if self.logprobs is not None else None
        return CompletionOutput(self.index, self.detokenizer.text, list(self.request.output_token_ids),
                                cumulative, self.logprobs, self.finish_reason,
                                self.stop_reason)


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False  # n > 1: the other samples fork from the first once the prompt is prefilled
    error: str | None = None
    grammar: Future | None = None  # structured outputs: the compiled grammar

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.finish_reason for s in self.seqs)

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [s.output() for s in self.seqs], self.finished,
                             self.seqs[0].request.num_cached_tokens, self.error)


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        t0 = time.perf_counter()
        dtype = "bfloat16" if args.dtype == "auto" else args.dtype
        loaded = load_model(args.model, dtype)
        self.args = args
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.eos_token_ids = set(loaded.eos_token_ids)
        max_pos = self.model_config.max_position_embeddings
        self.max_model_len = min(args.max_model_len or max_pos, max_pos)

        num_blocks = args.num_kv_blocks or num_blocks_for_budget(
            self.model_config, args.block_size, _DTYPES[dtype], parse_bytes(args.kv_cache_memory))
        self.kv = KVCacheManager(num_blocks, args.block_size, enable_prefix_caching=args.enable_prefix_caching,
                                 kv_layout=args.kv_layout, max_model_len=self.max_model_len)
        self.scheduler = Scheduler(SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens,
                                                   self.max_model_len, args.enable_chunked_prefill), self.kv)
        self.runner = ModelRunner(loaded.model, self.model_config, num_blocks, args.block_size,
                                  _DTYPES[dtype], args.attention_backend)
        self.sampler = Sampler(args.seed)
        self.requests: dict[str, RequestState] = {}
        self._seq_of: dict[int, Sequence] = {}  # id(Request) -> Sequence
        self._state_of: dict[int, RequestState] = {}  # id(Request) -> RequestState
        self._slot_samples = [0, 0]  # used and allocated KV slots, summed over steps (mean utilisation)
        self._structured = None  # StructuredOutputManager, made on the first constrained request
        self._grammar_gate = GrammarGate()
        logger.info("engine ready in %.1fs: %s, %s, %d KV blocks x %d tokens = %d tokens of KV capacity",
                    time.perf_counter() - t0, self.model_name, dtype, num_blocks, args.block_size,
                    num_blocks * args.block_size)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    # ---- requests in ---------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            bos = self.tokenizer.bos_token_id
            if bos is not None and len(ids) > 1 and ids[0] == ids[1] == bos:
                ids = ids[1:]  # a chat template already put a BOS in the text
            return ids
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        check_token_ids(ids, self.model_config.vocab_size)
        return ids

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model {self.model_name} has no chat template")
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    cache_salt: str | None = None, arrival_time: float | None = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params.validate()
        ids = self.tokenize(prompt)
        self.scheduler.check_fits(len(ids))
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        state = RequestState(request_id, prompt if isinstance(prompt, str) else None, ids, params, max_tokens)
        if params.structured_outputs is not None:
            state.grammar = self.structured_outputs.submit(params.structured_outputs)
            if state.grammar.done() and state.grammar.exception() is not None:
                raise state.grammar.exception()  # a cached compile error: a GrammarError (ValueError)
        req = Request(request_id, ids, max_tokens, cache_salt)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        self._add_sequence(state, req, 0)
        if state.grammar is not None and not state.grammar.done():
            self._grammar_gate.hold(state.grammar, (state, req))
        else:
            self.scheduler.add_request(req)
        self.requests[request_id] = state

    @property
    def structured_outputs(self):
        """The StructuredOutputManager (compile thread, grammar cache), made on first use."""
        if self._structured is None:
            from pagedllm.structured.manager import StructuredOutputManager

            self._structured = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                       sorted(self.eos_token_ids),
                                                       self.args.structured_outputs_backend)
        return self._structured

    def _admit_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar compiled go to the scheduler; a failed compile fails its request."""
        if not self.scheduler.running and not self.scheduler.waiting:
            self._grammar_gate.wait(0.01)  # nothing else to do: do not spin on the compile
        failed = []
        for (state, req), err in self._grammar_gate.release():
            if err is None:
                self.scheduler.add_request(req)
                continue
            state.error = str(err)
            for s in state.seqs:
                s.finish_reason = "abort"
            self.requests.pop(state.request_id, None)
            self._seq_of.pop(id(req), None)
            self._state_of.pop(id(req), None)
            failed.append(state.output())
        return failed

    def _add_sequence(self, state: RequestState, req: Request, index: int) -> Sequence:
        p = state.params
        gen = None if p.seed is None else torch.Generator().manual_seed(p.seed + index)
        seq = Sequence(req, index, IncrementalDetokenizer(self.tokenizer, state.prompt_token_ids, p.stop,
                                                          p.skip_special_tokens),
                       gen, [] if p.logprobs is not None else None)
        state.seqs.append(seq)
        self._seq_of[id(req)] = seq
        self._state_of[id(req)] = state
        return seq

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            state = self.requests.pop(rid, None)
            if state is None:
                continue
            for seq in state.seqs:
                if not seq.finish_reason:
                    seq.finish_reason = "abort"
            if self._grammar_gate.drop((state, state.seqs[0].request)):  # never reached the scheduler
                self._seq_of.pop(id(state.seqs[0].request), None)
                self._state_of.pop(id(state.seqs[0].request), None)
                continue
            self._release(state, RequestStatus.FINISHED_ABORTED)

    def _release(self, state: RequestState, status: RequestStatus) -> None:
        reqs = [s.request for s in state.seqs if not s.request.status.is_finished]
        self.scheduler.finish_requests(reqs, status)
        for s in state.seqs:
            self._seq_of.pop(id(s.request), None)
            self._state_of.pop(id(s.request), None)

    # ---- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        failed = self._admit_compiled() if len(self._grammar_gate) else []
        out = self.scheduler.schedule()
        if out.is_empty:
            return failed
        kv = self.kv.stats()
        self._slot_samples[0] += kv["used_slots"]
        self._slot_samples[1] += kv["allocated_slots"]
        ready, logits = self.run_model(out)
        touched: dict[int, RequestState] = {}
        rows: list[SamplingRow] = []
        row_seqs: list[Sequence] = []
        row_logit: list[int] = []
        for i, req in ready:
            state = self._state_of[id(req)]
            touched[id(state)] = state
            seqs = [self._seq_of[id(req)]]
            if state.params.n > 1 and not state.forked:
                seqs += self._fork_samples(state, req)
            for seq in seqs:
                rows.append(SamplingRow(state.params, state.prompt_token_ids, seq.request.output_token_ids,
                                        seq.generator))
                row_seqs.append(seq)
                row_logit.append(i)
        if rows:
            identity = row_logit == list(range(len(logits)))  # no forks this step: skip a [rows, vocab] copy
            sampled = self.sampler(logits if identity else logits[row_logit], rows, self._token_bitmask(row_seqs))
            for j, seq in enumerate(row_seqs):
                state = self._state_of[id(seq.request)]
                try:
                    self._append_token(state, seq, sampled, j)
                except Exception as e:  # one request's failure must not stop the others
                    logger.exception("request %s failed", state.request_id)
                    state.error = f"{type(e).__name__}: {e}"
                    for s in state.seqs:
                        s.finish_reason = s.finish_reason or "abort"
        outputs = failed
        for state in touched.values():
            if state.error or state.finished:
                self.requests.pop(state.request_id, None)
                self._release(state, RequestStatus.FINISHED_STOPPED)
            outputs.append(state.output())
        return outputs

    def run_model(self, out: SchedulerOutput) -> tuple[list[tuple[int, Request]], torch.Tensor]:
        """Run the model on a scheduled batch. Returns (logits row, request) for the requests whose last token now
        has logits, and those logits [rows, vocab]."""
        scheduled = out.scheduled
        block_tables = [self.kv.get_block_ids(s.request) for s in scheduled]
        sample_rows = [i for i, s in enumerate(scheduled)
                       if s.request.num_computed_tokens + s.num_new_tokens == s.request.num_tokens]
        logits = self.runner.execute(scheduled, block_tables, out.block_copies, sample_rows)
        self.scheduler.update_after_step(out)
        return [(row, scheduled[i].request) for row, i in enumerate(sample_rows)], logits

    def _token_bitmask(self, seqs: list[Sequence]) -> TokenBitmask | None:
        """The tokens each constrained sample may take next (unconstrained rows are not in it)."""
        rows, matchers = [], []
        for j, seq in enumerate(seqs):
            state = self._state_of[id(seq.request)]
            if state.grammar is None:
                continue
            if seq.matcher is None:  # each sample (n > 1) walks the grammar with its own matcher
                seq.matcher = self.structured_outputs.matcher(state.grammar.result())
            rows.append(j)
            matchers.append(seq.matcher)
        return TokenBitmask(rows, self.structured_outputs.bitmask(matchers)) if rows else None

    def _fork_samples(self, state: RequestState, parent: Request) -> list[Sequence]:
        """n > 1: the other samples share the prefilled prompt's blocks (copy-on-write later)."""
        state.forked = True
        children = []
        for index in range(1, state.params.n):
            child = Request(f"{state.request_id}#{index}", state.prompt_token_ids, state.max_tokens,
                            parent.cache_salt, parent.arrival_time)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            self.kv.fork(parent, child)
            self.scheduler.add_running(child, after=parent)
            children.append(self._add_sequence(state, child, index))
        return children

    def _append_token(self, state: RequestState, seq: Sequence, sampled, j: int) -> None:
        token = sampled.token_ids[j]
        req = seq.request
        req.append_output_token(token)
        if seq.matcher is not None and not seq.matcher.accept(token):
            raise RuntimeError(f"structured outputs: the grammar rejected token {token} (an empty mask?)")
        if seq.logprobs is not None:
            seq.cumulative_logprob += sampled.logprobs[j]
            entry = {token: Logprob(sampled.logprobs[j], sampled.ranks[j], self._decode_one(token))}
            k = state.params.logprobs or 0
            if k:
                for rank, (tid, lp) in enumerate(zip(sampled.top_ids[j][:k], sampled.top_logprobs[j][:k],
                                                     strict=True), start=1):
                    entry.setdefault(tid, Logprob(lp, rank, self._decode_one(tid)))
            seq.logprobs.append(entry)
        p = state.params
        if token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif not p.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif (stop := seq.detokenizer.add_token(token)) is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop
        elif seq.matcher is not None and seq.matcher.is_terminated():
            seq.finish_reason = "stop"  # the grammar is complete (its stop token was taken or ignore_eos is set)
        elif req.num_output_tokens >= state.max_tokens or req.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason:
            status = (RequestStatus.FINISHED_LENGTH if seq.finish_reason == "length"
                      else RequestStatus.FINISHED_STOPPED)
            self.scheduler.finish_requests([req], status)

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # ---- introspection ---------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def kv_cache_stats(self) -> dict:
        stats = dict(self.kv.stats())
        stats["num_preemptions"] = self.scheduler.num_preemptions
        used, allocated = self._slot_samples  # sampled at every step, after scheduling
        stats["mean_slot_utilisation"] = used / allocated if allocated else 0.0
        return stats
