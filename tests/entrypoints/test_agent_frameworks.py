"""An agent loop from the `openai-agents` SDK calls a Python tool and uses its result: over the Responses API and
over chat completions on a live server whose engine samples what a tool-using model would write
(agent_harness), and against a `pagedllm serve` process running the tiny model itself, where tool_choice
"required" makes the constrained call."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from agent_harness import API_KEY, make_agent_model, scripted_server, warm_up, weather_agent, weather_script
from server_harness import assert_idle_no_leak, free_port, wait_healthy

agents = pytest.importorskip("agents")
openai = pytest.importorskip("openai")

agents.set_tracing_disabled(True)  # no trace export: nothing may leave this machine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_agent_model(tmp_path_factory.mktemp("agent"))


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_agent_loop_uses_the_tool_result(model_dir, api):
    with scripted_server(model_dir, weather_script, reasoning_parser="qwen3") as server:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=600)
        model = (agents.OpenAIResponsesModel("tiny", client) if api == "responses"
                 else agents.OpenAIChatCompletionsModel("tiny", client))
        calls: list[str] = []
        result = agents.Runner.run_sync(weather_agent(model, calls), "What is the weather in Paris?")
        assert calls == ["Paris"]
        assert result.final_output == "The weather report says: Sunny in Paris, 21C"
        tool_turn = server.sampler.prompts[-1]  # the second model call saw the tool's result
        assert "Sunny in Paris, 21C" in tool_turn and '"name": "get_weather"' in tool_turn
        assert_idle_no_leak(server.engine)


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    """`pagedllm serve` in its own process on the tiny model."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm", "serve", str(model_dir), "--port", str(port), "--api-key", API_KEY,
           "--dtype", "float32", "--attention-backend", "reference", "--num-kv-blocks", "256",
           "--max-model-len", "1024", "--reasoning-parser", "qwen3", "--disable-log-stats",
           "--served-model-name", "tiny"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    log = tmp_path_factory.mktemp("serve") / "server.log"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=300, log=log)
        warm_up(url)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_agent_loop_against_pagedllm_serve(served, api):
    client = openai.AsyncOpenAI(base_url=served + "/v1", api_key=API_KEY, max_retries=0, timeout=600)
    model = (agents.OpenAIResponsesModel("tiny", client) if api == "responses"
             else agents.OpenAIChatCompletionsModel("tiny", client))
    # thinking off (the template closes the span in the prompt): a random model that opened it would never close it
    settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                    max_tokens=120, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    calls: list[str] = []
    agent = weather_agent(model, calls, model_settings=settings, tool_use_behavior="stop_on_first_tool")
    result = agents.Runner.run_sync(agent, "What is the weather in Rome?")
    assert len(calls) == 1 and calls[0] in ("Paris", "Rome")
    assert result.final_output == f"Sunny in {calls[0]}, 21C"
