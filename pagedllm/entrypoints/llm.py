"""The offline API: LLM.generate / chat / beam_search / embed / score, named as in vLLM."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence

from tqdm.auto import tqdm

from pagedllm.engine.args import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.request_stream import RequestFailedError
from pagedllm.engine.scoring import cosine, pair_up, score_task
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import (
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
    completions_of,
)
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | list[int] | dict  # dicts as vLLM's: {"prompt": text} or {"prompt_token_ids": [...]}
_PROMPT_TYPES = "a str, a list of token ids, a dict with 'prompt' or 'prompt_token_ids', or a list of those"


def _is_token_ids(x: object) -> bool:
    return isinstance(x, list | tuple) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _unwrap(prompt: Prompt, where: str = "prompt") -> str | list[int]:
    if isinstance(prompt, dict):
        keys = set(prompt) & {"prompt", "prompt_token_ids"}
        if len(keys) != 1:
            raise ValueError(f"{where}: a dict prompt needs exactly one of 'prompt' and 'prompt_token_ids', "
                             f"got keys {sorted(prompt)}")
        prompt = prompt[keys.pop()]
    if not isinstance(prompt, str) and not _is_token_ids(prompt):
        raise TypeError(f"{where} must be a str or a list of token ids, got {type(prompt).__name__}")
    return prompt if isinstance(prompt, str) else list(prompt)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[str | list[int]]:
    """The prompts as a list; TypeError naming the prompt otherwise (not a bare `list(...)` failure)."""
    if isinstance(prompts, str | dict):
        return [_unwrap(prompts)]
    if not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be {_PROMPT_TYPES}, got {type(prompts).__name__}")
    prompts = list(prompts)
    if prompts and _is_token_ids(prompts):
        return [prompts]  # a single prompt given as token ids
    return [_unwrap(p, f"prompts[{i}]") for i, p in enumerate(prompts)]


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        # Offline, no one waits for a first token: steps take max_num_batched_tokens (the most throughput, and the
        # same schedule on every run); the server sizes steps for latency (EngineArgs.max_step_ms "auto").
        kwargs.setdefault("max_step_ms", "off")
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's recommended defaults (--generation-config), as vLLM's."""
        return SamplingParams(**self.engine.generation_defaults)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest] | None = None
                 ) -> list[RequestOutput]:
        """lora_request: one adapter for every prompt, or one per prompt (None: the base model), as vLLM's."""
        prompts = _as_prompt_list(prompts)
        if not prompts:
            logger.warning("LLM.generate got no prompts: nothing to do")  # as vLLM: an empty result, not an error
            return []
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = (list(sampling_params) if isinstance(sampling_params, Sequence)
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        if not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError("sampling_params must be a SamplingParams or a sequence of them")
        grammars = [self.engine.structured_outputs.submit(p.structured_outputs) for p in params
                    if p.structured_outputs is not None]  # compile them all at once, in the background
        for g in grammars:
            g.result()  # an invalid schema / regex / grammar raises its GrammarError (a ValueError) before any add
        return self._add_and_run(prompts, params, use_tqdm, lora_request)

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True, *, truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`.outputs.embedding`), pooled as the checkpoint says; the pooling runner
        only (LLM(model, runner="pooling")), as vLLM's."""
        prompts = _as_prompt_list(prompts)
        if not prompts:
            return []
        params = pooling_params or PoolingParams()
        if not isinstance(params, PoolingParams):
            raise TypeError("pooling_params must be a PoolingParams")
        if truncate_prompt_tokens is not None:
            params = dataclasses.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        return self._add_and_run(prompts, [params] * len(prompts), use_tqdm)

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score: one text_1 against each text_2, or text_1[i] with text_2[i]. A cross-encoder scores
        each pair itself (the pair tokenized together); an embedding model scores the cosine similarity of the two
        texts' embeddings. The pooling runner only."""
        self.engine.check_runner(pooling=True)
        pairs = pair_up(text_1, text_2)
        params = pooling_params or PoolingParams()
        if truncate_prompt_tokens is not None:
            params = dataclasses.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        params.validate()
        if score_task(self.engine) == "score":
            prompts = [self.engine.tokenize_pair(a, b, params.truncate_prompt_tokens) for a, b in pairs]
            outs = self._add_and_run(prompts, [params] * len(prompts), use_tqdm)
            return [ScoringRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(o.outputs.embedding[0]))
                    for o in outs]
        firsts = list(dict.fromkeys(a for a, _ in pairs))  # 1:N embeds the one text_1 once
        embedded = self.embed(firsts + [b for _, b in pairs], params, use_tqdm)
        by_text = dict(zip(firsts, embedded[:len(firsts)], strict=True))
        return [ScoringRequestOutput(f"{by_text[a].request_id}-{e.request_id}",
                                     by_text[a].prompt_token_ids + e.prompt_token_ids,
                                     ScoringOutput(cosine(by_text[a].outputs.embedding, e.outputs.embedding)))
                for (a, _), e in zip(pairs, embedded[len(firsts):], strict=True)]

    def _add_and_run(self, prompts: list[str | list[int] | dict], params: Sequence[SamplingParams | PoolingParams],
                     use_tqdm: bool, lora_request: LoRARequest | Sequence[LoRARequest] | None = None) -> list:
        loras = (list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts")
        order: dict[str, int] = {}
        try:
            for i, (prompt, p, lora) in enumerate(zip(prompts, params, loras, strict=True)):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, p, lora_request=lora)
                order[rid] = i
        except Exception:
            self.engine.abort_request(list(order))
            raise
        return self._run(order, use_tqdm)

    def _run(self, order: dict[str, int], use_tqdm: bool) -> list:
        results: list[RequestOutput | EmbeddingRequestOutput | None] = [None] * len(order)
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True,
                   postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        tokens_in = tokens_out = 0
        try:
            while any(r is None for r in results):
                for out in self.engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        tokens_in += len(out.prompt_token_ids)
                        tokens_out += sum(len(c.token_ids) for c in completions_of(out))
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        # as vLLM's bar: tokens of the finished requests over the time so far
                        bar.set_postfix_str(f"est. speed input: {tokens_in / elapsed:.2f} toks/s, "
                                            f"output: {tokens_out / elapsed:.2f} toks/s", refresh=False)
                        bar.update(1)
        except BaseException:
            self.engine.abort_request(list(order))
            raise
        finally:
            bar.close()
        failed = [(i, out) for i, out in enumerate(results) if out is not None and out.error]
        if failed:  # never an empty text in place of an error: the caller gets every output with the error
            i, first = failed[0]
            raise RequestFailedError(f"{len(failed)} of {len(results)} requests failed in the engine; prompt {i}: "
                                     f"{first.error}", outputs=results)
        return results  # type: ignore[return-value]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, *, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest] | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat. Templates render with a time, memory and output limit (templating/sandbox.py);
        the rendered prompt's length is checked before it is tokenized."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        options = {"chat_template": chat_template, "add_generation_prompt": add_generation_prompt,
                   "continue_final_message": continue_final_message, "chat_template_kwargs": chat_template_kwargs,
                   "tools": tools}
        prompts: list[Prompt] = [self.engine.apply_chat_template(c, **options) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams):
        from pagedllm.engine.beam_search import beam_search

        return beam_search(self.engine, _as_prompt_list(prompts), params)

    def kv_cache_stats(self) -> dict:
        return self.engine.kv_cache_stats()
