"""Reasoning split from the answer: `<think>...</think>` (DeepSeek-R1, Qwen3, QwQ and their kin). Where the
output starts depends on the prompt: a template that opens the span (`...<think>\n`) starts the output inside
it, one that closes it (`<think>\n\n</think>`: thinking switched off) starts it outside, and otherwise the
model may open it with its first token."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

from pagedllm.entrypoints.openai.tool_parsers.base import held_tail


class Start(Enum):
    OPEN = "open"  # the output starts inside the reasoning
    MAY_OPEN = "may_open"  # reasoning only if the output starts with the start tag
    OFF = "off"  # no reasoning


@dataclass
class Split:
    reasoning: str
    content: str
    reasoning_done: bool  # the end tag came (or there was no reasoning): the content is the answer


class ReasoningParser:
    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    opens_by_default: ClassVar[bool] = False  # the model reasons first even when the prompt does not open it
    keeps_special_tokens: ClassVar[bool] = False  # its markers are special tokens the detokenizer would drop

    def start_state(self, prompt: str) -> Start:
        tail = prompt.rstrip()
        if tail.endswith(self.end):
            return Start.OFF
        if tail.endswith(self.start) or self.opens_by_default:
            return Start.OPEN
        return Start.MAY_OPEN

    def split(self, text: str, start: Start, final: bool) -> Split:
        """The reasoning and the content of the output so far. Not final: a tail that may be the start of a
        tag, and trailing whitespace of the reasoning, are held back (so later splits only extend this one)."""
        if start is Start.OFF:
            return Split("", text, True)
        body = text.lstrip()
        if not final and len(body) < len(self.start) and self.start.startswith(body):
            return Split("", "", False)  # maybe the start tag
        if body.startswith(self.start):
            body = body[len(self.start):]
        elif start is Start.MAY_OPEN:
            return Split("", text, True)
        at = body.find(self.end)
        if at >= 0:
            return Split(body[:at].strip(), body[at + len(self.end):].lstrip(), True)
        if not final:
            body = body[:len(body) - held_tail(body, [self.end])]
        return Split(body.strip(), "", False)
