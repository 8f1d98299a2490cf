"""What both endpoints share: model check, submission, the request's life (one response or an SSE stream), usage,
logprobs. The endpoints say only what differs: their prompts, choices and chunks."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from pagedllm.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError, RequestStream
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request, internal_error
from pagedllm.entrypoints.openai.lifecycle import ShutdownGate
from pagedllm.entrypoints.openai.output_parser import (
    OutputParser,
    Segment,
    SegmentEvent,
    SegmentStream,
    mark_cut,
    parse_final,
)
from pagedllm.entrypoints.openai.preprocess import PromptPreprocessor
from pagedllm.entrypoints.openai.protocol import PromptTokensDetails, UsageInfo
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels, model_not_found
from pagedllm.entrypoints.openai.streams import (
    SSE_DONE,
    ChoiceDelta,
    ClientDisconnected,
    DeltaTracker,
    final_outputs,
    guarded,
    merge_streams,
    run_until_disconnect,
)
from pagedllm.entrypoints.openai.structured import requested_structure
from pagedllm.entrypoints.openai.validation import check_unicode
from pagedllm.lora.request import LoRANotFoundError, LoRARequest
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured import StructuredOutputsParams

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of the stream


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def engine_error(err: BaseException) -> OpenAIError:
    """An error raised while a request was running, as the OpenAI error to report."""
    if isinstance(err, OpenAIError):
        return err
    if isinstance(err, EngineDeadError):  # our own short texts ("engine replica 0 died ..."); causes stay in the log
        return OpenAIError(503, f"The engine is not available: {err}.", code="engine_unavailable")
    # the details are internal (exception text, tracebacks): they go to the log, the client gets a reference
    return internal_error(err, "the engine failed while processing this request"
                          if isinstance(err, RequestFailedError) else "internal error")


def usage_of(finals: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in finals)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def prompt_logprobs_json(out: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
    if out.prompt_logprobs is None:
        return None
    return [None if d is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                    for t, lp in d.items()} for d in out.prompt_logprobs]


class LogprobFormatter:
    def __init__(self, tokenizer: Any, top_n: int) -> None:
        self.tokenizer = tokenizer
        self.top_n = top_n

    def token_text(self, token_id: int, lp: Logprob | None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id])

    def entries(self, c: CompletionOutput, start: int, end: int
                ) -> list[tuple[str, float, list[tuple[str, float]]]]:
        """(token text, logprob, [(top token text, logprob)...]) for the tokens start..end of one choice."""
        if c.logprobs is None:
            return []
        out = []
        for tid, d in zip(c.token_ids[start:end], c.logprobs[start:end], strict=False):
            lp = d.get(tid)
            ranked = sorted((e for e in d.items() if e[1].rank is not None and e[1].rank <= self.top_n),
                            key=lambda e: e[1].rank)
            top = [(self.token_text(t, v), v.logprob) for t, v in ranked[: self.top_n]]
            out.append((self.token_text(tid, lp), lp.logprob if lp is not None else float("nan"), top))
        return out


def now() -> int:
    return int(time.time())


Prompt = str | list[int]


@dataclass
class Call:
    """One HTTP request being served, as the endpoint hooks see it."""

    req: Any  # the endpoint's request model
    params: SamplingParams
    request_id: str
    model: str
    prompts: list[Prompt]
    fmt: LogprobFormatter
    created: int = field(default_factory=now)
    text_offsets: dict[int, int] = field(default_factory=dict)  # characters sent per choice (completions)
    parser: OutputParser | None = None  # chat: reasoning and tool calls read from the text
    segment_streams: dict[int, SegmentStream] = field(default_factory=dict)  # per choice, while streaming
    texts: dict[int, str] = field(default_factory=dict)  # text streamed so far per choice

    def segment_events(self, index: int, d: ChoiceDelta) -> list[SegmentEvent]:
        """The segment events of choice `index`'s new text `d`."""
        assert self.parser is not None
        stream = self.segment_streams.setdefault(index, SegmentStream(self.parser))
        self.texts[index] = text = self.texts.get(index, "") + d.text
        events = stream.update(text, final=d.finish_reason is not None)
        if d.finish_reason is not None:
            mark_cut(stream.segments, d.finish_reason)
        return events

    @property
    def include_usage(self) -> bool:
        return bool(self.req.include_usage)

    def choice_index(self, prompt_index: int, c: CompletionOutput) -> int:
        return prompt_index * self.params.n + c.index

    def chunk(self, resp: BaseModel, usage: UsageInfo | None = None) -> str:
        """One SSE event; OpenAI sends only the delta fields that are set, and usage only when asked."""
        if usage is not None:
            resp.usage = usage  # type: ignore[attr-defined]
        d = resp.model_dump(mode="json")
        for choice in d.get("choices", ()):
            if isinstance(choice.get("delta"), dict):
                choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        if not self.include_usage:
            d.pop("usage", None)
        return sse(d)


class OpenAIServing:
    """create() runs one request of an endpoint; subclasses fill in the hooks below."""

    id_prefix: ClassVar[str]
    request_params: ClassVar[set[str]]  # the endpoint's field names (errors name them)
    stream_model: ClassVar[type[BaseModel]]  # the endpoint's chunk: id, created, model, choices, usage

    def __init__(self, engine: AsyncEngine, models: OpenAIServingModels | str | list[str], *,
                 preprocess: PromptPreprocessor | None = None, gate: ShutdownGate | None = None) -> None:
        """models: what the server serves (shared by the endpoints: adapters load and unload at run time), or
        the base model's served names alone."""
        self.engine = engine
        self.preprocess = preprocess or PromptPreprocessor.for_engine(engine)
        self.gate = gate  # closed at the graceful-shutdown deadline: running responses end themselves
        self.models = models if isinstance(models, OpenAIServingModels) else OpenAIServingModels(engine, models)
        self.served_model_name = self.models.model_name
        self.default_chat_template: str | None = None  # --chat-template; a request's own wins, if trusted
        self.trust_request_chat_template = False  # --trust-request-chat-template
        self._warned_fields: set[str] = set()

    def request_chat_template(self, template: str | None) -> str | None:
        """The template a request renders with: its own only when the server trusts request templates (a
        template is a program the server runs), else a 400; without one, --chat-template or the model's."""
        if template is not None and not self.trust_request_chat_template:
            raise OpenAIError(400, "chat_template: a chat template was passed with the request, but the server was "
                                   "not started with --trust-request-chat-template; refused the untrusted template",
                              param="chat_template", code="invalid_value")
        return template or self.default_chat_template

    def warn_unknown_fields(self, req: BaseModel) -> None:
        """Unknown fields are ignored; each name is logged once per server, not on every request."""
        new = sorted(set(req.model_extra or ()) - self._warned_fields)
        if new:
            self._warned_fields.update(new)
            logger.warning("ignoring unknown request fields of %s: %s", type(req).__name__, ", ".join(new))

    # -- hooks ----------------------------------------------------------------------------------------------
    async def prompts(self, req: Any) -> list[Prompt]:
        raise NotImplementedError

    def structure(self, call: Call) -> StructuredOutputsParams | None:
        """What the output must match (response_format, structured_outputs, guided_*); ValueError if invalid."""
        return requested_structure(call.req)

    def response(self, call: Call, finals: list[RequestOutput]) -> BaseModel:
        """The whole (non-streamed) response."""
        raise NotImplementedError

    def stream_start(self, call: Call) -> Iterable[BaseModel]:
        """Chunks sent before any token (chat: the role; completions with echo: the prompts)."""
        return ()

    def stream_delta(self, call: Call, index: int, c: CompletionOutput, d: ChoiceDelta) -> Iterable[BaseModel]:
        """Chunks for the new part `d` of choice `index`."""
        raise NotImplementedError

    def stream_chunk(self, call: Call, choice: Any = None, usage: UsageInfo | None = None) -> BaseModel:
        """One chunk with one choice, or the closing usage chunk (no choice)."""
        return self.stream_model(id=call.request_id, created=call.created, model=call.model,
                                 choices=[choice] if choice is not None else [], usage=usage)

    # -- the request's life ---------------------------------------------------------------------------------
    async def create(self, req: Any, raw: Request) -> Response:
        call, streams = await self.start(req)
        if req.stream:
            return self.event_stream(self._stream(call, streams), lambda e: engine_error(e).sse())
        finals = await self.finish(raw, streams)
        if isinstance(finals, Response):
            return finals
        return JSONResponse(self.response(call, finals).model_dump(mode="json"))

    async def start(self, req: Any) -> tuple[Call, list[RequestStream]]:
        """Validate a request, render its prompts and add them to the engine: the part every API shares."""
        check_unicode(req)
        self.warn_unknown_fields(req)
        lora = self.check_model(req.model)
        try:
            params = req.to_sampling_params(getattr(self.engine, "generation_defaults", None))
        except ValueError as e:
            raise bad_request(e, self.request_params) from e
        prompts = await self.prompts(req)
        call = Call(req, params, req.request_id or random_id(self.id_prefix), req.model or self.served_model_name,
                    prompts, LogprobFormatter(self.engine.tokenizer, params.logprobs or 0))
        try:
            params.structured_outputs = self.structure(call)
            if params.structured_outputs is not None:
                await self.engine.compile_grammar(params.structured_outputs)
        except ValueError as e:  # GrammarError included: its message starts with the field at fault
            raise bad_request(e, self.request_params) from e
        return call, await self.submit(prompts, params, call.request_id, req.cache_salt, self.request_params,
                                       getattr(req, "priority", 0), lora_request=lora)

    def event_stream(self, body: AsyncIterator[str], on_error: Callable[[BaseException], str],
                     done: str = SSE_DONE) -> Response:
        """An SSE response; on_error renders a failure (or the shutdown deadline) as the API's error event."""
        return StreamingResponse(guarded(body, on_error, self.gate, done), media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    async def finish(self, raw: Request, streams: list[RequestStream]) -> list[RequestOutput] | Response:
        """The final outputs of a non-streamed request (a 499 response if the client went away)."""
        try:
            return await run_until_disconnect(raw, final_outputs(self.engine, streams), self.gate)
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as e:
            raise engine_error(e) from e

    async def finish_segments(self, raw: Request, call: Call, streams: list[RequestStream]
                              ) -> tuple[RequestOutput, list[Segment]] | Response:
        """A one-choice request to its end: its final output and segments (a 499 response if the client left)."""
        finals = await self.finish(raw, streams)
        if isinstance(finals, Response):
            return finals
        (final,) = finals
        c = final.outputs[0]
        segments = parse_final(call.parser or OutputParser(), c.text)
        mark_cut(segments, c.finish_reason)
        return final, segments

    async def stream_segments(self, call: Call, streams: list[RequestStream]
                              ) -> AsyncIterator[tuple[RequestOutput, list[SegmentEvent], bool]]:
        """A one-choice request's outputs as they come, each with its segment events and whether the output was
        cut by max_tokens (the last one says how it ended)."""
        tracker = DeltaTracker(call.params)
        async for _, out in merge_streams(self.engine, streams):
            d = tracker.delta(0, out.outputs[0])
            yield out, call.segment_events(0, d) if d is not None else [], out.outputs[0].finish_reason == "length"

    async def _stream(self, call: Call, streams: list[RequestStream]) -> AsyncIterator[str]:
        for resp in self.stream_start(call):
            yield call.chunk(resp)
        tracker = DeltaTracker(call.params)
        finals: dict[int, RequestOutput] = {}
        latest: dict[int, RequestOutput] = {}
        async for i, out in merge_streams(self.engine, streams):
            latest[i] = out
            if out.finished:
                finals[i] = out
            usage = usage_of(list(latest.values())) if call.req.continuous_usage else None
            for c in out.outputs:
                index = call.choice_index(i, c)
                d = tracker.delta(index, c)
                if d is not None:
                    for resp in self.stream_delta(call, index, c, d):
                        yield call.chunk(resp, usage)
        if call.include_usage:
            usage = usage_of([finals[i] for i in sorted(finals)])
            yield sse(self.stream_chunk(call, usage=usage).model_dump(mode="json"))
        yield SSE_DONE

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (None: the base model); a 404 for a model not served."""
        return self.models.lora_request(model)

    def check_token_ids(self, ids: list[int]) -> None:
        # the engine checks the ids against the model's vocabulary at add time
        if not ids:
            raise OpenAIError(400, "prompt must not be empty", param="prompt", code="invalid_value")

    async def submit(self, prompts: list[str | list[int] | dict], params: SamplingParams | PoolingParams, base_id: str,
                     cache_salt: str | None, known_params: set[str], priority: int = 0,
                     param: str | None = None, lora_request: LoRARequest | None = None) -> list[RequestStream]:
        """Tokenize every prompt (off the loops), then add them; on any rejection abort those already added
        and raise the OpenAI error. param: the field the prompts came from (errors name it). lora_request: the
        adapter they run with (check_model's)."""
        streams: list[RequestStream] = []
        param = param or ("messages" if "messages" in known_params else "prompt")  # chat: the templated conversation
        pooling = isinstance(params, PoolingParams)  # an embedding's prompt may fill the context, or be truncated
        limits = {"prefill_only": True, "truncating": params.truncate_prompt_tokens is not None} if pooling else {}
        lora = {} if lora_request is None else {"lora_request": lora_request}
        try:
            # (a dict: a cross-encoder's pair, tokenized and checked by the caller)
            tokenized = [{} if isinstance(p, dict) else await self.preprocess.tokenize(p, param, **limits)
                         for p in prompts]
            for i, (p, kw) in enumerate(zip(prompts, tokenized, strict=True)):
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                streams.append(await self.engine.add_request(p, params, rid, cache_salt, priority=priority, **kw,
                                                             **lora))
        except BaseException as e:
            for s in streams:
                self.engine.abort(s.request_id)
            if isinstance(e, LoRANotFoundError):  # unloaded while this request was on its way
                raise model_not_found(e.lora_name) from e
            if isinstance(e, ValueError):
                err = bad_request(e, known_params | {"prompt"})
                if err.param == "prompt" and param != "prompt":
                    err.param = param  # chat: the prompt is the templated conversation; embeddings: the input
                raise err from e
            if isinstance(e, EngineDeadError):
                raise engine_error(e) from e
            raise
        return streams
