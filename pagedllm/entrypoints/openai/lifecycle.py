"""The server's life cycle around uvicorn: a graceful shutdown whose deadline ends every response cleanly (an
error event and [DONE], not a cut) and exits 0."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

import uvicorn

from pagedllm.entrypoints.openai.errors import OpenAIError

logger = logging.getLogger(__name__)


class ShutdownGate:
    """Set when the graceful-shutdown deadline is about to expire: responses still running end themselves."""

    def __init__(self) -> None:
        self._cut: asyncio.Future | None = None

    def cut_task(self) -> asyncio.Future:
        """A future done at the deadline (one per event loop; the app runs in one)."""
        if self._cut is None:
            self._cut = asyncio.get_running_loop().create_future()
        return self._cut

    @property
    def is_cut(self) -> bool:
        return self._cut is not None and self._cut.done()

    def cut(self) -> None:
        fut = self.cut_task()
        if not fut.done():
            fut.set_result(None)

    @staticmethod
    def error() -> OpenAIError:
        return OpenAIError(503, "The server is shutting down; the request was stopped before it finished.",
                           code="server_shutdown")


def cut_margin(timeout: float) -> float:
    """How long before uvicorn's own deadline (which cancels responses mid-body) the gate closes, so that every
    response has time to write its error event and end."""
    return min(max(0.5, 0.1 * timeout), timeout)


class Server(uvicorn.Server):
    """uvicorn's server with a clean end to the graceful shutdown and exit status 0 after a signal."""

    def __init__(self, config: uvicorn.Config, gate: ShutdownGate) -> None:
        super().__init__(config)
        self.gate = gate

    async def shutdown(self, sockets=None) -> None:  # type: ignore[no-untyped-def]
        timeout = self.config.timeout_graceful_shutdown
        handle = None
        if timeout is not None:
            handle = asyncio.get_running_loop().call_later(timeout - cut_margin(timeout), self._cut)
        try:
            await super().shutdown(sockets)
        finally:
            if handle is not None:
                handle.cancel()

    def _cut(self) -> None:
        if self.server_state.tasks:
            logger.warning("graceful shutdown deadline: ending %d unfinished response(s) with an error event",
                           len(self.server_state.tasks))
        self.gate.cut()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises the captured signal after its graceful shutdown (exit status -15);
        # the shutdown was clean, so exit 0 instead.
        with super().capture_signals():
            yield
            getattr(self, "_captured_signals", []).clear()
