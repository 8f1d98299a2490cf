"""LLMEngine: add_request / step / abort over the scheduler, the KV cache manager and the model runner."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch

from pagedllm.core.hybrid_kv_cache_manager import make_kv_cache_manager
from pagedllm.core.kv_groups import plan_kv_groups
from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler import ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput
from pagedllm.dtypes import resolve_dtype
from pagedllm.engine.args import EngineArgs, parse_bytes
from pagedllm.engine.chat_template import render_chat_template
from pagedllm.engine.generation_config import generation_defaults
from pagedllm.engine.kv_snapshot import num_cached_free_blocks
from pagedllm.engine.output_processor import OutputProcessor, RequestState, SamplingPlan, SpecDecodeStats
from pagedllm.engine.prompt_logprobs import collect_prompt_logprobs, no_cache_salt
from pagedllm.engine.speculative import make_speculator
from pagedllm.model.config import check_token_ids
from pagedllm.model.hub import resolve_model_path
from pagedllm.model.kv_cache import kv_bytes_per_block, num_blocks_for_budget, resolve_kv_dtype
from pagedllm.model.loader import load_model
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured.backend import allow_token
from pagedllm.structured.gate import GrammarGate
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.sampler import Sampler, TokenBitmask

logger = logging.getLogger(__name__)



class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        t0 = time.perf_counter()
        dtype = resolve_dtype(args.dtype)
        self.model_path = resolve_model_path(args.model)
        loaded = load_model(self.model_path, dtype, quantization=args.quantization)
        self.args = args
        self.generation_defaults = generation_defaults(self.model_path, args.generation_config)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.eos_token_ids = set(loaded.eos_token_ids)
        max_pos = self.model_config.max_position_embeddings
        self.max_model_len = min(args.max_model_len or max_pos, max_pos)

        self.kv_dtype = resolve_kv_dtype(args.kv_cache_dtype, dtype)
        cfg = self.model_config
        self.kv_groups = plan_kv_groups([cfg.layer_window(i) for i in range(cfg.num_layers)], self.max_model_len,
                                        hybrid=args.hybrid_kv_cache and args.kv_layout == "paged")
        num_blocks = args.num_kv_blocks or num_blocks_for_budget(
            cfg, args.block_size, self.kv_dtype, parse_bytes(args.kv_cache_memory), self.kv_groups.group_size)
        self.kv = make_kv_cache_manager(num_blocks, args.block_size, self.kv_groups,
                                        enable_prefix_caching=args.enable_prefix_caching, kv_layout=args.kv_layout,
                                        max_model_len=self.max_model_len)
        self.scheduler = Scheduler(SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens,
                                                   self.max_model_len, args.enable_chunked_prefill), self.kv)
        self.runner = ModelRunner(loaded.model, self.model_config, num_blocks, args.block_size,
                                  self.kv_dtype, args.attention_backend, args.batch_invariant, self.kv_groups)
        self.sampler = Sampler(args.seed)
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler, self.eos_token_ids,
                                                self.max_model_len)
        self._slot_samples = [0, 0]  # used and allocated KV slots, summed over steps (mean utilisation)
        self.speculator = None
        if args.speculative_config is not None:
            self.speculator = make_speculator(args.speculative_config, dtype=dtype, num_blocks=num_blocks,
                                              block_size=args.block_size, attention_backend=args.attention_backend,
                                              vocab_size=self.model_config.vocab_size)
            self.output_processor.on_verified = self.speculator.observe
        self._structured = None  # StructuredOutputManager, made on the first constrained request
        self._grammar_gate = GrammarGate()  # requests whose grammar is still compiling
        logger.info("engine ready in %.1fs: %s, %s, %d KV blocks x %d tokens = %d tokens of KV capacity (KV %s, "
                    "%d bytes per token)", time.perf_counter() - t0, self.model_name, str(dtype).removeprefix("torch."),
                    num_blocks, args.block_size, num_blocks * args.block_size, self.kv_cache_dtype_name(),
                    self.kv_bytes_per_token())

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

    def apply_chat_template(self, messages: list[dict], **kwargs) -> str:
        """kwargs: chat_template, add_generation_prompt, continue_final_message, chat_template_kwargs."""
        return render_chat_template(self.tokenizer, messages, **kwargs)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    cache_salt: str | None = None, arrival_time: float | None = None,
                    prompt_token_ids: list[int] | None = None) -> None:
        """`prompt_token_ids`: the text prompt already tokenized (the server does it off the loop thread)."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params.validate()
        params.prepare(self.tokenizer, self.eos_token_ids, self.model_config.vocab_size)
        ids = self.tokenize(prompt if prompt_token_ids is None else prompt_token_ids)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens:]
        max_tokens = self.scheduler.check_fits(len(ids), params.max_tokens)
        if params.prompt_logprobs is not None:
            cache_salt = no_cache_salt(request_id, cache_salt)
        state = RequestState(request_id, prompt if isinstance(prompt, str) else None, ids, params, max_tokens,
                             cache_salt)
        if params.structured_outputs is not None:
            state.grammar = self.structured_outputs.submit(params.structured_outputs)
            if state.grammar.done() and state.grammar.exception() is not None:
                raise state.grammar.exception()  # a cached compile error: a GrammarError (a ValueError)
        req = self.output_processor.add_request(state, arrival_time)
        if state.grammar is not None and not state.grammar.done():
            self._grammar_gate.hold(state.grammar, (state, req))
        else:
            self.scheduler.add_request(req)

    # ---- structured outputs ----------------------------------------------------------------------
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
            if state.request_id not in self.requests:
                continue  # aborted while compiling
            if err is None:
                self.scheduler.add_request(req)
            else:
                failed.append(self.output_processor.abort(state.request_id, str(err)).output())
        return failed

    def _token_bitmask(self, plan: SamplingPlan) -> TokenBitmask | None:
        """The tokens each constrained row may take next (unconstrained rows are not in it); a sample with draft
        tokens gets one row per draft prefix, its matcher walked along the drafts and back."""
        rows, walks, row, extra = [], [], 0, []
        for state, sample, drafts in plan.samples:
            if state.grammar is not None and (sample.gate is None or sample.gate.masked):
                if sample.matcher is None:  # each sample (n > 1) walks the grammar with its own matcher
                    sample.matcher = self.structured_outputs.matcher(state.grammar.result())
                if sample.gate is not None and sample.gate.extra_token is not None:
                    extra.append((len(rows), sample.gate.extra_token))  # the model may open its reasoning
                rows.extend(range(row, row + len(drafts) + 1))
                walks.append((sample.matcher, drafts))
            row += len(drafts) + 1
        if not rows:
            return None
        bitmask = self.structured_outputs.bitmask(walks)
        for mask_row, token in extra:
            allow_token(bitmask, mask_row, token)
        return TokenBitmask(rows, bitmask)

    @property
    def requests(self) -> dict[str, RequestState]:
        return self.output_processor.requests

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            self.output_processor.abort(rid)

    # ---- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        failed_grammars = self._admit_compiled() if len(self._grammar_gate) else []
        out = self.scheduler.schedule()
        if out.is_empty:
            return failed_grammars
        self.output_processor.mark_scheduled(out.scheduled, time.monotonic())
        self._slot_samples[0] += self.kv.used_slots
        self._slot_samples[1] += self.kv.num_used_blocks() * self.kv.block_size
        logits, failed = self._execute_isolating_faults(out)
        outputs = failed_grammars + [state.output() for state in failed]
        sampling = self.scheduler.update_after_step(out)
        plan = self.output_processor.plan(sampling)
        if plan.rows:
            identity = plan.logit_rows == list(range(len(logits)))  # no forks: skip a [rows, vocab] copy
            sampled = self.sampler(logits if identity else logits[plan.logit_rows], plan.rows,
                                   self._token_bitmask(plan))
            outputs += self.output_processor.process(plan, sampled)
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self._draft_room)
        return outputs

    def _draft_room(self, request) -> int:
        """Draft tokens a request can take: verification adds one token of its own, and neither may pass
        max_tokens or the context."""
        found = self.output_processor.sample_of(request)
        if found is None:
            return 0
        return min(found[0].max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens) - 1

    def run_model(self, out: SchedulerOutput) -> tuple[list[ScheduledRequest], torch.Tensor]:
        """Run the model on a scheduled batch and advance the scheduler. Returns the entries that sample, in
        the order of their logits rows, and those logits [rows, vocab]."""
        logits = self._run(out.scheduled, out.block_copies)
        return self.scheduler.update_after_step(out), logits

    def _run(self, scheduled: list[ScheduledRequest], block_copies: list[tuple[int, int]]) -> torch.Tensor:
        per_request = [self.kv.get_group_block_ids(s.request) for s in scheduled]
        block_tables = [[t[g] for t in per_request] for g in range(self.kv_groups.num_groups)]
        logits = self.runner.execute(scheduled, block_tables, block_copies)
        if self.output_processor.num_prompt_logprobs:
            collect_prompt_logprobs(self.runner.model, self.runner.last_hidden, scheduled,
                                    self.output_processor.prompt_logprobs_of, self.output_processor.decode_one)
        return logits

    def _execute_isolating_faults(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[RequestState]]:
        """Run the step; if it fails, rerun its requests in halves (K/V writes are idempotent: same tokens,
        same slots) until each failing request runs alone, so only the requests that fail by themselves fail.
        Returns the logits of the surviving sampling rows and the failed requests (aborted, blocks freed)."""
        try:
            return self._run(out.scheduled, out.block_copies), []
        except Exception:
            logger.exception("model step of %d requests failed; retrying them in smaller groups", len(out.scheduled))
        rows: dict[int, torch.Tensor] = {}  # id(entry) -> its logits rows
        failed: dict[str, str] = {}

        def run(group: list[ScheduledRequest]) -> None:
            try:
                logits = self._run(group, out.block_copies).clone()
            except Exception as e:
                if len(group) > 1:
                    run(group[:len(group) // 2])
                    run(group[len(group) // 2:])
                    return
                logger.exception("request %s fails the model step alone", group[0].request.request_id)
                found = self.output_processor.sample_of(group[0].request)
                if found is not None:
                    failed[found[0].request_id] = f"model step failed: {type(e).__name__}: {e}"
                return
            offset = 0
            for s in group:
                rows[id(s)] = logits[offset:offset + s.num_logits]
                offset += s.num_logits

        run(out.scheduled)
        # Before update_after_step: a failed request's entries are skipped from now on.
        states = [self.output_processor.abort(rid, error) for rid, error in failed.items()]
        kept = [rows[id(s)] for s in out.scheduled if s.samples and id(s) in rows and s.request.status ==
                RequestStatus.RUNNING]
        logits = torch.cat(kept) if kept else torch.empty(0, self.runner.vocab_size)
        return logits, [st for st in states if st is not None]

    # ---- introspection ---------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def reset_stats(self) -> None:
        """Start new measurements: the peak of used blocks (from the blocks in use now) and the mean slot
        utilisation. Counters (prefix cache, preemptions) keep counting: take differences of those."""
        self.kv.reset_peak()
        self._slot_samples = [0, 0]
        self.output_processor.spec_stats = SpecDecodeStats()

    def spec_decode_stats(self) -> dict:
        """Draft tokens proposed and accepted, acceptance rate, mean tokens emitted per verification."""
        return self.output_processor.spec_stats.as_dict()

    def kv_cache_dtype_name(self) -> str:
        return str(self.kv_dtype).removeprefix("torch.")

    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token over all layers, scales included."""
        return kv_bytes_per_block(self.model_config, self.args.block_size, self.kv_dtype) // self.args.block_size

    def kv_cache_stats(self) -> dict:
        stats = dict(self.kv.stats())
        stats["kv_cache_dtype"] = self.kv_cache_dtype_name()
        stats["kv_bytes_per_token"] = self.kv_bytes_per_token()
        stats["num_preemptions"] = self.scheduler.num_preemptions
        stats["num_cached_free_blocks"] = num_cached_free_blocks(self.kv)  # free, still holding a prefix
        used, allocated = self._slot_samples  # sampled at every step, after scheduling
        stats["mean_slot_utilisation"] = used / allocated if allocated else 0.0
        spec = self.output_processor.spec_stats
        stats["spec_decode_num_draft_tokens"] = spec.num_draft_tokens
        stats["spec_decode_num_accepted_tokens"] = spec.num_accepted_tokens
        return stats
