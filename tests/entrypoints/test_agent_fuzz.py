"""Seeded random bodies for /v1/responses and /v1/messages (valid requests with random changes: wrong types,
missing or extra fields, unknown kinds, dangling call ids): each gets a 2xx or a 4xx in its API's shape, never a 5xx; afterwards nothing
is left running or holding KV blocks, and a normal request is answered as before."""

from __future__ import annotations

import random

import httpx
from agent_harness import API_KEY, WEATHER_SCHEMA
from server_harness import assert_idle_no_leak

SEED = 20261126
N = 100
SCALARS = [None, 0, -1, 1.5, True, "", "x", "auto", "none", "required", "any", "tool", "function", [], {}]


def anything(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 2 or r < 0.5:
        return rng.choice(SCALARS)
    if r < 0.75:
        return [anything(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["type", "text", "content", "name", "id", "call_id"]): anything(rng, depth + 1)
            for _ in range(rng.randint(0, 3))}


def mutate(rng: random.Random, value, depth: int = 0):
    """The value with one random change somewhere inside: a field replaced by anything, dropped, or added."""
    if isinstance(value, dict) and value and depth < 3 and rng.random() < 0.6:
        key = rng.choice(sorted(value))
        out = dict(value)
        r = rng.random()
        if r < 0.2:
            del out[key]
        elif r < 0.3:
            out[rng.choice(["type", "role", "content", "call_id", "tool_use_id", "extra"])] = anything(rng)
        else:
            out[key] = mutate(rng, value[key], depth + 1)
        return out
    if isinstance(value, list) and value and depth < 3 and rng.random() < 0.6:
        k = rng.randrange(len(value))
        return value[:k] + [mutate(rng, value[k], depth + 1)] + value[k + 1:]
    return anything(rng)


TOOL_CALL = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
RESPONSES = [
    {"model": "tiny", "input": "Please say hello.", "max_output_tokens": 8},
    {"model": "tiny", "input": [{"role": "user", "content": "What is the weather in Paris?"}], "max_output_tokens": 60,
     "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA}], "instructions": "Brief."},
    {"model": "tiny", "max_output_tokens": 8, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]}, TOOL_CALL,
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
     "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA}], "tool_choice": "auto"},
    {"model": "tiny", "input": "Please think first.", "max_output_tokens": 8, "text": {"format": {"type": "json_object"}}},
]
MESSAGES = [
    {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "say hello"}], "system": "Brief."},
    {"model": "tiny", "max_tokens": 60, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
     "tools": [{"name": "get_weather", "input_schema": WEATHER_SCHEMA}], "tool_choice": {"type": "auto"}},
    {"model": "tiny", "max_tokens": 8, "tools": [{"name": "get_weather", "input_schema": WEATHER_SCHEMA}], "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}]},
    {"model": "tiny", "max_tokens": 8, "stop_sequences": ["STOP"], "thinking": {"type": "disabled"},
     "messages": [{"role": "user", "content": [{"type": "text", "text": "stop word"}]}]},
]


def body_for(rng: random.Random, bases: list[dict]) -> dict:
    body = rng.choice(bases)
    for _ in range(rng.choice([0, 0, 1, 1, 2])):
        body = mutate(rng, body)
    body = body if isinstance(body, dict) else {"input": body}
    if isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = min(body["max_tokens"], 60)  # bounded work per example
    if isinstance(body.get("max_output_tokens"), int):
        body["max_output_tokens"] = min(body["max_output_tokens"], 60)
    body.setdefault("max_output_tokens" if "input" in body else "max_tokens", 8)
    return {**body, "stream": rng.random() < 0.3}


def test_random_bodies_never_5xx(agent_server):
    rng = random.Random(SEED)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    seen: dict[tuple[str, bool], int] = {}
    with httpx.Client(base_url=agent_server.url, headers=headers, timeout=600) as http:
        for i in range(N):
            path, body = (("/v1/responses", body_for(rng, RESPONSES)) if i % 2 == 0
                          else ("/v1/messages", body_for(rng, MESSAGES)))
            r = http.post(path, json=body)
            assert r.status_code < 500, (SEED, i, path, body, r.text[:300])
            seen[path, r.status_code < 400] = seen.get((path, r.status_code < 400), 0) + 1
            if r.status_code >= 400:
                err = r.json()
                if path == "/v1/messages":
                    assert err["type"] == "error" and err["error"]["message"], (SEED, i, err)
                else:
                    assert err["error"]["message"] and "type" in err["error"], (SEED, i, err)
            elif body.get("stream"):
                assert "event: " in r.text and "Traceback" not in r.text, (SEED, i, r.text[:300])
        print("statuses (path, ok): counts", seen)
        assert all(seen.get((p, ok), 0) >= 10 for p in ("/v1/responses", "/v1/messages") for ok in (True, False)), seen
        assert_idle_no_leak(agent_server.engine)
        r = http.post("/v1/messages", json={"model": "tiny", "max_tokens": 40,
                                            "messages": [{"role": "user", "content": "say hello"}]})
        assert r.json()["content"][-1]["text"] == "Hello there!"
