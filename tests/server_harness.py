"""A live server on a tiny random model, for the fault and fuzz tests: the real app, middleware and uvicorn
protocol (as `pagedllm serve` runs them) in a thread, and helpers to read engine state and errors."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from pagedllm.engine.args import EngineArgs
from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.lifecycle import Server
from pagedllm.entrypoints.openai.protocols import http_protocol

API_KEY = "sk-faults"
MAX_MODEL_LEN = 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc, timeout: float = 180.0, log: Path | None = None) -> None:
    """Poll a `pagedllm serve` process's /health until it answers 200 (its log, if any, on failure)."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log.read_text() if log is not None else f"exited with {proc.returncode}"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.2)


def tiny_async_engine(model_dir: Path, num_blocks: int = 256) -> AsyncEngine:
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(model_dir), dtype="float32", num_kv_blocks=num_blocks,
                                                   block_size=16, max_model_len=MAX_MODEL_LEN, seed=0))
    return AsyncEngine(engine)


class LiveServer:
    """`app` served by pagedllm's uvicorn Server subclass on a free port, in a daemon thread."""

    def __init__(self, app, *, graceful: float | None = None, header_timeout: float = 30.0) -> None:
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                timeout_graceful_shutdown=graceful, http=http_protocol(header_timeout, 64 * 1024))
        self.server = Server(config, app.state.shutdown_gate)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def post(self, path: str, body, key: str | None = API_KEY, **kw) -> httpx.Response:
        headers = {"Content-Type": "application/json", **kw.pop("headers", {})}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        content = None if isinstance(body, dict | list) else body  # str, bytes, or an iterator (chunked)
        return httpx.post(self.url + path, content=content, json=None if content is not None else body,
                          headers=headers, timeout=kw.pop("timeout", 60), **kw)


def engine_state(engine: AsyncEngine) -> dict:
    def read(e):
        s = dict(e.kv_cache_stats())
        s["num_running"], s["num_waiting"], s["num_requests"] = e.num_running(), e.num_waiting(), len(e.requests)
        return s

    return asyncio.run(engine.call(read))


def assert_idle_no_leak(engine: AsyncEngine, timeout: float = 20.0) -> None:
    """Once nothing runs or waits, every KV block is free (possibly cached) and no request is left."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine_state(engine)
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_requests"] == 0:
            break
        assert time.monotonic() < deadline, f"engine still busy: {s}"
        time.sleep(0.05)
    assert s["num_free_blocks"] == s["num_blocks"], s


def openai_error(r: httpx.Response, status: int | tuple[int, ...]) -> dict:
    """The OpenAI-shaped error of a response with that status; it quotes no Python internals."""
    statuses = status if isinstance(status, tuple) else (status,)
    assert r.status_code in statuses, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"], err
    assert not any(s in r.text for s in ("Traceback", "File \"", "Error:", "Exception")), r.text[:500]
    return err


def greedy_text(server: LiveServer, prompt: str, max_tokens: int = 8) -> str:
    r = server.post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]
