"""Scoring pairs of texts, what LLM.score and POST /v1/score, /v1/rerank share: pairing the texts as vLLM does, a
cross-encoder's pair tokenized together, a bi-encoder's score (the cosine of two embeddings). Pure Python."""

from __future__ import annotations

import math
from collections.abc import Sequence


def score_task(engine) -> str:
    """"score": the engine scores a pair itself (a cross-encoder); "embed": scores are cosines of embeddings."""
    return getattr(engine, "task", "embed")


def pair_up(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text_1 against every text_2 (1:N), else text_1[i] with text_2[i] (N:N)."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second:
        raise ValueError("text_1 and text_2 must each hold at least one text")
    if not all(isinstance(t, str) for t in (*first, *second)):
        raise TypeError("text_1 and text_2 must be strings or lists of strings")
    if len(first) == 1:
        first = first * len(second)
    elif len(first) != len(second):
        raise ValueError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or one per "
                         f"text_2")
    return list(zip(first, second, strict=True))


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """float64 cosine similarity (the embeddings may or may not be normalised)."""
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norm if norm else 0.0


def check_pair_length(num_tokens: int, max_model_len: int) -> None:
    if num_tokens > max_model_len:
        raise ValueError(f"the pair of texts is {num_tokens} tokens, more than max_model_len={max_model_len}; "
                         f"shorten them or set truncate_prompt_tokens")


def tokenize_pair(tokenizer, text_1: str, text_2: str, max_model_len: int,
                  truncate_prompt_tokens: int | None = None) -> dict:
    """A cross-encoder's prompt: {"prompt_token_ids", "token_type_ids"} of the pair in the tokenizer's template;
    ValueError when it does not fit in max_model_len (truncate_prompt_tokens: shortened to fit, -1: to the
    context)."""
    if not text_1 or not text_2:
        raise ValueError("a text of the pair is empty")
    keep = None if truncate_prompt_tokens is None else (
        max_model_len if truncate_prompt_tokens == -1 else min(truncate_prompt_tokens, max_model_len))
    ids, types = tokenizer.encode_pair(text_1, text_2, keep)
    check_pair_length(len(ids), max_model_len)
    return {"prompt_token_ids": ids, "token_type_ids": types}
