"""uvicorn's HTTP/1.1 protocols with limits on how a client sends its headers: a deadline for a request's
headers (uvicorn's keep-alive timer restarts on every byte, so a client sending one header byte at a time would
hold its connection forever) and, for httptools, a size cap (h11 has its own: h11_max_incomplete_event_size)."""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


class _HeaderDeadline:
    header_timeout: float = 30.0
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: object

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm_header_deadline(self) -> None:
        handle = getattr(self, "_header_deadline", None)
        if handle is not None:
            handle.cancel()
        self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self.cycle is None or self.cycle.response_complete:  # still waiting for a request's headers
            logger.info("closing a connection that sent no complete request headers in %.0fs",
                        self.header_timeout)
            self.timeout_keep_alive_handler()  # close it as uvicorn closes an idle keep-alive connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing():
            self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)  # type: ignore[misc]


class H11WithHeaderDeadline(_HeaderDeadline, H11Protocol):
    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers arrived
            self._disarm_header_deadline()


def _httptools_class() -> type | None:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return None

    class HttpToolsWithHeaderLimits(_HeaderDeadline, HttpToolsProtocol):
        max_header_bytes: int = 64 * 1024

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._header_bytes = 0

        def on_url(self, url: bytes) -> None:
            self._count_header_bytes(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count_header_bytes(len(name) + len(value))
            super().on_header(name, value)

        def _count_header_bytes(self, n: int) -> None:
            self._header_bytes += n
            if self._header_bytes > self.max_header_bytes:  # the parser answers 400 and closes
                raise ValueError("request headers too large")

        def on_headers_complete(self) -> None:
            self._disarm_header_deadline()
            super().on_headers_complete()

    return HttpToolsWithHeaderLimits


def http_protocol(header_timeout: float, max_header_bytes: int) -> type[asyncio.Protocol]:
    """The protocol class for uvicorn.Config(http=...): httptools when installed (uvicorn's default), else h11."""
    base = _httptools_class() or H11WithHeaderDeadline
    return type(base.__name__, (base,), {"header_timeout": header_timeout, "max_header_bytes": max_header_bytes})
