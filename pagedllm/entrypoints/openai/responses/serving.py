"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API on the chat engine path (one
request = one chat request = one engine request, with the chat endpoint's validation, limits, metrics and
logs), its output read by the same parsers and rendered as output items and semantic stream events."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.async_engine import RequestStream
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request, renamed
from pagedllm.entrypoints.openai.output_parser import Segment
from pagedllm.entrypoints.openai.responses.builder import ResponseBuilder, assistant_message, usage
from pagedllm.entrypoints.openai.responses.convert import CHAT_NAMES, to_chat_request
from pagedllm.entrypoints.openai.responses.events import ResponseEvents
from pagedllm.entrypoints.openai.responses.protocol import ResponsesRequest
from pagedllm.entrypoints.openai.responses.store import ResponseStore, StoredResponse
from pagedllm.entrypoints.openai.serving import Call, engine_error, usage_of
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.validation import check_unicode
from pagedllm.outputs import RequestOutput

PARAMS = set(ResponsesRequest.model_fields)


def reasoning_tokens(tokenizer: Any, segments: list[Segment]) -> int:
    text = "".join(s.text for s in segments if s.kind == "reasoning")
    return len(tokenizer.encode(text, add_special_tokens=False)) if text else 0


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        check_unicode(req)
        self.chat.warn_unknown_fields(req)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            prev = self.store.get(req.previous_response_id)
            if prev is None:
                raise OpenAIError(400, f"Previous response with id '{req.previous_response_id}' not found.",
                                  param="previous_response_id", code="previous_response_not_found")
            history = prev.conversation
        response_id = f"resp_{uuid.uuid4().hex}"
        try:
            new, chat_req = to_chat_request(req, history, response_id)
        except ValueError as e:
            raise bad_request(e, PARAMS) from e
        try:
            call, streams = await self.chat.start(chat_req)
        except OpenAIError as e:
            raise renamed(e, CHAT_NAMES) from e
        builder = ResponseBuilder(req, response_id, call.model)
        history = history + new
        if req.stream:
            events = ResponseEvents(builder)
            return self.chat.event_stream(self._stream(call, streams, builder, events, history),
                                          lambda e: events.error(engine_error(e)), done="")
        done = await self.chat.finish_segments(raw, call, streams)
        if isinstance(done, Response):
            return done
        final, segments = done
        return JSONResponse(self._complete(call, builder, final, segments, history))

    async def _stream(self, call: Call, streams: list[RequestStream], builder: ResponseBuilder,
                      events: ResponseEvents, history: list[dict[str, Any]]) -> AsyncIterator[str]:
        for event in events.start():
            yield event
        final = None
        async for out, segment_events, cut in self.chat.stream_segments(call, streams):
            final = out
            for ev in segment_events:
                for event in events.segment(ev, cut):
                    yield event
        assert final is not None and final.finished
        stream = call.segment_streams.get(0)
        yield events.finish(self._complete(call, builder, final, stream.segments if stream else [], history))

    def _complete(self, call: Call, builder: ResponseBuilder, final: RequestOutput, segments: list[Segment],
                  history: list[dict[str, Any]]) -> dict[str, Any]:
        """The finished Response (stored when asked)."""
        cut = final.outputs[0].finish_reason == "length"
        u = usage(usage_of([final]), reasoning_tokens(self.chat.engine.tokenizer, segments))
        response = builder.response("incomplete" if cut else "completed", builder.output(segments, cut), u)
        if builder.req.store:
            self.store.put(builder.id, StoredResponse(response, [*history, assistant_message(segments)]))
        return response

    def get(self, response_id: str) -> dict[str, Any]:
        stored = self.store.get(response_id)
        if stored is None:
            raise OpenAIError(404, f"Response with id '{response_id}' not found.", param="response_id",
                              code="not_found")
        return stored.response

    def delete(self, response_id: str) -> dict[str, Any]:
        if not self.store.delete(response_id):
            raise OpenAIError(404, f"Response with id '{response_id}' not found.", param="response_id",
                              code="not_found")
        return {"id": response_id, "object": "response", "deleted": True}


def add_responses_routes(app: FastAPI, responses: OpenAIServingResponses) -> None:
    app.add_api_route("/v1/responses", responses.create, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", responses.get, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"])
