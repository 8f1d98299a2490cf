"""Anthropic's Messages API through the real `anthropic` SDK (messages.create / messages.stream /
messages.count_tokens), on a live server whose engine samples scripted text (agent_harness): thinking, text and
tool_use blocks, a tool round trip, stop sequences, a cut call, the constrained tool choices on the real model,
errors in Anthropic's shape, and x-api-key next to Bearer."""

from __future__ import annotations

import json
import threading

import httpx
import jsonschema
import pytest
from agent_harness import API_KEY, LONG_CALL, WEATHER_SCHEMA
from server_harness import assert_idle_no_leak

anthropic = pytest.importorskip("anthropic")

TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER_SCHEMA}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def client(agent_server):
    return anthropic.Anthropic(base_url=agent_server.url, api_key=API_KEY, max_retries=0, timeout=600)


def blocks(message):
    out = []
    for b in message.content:
        if b.type == "thinking":
            out.append(("thinking", b.thinking))
        elif b.type == "text":
            out.append(("text", b.text))
        else:
            out.append(("tool_use", b.name, b.input))
    return out


def test_thinking_text_and_tool_use(client):
    m = client.messages.create(model="tiny", max_tokens=200, messages=ASK, tools=TOOLS)
    assert blocks(m) == [("thinking", "The user wants the weather: call the tool."), ("text", "Let me look that up."),
                         ("tool_use", "get_weather", {"city": "Paris"})]
    assert m.stop_reason == "tool_use" and m.usage.output_tokens > 0 and m.content[2].id


def test_stream_matches_create_and_events_pair_up(client):
    whole = client.messages.create(model="tiny", max_tokens=200, messages=ASK, tools=TOOLS)
    with client.messages.stream(model="tiny", max_tokens=200, messages=ASK, tools=TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert blocks(final) == blocks(whole) and final.stop_reason == "tool_use"
    raw = [e for e in events if e.type in ("message_start", "content_block_start", "content_block_delta",
                                           "content_block_stop", "message_delta", "message_stop")]
    assert raw[0].type == "message_start" and [e.type for e in raw[-2:]] == ["message_delta", "message_stop"]
    open_block = None
    for e in raw[1:-2]:
        if e.type == "content_block_start":
            assert open_block is None
            open_block = e.index
        elif e.type == "content_block_stop":
            assert open_block == e.index
            open_block = None
        else:
            assert e.index == open_block
    kinds = [e.delta.type for e in raw if e.type == "content_block_delta"]
    assert {"thinking_delta", "text_delta", "input_json_delta"} <= set(kinds)
    assert raw[-2].usage.output_tokens == whole.usage.output_tokens


def test_tool_round_trip(client):
    first = client.messages.create(model="tiny", max_tokens=200, messages=ASK, tools=TOOLS)
    use = next(b for b in first.content if b.type == "tool_use")
    turn = ASK + [{"role": "assistant", "content": first.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": [{"type": "text", "text": "Sunny, 21C"}]}]}]
    second = client.messages.create(model="tiny", max_tokens=200, messages=turn, tools=TOOLS)
    assert blocks(second) == [("thinking", "The tool answered."), ("text", "The weather report says: Sunny, 21C")]
    assert second.stop_reason == "end_turn" and second.usage.cache_read_input_tokens > 0


def test_count_tokens_is_the_prompt(client):
    counted = client.messages.count_tokens(model="tiny", messages=ASK, tools=TOOLS, system="Be brief.")
    m = client.messages.create(model="tiny", max_tokens=200, messages=ASK, tools=TOOLS, system="Be brief.")
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens > 0


def test_stop_sequence_and_cut_call(agent_server, client):
    m = client.messages.create(model="tiny", max_tokens=50, messages=[{"role": "user", "content": "stop word"}],
                               stop_sequences=["STOP"])
    assert blocks(m) == [("text", "Before the ")] and m.stop_reason == "stop_sequence" and m.stop_sequence == "STOP"
    head = LONG_CALL[:LONG_CALL.index("Paris") + len("Paris Paris")]
    budget = len(agent_server.engine.tokenizer.encode(head, add_special_tokens=False))
    cut = client.messages.create(model="tiny", max_tokens=budget, tools=TOOLS,
                                 messages=[{"role": "user", "content": "Make a long call."}])
    assert cut.stop_reason == "max_tokens"
    (use,) = cut.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.input["city"].startswith("Paris Paris")


def test_any_and_named_tool_choice_on_the_model(client):
    for choice in ({"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "get_weather"}):
        m = client.messages.create(model="tiny", max_tokens=120, extra_body={"temperature": 0}, tools=TOOLS,
                                   tool_choice=choice,
                                   messages=[{"role": "user", "content": "Anything at all."}])
        uses = [b for b in m.content if b.type == "tool_use"]
        assert len(uses) == 1 and m.stop_reason == "tool_use", m.content
        jsonschema.validate(uses[0].input, WEATHER_SCHEMA)
    m = client.messages.create(model="tiny", max_tokens=200, messages=ASK, tools=TOOLS, tool_choice={"type": "none"})
    assert m.stop_reason == "end_turn" and all(b.type != "tool_use" for b in m.content)


BAD = [
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}]},
     "tool_use_id"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
     "not supported"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}],
      "tool_choice": {"type": "tool", "name": "f"}}, "tools"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
    ({"max_tokens": 0}, "max_tokens"),
]


def test_bad_input_is_an_anthropic_400_and_others_are_unaffected(agent_server, client):
    done = {}
    other = threading.Thread(target=lambda: done.update(m=client.messages.create(
        model="tiny", max_tokens=200, messages=ASK, tools=TOOLS)))
    other.start()
    for body, words in BAD:
        kw = {"model": "tiny", "max_tokens": 20, "messages": ASK, **body}
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(**kw)
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
        assert words in e.value.body["error"]["message"], (body, e.value.body)
    r = httpx.post(agent_server.url + "/v1/messages", json={"model": "tiny", "messages": ASK},  # no max_tokens
                   headers={"x-api-key": API_KEY})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    other.join(120)
    assert blocks(done["m"])[-1][0] == "tool_use"
    assert_idle_no_leak(agent_server.engine)


def test_api_keys_and_error_shapes(agent_server):
    bad = anthropic.Anthropic(base_url=agent_server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="tiny", max_tokens=5, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=agent_server.url, auth_token=API_KEY, api_key=None, max_retries=0)
    assert bearer.messages.create(model="tiny", max_tokens=50, messages=[{"role": "user", "content": "say hello"}]
                                  ).content[-1].text == "Hello there!"
    chat = httpx.post(agent_server.url + "/v1/chat/completions", headers={"x-api-key": API_KEY}, json={
        "model": "tiny", "messages": [{"role": "user", "content": "say hello"}], "max_tokens": 40})
    assert chat.status_code == 200, chat.text
    both = httpx.post(agent_server.url + "/v1/chat/completions", json={"messages": ASK},
                      headers={"x-api-key": API_KEY, "Authorization": "Bearer wrong"})
    assert both.status_code == 401 and both.json()["error"]["code"] == "invalid_api_key"  # OpenAI's shape here
    missing = httpx.post(agent_server.url + "/v1/messages/count_tokens", json={"messages": ASK})
    assert missing.status_code == 401 and missing.json()["type"] == "error"
    unknown = httpx.post(agent_server.url + "/v1/messages", json=json.loads('{"model": "other", "max_tokens": 5, '
                                                                      '"messages": [{"role": "user", "content": "x"}]}'),
                         headers={"x-api-key": API_KEY})
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
