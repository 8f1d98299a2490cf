"""Request checks that pydantic's types cannot express: text that is not valid Unicode, prompts that are
too long to run (known before the engine sees them)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from pagedllm.engine import prompt_limits
from pagedllm.entrypoints.openai.errors import OpenAIError


def lone_surrogate_path(value: Any, path: str) -> str | None:
    """The path of the first string (or dict key) in `value` holding a lone UTF-16 surrogate ("\\ud800"):
    JSON allows it as an escape, but it is not Unicode, so it can be neither tokenized nor sent back."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, BaseModel):
        value = value.model_dump(exclude_unset=True)
    if isinstance(value, dict):
        for k, v in value.items():
            key = k if isinstance(k, str) else str(k)
            found = lone_surrogate_path(key, f"{path}.<key>") or lone_surrogate_path(v, f"{path}.{key}")
            if found:
                return found
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            found = lone_surrogate_path(v, f"{path}[{i}]")
            if found:
                return found
    return None


def check_unicode(req: BaseModel) -> None:
    """400 naming the field when any text of the request is not valid Unicode."""
    for name in type(req).model_fields:
        path = lone_surrogate_path(getattr(req, name), name)
        if path is not None:
            # the message must not quote the text: it could not be encoded into the response either
            raise OpenAIError(400, f"{path} is not valid Unicode (it contains a lone UTF-16 surrogate)",
                              param=name, code="invalid_value")


def prompt_too_long(num_tokens: int, max_model_len: int, param: str = "prompt") -> OpenAIError:
    return OpenAIError(400, f"{param} is {num_tokens} tokens, which leaves no room to generate within "
                            f"max_model_len={max_model_len}", param=param, code="context_length_exceeded")


def check_prompt_tokens(num_tokens: int, max_model_len: int, param: str = "prompt", *,
                        prefill_only: bool = False) -> None:
    """prefill_only (embeddings): the prompt may fill the context, nothing is generated after it."""
    if prefill_only and num_tokens > max_model_len:
        raise OpenAIError(400, f"{param} is {num_tokens} tokens, more than max_model_len={max_model_len}; set "
                               f"truncate_prompt_tokens to keep its last tokens", param=param,
                          code="context_length_exceeded")
    if num_tokens >= max_model_len and not prefill_only:
        raise prompt_too_long(num_tokens, max_model_len, param)


def check_text_length(text: str, max_model_len: int, chars_per_token: int, param: str = "prompt") -> None:
    """A 400 before tokenizing for a text too long to fit (engine/prompt_limits.py has the rule)."""
    try:
        prompt_limits.check_text_length(text, max_model_len, chars_per_token, param)
    except prompt_limits.PromptTooLongError as e:
        raise OpenAIError(400, str(e), param=param, code="context_length_exceeded") from e
