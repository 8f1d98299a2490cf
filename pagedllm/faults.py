"""Faults of one request versus signals to the process. Native libraries may raise BaseExceptions that are not
Exceptions (a Rust panic in `tokenizers` or `llguidance` surfaces as pyo3's PanicException): at a request's
boundary those fail that request, while KeyboardInterrupt, SystemExit and cancellation keep propagating."""

from __future__ import annotations

import asyncio

_PROCESS_SIGNALS = (KeyboardInterrupt, SystemExit, GeneratorExit, asyncio.CancelledError)


def is_request_fault(e: BaseException) -> bool:
    """True for anything a request's input can provoke (every Exception, and native BaseExceptions)."""
    return isinstance(e, Exception) or not isinstance(e, _PROCESS_SIGNALS)


def as_exception(e: BaseException, what: str) -> Exception:
    """`e` as an Exception the request boundary can report: Exceptions as they are, native BaseExceptions wrapped
    in a RuntimeError naming `what` failed."""
    if isinstance(e, Exception):
        return e
    return RuntimeError(f"{what} failed in native code: {type(e).__name__}: {e}")
