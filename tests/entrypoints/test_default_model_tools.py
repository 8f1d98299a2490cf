"""The default model's tool calls through the real openai SDK: two offered tools, tool_choice "auto"; requests that
clearly need a tool get tool_calls (whatever form the model writes them in: tagged, fenced or bare), and requests
that do not get none."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Current local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
]
NEEDS_A_TOOL = [
    "What's the weather in Paris right now?",
    "Is it raining in London at the moment?",
    "What time is it in Tokyo now?",
    "Tell me the current temperature in Berlin.",
    "What is the local time in New York right now?",
    "How hot is it in Madrid today?",
    "Check the weather in Sydney for me.",
    "What's the time in Mumbai at the moment?",
    "Look up the current weather in Toronto.",
    "Can you tell me what time it is right now in Cairo?",
]
NEEDS_NONE = [
    "Write a Python function that reverses a string.",
    "What is 17 times 3?",
    "Explain what a hash map is in one sentence.",
    "Translate 'good morning' into French.",
    "Give me a JSON object with keys a and b set to 1 and 2.",
    "What is the capital of Italy?",
    "Write a haiku about the sea.",
    "How do I sort a list in Python?",
    "Name three primary colours.",
    "Summarise what an operating system does in one sentence.",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(peer: str, port: int) -> subprocess.Popen:
    """The default model behind `pagedllm serve`, or the same file behind llama.cpp's `llama-server --jinja` (the
    peer: its own Hermes-style parser reads the same model's output)."""
    env = {**os.environ, "PAGEDLLM_DEFAULT_MODEL": "qwen2.5-coder-0.5b-instruct"}
    if peer == "llama-server":
        from pagedllm.model.embedded import embedded_model_path

        model = embedded_model_path("qwen2.5-coder-0.5b-instruct")
        llama_server = os.path.join(os.path.dirname(sys.executable), "llama-server")  # make bench-setup
        cmd = [llama_server, "-m", model, "--jinja", "--port", str(port), "-c", "2048"]
    else:
        cmd = [sys.executable, "-m", "pagedllm", "serve", "--port", str(port), "--max-model-len", "2048"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def tool_call_counts(need: list[str], need_none: list[str], say=print, peer: str = "pagedllm") -> tuple[int, int]:
    """(requests of `need` answered with tool_calls, requests of `need_none` answered with tool_calls), from the
    default model behind `peer`."""
    import httpx
    import openai

    port = _free_port()
    server = _start_server(peer, port)
    try:
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise RuntimeError("the server exited")
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        model_id = client.models.list().data[0].id
        counts = []
        for prompts in (need, need_none):
            n = 0
            for prompt in prompts:
                r = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompt}],
                                                   tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=96)
                calls = r.choices[0].message.tool_calls or []
                n += bool(calls)
                shown = [(c.function.name, json.loads(c.function.arguments)) for c in calls]
                say(f"{prompt!r}: {shown or repr((r.choices[0].message.content or '')[:80])}")
            counts.append(n)
        return counts[0], counts[1]
    finally:
        server.terminate()
        server.wait(timeout=60)


@pytest.mark.slow
def test_the_default_model_calls_tools_through_the_sdk():
    """Four of the requests (the whole set, 20 requests, is
    `python tests/entrypoints/test_default_model_tools.py`: two minutes here): the model writes its calls fenced
    or bare, never in its template's tags."""
    called, _ = tool_call_counts(NEEDS_A_TOOL[:4], [])
    assert called >= 3, called


if __name__ == "__main__":
    t0 = time.monotonic()
    peer = sys.argv[1] if len(sys.argv) > 1 else "pagedllm"  # or llama-server
    called, needless = tool_call_counts(NEEDS_A_TOOL, NEEDS_NONE, peer=peer)
    print(f"{peer}: tool_calls for {called}/{len(NEEDS_A_TOOL)} requests that need a tool, {needless}/{len(NEEDS_NONE)} "
          f"that do not ({time.monotonic() - t0:.0f} s)")
