"""/v1/chat/completions: the model's chat template, then the same engine path as completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.engine.async_engine import RequestStream
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request
from pagedllm.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobToken,
    ChatLogprobTop,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
)
from pagedllm.entrypoints.openai.serving import (
    SSE_DONE,
    SSE_HEADERS,
    ClientDisconnected,
    DeltaTracker,
    LogprobFormatter,
    OpenAIServing,
    engine_error,
    final_outputs,
    guarded,
    merge_streams,
    now,
    random_id,
    run_until_disconnect,
    sse,
    usage_of,
)
from pagedllm.entrypoints.openai.validation import check_unicode
from pagedllm.outputs import CompletionOutput

_PARAMS = set(ChatCompletionRequest.model_fields)


def _logprobs(fmt: LogprobFormatter, c: CompletionOutput, start: int, end: int) -> ChatChoiceLogprobs:
    content = [
        ChatLogprobToken(token=t, logprob=lp, bytes=list(t.encode("utf-8")),
                         top_logprobs=[ChatLogprobTop(token=tt, logprob=tl, bytes=list(tt.encode("utf-8")))
                                       for tt, tl in top])
        for t, lp, top in fmt.entries(c, start, end)
    ]
    return ChatChoiceLogprobs(content=content)


class OpenAIServingChat(OpenAIServing):
    async def _prompt(self, req: ChatCompletionRequest) -> str:
        try:
            messages = [m.to_template_dict() for m in req.messages]
            return await self.preprocess.render_chat(messages)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="messages", code="invalid_value") from e
        except Exception as e:  # jinja errors of the template (roles must alternate, ...)
            raise OpenAIError(400, f"messages: chat template failed: {e}", param="messages",
                              code="invalid_value") from e

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        check_unicode(req)
        self.check_model(req.model)
        try:
            params = req.to_sampling_params()
        except ValueError as e:
            raise bad_request(e, _PARAMS) from e
        prompt = await self._prompt(req)
        rid = random_id("chatcmpl")
        model = req.model or self.served_model_name
        streams = await self.submit([prompt], params, rid, req.cache_salt, _PARAMS)
        fmt = LogprobFormatter(self.engine.tokenizer, req.top_logprobs or 0)
        if req.stream:
            body = self._stream(req, params.n, rid, model, streams[0], DeltaTracker(params), fmt)
            return StreamingResponse(guarded(body, self.gate),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        try:
            (final,) = await run_until_disconnect(raw, final_outputs(self.engine, streams), self.gate)
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as e:
            raise engine_error(e) from e
        choices = [
            ChatCompletionChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                                 logprobs=_logprobs(fmt, c, 0, len(c.token_ids)) if req.logprobs else None,
                                 finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            for c in sorted(final.outputs, key=lambda c: c.index)
        ]
        resp = ChatCompletionResponse(id=rid, created=now(), model=model, choices=choices,
                                      usage=usage_of([final]))
        return JSONResponse(resp.model_dump(mode="json"))

    async def _stream(self, req: ChatCompletionRequest, n: int, rid: str, model: str, stream: RequestStream,
                      tracker: DeltaTracker, fmt: LogprobFormatter) -> AsyncIterator[str]:
        created = now()
        include_usage = req.include_usage

        def chunk(index: int, delta: DeltaMessage, lp: ChatChoiceLogprobs | None = None,
                  finish: str | None = None, stop_reason: Any = None) -> str:
            resp = ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[
                ChatStreamChoice(index=index, delta=delta, logprobs=lp, finish_reason=finish,
                                 stop_reason=stop_reason)])
            d = resp.model_dump(mode="json")
            # OpenAI sends only the delta fields that are set: {"role", "content"}, {"content"}, then {}
            d["choices"][0]["delta"] = {k: v for k, v in d["choices"][0]["delta"].items() if v is not None}
            if not include_usage:
                d.pop("usage")
            return sse(d)

        for i in range(n):
            yield chunk(i, DeltaMessage(role="assistant", content=""))
        final = None
        async for _, out in merge_streams(self.engine, [stream]):
            if out.finished:
                final = out
            for c in out.outputs:
                d = tracker.delta(c.index, c)
                if d is None:
                    continue
                lp = None
                if req.logprobs and d.end_token > d.start_token:
                    lp = _logprobs(fmt, c, d.start_token, d.end_token)
                if d.text or lp is not None:
                    yield chunk(c.index, DeltaMessage(content=d.text), lp)
                if d.finish_reason is not None:
                    yield chunk(c.index, DeltaMessage(), finish=d.finish_reason, stop_reason=c.stop_reason)
        if include_usage and final is not None:
            yield sse(ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[],
                                                   usage=usage_of([final])).model_dump(mode="json"))
        yield SSE_DONE
