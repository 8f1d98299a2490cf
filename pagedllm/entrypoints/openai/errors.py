"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with the matching HTTP status."""

from __future__ import annotations

import json
import re

from fastapi.responses import JSONResponse

from pagedllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 422: "invalid_request_error", 503: "server_error"}


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

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info()).model_dump(), status_code=self.status)

    def sse(self) -> str:
        """The error as one SSE event (a failure after the stream has started)."""
        return f"data: {json.dumps(ErrorResponse(error=self.info()).model_dump())}\n\n"


_PARAM = re.compile(r"^([a-z_]+)\b")


def bad_request(err: Exception, known_params: set[str] | None = None) -> OpenAIError:
    """A ValueError from SamplingParams / the engine: its message starts with the parameter's name."""
    message = str(err)
    m = _PARAM.match(message)
    param = m.group(1) if m and (known_params is None or m.group(1) in known_params) else None
    return OpenAIError(400, message, param=param, code="invalid_value" if param else None)
