"""What the asyncio side of AsyncEngine holds: a request's output stream, and the errors a stream raises."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm.outputs import RequestOutput


class EngineDeadError(RuntimeError):
    """The engine loop is not running (never started, shut down, or crashed)."""


class RequestFailedError(RuntimeError):
    """The engine failed while processing this request; other requests go on. Offline (LLM.generate) it is raised
    once every request has ended, with all of their outputs in `outputs` (the failed ones carry `.error`)."""

    def __init__(self, message: str, outputs: list | None = None) -> None:
        super().__init__(message)
        self.outputs = outputs


@dataclass
class Tracked:
    """Loop-thread bookkeeping of one request. It holds the stream's queue, not the stream itself, so that a
    stream dropped by its consumer gets collected (and aborted, see RequestStream.__del__)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    num_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    counted_prompt: bool = False


@dataclass
class RequestStream:
    """The outputs of one request, consumed by one asyncio task. Outputs are cumulative, so when the consumer
    lags behind, it skips straight to the newest one."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    accepted: asyncio.Future | None = None
    finished: bool = False
    on_abandon: Callable[[str], None] | None = None

    def __del__(self) -> None:
        # Safety net: a consumer that never iterated (e.g. a client gone before the response started).
        if not self.finished and self.on_abandon is not None:
            with contextlib.suppress(Exception):
                self.on_abandon(self.request_id)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        while not isinstance(item, BaseException) and not item.finished and not self.queue.empty():
            item = self.queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item
