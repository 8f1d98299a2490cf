"""A live server for the end-to-end tests with the real `openai` client (entrypoints/test_server.py and its kin,
distributed/test_ray_serve.py): an app build_app made, served by plain uvicorn on 127.0.0.1 in a daemon thread.
(The fault tests need pagedllm's own lifecycle, the graceful-shutdown gate and the header deadline: theirs is
server_harness.LiveServer.)"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Iterator

import uvicorn
from server_harness import engine_state, free_port
from tiny_models import wait_until

API_KEY = "sk-test-" + "".join(random.choices("abcdef0123456789", k=12))


class LiveServer:
    """`app` served by plain uvicorn on a free port of 127.0.0.1, in a daemon thread."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@contextlib.contextmanager
def serving(engine, app) -> Iterator[LiveServer]:
    """`app` live (the LiveServer's `.engine` is its AsyncEngine), the engine shut down after."""
    with LiveServer(app) as live:
        live.engine = engine
        yield live
    engine.shutdown()


def wait_idle(server, timeout: float = 60.0) -> dict:
    """Engine stats (server.engine: an AsyncEngine) once no request runs or waits any more."""
    last: dict = {}

    def idle() -> dict | None:
        last.update(engine_state(server.engine))
        return dict(last) if last["num_running"] == 0 and last["num_waiting"] == 0 else None

    return wait_until(idle, lambda: f"the engine to go idle (last stats: {last})", timeout, interval=0.05)
