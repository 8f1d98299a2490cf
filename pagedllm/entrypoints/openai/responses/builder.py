"""The Response object and its output items (reasoning, message, function_call), from a choice's segments;
the same builder serves the whole response, every streamed event and the stored copy."""

from __future__ import annotations

import time
from typing import Any

from pagedllm.entrypoints.openai.output_parser import Segment
from pagedllm.entrypoints.openai.protocol import UsageInfo
from pagedllm.entrypoints.openai.responses.protocol import ResponsesRequest

_ITEM_PREFIX = {"reasoning": "rs", "text": "msg", "call": "fc"}


class ResponseBuilder:
    def __init__(self, req: ResponsesRequest, response_id: str, model: str) -> None:
        self.req = req
        self.id = response_id
        self.model = model
        self.created_at = time.time()

    def item_id(self, index: int, seg: Segment) -> str:
        """Stable per output position, so streamed and final items agree."""
        return f"{_ITEM_PREFIX[seg.kind]}_{self.id.removeprefix('resp_')[:40]}_{index}"

    def item(self, index: int, seg: Segment, status: str) -> dict[str, Any]:
        """One output item; status: in_progress (just added, empty), completed or incomplete."""
        item_id, empty = self.item_id(index, seg), status == "in_progress"
        if seg.kind == "reasoning":
            content = [] if empty else [{"type": "reasoning_text", "text": seg.text}]
            return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}
        if seg.kind == "text":
            content = [] if empty else [text_part(seg.text)]
            return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}
        return {"id": item_id, "type": "function_call", "call_id": seg.call_id, "name": seg.name,
                "arguments": "" if empty else seg.text, "status": status}

    def output(self, segments: list[Segment], cut: bool) -> list[dict[str, Any]]:
        return [self.item(i, s, item_status(s, cut and i == len(segments) - 1)) for i, s in enumerate(segments)]

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        r = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": time.time() if status == "completed" else None, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "metadata": r.metadata or {},
            "model": self.model, "output": output,
            "parallel_tool_calls": True if r.parallel_tool_calls is None else r.parallel_tool_calls,
            "previous_response_id": r.previous_response_id, "reasoning": r.reasoning, "store": r.store,
            "temperature": r.temperature, "top_p": r.top_p, "text": r.text or {"format": {"type": "text"}},
            "tool_choice": r.tool_choice if r.tool_choice is not None else "auto", "tools": r.tools or [],
            "truncation": r.truncation or "disabled", "usage": usage, "user": r.user,
        }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def item_status(seg: Segment, cut: bool) -> str:
    return "incomplete" if cut or (seg.kind == "call" and not seg.complete) else "completed"


def usage(u: UsageInfo, reasoning_tokens: int) -> dict[str, Any]:
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": u.total_tokens}


def assistant_message(segments: list[Segment]) -> dict[str, Any]:
    """This turn's output as the chat message a follow-up's template renders."""
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(s.text for s in segments if s.kind == "text")}
    reasoning = "".join(s.text for s in segments if s.kind == "reasoning")
    if reasoning:
        msg["reasoning_content"] = reasoning
    calls = [{"id": s.call_id, "type": "function", "function": {"name": s.name, "arguments": s.text}}
             for s in segments if s.kind == "call"]
    if calls:
        msg["tool_calls"] = calls
    return msg
