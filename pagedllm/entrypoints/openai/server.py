"""The OpenAI-compatible HTTP server: FastAPI app, API-key check, error mapping, `pagedllm serve`."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.distributed.args import DataParallelArgs
from pagedllm.engine.args import EngineArgs
from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.engine.startup_summary import startup_summary
from pagedllm.entrypoints.openai.anthropic.serving import AnthropicServingMessages, add_messages_routes
from pagedllm.entrypoints.openai.errors import OpenAIError, error_response, internal_error
from pagedllm.entrypoints.openai.kv_page import add_kv_routes
from pagedllm.entrypoints.openai.lifecycle import Server, ShutdownGate
from pagedllm.entrypoints.openai.middleware import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES,
    ApiKeyMiddleware,
    RequestLimitsMiddleware,
)
from pagedllm.entrypoints.openai.preprocess import PromptPreprocessor
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from pagedllm.entrypoints.openai.protocols import http_protocol
from pagedllm.entrypoints.openai.reasoning import REASONING_PARSERS, make_reasoning_parser
from pagedllm.entrypoints.openai.responses.serving import OpenAIServingResponses, add_responses_routes
from pagedllm.entrypoints.openai.responses.store import DEFAULT_MAX_RESPONSES, ResponseStore
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding, add_embedding_routes
from pagedllm.entrypoints.openai.serving_extras import OpenAIServingTokens, add_extra_routes
from pagedllm.entrypoints.openai.serving_models import (
    LoRAModuleError,
    LoRAModulePath,
    OpenAIServingModels,
    add_lora_routes,
    parse_lora_module,
)
from pagedllm.entrypoints.openai.serving_score import OpenAIServingScore, add_score_routes
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, make_tool_parser
from pagedllm.metrics import CONTENT_TYPE_LATEST

logger = logging.getLogger(__name__)

API_KEY_ENV = "PAGEDLLM_API_KEY"


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return OpenAIError(400, "Request body is not valid JSON.", code="invalid_json")
    parts, param = [], None
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        param = param or (loc[0] if loc else None)
        parts.append(f"{'.'.join(loc) or 'body'}: {e.get('msg')}")
    return OpenAIError(400, "; ".join(parts), param=param, code="invalid_value")


def build_app(engine: EngineArgs | AsyncEngine, api_key: str | list[str] | None = None,
              served_model_name: str | list[str] | None = None, owns_engine: bool | None = None, *,
              allowed_origins: list[str] | None = None, chat_template: str | None = None,
              trust_request_chat_template: bool = False,
              docs: bool | None = None, max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              request_body_timeout: float = DEFAULT_BODY_TIMEOUT, reasoning_parser: str | None = None,
              tool_call_parser: str | None = None, max_stored_responses: int = DEFAULT_MAX_RESPONSES,
              lora_modules: list[LoRAModulePath] | None = None, **engine_options: Any) -> FastAPI:
    """The app for `engine`. Given EngineArgs, the app builds and owns its engine (shut down with the app;
    engine_options go to AsyncEngine: log_stats_interval, log_requests, log_prompts); given an AsyncEngine (or
    another client with its interface, e.g. the data-parallel one), the caller owns it (the app only starts it)
    unless owns_engine=True. served_model_name: the ids clients may use (the first is reported).
    chat_template: template text used when a request names none; a request's own `chat_template` is refused unless
    trust_request_chat_template. allowed_origins: CORS. lora_modules: LoRA adapters loaded now, before the engine
    starts (LoRAModuleError for one that cannot; the engine must have LoRA enabled), served under their names."""
    if owns_engine is None:
        owns_engine = isinstance(engine, EngineArgs)
    async_engine = (AsyncEngine.from_engine_args(engine, **engine_options) if isinstance(engine, EngineArgs)
                    else engine)
    models = OpenAIServingModels(async_engine, served_model_name, lora_modules)
    models.init_static_loras()
    names, name = models.base_model_names, models.model_name
    gate = ShutdownGate()  # closed by lifecycle.Server at the graceful-shutdown deadline
    preprocess = PromptPreprocessor.for_engine(async_engine)
    completion = OpenAIServingCompletion(async_engine, models, preprocess=preprocess, gate=gate)
    chat = OpenAIServingChat(async_engine, models, preprocess=preprocess, gate=gate)
    tokens = OpenAIServingTokens(async_engine, models, preprocess=preprocess, gate=gate)
    embedding = OpenAIServingEmbedding(async_engine, models, preprocess=preprocess, gate=gate)
    score = OpenAIServingScore(async_engine, models, preprocess=preprocess, gate=gate)
    for serving in (chat, tokens):
        serving.default_chat_template = chat_template
        serving.trust_request_chat_template = trust_request_chat_template
    chat.reasoning_parser = make_reasoning_parser(reasoning_parser) if reasoning_parser else None
    if tool_call_parser is not None:
        make_tool_parser(tool_call_parser, {})  # an unknown name fails here, not on the first request
    chat.tool_call_parser = tool_call_parser
    responses = OpenAIServingResponses(chat, ResponseStore(max_stored_responses))
    messages = AnthropicServingMessages(chat)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if isinstance(async_engine, AsyncEngine):  # (the data-parallel client logs its replicas itself)
            logger.info("serving %s as %s: %s", async_engine.model_name, names, startup_summary(async_engine.engine))
        async_engine.start()
        try:
            yield
        finally:
            preprocess.shutdown()
            if owns_engine:
                async_engine.shutdown()

    if docs is None:  # /docs and /openapi.json are not behind the key: off when there is one
        docs = not api_key
    app = FastAPI(title="pagedllm", lifespan=lifespan, **({} if docs else
                  {"docs_url": None, "redoc_url": None, "openapi_url": None}))
    app.state.engine = async_engine
    app.state.served_model_name = name
    app.state.shutdown_gate = gate
    app.add_middleware(RequestLimitsMiddleware, max_body_bytes=max_request_body_bytes,
                       body_timeout=request_body_timeout)
    if api_key:  # added after the limits, so it runs first: no body is read for a wrong key
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    if allowed_origins:
        # outermost, so that preflight requests (no Authorization header) are answered before the key check
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in allowed_origins)

    # each API's errors in its own shape (errors.error_response picks it by path)
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> Response:
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        return error_response(request.url.path, _validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = "not_found" if exc.status_code == 404 else None
        return error_response(request.url.path, OpenAIError(exc.status_code, str(exc.detail), code=code))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        return error_response(request.url.path, internal_error(exc, "unhandled error"))

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
    async def list_models() -> ModelList:
        return ModelList(data=models.model_cards())

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        return models.model_card(model_id)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await completion.create(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(req, raw)

    add_responses_routes(app, responses)
    add_messages_routes(app, messages)
    add_extra_routes(app, tokens)
    add_embedding_routes(app, embedding)
    add_lora_routes(app, models)
    add_score_routes(app, score)
    add_kv_routes(app, async_engine)  # with data-parallel replicas: /kv?replica=i
    return app


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--api-key", action="append", default=None,
                        help=f"require `Authorization: Bearer KEY` on /v1 and /reset_prefix_cache; repeat for "
                             f"several keys (or env {API_KEY_ENV})")
    parser.add_argument("--served-model-name", action="extend", nargs="+", default=None,
                        help="model ids clients may use; the first is reported (default: the model's name)")
    parser.add_argument("--allowed-origins", action="extend", nargs="+", default=None, type=_origins,
                        help="CORS origins allowed to call the API (JSON list or space-separated; '*' for any)")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template file (or the template text) instead of the model's")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="let requests carry their own chat_template (a program the server renders; refused "
                             "by default, as vLLM)")
    parser.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                        help="read the model's reasoning (<think> spans; gpt_oss: harmony's analysis channel) out of "
                             "its text: reasoning_content (chat), "
                             "reasoning items (responses), thinking blocks (messages)")
    parser.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                        help="the format of tool calls in free text for tool_choice auto (default: read from the "
                             "chat template where unambiguous, else hermes)")
    parser.add_argument("--max-stored-responses", type=int, default=DEFAULT_MAX_RESPONSES,
                        help="responses kept for GET /v1/responses/{id} and previous_response_id (least recently "
                             "used dropped first; 0: none)")
    parser.add_argument("--lora-modules", action="extend", nargs="+", default=None, type=_lora_module,
                        metavar="NAME=PATH",
                        help="LoRA adapters to serve, loaded at start-up (implies --enable-lora): name=path (a PEFT "
                             "directory or a GGUF LoRA file) or JSON '{\"name\": ..., \"path\": ..., "
                             "\"base_model_name\": ...}'; a request picks one by its `model`")
    parser.add_argument("--enable-log-requests", action="store_true",
                        help="log each request's id, prompt length, parameters and finish reasons")
    parser.add_argument("--log-prompts", action="store_true",
                        help="with --enable-log-requests, log the prompt text too")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic stats line (throughput, queue, KV usage, prefix hits)")
    parser.add_argument("--log-stats-interval", type=float, default=10.0, help="seconds between stats lines")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"], help="uvicorn's own log level")
    parser.add_argument("--timeout-graceful-shutdown", type=float, default=30.0,
                        help="seconds in-flight requests get to finish after SIGINT/SIGTERM")
    add_limit_args(parser)
    EngineArgs.add_cli_args(parser, positional_model=True, threads=False)  # --threads comes with the next
    DataParallelArgs.add_cli_args(parser)
    return parser


def _lora_module(value: str) -> LoRAModulePath:
    try:
        return parse_lora_module(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _origins(value: str) -> list[str]:
    """A JSON list (vLLM's form) or one origin."""
    if value.lstrip().startswith("["):
        return list(json.loads(value))
    return [value]


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file, or the template itself when it looks like one."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" in value:
        return value
    raise SystemExit(f"error: --chat-template: no such file: {value}")


def serve_main(args: argparse.Namespace) -> None:
    """Run until SIGINT/SIGTERM: uvicorn then stops accepting, lets in-flight requests finish (up to
    --timeout-graceful-shutdown seconds, then cancels them, which aborts them in the engine), and the app's
    lifespan stops the engine loop."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # no-op if set
    env_key = os.environ.get(API_KEY_ENV)
    api_keys = (args.api_key or []) + ([env_key] if env_key else [])
    origins = [o for group in args.allowed_origins or [] for o in group]
    engine: EngineArgs | Any = EngineArgs.from_cli_args(args)
    if args.lora_modules:
        engine.enable_lora = True  # as a convenience: adapters to serve need LoRA on
    dp = DataParallelArgs.from_cli_args(args)
    if dp.enabled and engine.enable_lora:
        raise SystemExit("pagedllm serve: error: LoRA adapters (--enable-lora, --lora-modules) are not supported "
                         "with data-parallel serving yet (--data-parallel-size / --ray-address)")
    if dp.enabled:  # N replicas on Ray; only then is Ray imported
        from pagedllm.distributed.client import DataParallelEngine

        engine = DataParallelEngine(engine, dp)
    try:  # a bad --lora-modules adapter: one line, as a bad model
        app = build_app(engine, api_key=api_keys or None, served_model_name=args.served_model_name, owns_engine=True,
                        allowed_origins=origins or None, chat_template=read_chat_template(args.chat_template),
                        trust_request_chat_template=args.trust_request_chat_template,
                        log_stats_interval=None if args.disable_log_stats else args.log_stats_interval,
                        log_requests=args.enable_log_requests, log_prompts=args.log_prompts, docs=args.docs,
                        max_request_body_bytes=args.max_request_body_bytes, request_body_timeout=args.request_body_timeout,
                        reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                        max_stored_responses=args.max_stored_responses, lora_modules=args.lora_modules)
    except LoRAModuleError as e:
        raise SystemExit(f"pagedllm serve: error: {e}") from None
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=args.timeout_graceful_shutdown, **uvicorn_limits(args))
    Server(config, app.state.shutdown_gate).run()


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("limits on clients")
    g.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413 before they are parsed")
    g.add_argument("--request-body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT,
                   help="seconds a client may pause while sending a body (then 408)")
    g.add_argument("--request-header-timeout", type=float, default=30.0,
                   help="seconds a connection gets to send a complete request head (then it is closed)")
    g.add_argument("--max-request-header-bytes", type=int, default=64 * 1024,
                   help="largest request head (request line + headers) a client may send")
    g.add_argument("--timeout-keep-alive", type=int, default=5, help="idle keep-alive connections close after this")
    g.add_argument("--limit-concurrency", type=int, default=None,
                   help="connections + requests at once before new ones get 503 (default: no limit)")
    g.add_argument("--docs", action=argparse.BooleanOptionalAction, default=None,
                   help="serve /docs and /openapi.json (default: only when no API key is set)")


def uvicorn_limits(args: argparse.Namespace) -> dict[str, Any]:
    return {"http": http_protocol(args.request_header_timeout, args.max_request_header_bytes),
            "h11_max_incomplete_event_size": args.max_request_header_bytes,
            "timeout_keep_alive": args.timeout_keep_alive, "limit_concurrency": args.limit_concurrency}


def main(argv: list[str] | None = None) -> Any:
    from pagedllm.model.errors import InvalidModelError

    parser = add_serve_args(argparse.ArgumentParser(prog="pagedllm serve"))
    try:
        serve_main(parser.parse_args(argv))
    except InvalidModelError as e:  # one line naming file and field, not a traceback
        raise SystemExit(f"pagedllm serve: error: cannot load the model: {e}") from None


if __name__ == "__main__":
    main()
