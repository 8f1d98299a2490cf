"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with the matching HTTP status."""

from __future__ import annotations

import json
import logging
import re
import uuid

from fastapi.responses import Response

from pagedllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
          422: "invalid_request_error", 503: "server_error"}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def info(self) -> ErrorInfo:
        return ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)

    def body(self) -> str:
        # ASCII JSON: a message quoting client text with a lone surrogate still encodes
        return json.dumps(ErrorResponse(error=self.info()).model_dump(), ensure_ascii=True)

    def response(self) -> Response:
        return Response(self.body(), status_code=self.status, media_type="application/json")

    def sse(self) -> str:
        """The error as one SSE event (a failure after the stream has started)."""
        return f"data: {self.body()}\n\n"


_PARAM = re.compile(r"^([a-z_]+)\b")


def bad_request(err: Exception, known_params: set[str] | None = None) -> OpenAIError:
    """A ValueError from SamplingParams / the engine: its message starts with the parameter's name."""
    message = str(err)
    m = _PARAM.match(message)
    param = m.group(1) if m and (known_params is None or m.group(1) in known_params) else None
    return OpenAIError(400, message, param=param, code="invalid_value" if param else None)


def internal_error(err: BaseException, what: str = "internal error") -> OpenAIError:
    """A 500 that says nothing of the exception (its text may quote internals or user data): the details go
    to the log under a reference the client can quote."""
    ref = uuid.uuid4().hex[:12]
    logger.error("%s [ref %s]: %s: %s", what, ref, type(err).__name__, err, exc_info=err)
    return OpenAIError(500, f"The server had an error: {what} (reference {ref}).", code="internal_error")


def renamed(err: OpenAIError, names: dict[str, str]) -> OpenAIError:
    """An error of the chat request another API's request became, naming that API's own field."""
    if err.param in names:
        old, err.param = err.param, names[err.param]
        if err.message.startswith(old):
            err.message = err.param + err.message[len(old):]
    return err


# --- Anthropic's shape, for the /v1/messages routes: {"type": "error", "error": {"type", "message"}} ---------
ANTHROPIC_PATHS = ("/v1/messages",)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(err: OpenAIError) -> str:
    kind = _ANTHROPIC_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return json.dumps({"type": "error", "error": {"type": kind, "message": err.message}}, ensure_ascii=True)


def error_response(path: str, err: OpenAIError) -> Response:
    """The error in the shape of the API the path belongs to."""
    if path.startswith(ANTHROPIC_PATHS):
        return Response(anthropic_error_body(err), status_code=err.status, media_type="application/json")
    return err.response()
