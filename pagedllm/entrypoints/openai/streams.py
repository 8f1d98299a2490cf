"""Async plumbing of a request's outputs: disconnect watching, stream merging, deltas, guarded SSE bodies."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request

from pagedllm.engine.async_engine import AsyncEngine, RequestStream
from pagedllm.entrypoints.openai.lifecycle import ShutdownGate
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

T = TypeVar("T")
SSE_DONE = "data: [DONE]\n\n"


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


async def guarded(gen: AsyncIterator[str], on_error: Callable[[BaseException], str],
                  gate: ShutdownGate | None = None, done: str = SSE_DONE) -> AsyncIterator[str]:
    """An SSE body that ends cleanly whatever happens after the headers: a failure, or the graceful-shutdown
    deadline, becomes one error event followed by `done` ([DONE]; APIs without it pass ""), never a
    connection cut mid-body."""
    nxt: asyncio.Future | None = None
    try:
        while True:
            nxt = asyncio.ensure_future(anext(gen))
            if gate is not None:
                await asyncio.wait({nxt, gate.cut_task()}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():  # the deadline came first (the finally below stops the body)
                    yield on_error(gate.error()) + done
                    return
            try:
                chunk = await nxt
            except StopAsyncIteration:
                return
            yield chunk
    except ClientDisconnected:
        return
    except Exception as e:
        yield on_error(e) + done
    finally:
        if nxt is not None and not nxt.done():
            nxt.cancel()
            with contextlib.suppress(BaseException):
                await nxt
        await gen.aclose()  # type: ignore[attr-defined]  # aborts the body's engine requests
