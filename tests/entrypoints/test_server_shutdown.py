"""`pagedllm serve` as a real process: SIGTERM stops accepting, lets the in-flight stream finish, exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest
from server_harness import wait_healthy

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_graceful_shutdown_on_signal(tmp_path, sig):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PAGEDLLM_API_KEY="k-env",
               PYTHONUNBUFFERED="1")
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm", "serve", "--port", str(port), "--dtype", "float32",
                             "--num-kv-blocks", "64", "--max-model-len", "512", "--uvicorn-log-level", "info"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, log=tmp_path / "server.log")
        # the key comes from the environment
        assert httpx.get(url + "/v1/models").status_code == 401
        headers = {"Authorization": "Bearer k-env"}
        assert httpx.get(url + "/v1/models", headers=headers).status_code == 200

        events: list[str] = []
        first = threading.Event()

        def stream() -> None:
            body = {"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True, "stream": True,
                    "temperature": 0}
            with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=120) as r:
                for line in r.iter_lines():
                    if line:
                        events.append(line)
                        first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(120), "no first token"
        proc.send_signal(sig)
        t.join(120)
        assert proc.wait(120) == 0
        out = open(tmp_path / "server.log").read()
        assert events[-1] == "data: [DONE]", (events[-3:], out[-2000:])
        text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1] if json.loads(e[6:])["choices"])
        assert text  # the in-flight request ran to its end
        finish = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
        assert finish[-1] == "length"
        assert "Traceback" not in out, out[-3000:]
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
