"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the chat engine path (one request
= one chat request = one engine request, with the chat endpoint's validation, limits, metrics and logs); errors
in Anthropic's shape (errors.error_response picks it for these paths)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.async_engine import RequestStream
from pagedllm.entrypoints.openai.anthropic import render
from pagedllm.entrypoints.openai.anthropic.convert import (
    CHAT_NAMES,
    CountTokensRequest,
    MessagesRequest,
    to_chat_request,
)
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request, renamed
from pagedllm.entrypoints.openai.serving import Call, engine_error
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.validation import check_unicode

PARAMS = set(MessagesRequest.model_fields)


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def _start(self, req: MessagesRequest, message_id: str) -> tuple[Call, list[RequestStream]]:
        check_unicode(req)
        self.chat.warn_unknown_fields(req)
        try:
            chat_req = to_chat_request(req, message_id)
        except ValueError as e:
            raise bad_request(e, PARAMS) from e
        try:
            return await self.chat.start(chat_req)
        except OpenAIError as e:
            raise renamed(e, CHAT_NAMES) from e

    async def create(self, req: MessagesRequest, raw: Request) -> Response:
        message_id = f"msg_{uuid.uuid4().hex}"
        call, streams = await self._start(req, message_id)
        if req.stream:
            return self.chat.event_stream(self._stream(call, streams, message_id),
                                          lambda e: render.error_event(engine_error(e)), done="")
        done = await self.chat.finish_segments(raw, call, streams)
        if isinstance(done, Response):
            return done
        final, segments = done
        return JSONResponse(render.message(message_id, call.model, segments, final))

    async def _stream(self, call: Call, streams: list[RequestStream], message_id: str) -> AsyncIterator[str]:
        final = None
        async for out, events, _ in self.chat.stream_segments(call, streams):
            if final is None:
                yield render.message_start(message_id, call.model, out)
            final = out
            for ev in events:
                for event in render.segment_events(ev):
                    yield event
        assert final is not None and final.finished
        stream = call.segment_streams.get(0)
        for event in render.message_end(stream.segments if stream else [], final):
            yield event

    async def count_tokens(self, req: CountTokensRequest) -> dict[str, int]:
        check_unicode(req)
        self.chat.check_model(req.model)
        try:
            chat_req = to_chat_request(req)
        except ValueError as e:
            raise bad_request(e, PARAMS) from e
        try:
            prompt = (await self.chat.prompts(chat_req))[0]
            ids = await self.chat.preprocess.token_ids(prompt) if isinstance(prompt, str) else prompt
        except OpenAIError as e:
            raise renamed(e, CHAT_NAMES) from e
        return {"input_tokens": len(ids)}


def add_messages_routes(app: FastAPI, messages: AnthropicServingMessages) -> None:
    app.add_api_route("/v1/messages", messages.create, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"])
