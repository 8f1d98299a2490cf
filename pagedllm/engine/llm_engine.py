"""LLMEngine: add_request / step / abort over the scheduler, the KV cache manager and the model runner.

A step is schedule -> execute -> update (core/step.py): the scheduler picks the work, the runner runs the model and
samples, the scheduler changes every sequence's state on the sampled tokens, and the output processor turns the
changes into RequestOutputs (its stop strings are handed back to the scheduler). Beam search and the draft model
run the same three calls."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from functools import cached_property

from pagedllm.core.hybrid_kv_cache_manager import make_kv_cache_manager
from pagedllm.core.kv_groups import plan_kv_groups
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput
from pagedllm.core.step import RunnerOutput
from pagedllm.engine.args import EngineArgs
from pagedllm.engine.disk_tier import make_disk_tier
from pagedllm.engine.fault_isolation import execute_isolating_faults
from pagedllm.engine.kv_budget import draft_loaded_first, kv_budget
from pagedllm.engine.lora_registry import LoRARegistry, ReadLoRA, lora_cache_salt
from pagedllm.engine.output_processor import OutputProcessor, RequestState, SpecDecodeStats
from pagedllm.engine.placement import place
from pagedllm.engine.prompt_limits import check_text_length, max_token_chars
from pagedllm.engine.scoring import check_pair_length, tokenize_pair
from pagedllm.engine.speculative import make_speculator
from pagedllm.engine.step_budget import StepBudget
from pagedllm.engine.structured_steps import grammar_factory, token_bitmask
from pagedllm.faults import as_exception, is_request_fault
from pagedllm.lora.manager import LoRAManager
from pagedllm.lora.request import LoRARequest
from pagedllm.model.config import check_token_ids
from pagedllm.model.generation_config import generation_defaults
from pagedllm.model.hub import resolve_model_path
from pagedllm.model.kv_cache import kv_bytes_per_block, num_blocks_for_budget, resolve_kv_dtype
from pagedllm.model.loader import load_model
from pagedllm.model.pooling_config import pooling_config_for
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured.gate import GrammarGate
from pagedllm.templating.sandbox import render_chat_template
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def no_cache_salt(request_id: str, cache_salt: str | None) -> str:
    """A salt no other request shares: the prompt is computed in full (prompt_logprobs need every position's
    logits, and cached tokens are not recomputed)."""
    return f"{cache_salt or ''}\x00prompt_logprobs\x00{request_id}"


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        t0 = time.perf_counter()
        self.model_path = resolve_model_path(args.model)
        self.placement = placement = place(args)
        loaded = load_model(self.model_path, placement.dtype, quantization=placement.quantization)
        loaded.model.to(placement.device)
        draft = draft_loaded_first(placement, args.speculative_config, loaded.dtype)
        self.dtype = dtype = loaded.dtype  # "auto" is decided by the loader (it knows the weight format)
        self.args = args
        self.generation_defaults = generation_defaults(self.model_path, args.generation_config,
                                                       loaded.sampling_defaults)
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
        num_blocks = args.num_kv_blocks or num_blocks_for_budget(  # (a GPU's budget is profiled: only if needed)
            cfg, args.block_size, self.kv_dtype, kv_budget(args, placement, loaded.model, cfg, self.kv_dtype,
                                                           self.kv_groups, draft), self.kv_groups.group_size)
        self.kv = make_kv_cache_manager(num_blocks, args.block_size, self.kv_groups,
                                        enable_prefix_caching=args.enable_prefix_caching, kv_layout=args.kv_layout,
                                        max_model_len=self.max_model_len)
        self.scheduler = Scheduler(SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens,
                                                   self.max_model_len, args.enable_chunked_prefill,
                                                   policy=args.scheduling_policy, prefill_order=args.prefill_order,
                                                   max_loras=args.max_loras),
                                   self.kv)
        # the pooling runner: how prompts' hidden states become embeddings (None: the engine generates)
        self.pooling_config = pooling_config_for(args.runner, args.hf_overrides, self.model_path, self.tokenizer)
        self.step_budget = StepBudget(args.max_step_ms, args.max_num_batched_tokens)
        lora = LoRAManager(loaded.model, args.max_loras, args.max_lora_rank) if args.enable_lora else None
        self.loras = None if lora is None else LoRARegistry(lora, cfg, self._runs_adapter)
        self.runner = ModelRunner(loaded.model, self.model_config, num_blocks=num_blocks, block_size=args.block_size,
                                  kv_dtype=self.kv_dtype, attention_backend=placement.backend,
                                  device=placement.device,
                                  batch_invariant=args.batch_invariant, layout=self.kv_groups, seed=args.seed,
                                  pooling=self.pooling_config, lora=lora)
        if placement.device.type == "cuda" and not args.enforce_eager:
            self.runner.enable_decode_graphs(args.max_num_seqs, self.max_model_len, capture=True)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.num_steps = 0  # steps that ran the model
        self._slot_samples = [0, 0]  # used and allocated KV slots, summed over steps (mean utilisation)
        self.speculator = None
        if args.speculative_config is not None:
            self.speculator = make_speculator(args.speculative_config, dtype=dtype, num_blocks=num_blocks,
                                              block_size=args.block_size, attention_backend=args.attention_backend,
                                              vocab_size=self.model_config.vocab_size,
                                              max_model_len=self.max_model_len, batch_invariant=args.batch_invariant,
                                              **({"placement": placement, "loaded": draft}  # where we run
                                                 if placement.torch_path else {}))
            self.output_processor.on_verified = self.speculator.observe
        self._structured = None  # StructuredOutputManager, made on the first constrained request
        self.disk_tier = make_disk_tier(  # None: off
            args.kv_disk_cache_dir, args.kv_disk_cache_size, kv=self.kv, runner=self.runner,
            model_path=self.model_path, config=self.model_config, dtype=dtype, quantization=args.quantization,
            kv_cache_dtype=self.kv_cache_dtype_name(), layout=self.kv_groups)
        if self.disk_tier is not None:
            self.scheduler.kv_tier = self.disk_tier.coordinator
        self._grammar_gate = GrammarGate()  # requests whose grammar is still compiling
        logger.info("engine ready in %.1fs: %s, %s, %d KV blocks x %d tokens = %d tokens of KV capacity (KV %s, "
                    "%d bytes per token)", time.perf_counter() - t0, self.model_name, str(dtype).removeprefix("torch."),
                    num_blocks, args.block_size, num_blocks * args.block_size, self.kv_cache_dtype_name(),
                    self.kv_bytes_per_token())

    @property
    def task(self) -> str:
        """"score": a decoder reranker (scores pairs of texts), else "embed" (or a generator)."""
        return "score" if self.pooling_config is not None and self.pooling_config.score_tokens else "embed"

    def tokenize_pair(self, text_1: str, text_2: str, truncate_prompt_tokens: int | None = None) -> dict:
        return tokenize_pair(self.tokenizer, text_1, text_2, self.max_model_len, truncate_prompt_tokens)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        """The engine for args.model: an EncoderEngine for a BERT-family encoder (no KV cache, no generation;
        engine/encoder_engine.py), else an LLMEngine."""
        from pagedllm.model.encoder_config import is_encoder

        path = resolve_model_path(args.model)
        if is_encoder(path):
            from pagedllm.engine.encoder_engine import EncoderEngine

            return EncoderEngine(args, path)  # type: ignore[return-value]  (the same add/step/abort interface)
        return cls(args)

    # ---- requests in ---------------------------------------------------------------------------
    @cached_property
    def chars_per_token(self) -> int:
        """The most characters one token spells: bounds a text's length before it is tokenized."""
        return max_token_chars(self.tokenizer)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is not None:  # (without one, encode below says so)
                check_text_length(prompt, self.max_model_len, self.chars_per_token)
            try:
                ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            except BaseException as e:  # a panic in the Rust tokenizer fails this request, not the process
                if isinstance(e, Exception) or not is_request_fault(e):
                    raise
                raise as_exception(e, "tokenizing the prompt") from e
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
        """kwargs: chat_template, add_generation_prompt, continue_final_message, chat_template_kwargs, tools.
        Rendered in the template sandbox (a time, memory and output limit; templating/sandbox.py)."""
        return render_chat_template(self.tokenizer, messages, **kwargs)

    @property
    def runner_name(self) -> str:
        return self.args.runner

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | PoolingParams, *,
                    cache_salt: str | None = None, arrival_time: float | None = None,
                    prompt_token_ids: list[int] | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> None:
        """`prompt_token_ids`: the text prompt already tokenized (the server does it off the loop thread).
        `priority`: lower first under the priority scheduling policy. PoolingParams: an embedding request (the
        pooling runner only), SamplingParams: a generation request (the generate runner only). `lora_request`:
        the adapter it runs with (loaded on first use; LLM(enable_lora=True))."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        pooling = isinstance(params, PoolingParams)
        self.check_runner(pooling)
        lora = None if lora_request is None else self.add_lora(lora_request)
        cache_salt = lora_cache_salt(cache_salt, lora)
        lora_id = None if lora is None else lora.key
        if pooling:
            self._add_pooling_request(request_id, prompt, params, cache_salt, arrival_time, prompt_token_ids,
                                      priority, lora_id)
            return
        params.validate()
        params.prepare(self.tokenizer, self.eos_token_ids, self.model_config.vocab_size)
        ids = self.tokenize(prompt if prompt_token_ids is None else prompt_token_ids)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens:]
        max_tokens = self.scheduler.check_fits(len(ids), params.max_tokens)
        if params.prompt_logprobs is not None:
            cache_salt = no_cache_salt(request_id, cache_salt)
        state = RequestState(request_id, prompt if isinstance(prompt, str) else None, ids, params, max_tokens,
                             cache_salt, lora_id=lora_id)
        if params.structured_outputs is not None:
            state.grammar = self.structured_outputs.submit(params.structured_outputs)
            if state.grammar.done() and state.grammar.exception() is not None:
                raise state.grammar.exception()  # a cached compile error: a GrammarError (a ValueError)
        new_grammar = None if state.grammar is None else grammar_factory(lambda: self.structured_outputs, state.grammar, params)
        req = self.output_processor.add_request(state, arrival_time, priority=priority, new_grammar=new_grammar)
        if state.grammar is not None and not state.grammar.done():
            self._grammar_gate.hold(state.grammar, (state, req))  # built complete; scheduled once compiled
        else:
            self.scheduler.add_request(req)

    # ---- LoRA adapters ---------------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest, read: ReadLoRA | None = None):
        """Load an adapter (once per name; LoadedLoRA). ValueError where LoRA is off or the adapter cannot load.
        read: its files as read_lora read them (else they are read here)."""
        return self._lora_registry().resolve(lora_request, read)

    def read_lora(self, lora_request: LoRARequest) -> ReadLoRA:
        """Read and check an adapter's files for add_lora; safe from another thread while the engine steps."""
        return self._lora_registry().read(lora_request)

    def _lora_registry(self) -> LoRARegistry:
        if self.loras is None:
            raise ValueError("LoRA is not enabled on this engine (LLM(enable_lora=True), `--enable-lora`)")
        return self.loras

    def remove_lora(self, name: str) -> bool:
        """Unload by name (its running requests finish with it); False if no such adapter is loaded."""
        return self.loras is not None and self.loras.remove(name)

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.loras is None else [lo.request for lo in self.loras.loaded.values()]

    def _runs_adapter(self, key: int) -> bool:
        """A live request (queued, running, or waiting for its grammar to compile) runs adapter `key`."""
        return any(state.lora_id == key for state in self.requests.values())

    def check_runner(self, pooling: bool) -> None:
        """ValueError naming the loaded runner when the request is for the other one (an engine runs one)."""
        if pooling != (self.pooling_config is not None):
            wanted, other = ("embedding", "pooling") if pooling else ("generation", "generate")
            raise ValueError(f"this engine runs the {self.runner_name!r} runner, which does not take {wanted} "
                             f"requests (start it with runner={other!r}, `--runner {other}`)")

    def _add_pooling_request(self, request_id: str, prompt: str | list[int], params: PoolingParams,
                             cache_salt: str | None, arrival_time: float | None, prompt_token_ids: list[int] | None,
                             priority: int, lora_id: int | None) -> None:
        """Prefill only: the scheduler ends it once its prompt is computed, the runner pools it. A reranker's
        prompt is a pair {"prompt_token_ids", ...} from tokenize_pair."""
        if isinstance(prompt, dict) != (self.task == "score"):
            raise ValueError("this model is a reranker: it scores pairs of texts (LLM.score, /v1/score, /v1/rerank) "
                             "and makes no embeddings" if self.task == "score" else
                             "this model makes embeddings: it takes single texts")
        params.validate(None if self.task == "score" else self.model_config.hidden_size)
        if self.task == "score" and params.dimensions is not None:
            raise ValueError("dimensions: a reranker's output is one score, not an embedding")
        if isinstance(prompt, dict):
            ids = self.tokenize(prompt.get("prompt_token_ids") or [])
            check_pair_length(len(ids), self.max_model_len)
            prompt = ids
        else:
            ids = params.truncated(self.tokenize(prompt if prompt_token_ids is None else prompt_token_ids),
                                   self.max_model_len)
        if self.pooling_config.needs_every_token:  # the prefix cache would skip rows the pooling reads
            cache_salt = no_cache_salt(request_id, cache_salt)
        state = RequestState(request_id, prompt if isinstance(prompt, str) else None, ids, params, 0, cache_salt,
                             lora_id=lora_id)
        self.scheduler.add_request(self.output_processor.add_request(state, arrival_time, priority=priority))

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
                failed.append(self._abort(state.request_id, str(err)).output())
        return failed

    @property
    def requests(self) -> dict[str, RequestState]:
        return self.output_processor.requests

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            self._abort(rid)

    def _abort(self, request_id: str, error: str | None = None) -> RequestState | None:
        state, live = self.output_processor.abort(request_id, error)
        if self.runner.pooler is not None:
            self.runner.pooler.forget([r.request_id for r in live])
        self.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
        return state

    # ---- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """schedule -> execute -> update, then the outputs of every request the step touched."""
        failed_grammars = self._admit_compiled() if len(self._grammar_gate) else []
        decoding = sum(r.num_tokens - r.num_computed_tokens == 1 for r in self.scheduler.running)
        out = self.scheduler.schedule(self.step_budget.prompt_budget(decoding, self.scheduler.num_streams))
        if self.disk_tier is not None:
            self.disk_tier.before_execute()  # before the model writes into blocks the pool just evicted
            if out.is_empty:
                self.disk_tier.after_step(idle=True)  # a request may be waiting for its blocks from disk
        if self.loras is not None and self.loras.has_retired:
            self.loras.collect()
        if out.is_empty:
            return failed_grammars
        self.num_steps += 1
        t0 = time.monotonic()
        self.output_processor.mark_scheduled(out.scheduled, t0)
        self._slot_samples[0] += self.kv.used_slots
        self._slot_samples[1] += self.kv.num_used_blocks() * self.kv.block_size
        runner_out, failed = self._execute_isolating_faults(out)
        decode_rows = sum(s.num_new_tokens for s in out.scheduled if s.samples and s.num_new_tokens == s.num_logits)
        prompt_tokens = sum(s.num_new_tokens for s in out.scheduled) - decode_rows
        self.step_budget.observe(prompt_tokens, decode_rows, time.monotonic() - t0)
        updates = self.scheduler.update_from_output(out, runner_out.sampled)
        processed = self.output_processor.process(updates, runner_out)
        self.scheduler.finish_requests(processed.stopped, RequestStatus.FINISHED_STOPPED)
        self.scheduler.finish_requests(processed.aborted, RequestStatus.FINISHED_ABORTED)
        if self.speculator is not None:
            self.scheduler.update_draft_token_ids(self.speculator.propose(self.scheduler.running, self._draft_room))
        if self.disk_tier is not None:
            self.disk_tier.after_step()
        return failed_grammars + [state.output() for state in failed] + processed.outputs

    def _draft_room(self, request: Request) -> int:
        """Draft tokens a request can take: verification adds one token of its own, and neither may pass
        max_tokens or the context."""
        if request.max_tokens is None or request.beam is not None:
            return 0
        return min(request.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens) - 1

    def _execute(self, scheduled: list[ScheduledRequest], block_copies: list[tuple[int, int]]) -> RunnerOutput:
        return self.runner.execute(scheduled, block_copies, token_bitmask(lambda: self.structured_outputs, scheduled))

    def _execute_isolating_faults(self, out: SchedulerOutput) -> tuple[RunnerOutput, list[RequestState]]:
        """The step's rows, with the requests that failed it by themselves (engine/fault_isolation.py) aborted
        (blocks freed; their rows are placeholders the scheduler skips)."""
        failed: dict[str, str] = {}

        def fail(entry: ScheduledRequest, error: str) -> None:
            found = self.output_processor.sample_of(entry.request)
            if found is not None:
                failed[found[0].request_id] = error

        result = execute_isolating_faults(lambda group: self._execute(group, out.block_copies), out.scheduled, fail)
        states = [self._abort(rid, error) for rid, error in failed.items()]  # the scheduler skips them now
        return result, [st for st in states if st is not None]

    # ---- introspection ---------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        """Requests waiting to run, those reading their prefix from the disk tier included."""
        loading = self.disk_tier.coordinator.num_loading if self.disk_tier is not None else 0
        return len(self.scheduler.waiting) + loading

    def wait_for_kv_loads(self) -> bool:
        """Wait for a disk-tier load (beam search, when nothing else can run); False if none is in flight or
        done and waiting to go back to the queue."""
        if self.disk_tier is None or not self.disk_tier.coordinator.num_loading:
            return False
        if self.disk_tier.coordinator.loads:  # (else they are done: the next schedule() takes them)
            self.disk_tier.before_execute()  # starts the loads the last schedule() began
            self.disk_tier.after_step(idle=True)
        return True

    def close(self) -> None:
        """Shutdown: write the cached KV blocks the disk tier lacks, so that a restart finds them."""
        if self.disk_tier is not None:
            self.disk_tier.close()

    def reset_prefix_cache(self, reset_external: bool = False) -> bool:
        """Forget every cached block (False, nothing changed, while requests hold blocks); reset_external: also
        delete the disk tier's entries."""
        if not self.kv.reset_prefix_cache():
            return False
        if reset_external and self.disk_tier is not None:
            self.disk_tier.clear()
        return True

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
        stats["num_cached_free_blocks"] = self.kv.block_pool.num_cached_free_blocks()  # free, still holding a prefix
        used, allocated = self._slot_samples  # sampled at every step, after scheduling
        stats["mean_slot_utilisation"] = used / allocated if allocated else 0.0
        spec = self.output_processor.spec_stats
        stats["spec_decode_num_draft_tokens"] = spec.num_draft_tokens
        stats["spec_decode_num_accepted_tokens"] = spec.num_accepted_tokens
        if self.disk_tier is not None:
            stats.update(self.disk_tier.stats())
        return stats

