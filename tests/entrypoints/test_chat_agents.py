"""Chat completions with a reasoning parser and free-text tool calls, through the real `openai` SDK on a live
server whose engine samples scripted text (agent_harness): reasoning_content and tool_calls whole and streamed
(the deltas assemble into the whole message), text around calls, parallel and cut calls, the parser chosen by
the chat template, a template that opens the reasoning on the real model, and json_schema after reasoning."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from agent_harness import (
    API_KEY,
    LONG_CALL,
    QWEN3_TEMPLATE,
    WEATHER_SCHEMA,
    assembled,
    openai_client,
    same_but_ids,
    whole,
)

openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}]
OPENS_THINKING = QWEN3_TEMPLATE + "{%- if add_generation_prompt %}{{- '<think>\\n' }}{%- endif %}"


@pytest.fixture
def client(agent_server):
    return openai_client(agent_server)


def chat(client, content, **kw):
    kw.setdefault("max_tokens", 200)
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], **kw)


@pytest.mark.parametrize("content", ["What is the weather in Paris?", "Weather in Paris and Rome, please.",
                                     "Please say hello."])
def test_reasoning_and_tool_calls_whole_and_streamed(client, content):
    w = whole(chat(client, content, tools=TOOLS))
    s = assembled(chat(client, content, tools=TOOLS, stream=True))
    assert same_but_ids(w, s), (w, s)
    assert all(c["id"] for c in s[2]) and len({c["id"] for c in s[2]}) == len(s[2])
    if "Rome" in content:
        assert [json.loads(c["arguments"])["city"] for c in w[2]] == ["Paris", "Rome"] and w[3] == "tool_calls"
    elif "hello" in content:
        assert w == ("Hello there!", "A greeting.", [], "stop")
    else:
        assert w[:2] == ("Let me look that up.", "The user wants the weather: call the tool.")
        assert w[2][0]["name"] == "get_weather" and w[3] == "tool_calls"


def test_cut_call_is_reported_with_finish_reason_length(agent_server, client):
    head = LONG_CALL[:LONG_CALL.index("Paris") + len("Paris Paris")]
    budget = len(agent_server.engine.tokenizer.encode(head, add_special_tokens=False))
    w = whole(chat(client, "Make a long call.", tools=TOOLS, max_tokens=budget))
    s = assembled(chat(client, "Make a long call.", tools=TOOLS, max_tokens=budget, stream=True))
    assert same_but_ids(w, s)
    content, _, (call,), finish = w
    assert finish == "length" and content == "" and call["name"] == "get_weather"
    assert call["arguments"].startswith('{"city": "Paris Paris')


def test_parser_read_from_a_request_template(client):
    mistral_template = QWEN3_TEMPLATE.replace("<tool_call>", "[TOOL_CALLS]")
    r = chat(client, "mistral style", tools=TOOLS, extra_body={"chat_template": mistral_template})
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].message.content == "Checking." and call.function.arguments == '{"city": "Rome"}'
    assert len(call.id) == 9 and call.id.isalnum()  # Mistral's templates want such ids back


def test_template_that_opens_reasoning_on_the_real_model(agent_server, client):
    """Nothing scripted: the random model writes, the prompt opened <think>, so all of it is reasoning."""
    kw = {"max_tokens": 24, "temperature": 0, "extra_body": {"chat_template": OPENS_THINKING}}
    ids = httpx.post(agent_server.url + "/tokenize", headers={"Authorization": f"Bearer {API_KEY}"}, json={
        "messages": [{"role": "user", "content": "Tell me."}], "chat_template": OPENS_THINKING}).json()["tokens"]
    text = client.completions.create(model="tiny", prompt=ids, max_tokens=24, temperature=0).choices[0].text
    w = whole(chat(client, "Tell me.", **kw))
    s = assembled(chat(client, "Tell me.", stream=True, **kw))
    assert text.strip() and w == s == ("", text.strip(), [], "length")


def test_json_schema_starts_after_the_reasoning(client):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    w = whole(chat(client, "Please think first.", response_format=fmt, temperature=0, max_tokens=60))
    s = assembled(chat(client, "Please think first.", response_format=fmt, temperature=0, max_tokens=60,
                       stream=True))
    assert w == s and w[1] == "Plan the answer." and w[3] == "stop"
    jsonschema.validate(json.loads(w[0]), schema)
    named = whole(chat(client, "Please think first.", tools=TOOLS, temperature=0, max_tokens=60,
                       tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert named[1] == "Plan the answer." and named[3] == "tool_calls"
    jsonschema.validate(json.loads(named[2][0]["arguments"]), WEATHER_SCHEMA)
