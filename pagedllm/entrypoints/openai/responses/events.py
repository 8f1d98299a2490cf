"""The Responses API's streaming events, in the order OpenAI sends them, each with its sequence number:
response.created, response.in_progress, then per output item output_item.added, content_part.added, the deltas
(output_text / reasoning_text / function_call_arguments), their .done, content_part.done, output_item.done,
and last response.completed (or response.incomplete when max_output_tokens cut it)."""

from __future__ import annotations

import json
from typing import Any

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.output_parser import Segment, SegmentEvent
from pagedllm.entrypoints.openai.responses.builder import ResponseBuilder, item_status, text_part


class ResponseEvents:
    def __init__(self, builder: ResponseBuilder) -> None:
        self.builder = builder
        self.seq = 0

    def sse(self, type_: str, **payload: Any) -> str:
        data = {"type": type_, "sequence_number": self.seq, **payload}
        self.seq += 1
        return f"event: {type_}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def start(self) -> list[str]:
        head = self.builder.response("in_progress", [])
        return [self.sse("response.created", response=head), self.sse("response.in_progress", response=head)]

    def segment(self, ev: SegmentEvent, cut: bool) -> list[str]:
        """The events of one segment event; cut: the output ended by max_output_tokens."""
        i, seg = ev.index, ev.segment
        item_id = self.builder.item_id(i, seg)
        if ev.type == "start":
            out = [self.sse("response.output_item.added", output_index=i,
                            item=self.builder.item(i, seg, "in_progress"))]
            if seg.kind != "call":
                out.append(self.sse("response.content_part.added", item_id=item_id, output_index=i,
                                    content_index=0, part=self._part(seg, "")))
            return out
        if ev.type == "delta":
            if seg.kind == "call":
                return [self.sse("response.function_call_arguments.delta", item_id=item_id, output_index=i,
                                 delta=ev.delta)]
            kind = "reasoning_text" if seg.kind == "reasoning" else "output_text"
            extra = {"logprobs": []} if seg.kind == "text" else {}
            return [self.sse(f"response.{kind}.delta", item_id=item_id, output_index=i, content_index=0,
                             delta=ev.delta, **extra)]
        item = self.builder.item(i, seg, item_status(seg, cut))
        if seg.kind == "call":
            done = [self.sse("response.function_call_arguments.done", item_id=item_id, output_index=i,
                             name=seg.name, arguments=seg.text)]
        else:
            kind = "reasoning_text" if seg.kind == "reasoning" else "output_text"
            extra = {"logprobs": []} if seg.kind == "text" else {}
            done = [self.sse(f"response.{kind}.done", item_id=item_id, output_index=i, content_index=0,
                             text=seg.text, **extra),
                    self.sse("response.content_part.done", item_id=item_id, output_index=i, content_index=0,
                             part=self._part(seg, seg.text))]
        return [*done, self.sse("response.output_item.done", output_index=i, item=item)]

    @staticmethod
    def _part(seg: Segment, text: str) -> dict[str, Any]:
        return {"type": "reasoning_text", "text": text} if seg.kind == "reasoning" else text_part(text)

    def finish(self, response: dict[str, Any]) -> str:
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return self.sse(kind, response=response)

    def error(self, err: OpenAIError) -> str:
        """A failure after the stream started: an error event, then response.failed."""
        info = {"code": err.code or err.type, "message": err.message}
        return (self.sse("error", code=info["code"], message=err.message, param=err.param)
                + self.sse("response.failed", response=self.builder.response("failed", [], error=info)))
