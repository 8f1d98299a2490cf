"""What both endpoints share: model check, submission, disconnect watching, stream merging, deltas, logprobs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request

from pagedllm.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError, RequestStream
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request, internal_error
from pagedllm.entrypoints.openai.lifecycle import ShutdownGate
from pagedllm.entrypoints.openai.preprocess import PromptPreprocessor
from pagedllm.entrypoints.openai.protocol import PromptTokensDetails, UsageInfo
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of the stream


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def engine_error(err: BaseException) -> OpenAIError:
    """An error raised while a request was running, as the OpenAI error to report."""
    if isinstance(err, OpenAIError):
        return err
    if isinstance(err, EngineDeadError):
        return OpenAIError(503, "The engine is not running.", code="engine_unavailable")
    # the details are internal (exception text, tracebacks): they go to the log, the client gets a reference
    return internal_error(err, "the engine failed while processing this request"
                          if isinstance(err, RequestFailedError) else "internal error")


class ClientDisconnected(Exception):
    pass


async def wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, work: Awaitable[T], gate: ShutdownGate | None = None) -> T:
    """Run `work`; if the client goes away first, cancel it (which aborts its engine requests). If the
    graceful-shutdown deadline comes first, cancel it too and raise the shutdown error (a 503, not a cut)."""
    task = asyncio.ensure_future(work)
    disconnect = asyncio.ensure_future(wait_for_disconnect(request))
    waits = {task, disconnect} if gate is None else {task, disconnect, gate.cut_task()}
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        cut = gate is not None and gate.is_cut and not task.done() and not disconnect.done()
        for t in (task, disconnect):  # (the gate's future is shared: never cancelled here)
            if not t.done():
                t.cancel()
        for t in (task, disconnect):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
    if cut:
        raise gate.error()  # type: ignore[union-attr]
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def final_output(engine: AsyncEngine, stream: RequestStream) -> RequestOutput:
    last = None
    async with contextlib.aclosing(engine.outputs(stream)) as outs:
        async for out in outs:
            last = out
    assert last is not None and last.finished
    return last


async def final_outputs(engine: AsyncEngine, streams: list[RequestStream]) -> list[RequestOutput]:
    """All requests to the end; the first failure cancels (aborts) the others."""
    if len(streams) == 1:
        return [await final_output(engine, streams[0])]
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(final_output(engine, s)) for s in streams]
    return [t.result() for t in tasks]


async def merge_streams(engine: AsyncEngine,
                        streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as (prompt index, output), in arrival order."""
    if len(streams) == 1:
        async with contextlib.aclosing(engine.outputs(streams[0])) as outs:
            async for out in outs:
                yield 0, out
        return
    q: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async with contextlib.aclosing(engine.outputs(s)) as outs:
                async for out in outs:
                    q.put_nowait((i, out))
        except Exception as e:
            q.put_nowait((i, e))
        finally:
            q.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


def usage_of(finals: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in finals)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


@dataclass
class ChoiceDelta:
    text: str
    start_token: int  # new tokens are token_ids[start_token:end_token]
    end_token: int
    finish_reason: str | None


class DeltaTracker:
    """Turns cumulative CompletionOutputs into deltas. While a choice runs, the last (longest stop string - 1)
    characters are held back: they might be the start of a stop string that the engine will cut off."""

    def __init__(self, params: SamplingParams) -> None:
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        self.sent_text: dict[int, int] = {}
        self.sent_tokens: dict[int, int] = {}
        self.done: set[int] = set()

    def delta(self, key: int, c: CompletionOutput) -> ChoiceDelta | None:
        if key in self.done:
            return None
        sent = self.sent_text.get(key, 0)
        text = c.text
        end = len(text) if c.finish_reason is not None else max(sent, len(text) - self.hold)
        start_tok = self.sent_tokens.get(key, 0)
        end_tok = len(c.token_ids)
        if end <= sent and end_tok <= start_tok and c.finish_reason is None:
            return None
        self.sent_text[key] = max(sent, end)
        self.sent_tokens[key] = end_tok
        if c.finish_reason is not None:
            self.done.add(key)
        return ChoiceDelta(text[sent:end], start_tok, end_tok, c.finish_reason)


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


async def guarded(gen: AsyncIterator[str], gate: ShutdownGate | None = None) -> AsyncIterator[str]:
    """An SSE body that ends cleanly whatever happens after the headers: a failure, or the graceful-shutdown
    deadline, becomes one error event followed by [DONE], never a connection cut mid-body."""
    nxt: asyncio.Future | None = None
    try:
        while True:
            nxt = asyncio.ensure_future(anext(gen))
            if gate is not None:
                await asyncio.wait({nxt, gate.cut_task()}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():  # the deadline came first (the finally below stops the body)
                    yield gate.error().sse() + SSE_DONE
                    return
            try:
                chunk = await nxt
            except StopAsyncIteration:
                return
            yield chunk
    except ClientDisconnected:
        return
    except Exception as e:
        yield engine_error(e).sse() + SSE_DONE
    finally:
        if nxt is not None and not nxt.done():
            nxt.cancel()
            with contextlib.suppress(BaseException):
                await nxt
        await gen.aclose()  # type: ignore[attr-defined]  # aborts the body's engine requests


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, served_model_name: str, *,
                 preprocess: PromptPreprocessor | None = None, gate: ShutdownGate | None = None) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.preprocess = preprocess or PromptPreprocessor(engine)
        self.gate = gate

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.served_model_name, self.engine.model_name):
            raise OpenAIError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")

    def check_token_ids(self, ids: list[int]) -> None:
        # the engine checks the ids against the model's vocabulary at add time
        if not ids:
            raise OpenAIError(400, "prompt must not be empty", param="prompt", code="invalid_value")

    async def submit(self, prompts: list[str | list[int]], params: SamplingParams, base_id: str,
                     cache_salt: str | None, known_params: set[str]) -> list[RequestStream]:
        """Tokenize every prompt (off the loops), then add them; on any rejection abort those already added
        and raise the OpenAI error."""
        streams: list[RequestStream] = []
        param = "messages" if "messages" in known_params else "prompt"  # chat: the templated conversation
        try:
            ids = [await self.preprocess.tokenize(p, param) for p in prompts]
            for i, (p, p_ids) in enumerate(zip(prompts, ids, strict=True)):
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                streams.append(await self.engine.add_request(p, params, rid, cache_salt, prompt_token_ids=p_ids))
        except BaseException as e:
            for s in streams:
                self.engine.abort(s.request_id)
            if isinstance(e, ValueError):
                err = bad_request(e, known_params | {"prompt"})
                if err.param == "prompt" and "messages" in known_params:
                    err.param = "messages"  # chat: the prompt is the templated conversation
                raise err from e
            if isinstance(e, EngineDeadError):
                raise engine_error(e) from e
            raise
        return streams
