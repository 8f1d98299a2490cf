"""The offline API: LLM.generate / chat / beam_search, named as in vLLM."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

from tqdm.auto import tqdm

from pagedllm.engine.args import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | list[int]
_PROMPT_TYPES = "a str, a list of token ids, or a list of those"


def _is_token_ids(x: object) -> bool:
    return isinstance(x, list | tuple) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """The prompts as a list; TypeError naming the prompt otherwise (not a bare `list(...)` failure)."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be {_PROMPT_TYPES}, got {type(prompts).__name__}")
    prompts = list(prompts)
    if prompts and _is_token_ids(prompts):
        return [prompts]  # a single prompt given as token ids
    for i, p in enumerate(prompts):
        if not isinstance(p, str) and not _is_token_ids(p):
            raise TypeError(f"prompts[{i}] must be a str or a list of token ids, got {type(p).__name__}")
    return [p if isinstance(p, str) else list(p) for p in prompts]


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        if not prompts:
            logger.warning("LLM.generate got no prompts: nothing to do")  # as vLLM: an empty result, not an error
            return []
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (list(sampling_params) if isinstance(sampling_params, Sequence)
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        if not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError("sampling_params must be a SamplingParams or a sequence of them")
        order: dict[str, int] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, p)
                order[rid] = i
        except Exception:
            self.engine.abort_request(list(order))
            raise
        return self._run(order, use_tqdm)

    def _run(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(order)
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while any(r is None for r in results):
                for out in self.engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
        except BaseException:
            self.engine.abort_request(list(order))
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.engine.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams):
        from pagedllm.engine.beam_search import beam_search

        return beam_search(self.engine, _as_prompt_list(prompts), params)

    def kv_cache_stats(self) -> dict:
        return self.engine.kv_cache_stats()
