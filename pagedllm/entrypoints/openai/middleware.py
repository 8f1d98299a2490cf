"""ASGI middleware in front of the app: the API key, and limits on how much and how slowly a client may send."""

from __future__ import annotations

import asyncio
import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.entrypoints.openai.errors import OpenAIError, error_response

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # ~1M tokens of text; a max_model_len prompt is far smaller
DEFAULT_BODY_TIMEOUT = 30.0  # seconds a client may pause while sending its body
_DRAIN_FACTOR = 4


def _unauthorized(message: str, status: int = 401) -> OpenAIError:
    return OpenAIError(status, message, code="invalid_api_key")


# besides /v1: what changes the engine's state, and the unversioned aliases that run the model
PROTECTED_PATHS = ("/reset_prefix_cache", "/score", "/rerank", "/v2/rerank")


class ApiKeyMiddleware:
    """Every /v1 route (and POST /reset_prefix_cache) needs one of the keys, as `Authorization: Bearer <key>`
    (scheme case-insensitive, RFC 7235) or as `x-api-key: <key>` (Anthropic's clients), each header at most
    once and every one sent right; checked before the body is even read."""

    def __init__(self, app: ASGIApp, api_key: str | list[str]) -> None:
        self.app = app
        self.expected = [k.encode() for k in ([api_key] if isinstance(api_key, str) else api_key)]

    def _known(self, token: bytes) -> bool:
        # compare with every key (no early exit) so that timing tells nothing about which one came close
        return any([hmac.compare_digest(token.strip(), k) for k in self.expected])

    def _error(self, scope: Scope) -> OpenAIError | None:
        auth = [v for k, v in scope["headers"] if k == b"authorization"]
        x_key = [v for k, v in scope["headers"] if k == b"x-api-key"]
        if len(auth) > 1 or len(x_key) > 1:  # which one would a proxy have checked? refuse to guess
            return _unauthorized("Send exactly one Authorization (or x-api-key) header.", status=400)
        tokens = list(x_key)
        if auth:
            scheme, _, token = auth[0].strip().partition(b" ")
            tokens.append(token if scheme.lower() == b"bearer" else b"")
        if not tokens or not all([self._known(t) for t in tokens]):
            return _unauthorized("Incorrect or missing API key: send `Authorization: Bearer <key>` or "
                                 "`x-api-key: <key>`.")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path.startswith("/v1") or path in PROTECTED_PATHS:
            err = self._error(scope)
            if err is not None:
                await error_response(path, err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestLimitsMiddleware:
    """Reads each request body up front under a size cap (413) and a deadline between its chunks (408), then
    hands it to the app in one piece."""

    def __init__(self, app: ASGIApp, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 body_timeout: float = DEFAULT_BODY_TIMEOUT) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout

    def _too_large(self, size: int | None = None) -> OpenAIError:
        got = f" ({size} bytes)" if size is not None else ""
        return OpenAIError(413, f"Request body too large{got}: the limit is {self.max_body_bytes} bytes "
                                "(--max-request-body-bytes).", code="request_too_large")

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | OpenAIError | None:
        """The whole body; an error to send; None if the client went away. A body over the cap is read on
        and dropped up to _DRAIN_FACTOR x the cap, so that a client still sending gets the 413 rather than a
        reset connection; beyond that the connection is closed on it."""
        declared = dict(scope["headers"]).get(b"content-length")
        size = int(declared) if declared is not None and declared.isdigit() else None
        if size is not None and size > self.max_body_bytes * _DRAIN_FACTOR:
            return self._too_large(size)
        body, received = bytearray(), 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout)
            except TimeoutError:
                return OpenAIError(408, f"Request body not received within {self.body_timeout:g}s.",
                                   code="request_timeout")
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            received += len(chunk)
            if received <= self.max_body_bytes:
                body += chunk
            elif received > self.max_body_bytes * _DRAIN_FACTOR:
                return self._too_large(size)
            if not message.get("more_body", False):
                return bytes(body) if received <= self.max_body_bytes else self._too_large(received)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        body = await self._read_body(scope, receive)
        if body is None:
            return
        if isinstance(body, OpenAIError):
            response = error_response(scope.get("path", ""), body)
            response.headers["connection"] = "close"  # the rest of the body is not read
            await response(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then the real channel (disconnect detection)

        await self.app(scope, replay, send)
