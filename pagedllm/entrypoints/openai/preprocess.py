"""Prompt preparation off both loops: chat templates and tokenization run in a small worker pool, so that a
huge prompt delays only its own request, never the engine loop (which steps every stream) nor the asyncio loop
(which writes every stream's chunks). HF fast tokenizers release the GIL while they encode."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.engine.prompt_limits import max_token_chars
from pagedllm.entrypoints.openai.validation import check_prompt_tokens, check_text_length
from pagedllm.faults import as_exception, is_request_fault

if TYPE_CHECKING:  # Ray is an extra
    from pagedllm.distributed.client import DataParallelEngine

T = TypeVar("T")


class PromptPreprocessor:
    def __init__(self, tokenizer: Any, max_model_len: int, render_chat: Callable[..., str],
                 tokenize: Callable[[str], list[int]] | None = None, workers: int = 2) -> None:
        """Only pure, thread-safe functions of the tokenizer run here. render_chat(messages, **options): the
        chat template. tokenize: the engine's own (BOS handling included), whose ids add_request takes as
        prompt_token_ids; None for an engine that tokenizes for itself (its prompts get only the checks)."""
        self.tokenizer = tokenizer  # Any: transformers' or model/tokenizer.py's, which share no base class
        self.max_model_len = max_model_len
        self.chars_per_token = max_token_chars(tokenizer)
        self._render_chat = render_chat
        self._tokenize = tokenize
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pagedllm-prompt")

    @classmethod
    def for_engine(cls, engine: AsyncEngine | DataParallelEngine, workers: int = 2) -> PromptPreprocessor:
        """The AsyncEngine's prompts are tokenized here, off its loop thread; the data-parallel client's by
        the replica that runs them (its add_request takes no token ids)."""
        tokenize = engine.engine.tokenize if isinstance(engine, AsyncEngine) else None
        return cls(engine.tokenizer, engine.max_model_len, engine.apply_chat_template, tokenize, workers)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the pool (a native panic in it becomes an Exception)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, _guarded, fn, *args)

    async def render_chat(self, messages: list[dict], **template_options: Any) -> str:
        return await self.run(functools.partial(self._render_chat, messages, **template_options))

    async def tokenize(self, prompt: str | list[int], param: str = "prompt", *, prefill_only: bool = False,
                       truncating: bool = False) -> dict[str, Any]:
        """The prompt's token ids as add_request keywords; a 400 as soon as its length shows it cannot fit in
        max_model_len. An engine that tokenizes for itself (the data-parallel client) gets only the checks.
        prefill_only: an embedding's prompt, which may fill the context; truncating: the engine keeps its last
        tokens (truncate_prompt_tokens), so no token count is too many."""
        if isinstance(prompt, str):
            check_text_length(prompt, self.max_model_len, self.chars_per_token, param)
            if self._tokenize is None:
                return {}
            ids = await self.run(self._tokenize, prompt)
        else:
            ids = prompt  # the engine checks them against the vocabulary
        if not truncating:
            check_prompt_tokens(len(ids), self.max_model_len, param, prefill_only=prefill_only)
        return {"prompt_token_ids": ids} if self._tokenize is not None and isinstance(prompt, str) else {}

    async def token_ids(self, prompt: str) -> list[int]:
        """The prompt's token ids as the engine counts them, unchecked (for count_tokens)."""
        return await self.run(self._tokenize or self.tokenizer.encode, prompt)

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
