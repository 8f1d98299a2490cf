"""The OpenAI-compatible HTTP server: FastAPI app, API-key check, error mapping, `pagedllm serve`."""

from __future__ import annotations

import argparse
import contextlib
import hmac
import logging
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.distributed.args import DataParallelArgs
from pagedllm.engine.args import EngineArgs
from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.metrics import CONTENT_TYPE_LATEST

logger = logging.getLogger(__name__)

API_KEY_ENV = "PAGEDLLM_API_KEY"


class ApiKeyMiddleware:
    """Every /v1 route needs `Authorization: Bearer <key>`; checked before the body is even parsed."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                err = OpenAIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                                  code="invalid_api_key")
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return OpenAIError(400, "Request body is not valid JSON.", code="invalid_json")
    parts, param = [], None
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        param = param or (loc[0] if loc else None)
        parts.append(f"{'.'.join(loc) or 'body'}: {e.get('msg')}")
    return OpenAIError(422, "; ".join(parts), param=param, code="invalid_request")


def build_app(engine: EngineArgs | AsyncEngine, api_key: str | None = None,
              served_model_name: str | None = None, owns_engine: bool | None = None) -> FastAPI:
    """The app for `engine`. Given EngineArgs, the app builds and owns its engine (shut down with the app);
    given an AsyncEngine (or another client with its interface, e.g. the data-parallel one), the caller owns
    it (the app only starts it) unless owns_engine=True."""
    if owns_engine is None:
        owns_engine = isinstance(engine, EngineArgs)
    async_engine = AsyncEngine.from_engine_args(engine) if isinstance(engine, EngineArgs) else engine
    name = served_model_name or async_engine.model_name
    completion = OpenAIServingCompletion(async_engine, name)
    chat = OpenAIServingChat(async_engine, name)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            if owns_engine:
                async_engine.shutdown()

    app = FastAPI(title="pagedllm", lifespan=lifespan)
    app.state.engine = async_engine
    app.state.served_model_name = name
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return OpenAIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        return OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error").response()

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_running:
            return OpenAIError(503, "engine is not running", code="engine_unavailable").response()
        body: dict[str, Any] = {"status": "ok"}
        if hasattr(async_engine, "health_report"):  # data parallel: one entry per replica
            body["replicas"] = async_engine.health_report()
        return JSONResponse(body)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(async_engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, max_model_len=async_engine.max_model_len)])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        completion.check_model(model_id)
        return ModelCard(id=name, max_model_len=async_engine.max_model_len)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await completion.create(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(req, raw)

    return app


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help=f"require this bearer key on /v1 (or env {API_KEY_ENV})")
    parser.add_argument("--served-model-name", default=None, help="model id clients use (default: the model's)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("--timeout-graceful-shutdown", type=float, default=30.0,
                        help="seconds in-flight requests get to finish after SIGINT/SIGTERM")
    EngineArgs.add_cli_args(parser)
    DataParallelArgs.add_cli_args(parser)
    return parser


def serve_main(args: argparse.Namespace) -> None:
    """Run until SIGINT/SIGTERM: uvicorn then stops accepting, lets in-flight requests finish (up to
    --timeout-graceful-shutdown seconds, then cancels them, which aborts them in the engine), and the app's
    lifespan stops the engine loop."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # no-op if set
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    engine: EngineArgs | Any = EngineArgs.from_cli_args(args)
    dp = DataParallelArgs.from_cli_args(args)
    if dp.enabled:  # N replicas on Ray; only then is Ray imported
        from pagedllm.distributed.client import DataParallelEngine

        engine = DataParallelEngine(engine, dp)
    app = build_app(engine, api_key=api_key, served_model_name=args.served_model_name, owns_engine=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=args.timeout_graceful_shutdown)

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn re-raises the captured signal after its graceful shutdown (exit status -15);
            # the shutdown was clean, so exit 0 instead.
            with super().capture_signals():
                yield
                getattr(self, "_captured_signals", []).clear()

    Server(config).run()


def main(argv: list[str] | None = None) -> Any:
    parser = add_serve_args(argparse.ArgumentParser(prog="pagedllm serve"))
    serve_main(parser.parse_args(argv))


if __name__ == "__main__":
    main()
