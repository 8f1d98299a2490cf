"""/v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.engine.async_engine import RequestStream
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request
from pagedllm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
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
from pagedllm.sampling_params import SamplingParams

_PARAMS = set(CompletionRequest.model_fields)


def _logprobs(fmt: LogprobFormatter, c: CompletionOutput, start: int, end: int, offset: int
              ) -> tuple[CompletionLogprobs, int]:
    lp = CompletionLogprobs()
    for text, logprob, top in fmt.entries(c, start, end):
        lp.tokens.append(text)
        lp.token_logprobs.append(logprob)
        lp.top_logprobs.append(dict(top))
        lp.text_offset.append(offset)
        offset += len(text)
    return lp, offset


class OpenAIServingCompletion(OpenAIServing):
    def _prompts(self, req: CompletionRequest) -> list[str | list[int]]:
        p = req.prompt
        if isinstance(p, str):
            prompts: list[str | list[int]] = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [p]  # type: ignore[list-item]
        else:
            prompts = list(p)  # type: ignore[arg-type]
        if not prompts:
            raise OpenAIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
        for q in prompts:
            if isinstance(q, list):
                self.check_token_ids(q)
        return prompts

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        check_unicode(req)
        self.check_model(req.model)
        try:
            params = req.to_sampling_params()
        except ValueError as e:
            raise bad_request(e, _PARAMS) from e
        prompts = self._prompts(req)
        rid = random_id("cmpl")
        model = req.model or self.served_model_name
        streams = await self.submit(prompts, params, rid, req.cache_salt, _PARAMS)
        echo = [self._echo_text(p) for p in prompts] if req.echo else None
        if req.stream:
            body = self._stream(req, params, rid, model, streams, echo)
            return StreamingResponse(guarded(body, self.gate),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        try:
            finals = await run_until_disconnect(raw, final_outputs(self.engine, streams), self.gate)
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as e:
            raise engine_error(e) from e
        fmt = LogprobFormatter(self.engine.tokenizer, req.logprobs or 0)
        choices = []
        for i, out in enumerate(finals):
            prefix = echo[i] if echo else ""
            for c in out.outputs:
                lp = _logprobs(fmt, c, 0, len(c.token_ids), len(prefix))[0] if req.logprobs is not None else None
                choices.append(CompletionChoice(index=i * params.n + c.index, text=prefix + c.text, logprobs=lp,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        choices.sort(key=lambda ch: ch.index)
        resp = CompletionResponse(id=rid, created=now(), model=model, choices=choices, usage=usage_of(finals))
        return JSONResponse(resp.model_dump(mode="json"))

    def _echo_text(self, prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(prompt)

    async def _stream(self, req: CompletionRequest, params: SamplingParams, rid: str, model: str,
                      streams: list[RequestStream], echo: list[str] | None) -> AsyncIterator[str]:
        created = now()
        include_usage = req.include_usage
        tracker = DeltaTracker(params)
        fmt = LogprobFormatter(self.engine.tokenizer, req.logprobs or 0)
        offsets: dict[int, int] = {}
        finals = {}

        def chunk(index: int, text: str, lp: CompletionLogprobs | None, finish: str | None,
                  stop_reason: int | str | None) -> str:
            resp = CompletionStreamResponse(id=rid, created=created, model=model, choices=[
                CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=finish,
                                 stop_reason=stop_reason)])
            d = resp.model_dump(mode="json")
            if not include_usage:
                d.pop("usage")
            return sse(d)

        if echo:
            for i, text in enumerate(echo):
                for j in range(params.n):
                    offsets[i * params.n + j] = len(text)
                    yield chunk(i * params.n + j, text, None, None, None)
        async for i, out in merge_streams(self.engine, streams):
            if out.finished:
                finals[i] = out
            for c in out.outputs:
                index = i * params.n + c.index
                d = tracker.delta(index, c)
                if d is None:
                    continue
                lp = None
                if req.logprobs is not None and d.end_token > d.start_token:
                    lp, offsets[index] = _logprobs(fmt, c, d.start_token, d.end_token, offsets.get(index, 0))
                if d.text or lp is not None:
                    yield chunk(index, d.text, lp, None, None)
                if d.finish_reason is not None:
                    yield chunk(index, "", None, d.finish_reason, c.stop_reason)
        if include_usage:
            usage = usage_of([finals[i] for i in sorted(finals)])
            yield sse(CompletionStreamResponse(id=rid, created=created, model=model, choices=[],
                                               usage=usage).model_dump(mode="json"))
        yield SSE_DONE
