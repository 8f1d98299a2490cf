"""The server against hostile templates and schemas: a request's own chat_template is refused unless the server
trusts request templates; a runaway template (trusted) or a hostile schema fails its own request with a 400 while
/health keeps answering; SIGTERM stops a `pagedllm serve` whose template renderer is busy with a runaway."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
from server_harness import LiveServer, assert_idle_no_leak, free_port, openai_error, tiny_async_engine
from tiny_models import make_tiny_model

from pagedllm.entrypoints.openai.server import build_app

RUNAWAY = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("hostile_model"), "llama", seed=2)


@pytest.fixture(scope="module")
def servers(model_dir):
    """One engine behind two apps: the default (request templates refused) and one that trusts them."""
    engine = tiny_async_engine(model_dir)
    engine.start()
    apps = [build_app(engine, api_key=None, owns_engine=False, served_model_name="tiny",
                      trust_request_chat_template=trust) for trust in (False, True)]
    try:
        with LiveServer(apps[0]) as untrusted, LiveServer(apps[1]) as trusted:
            yield untrusted, trusted
        assert_idle_no_leak(engine)
    finally:
        engine.shutdown()


def _chat(server, **extra) -> httpx.Response:
    return server.post("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, **extra},
                       key=None)


def test_request_chat_template_needs_trust(servers):
    untrusted, trusted = servers
    own = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    err = openai_error(_chat(untrusted, chat_template=own), 400)
    assert err["param"] == "chat_template" and "--trust-request-chat-template" in err["message"]
    err = openai_error(untrusted.post("/tokenize", {"messages": MESSAGES, "chat_template": own}, key=None), 400)
    assert err["param"] == "chat_template"
    assert _chat(untrusted).status_code == 200  # the model's own template
    assert trusted.post("/tokenize", {"messages": MESSAGES, "chat_template": own}, key=None).json()["count"] > 0
    assert _chat(trusted, chat_template=own).status_code == 200


def _while_in_flight(server, request) -> tuple[httpx.Response, list[float]]:
    """Run `request` in a thread and poll /health until it answers; the health latencies seen meanwhile."""
    result: dict = {}
    t = threading.Thread(target=lambda: result.setdefault("r", request()))
    t.start()
    latencies = []
    while t.is_alive():
        t0 = time.perf_counter()
        assert httpx.get(server.url + "/health", timeout=60).status_code == 200
        latencies.append(time.perf_counter() - t0)
    t.join()
    return result["r"], latencies


def test_health_answers_while_a_runaway_template_is_stopped(servers):
    _, trusted = servers
    response, latencies = _while_in_flight(trusted, lambda: _chat(trusted, chat_template=RUNAWAY))
    err = openai_error(response, 400)
    assert "time limit" in err["message"] and err["param"] == "messages"
    assert len(latencies) >= 3, latencies  # the loop kept serving during the whole rendering
    print(f"/health during the runaway template: {len(latencies)} answers, slowest {max(latencies):.3f} s")
    err = openai_error(_chat(trusted, chat_template="{{ 10**(10**10) }}"), 400)  # folded at compile time before
    assert "bits" in err["message"]
    assert _chat(trusted).status_code == 200


def _nested(depth: int) -> dict:
    schema: dict = {}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("schema", [
    _nested(300),
    {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}, "required": ["p0"],
     "additionalProperties": False, "minProperties": 10**9},
    {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
])
def test_hostile_schema_fails_its_request_only(servers, schema):
    untrusted, _ = servers
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    response, latencies = _while_in_flight(untrusted, lambda: _chat(untrusted, response_format=fmt))
    assert response.status_code in (200, 400), response.text
    print(f"/health during the schema: {len(latencies)} answers, slowest {max(latencies, default=0):.3f} s")
    assert _chat(untrusted).status_code == 200


@pytest.mark.slow
def test_sigterm_while_a_template_runs_away(model_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm", "serve", str(model_dir), "--port", str(port),
                             "--dtype", "float32", "--num-kv-blocks", "64", "--trust-request-chat-template",
                             "--served-model-name", "tiny"],
                            env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1"), stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        with httpx.Client(timeout=5) as client:
            while True:  # until it is up (pytest-timeout guards a server that never comes up)
                assert proc.poll() is None, open(tmp_path / "server.log").read()
                try:
                    if client.get(url + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.2)
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "chat_template": RUNAWAY}
        t = threading.Thread(target=lambda: httpx.post(url + "/v1/chat/completions", json=body, timeout=120))
        t.start()
        server = psutil.Process(proc.pid)
        while not any("templating.worker" in " ".join(c.cmdline()) and c.cpu_times().user > 0.5
                       for c in server.children()):
            assert t.is_alive()
            time.sleep(0.1)  # until the runaway is rendering
        workers = [c for c in server.children() if "templating.worker" in " ".join(c.cmdline())]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, open(tmp_path / "server.log").read()[-3000:]
        t.join(120)
        psutil.wait_procs(workers, timeout=60)
        assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
    finally:
        if proc.poll() is None:
            proc.kill()
