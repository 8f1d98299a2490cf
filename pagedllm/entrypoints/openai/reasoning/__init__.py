"""Reasoning parsers (`--reasoning-parser NAME`): the model's reasoning as `reasoning_content` (chat),
reasoning items (responses) and thinking blocks (messages)."""

from __future__ import annotations

from pagedllm.entrypoints.openai.reasoning.base import ReasoningParser, Split, Start
from pagedllm.entrypoints.openai.reasoning.gpt_oss import GptOssReasoningParser
from pagedllm.entrypoints.openai.reasoning.think import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (
    DeepSeekR1ReasoningParser, Qwen3ReasoningParser, GptOssReasoningParser)}


def make_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}, got {name!r}") from None


__all__ = ["REASONING_PARSERS", "ReasoningParser", "Split", "Start", "make_reasoning_parser"]
