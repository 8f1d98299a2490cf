"""A choice's segments as Anthropic's Message (thinking, text and tool_use content blocks, stop_reason, usage)
and as its event stream: message_start, per block content_block_start / content_block_delta (thinking_delta,
text_delta, input_json_delta) / content_block_stop, then message_delta and message_stop."""

from __future__ import annotations

import json
from typing import Any

from pagedllm.entrypoints.openai.errors import OpenAIError, anthropic_error_body
from pagedllm.entrypoints.openai.output_parser import Segment, SegmentEvent
from pagedllm.entrypoints.openai.tool_parsers.jsonscan import close_partial
from pagedllm.outputs import CompletionOutput, RequestOutput


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the input object (what a cut call had written so far; {} if nothing parses)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = close_partial(arguments)
    return value if isinstance(value, dict) else {}


def block(seg: Segment, empty: bool = False) -> dict[str, Any]:
    text = "" if empty else seg.text
    if seg.kind == "reasoning":
        return {"type": "thinking", "thinking": text, "signature": ""}
    if seg.kind == "text":
        return {"type": "text", "text": text}
    return {"type": "tool_use", "id": seg.call_id, "name": seg.name, "input": {} if empty else tool_input(seg.text)}


def stop_reason(segments: list[Segment], c: CompletionOutput) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if any(s.kind == "call" for s in segments):
        return "tool_use", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def usage(final: RequestOutput) -> dict[str, int]:
    """Anthropic counts prompt tokens read from the cache apart from input_tokens."""
    cached = final.num_cached_tokens
    return {"input_tokens": len(final.prompt_token_ids) - cached, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0, "output_tokens": sum(len(c.token_ids) for c in final.outputs)}


def message(message_id: str, model: str, segments: list[Segment], final: RequestOutput) -> dict[str, Any]:
    reason, sequence = stop_reason(segments, final.outputs[0])
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": [block(s) for s in segments], "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage(final)}


def sse(type_: str, **payload: Any) -> str:
    data = json.dumps({"type": type_, **payload}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {type_}\ndata: {data}\n\n"


def message_start(message_id: str, model: str, first: RequestOutput) -> str:
    u = usage(first)
    u["output_tokens"] = 0
    return sse("message_start", message={"id": message_id, "type": "message", "role": "assistant", "model": model,
                                         "content": [], "stop_reason": None, "stop_sequence": None, "usage": u})


_DELTAS = {"reasoning": ("thinking_delta", "thinking"), "text": ("text_delta", "text"),
           "call": ("input_json_delta", "partial_json")}


def segment_events(ev: SegmentEvent) -> list[str]:
    if ev.type == "start":
        return [sse("content_block_start", index=ev.index, content_block=block(ev.segment, empty=True))]
    if ev.type == "delta":
        kind, key = _DELTAS[ev.segment.kind]
        return [sse("content_block_delta", index=ev.index, delta={"type": kind, key: ev.delta})]
    return [sse("content_block_stop", index=ev.index)]


def message_end(segments: list[Segment], final: RequestOutput) -> list[str]:
    reason, sequence = stop_reason(segments, final.outputs[0])
    u = usage(final)
    return [sse("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                usage={"output_tokens": u["output_tokens"], "input_tokens": u["input_tokens"],
                       "cache_read_input_tokens": u["cache_read_input_tokens"]}),
            sse("message_stop")]


def error_event(err: OpenAIError) -> str:
    return f"event: error\ndata: {anthropic_error_body(err)}\n\n"
