"""EncoderEngine: LLMEngine's add_request / step / abort for bidirectional encoders (BERT-family embedders and
cross-encoders), so that LLM(..., runner="pooling"), the AsyncEngine and the server run them unchanged.

An encoder needs no paged KV cache: it reads a prompt once, every token attending to every other, and generates
nothing, so there is no K/V to keep between steps, nothing to share by prefix and nothing to preempt. A step takes
waiting requests in order until their tokens fill max_num_batched_tokens (one longer prompt runs alone), runs them
as one flat batch (each sequence attends to itself only: a request's result does not depend on its neighbours),
pools each sequence and finishes it."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property

import torch

from pagedllm.engine.args import EngineArgs
from pagedllm.engine.prompt_limits import check_text_length, max_token_chars
from pagedllm.engine.scoring import check_pair_length, tokenize_pair
from pagedllm.faults import as_exception, is_request_fault
from pagedllm.kernels import KernelMode, forward_context
from pagedllm.model.config import check_token_ids
from pagedllm.model.encoder_loader import LoadedEncoder, load_encoder
from pagedllm.model.pooling_config import PoolingConfig, resolve_pooling_config
from pagedllm.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestMetrics
from pagedllm.pooling_params import PoolingParams
from pagedllm.templating.sandbox import render_chat_template
from pagedllm.worker.pooler import finish_embedding

logger = logging.getLogger(__name__)

ENCODER_DEFAULT_POOLING = PoolingConfig("CLS", True)  # vLLM's for BERT-family embedders without pooling files


@dataclass
class EncoderRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_type_ids: list[int] | None
    params: PoolingParams
    priority: int
    metrics: RequestMetrics
    order: int = 0
    error: str | None = field(default=None)

    def output(self, vector: list[float] | None) -> EmbeddingRequestOutput:
        return EmbeddingRequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                                      None if vector is None else EmbeddingOutput(vector), finished=True,
                                      error=self.error, metrics=self.metrics)


class EncoderEngine:
    def __init__(self, args: EngineArgs, model_path: str) -> None:
        t0 = time.perf_counter()
        if args.runner != "pooling":
            raise ValueError(f"{model_path} is an encoder (embeddings or scores, no text generation): start it with "
                             f"runner='pooling' (`--runner pooling`)")
        self.args = args
        self.model_path = model_path
        loaded: LoadedEncoder = load_encoder(model_path, args.dtype)
        self.model, self.model_config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        self.model_name, self.dtype = loaded.name, loaded.dtype
        self.max_model_len = min(args.max_model_len or self.model_config.max_model_len, self.model_config.max_model_len)
        self.pooling_config = (ENCODER_DEFAULT_POOLING if self.model_config.is_cross_encoder  # (its head reads CLS)
                               else resolve_pooling_config(model_path, default=ENCODER_DEFAULT_POOLING))
        self.generation_defaults: dict = {}
        self.eos_token_ids: set[int] = set()
        self._waiting: list[EncoderRequest] = []
        self._requests: dict[str, EncoderRequest] = {}
        self._order = 0
        self.num_steps = 0
        logger.info("encoder engine ready in %.1fs: %s, %s, %s, max model len %d", time.perf_counter() - t0,
                    self.model_name, self.task, str(self.dtype).removeprefix("torch."), self.max_model_len)

    # ---- facts -----------------------------------------------------------------------------------------------
    @property
    def runner_name(self) -> str:
        return self.args.runner

    @property
    def task(self) -> str:
        """"score" for a cross-encoder (a relevance score per pair of texts), else "embed"."""
        return "score" if self.model_config.is_cross_encoder else "embed"

    @cached_property
    def chars_per_token(self) -> int:
        return max_token_chars(self.tokenizer)

    def describe(self) -> str:
        """The startup line of `pagedllm serve` (engine/startup_summary.py)."""
        return (f"model {self.model_name} ({self.model_config.architecture} encoder, {self.task}), dtype "
                f"{str(self.dtype).removeprefix('torch.')}, max model len {self.max_model_len}, pooling "
                f"{self.pooling_config.pooling_type}, no KV cache (encoders read each prompt once)")

    # ---- requests in -----------------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            check_text_length(prompt, self.max_model_len, self.chars_per_token)
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        check_token_ids(ids, self.model_config.vocab_size)
        return ids

    def tokenize_pair(self, text_1: str, text_2: str, truncate_prompt_tokens: int | None = None) -> dict:
        return tokenize_pair(self.tokenizer, text_1, text_2, self.max_model_len, truncate_prompt_tokens)

    def apply_chat_template(self, messages: list[dict], **kwargs) -> str:
        return render_chat_template(self.tokenizer, messages, **kwargs)

    loras = None  # LoRA adapters apply to decoders only (LLMEngine's LoRARegistry)

    def add_lora(self, lora_request, read=None):
        raise ValueError("LoRA adapters are not supported on encoder models")

    read_lora = add_lora

    def remove_lora(self, name: str) -> bool:
        return False

    def list_loras(self) -> list:
        return []

    def check_runner(self, pooling: bool) -> None:
        if not pooling:
            raise ValueError("this engine runs the 'pooling' runner on an encoder, which does not take generation "
                             "requests")

    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: PoolingParams, *,
                    cache_salt: str | None = None, arrival_time: float | None = None,
                    prompt_token_ids: list[int] | None = None, priority: int = 0, lora_request=None) -> None:
        """prompt: a text, token ids, or a tokenized pair {"prompt_token_ids", "token_type_ids"} (a cross-encoder's
        input, from tokenize_pair). cache_salt is accepted and unused: there is no cache. lora_request: None only
        (LLM passes it to every engine; encoders take no adapters)."""
        if lora_request is not None:
            raise ValueError("LoRA adapters are for decoder models: this encoder takes none")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.check_runner(isinstance(params, PoolingParams))
        params.validate(None if self.task == "score" else self.model_config.hidden_size)
        if self.task == "score" and params.dimensions is not None:
            raise ValueError("dimensions: a cross-encoder's output is one score, not an embedding")
        if isinstance(prompt, dict) != (self.task == "score"):
            raise ValueError("this model is a cross-encoder: it scores pairs of texts (LLM.score, /v1/score, "
                             "/v1/rerank) and makes no embeddings" if self.task == "score" else
                             "this model makes embeddings: it takes single texts (pairs are scored by the cosine of "
                             "their embeddings)")
        types = None
        if isinstance(prompt, dict):
            ids, types = self._pair_ids(prompt)
        else:
            ids = params.truncated(self.tokenize(prompt if prompt_token_ids is None else prompt_token_ids),
                                   self.max_model_len)
            if len(ids) > self.max_model_len:
                raise ValueError(f"the prompt is {len(ids)} tokens, more than max_model_len={self.max_model_len}; "
                                 f"shorten it or set truncate_prompt_tokens")
        req = EncoderRequest(request_id, prompt if isinstance(prompt, str) else None, ids, types, params, priority,
                             RequestMetrics(arrival_time if arrival_time is not None else time.monotonic()),
                             order=self._order)
        self._order += 1
        self._requests[request_id] = req
        self._waiting.append(req)
        if self.args.scheduling_policy == "priority":
            self._waiting.sort(key=lambda r: (r.priority, r.order))

    def _pair_ids(self, prompt: dict) -> tuple[list[int], list[int]]:
        ids, types = list(prompt.get("prompt_token_ids") or []), prompt.get("token_type_ids")
        if not ids:
            raise ValueError("prompt must not be empty")
        check_token_ids(ids, self.model_config.vocab_size)
        check_pair_length(len(ids), self.max_model_len)
        types = [0] * len(ids) if types is None else list(types)
        if len(types) != len(ids):
            raise ValueError(f"token_type_ids has {len(types)} entries for {len(ids)} tokens")
        # a model with one token type (XLM-R) takes the pair's second text as type 0, as transformers does
        limit = max(self.model_config.type_vocab_size, 1)
        return ids, [t if t < limit else 0 for t in types]

    @property
    def requests(self) -> dict[str, EncoderRequest]:
        return self._requests

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            req = self._requests.pop(rid, None)
            if req is not None:
                self._waiting.remove(req)

    # ---- one step --------------------------------------------------------------------------------------------
    def step(self) -> list[EmbeddingRequestOutput]:
        batch = self._next_batch()
        if not batch:
            return []
        self.num_steps += 1
        now = time.monotonic()
        for req in batch:
            req.metrics.first_scheduled_time = now
        try:
            vectors: list[list[float] | None] = list(self._execute(batch))
        except BaseException as e:  # native panics too: they fail requests, not the engine
            if not isinstance(e, Exception) and not is_request_fault(e):
                raise
            logger.exception("encoder step of %d requests failed; running them one at a time", len(batch))
            vectors = [self._execute_alone(req) for req in batch]
        done = time.monotonic()
        outputs = []
        for enc, vector in zip(batch, vectors, strict=True):
            self._requests.pop(enc.request_id, None)
            if vector is not None and not all(math.isfinite(v) for v in vector):
                enc.error = ("model step failed: the model's output for this request is not finite (NaN or "
                             "infinity): its weights or activations overflowed")
                vector = None
            enc.metrics.first_token_time = enc.metrics.last_token_time = enc.metrics.finished_time = done
            outputs.append(enc.output(vector))
        return outputs

    def _next_batch(self) -> list[EncoderRequest]:
        """Waiting requests in order while their tokens fit the step's budget (the first one always runs)."""
        batch, tokens = [], 0
        for req in self._waiting:
            n = len(req.prompt_token_ids)
            if batch and (tokens + n > self.args.max_num_batched_tokens or len(batch) >= self.args.max_num_seqs):
                break
            batch.append(req)
            tokens += n
        del self._waiting[:len(batch)]
        return batch

    def _execute_alone(self, enc: EncoderRequest) -> list[float] | None:
        try:
            return self._execute([enc])[0]
        except BaseException as e:
            if not isinstance(e, Exception) and not is_request_fault(e):
                raise
            err = as_exception(e, "running the encoder")
            logger.error("request %s fails the encoder step alone: %s", enc.request_id, err)
            enc.error = f"model step failed: {type(err).__name__}: {err}"
            return None

    def _execute(self, batch: list[EncoderRequest]) -> list[list[float]]:
        ids = [t for r in batch for t in r.prompt_token_ids]
        positions = [p for r in batch for p in self.model.positions(r.prompt_token_ids)]
        types = [t for r in batch for t in (r.token_type_ids or [0] * len(r.prompt_token_ids))]
        lens = [len(r.prompt_token_ids) for r in batch]
        with forward_context(KernelMode(invariant=self.args.batch_invariant)):  # --no-batch-invariant: one GEMM
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), torch.tensor(types), lens)
        starts = torch.tensor([0, *lens[:-1]]).cumsum(0)
        if self.task == "score":
            logits = self.model.score(hidden[starts])[:, 0]
            scores = torch.sigmoid(logits) if self.model_config.sigmoid else logits
            return [[s] for s in scores.tolist()]
        out = []
        for req, start, n in zip(batch, starts.tolist(), lens, strict=True):
            rows = hidden[start:start + n].float()
            kind = self.pooling_config.pooling_type
            pooled = rows[0] if kind == "CLS" else rows[-1] if kind == "LAST" else rows.mean(0)
            out.append(finish_embedding(pooled, self.pooling_config, req.params))
        return out

    # ---- introspection ---------------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def num_running(self) -> int:
        return 0  # (a step runs and finishes its requests at once)

    def num_waiting(self) -> int:
        return len(self._waiting)

    def kv_cache_stats(self) -> dict:
        """The KV statistics' keys, all zero: an encoder has no KV cache."""
        return {"num_blocks": 0, "num_free_blocks": 0, "block_size": self.args.block_size, "used_slots": 0,
                "allocated_slots": 0, "peak_used_blocks": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
                "num_preemptions": 0, "kv_cache_dtype": "none", "kv_bytes_per_token": 0}

    def reset_prefix_cache(self, reset_external: bool = False) -> bool:
        return True  # nothing cached

    def reset_stats(self) -> None:
        pass

    def close(self) -> None:
        pass

