"""Prompt preparation off both loops: chat templates and tokenization run in a small worker pool, so that a
huge prompt delays only its own request, never the engine loop (which steps every stream) nor the asyncio loop
(which writes every stream's chunks). HF fast tokenizers release the GIL while they encode."""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pagedllm.engine.prompt_limits import max_token_chars
from pagedllm.entrypoints.openai.validation import check_prompt_tokens, check_text_length
from pagedllm.faults import as_exception, is_request_fault

T = TypeVar("T")


class PromptPreprocessor:
    def __init__(self, engine: Any, workers: int = 2) -> None:
        """`engine` is the AsyncEngine; only its pure, thread-safe parts are used (tokenizer, chat template)."""
        self.engine = engine
        self.max_model_len: int = engine.max_model_len
        self.chars_per_token = max_token_chars(engine.tokenizer)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pagedllm-prompt")
        # AsyncEngine: the LLMEngine's own tokenize (BOS handling included), a pure function of the tokenizer
        accepts_ids = "prompt_token_ids" in inspect.signature(engine.add_request).parameters
        self._tokenize = getattr(getattr(engine, "engine", None), "tokenize", None) if accepts_ids else None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the pool (a native panic in it becomes an Exception)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, _guarded, fn, *args)

    async def render_chat(self, messages: list[dict], **template_options: Any) -> str:
        return await self.run(functools.partial(self.engine.apply_chat_template, messages, **template_options))

    async def tokenize(self, prompt: str | list[int], param: str = "prompt") -> dict[str, Any]:
        """The prompt's token ids as add_request keywords; a 400 as soon as its length shows it cannot fit in
        max_model_len. An engine that tokenizes for itself (the data-parallel client) gets only the checks."""
        if isinstance(prompt, str):
            check_text_length(prompt, self.max_model_len, self.chars_per_token, param)
            if self._tokenize is None:
                return {}
            ids = await self.run(self._tokenize, prompt)
        else:
            ids = prompt  # the engine checks them against the vocabulary
        check_prompt_tokens(len(ids), self.max_model_len, param)
        return {"prompt_token_ids": ids} if self._tokenize is not None and isinstance(prompt, str) else {}

    async def token_ids(self, prompt: str) -> list[int]:
        """The prompt's token ids as the engine counts them, unchecked (for count_tokens)."""
        return await self.run(self._tokenize or self.engine.tokenizer.encode, prompt)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _guarded(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args), a native panic (a BaseException) turned into an Exception the request's handler reports."""
    try:
        return fn(*args)
    except BaseException as e:
        if isinstance(e, Exception) or not is_request_fault(e):
            raise
        raise as_exception(e, "preparing the prompt") from e
