"""Fault injection against a live server (issue #21): every bad input is an OpenAI-shaped 4xx naming what is
wrong, no response quotes internals, a huge prompt stalls no other stream, the graceful-shutdown deadline ends
streams with an error event, slow or greedy clients are cut off, and the offline API checks its inputs.
A tiny random model keeps each test to seconds."""

from __future__ import annotations

import json
import logging
import math
import socket
import threading
import time

import httpx
import pytest
from server_harness import (
    API_KEY,
    MAX_MODEL_LEN,
    LiveServer,
    assert_idle_no_leak,
    greedy_text,
    openai_error,
    tiny_async_engine,
)
from tiny_models import make_tiny_model, wait_until

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.openai.server import build_app

FLOATS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]
PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("faults_model"), "llama", seed=5)


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = tiny_async_engine(model_dir)
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    app = build_app(engine, api_key=API_KEY, served_model_name="tiny", max_request_body_bytes=6 * 1024 * 1024,
                    request_body_timeout=1.0)
    with LiveServer(app, header_timeout=1.0) as live:
        live.reference = greedy_text(live, PROMPT)
        yield live
    assert_idle_no_leak(engine)


def _stream_gaps(server: LiveServer, body: dict, started: threading.Event, out: dict) -> None:
    """Consume one SSE stream, recording its events and the longest pause between two of them."""
    events, gaps, last = [], [], None
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        for line in r.iter_lines():
            if not line:
                continue
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
            events.append(line)
            started.set()
    out.update(events=events, max_gap=max(gaps, default=0.0))


# --- item 3: NaN and infinities ----------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_floats_rejected(server, value):
    for field in FLOATS:
        for path, base in [("/v1/completions", '"prompt": "hi"'),
                           ("/v1/chat/completions", '"messages": [{"role": "user", "content": "hi"}]')]:
            r = server.post(path, f'{{{base}, "max_tokens": 2, "{field}": {value}}}')
            err = openai_error(r, 400)
            assert err["param"] == field, (path, field, err)


def test_sampling_params_reject_non_finite():
    for field in FLOATS:
        for value in (math.nan, math.inf, -math.inf):
            with pytest.raises(ValueError, match=field):
                SamplingParams(**{field: value})


# --- item 4: text that is not Unicode, internals never quoted ----------------------------------------------
@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": "hi", "model": "\\ud800", "max_tokens": 2}', "model"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["\\ud83d"], "max_tokens": 2}', "stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x\\ud800"}]}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x", "name": "\\udc00"}]}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "model": "\\ud800"}', "model"),
])
def test_lone_surrogates_are_400_naming_the_field(server, path, body, param):
    err = openai_error(server.post(path, body), 400)
    assert err["param"] == param and "Unicode" in err["message"], err


def test_failures_quote_no_internals(server, engine, monkeypatch):
    secret = "secret-internal-detail-42"

    def broken_step():
        raise RuntimeError(secret)

    monkeypatch.setattr(engine.engine, "step", broken_step)
    r = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    assert secret not in r.text and "RuntimeError" not in r.text
    assert openai_error(r, 500)["code"] == "internal_error"
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 4, "stream": True},
                      headers={"Authorization": f"Bearer {API_KEY}"}) as s:
        text = s.read().decode()
    assert secret not in text and "RuntimeError" not in text and '"error"' in text
    monkeypatch.undo()
    # an exception outside the engine (here: in request handling) goes to the generic 500 handler
    from pagedllm.entrypoints.openai import serving_completion

    async def broken_prompts(self, req):
        raise KeyError(secret)

    monkeypatch.setattr(serving_completion.OpenAIServingCompletion, "prompts", broken_prompts)
    r = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    assert secret not in r.text and "KeyError" not in r.text
    openai_error(r, 500)
    monkeypatch.undo()
    assert greedy_text(server, PROMPT) == server.reference


# --- item 2: body size cap, huge prompts stall nobody ------------------------------------------------------
def test_body_over_cap_is_413(server):
    big = json.dumps({"prompt": "word " * (7 * 1024 * 1024 // 5), "max_tokens": 2})
    assert openai_error(server.post("/v1/completions", big), 413)["code"] == "request_too_large"
    # a chunked body (no Content-Length) is cut off too
    chunks = (big[i:i + 65536].encode() for i in range(0, len(big), 65536))
    r = server.post("/v1/completions", chunks)
    openai_error(r, 413)


@pytest.mark.parametrize("huge_path", ["/v1/completions", "/v1/chat/completions"])
def test_huge_prompt_does_not_stall_other_streams(server, huge_path):
    started, out = threading.Event(), {}
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
    t = threading.Thread(target=_stream_gaps, args=(server, body, started, out))
    t.start()
    assert started.wait(60)
    text = "alpha beta gamma delta " * (5 * 1024 * 1024 // 23)  # 5 MB: under the body cap, far over the context
    huge = ({"prompt": text, "max_tokens": 2} if huge_path == "/v1/completions"
            else {"messages": [{"role": "user", "content": text}], "max_tokens": 2})
    t0 = time.monotonic()
    err = openai_error(server.post(huge_path, huge), 400)
    rejected_in = time.monotonic() - t0
    assert "max_model_len" in err["message"] and err["param"] in ("prompt", "messages")
    t.join(120)
    assert not t.is_alive(), "the other stream did not end within 120 s"
    assert out["events"][-1] == "data: [DONE]"
    # The pause is the behaviour under test, so a time bound decides it: tokenizing 5 MB on the engine
    # loop stalled the other stream for several seconds; 2 s is generous on a loaded machine and still
    # catches that.
    assert out["max_gap"] < 2.0, (out["max_gap"], rejected_in)


def test_over_long_prompt_rejected_before_the_engine(server, engine, monkeypatch):
    """A prompt over max_model_len (as token ids, or text within the character bound) is refused by the
    server once its length is known; the engine loop never sees it."""
    seen = []
    monkeypatch.setattr(engine, "_do_add", lambda *a, **k: seen.append(a))
    r = server.post("/v1/completions", {"prompt": [5] * (MAX_MODEL_LEN + 1), "max_tokens": 2})
    assert openai_error(r, 400)["param"] == "prompt"
    r = server.post("/v1/completions", {"prompt": "fox " * (MAX_MODEL_LEN + 1), "max_tokens": 2})
    assert "max_model_len" in openai_error(r, 400)["message"]
    assert not seen


# --- item 5: the graceful-shutdown deadline ---------------------------------------------------------------
def test_shutdown_deadline_ends_streams_with_error_and_done(engine, monkeypatch):
    step = engine.engine.step

    def slow_step():  # a stream that cannot finish within the graceful-shutdown timeout
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(engine.engine, "step", slow_step)
    app = build_app(engine, api_key=API_KEY)
    with LiveServer(app, graceful=1.5) as live:
        started, out = threading.Event(), {}
        body = {"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True}
        t = threading.Thread(target=_stream_gaps, args=(live, body, started, out))
        t.start()
        assert started.wait(60)
        plain: dict = {}
        p = threading.Thread(target=lambda: plain.update(r=live.post(
            "/v1/completions", {"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True})))
        p.start()
        # both requests in the engine before the shutdown (else the test would not see what it is about)
        wait_until(lambda: len(engine._tracked) >= 2,
                   lambda: f"both requests in the engine ({len(engine._tracked)} tracked)")
        live.server.should_exit = True
        t.join(60)
        p.join(60)
        assert not t.is_alive() and not p.is_alive(), "a request outlived the shutdown deadline by 60 s"
    events = out["events"]
    assert events[-1] == "data: [DONE]", events[-3:]
    err = json.loads(events[-2][len("data: "):])["error"]
    assert err["code"] == "server_shutdown" and err["type"] == "server_error"
    assert openai_error(plain["r"], 503)["code"] == "server_shutdown"
    monkeypatch.undo()
    assert_idle_no_leak(engine)


# --- item 7: authorization, docs, slow clients -------------------------------------------------------------
def test_bearer_scheme_is_case_insensitive(server):
    for scheme in ("bearer", "BEARER", "Bearer"):
        r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"})
        assert r.status_code == 200, (scheme, r.text)
    openai_error(httpx.get(server.url + "/v1/models", headers={"Authorization": f"Basic {API_KEY}"}), 401)


def test_duplicate_authorization_headers_rejected(server):
    for pair in ([f"Bearer {API_KEY}", "Bearer wrong"], ["Bearer wrong", f"Bearer {API_KEY}"],
                 [f"Bearer {API_KEY}", f"Bearer {API_KEY}"]):
        r = httpx.get(server.url + "/v1/models", headers=[("Authorization", v) for v in pair])
        openai_error(r, (400, 401))


def test_docs_off_by_default_with_a_key(server, engine):
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert httpx.get(server.url + path).status_code == 404, path
    app = build_app(engine, api_key=API_KEY, docs=True)
    assert "/v1/completions" in app.openapi()["paths"] and app.openapi_url == "/openapi.json"
    assert build_app(engine).openapi_url == "/openapi.json"  # no key: open as before


def test_slow_header_client_is_disconnected(server):
    """Only the header deadline (1 s here) closes a connection that keeps trickling header bytes (the 64 KiB
    header cap is far off), so the test waits for the close; the timeout only bounds the wait."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")

        def closed_after_one_more_byte() -> bool:
            try:
                s.sendall(b"X")  # one header byte at a time, forever
                return s.recv(1, socket.MSG_DONTWAIT) == b""
            except BlockingIOError:  # open, nothing to read
                return False
            except OSError:  # reset
                return True

        wait_until(closed_after_one_more_byte, "the server to close a connection whose headers never end",
                   timeout=60, interval=0.2)


def test_slow_body_is_408(server):
    """Only the body deadline (1 s here) answers 408 to a body that never comes; the timeout only bounds
    the wait."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                  "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"".encode())
        try:
            reply = s.recv(4096).decode()
        except TimeoutError:
            pytest.fail("no reply within 60 s to a request whose body never ends")
    assert reply.startswith("HTTP/1.1 408"), reply


# --- item 7: the offline API ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", num_kv_blocks=64, block_size=16, max_model_len=256)


def test_offline_input_checks(llm, caplog):
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**70)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=-(2**63) - 1)
    SamplingParams(seed=2**63 - 1, n=4)  # the bounds themselves are fine
    with pytest.raises(TypeError, match="prompts"):
        llm.generate(123, use_tqdm=False)
    with pytest.raises(TypeError, match=r"prompts\[1\]"):
        llm.generate(["ok", None], use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params"):
        llm.generate("ok", {"temperature": 0}, use_tqdm=False)
    with caplog.at_level(logging.WARNING):
        assert llm.generate([], use_tqdm=False) == []
    assert "no prompts" in caplog.text
    out = llm.generate(["hi", [5, 6, 7]], SamplingParams(max_tokens=2, seed=2**63 - 1, n=2), use_tqdm=False)
    assert [len(o.outputs) for o in out] == [2, 2]
    assert llm.kv_cache_stats()["num_free_blocks"] == llm.kv_cache_stats()["num_blocks"]
