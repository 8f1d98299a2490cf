"""A choice's text as segments (reasoning, text, tool calls, in the model's order), parsed whole or as it
streams. The three APIs (chat completions, responses, messages) render the same segments and the same
start / delta / end events in their own shapes, so a streamed answer assembles into the non-streamed one."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from pagedllm.entrypoints.openai.reasoning import ReasoningParser, Split, Start
from pagedllm.entrypoints.openai.tool_parsers import ToolParser

logger = logging.getLogger(__name__)

Kind = Literal["reasoning", "text", "call"]


@dataclass
class Segment:
    kind: Kind
    text: str = ""  # the reasoning, the text, or the call's arguments (JSON text)
    name: str = ""  # call: the function
    call_id: str = ""  # call: its id
    complete: bool = True  # call: the model closed it


@dataclass
class SegmentEvent:
    type: Literal["start", "delta", "end"]
    index: int  # the segment's position in the output
    segment: Segment  # its state after this event
    delta: str = ""


class OutputParser:
    """Reasoning (when the server has a reasoning parser), then tool calls in what follows it (when the request
    has tools and a parser reads them)."""

    def __init__(self, reasoning: ReasoningParser | None = None, start: Start = Start.OFF,
                 tools: ToolParser | None = None) -> None:
        self.reasoning = reasoning
        self.start = start if reasoning is not None else Start.OFF
        self.tools = tools

    @property
    def plain(self) -> bool:
        """Text in, text out: nothing to parse."""
        return self.start is Start.OFF and self.tools is None

    @property
    def keeps_special_tokens(self) -> bool:
        """The output must be detokenized with its special tokens: a parser reads markers that are such tokens."""
        reasoning = self.start is not Start.OFF and self.reasoning.keeps_special_tokens
        return reasoning or (self.tools is not None and self.tools.keeps_special_tokens)

    def parse(self, text: str, final: bool) -> list[Segment]:
        split = self.reasoning.split(text, self.start, final) if self.reasoning is not None else Split("", text, True)
        out = [Segment("reasoning", split.reasoning)] if split.reasoning else []
        if not split.reasoning_done:
            return out
        if self.tools is None:
            return out + ([Segment("text", split.content)] if split.content else [])
        for piece in self.tools.parse(split.content, final):
            if isinstance(piece, str):
                out.append(Segment("text", piece))
            else:
                out.append(Segment("call", piece.arguments, piece.name, complete=piece.complete))
        return out

    def new_call_id(self) -> str:
        assert self.tools is not None
        return self.tools.new_call_id()


class SegmentStream:
    """Successive parses of a growing text as events: a segment starts (a call with its id and name), grows by
    deltas, and ends when the next one starts or the text is final. `segments` is what was sent."""

    def __init__(self, parser: OutputParser) -> None:
        self.parser = parser
        self.segments: list[Segment] = []
        self._ended = 0  # segments before this index have had their end event
        self._warned = False

    def update(self, text: str, final: bool) -> list[SegmentEvent]:
        events: list[SegmentEvent] = []
        for i, seg in enumerate(self.parser.parse(text, final)):
            if i < len(self.segments):
                self._grow(i, seg, events)
                continue
            if self.segments and self._ended < len(self.segments):
                self._ended = len(self.segments)
                events.append(SegmentEvent("end", i - 1, self.segments[-1]))
            if seg.kind == "call":
                seg.call_id = self.parser.new_call_id()
            text_now, seg.text = seg.text, ""
            self.segments.append(seg)
            events.append(SegmentEvent("start", i, seg))
            if text_now:
                seg.text = text_now
                events.append(SegmentEvent("delta", i, seg, text_now))
        if final and self._ended < len(self.segments):
            self._ended = len(self.segments)
            events.append(SegmentEvent("end", len(self.segments) - 1, self.segments[-1]))
        return events

    def _grow(self, i: int, seg: Segment, events: list[SegmentEvent]) -> None:
        old = self.segments[i]
        if old.kind != seg.kind or old.name != seg.name or not seg.text.startswith(old.text) \
                or (i < self._ended and seg.text != old.text):
            if not self._warned:  # a parser broke its promise: keep what was sent, say so once
                self._warned = True
                logger.warning("output parser changed segment %d already sent (%s %r -> %s %r)", i, old.kind,
                               old.text[:40], seg.kind, seg.text[:40])
            return
        old.complete = seg.complete
        if len(seg.text) > len(old.text):
            delta, old.text = seg.text[len(old.text):], seg.text
            events.append(SegmentEvent("delta", i, old, delta))


def parse_final(parser: OutputParser, text: str) -> list[Segment]:
    """The segments of a finished text (calls get their ids), as a stream of it would end."""
    stream = SegmentStream(parser)
    stream.update(text, final=True)
    return stream.segments


def mark_cut(segments: list[Segment], finish_reason: str | None) -> None:
    """A text cut by max_tokens leaves its last call unfinished, whatever the parser saw."""
    if finish_reason == "length" and segments and segments[-1].kind == "call":
        segments[-1].complete = False
