"""Structured outputs through the OpenAI server with the real `openai` client and the real default model:
response_format (json_schema, json_object) on both endpoints, vLLM's guided_* extras, tool calls, streaming,
mixed batches and 400s for invalid constraints."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from live_server import API_KEY, serving, wait_idle

openai = pytest.importorskip("openai")

from pagedllm.engine.async_engine import AsyncEngine  # noqa: E402
from pagedllm.entrypoints.openai.server import build_app  # noqa: E402

pytestmark = pytest.mark.slow

NAME = {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"}
SCHEMAS = {
    "person": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 18,
                                                                      "maximum": 99}},
               "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "city": {"type": "object", "properties": {"name": NAME, "country": {"enum": ["FR", "DE", "IT"]}},
                 "required": ["name", "country"], "additionalProperties": False},
        "population": {"type": "integer", "minimum": 1000, "maximum": 99999999}},
        "required": ["city", "population"], "additionalProperties": False},
    "list": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 3}},
        "required": ["colors"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {
        "score": {"type": "number", "minimum": 0, "maximum": 10}, "ok": {"type": "boolean"},
        "code": {"type": "string", "pattern": "^[0-9]{3}-[A-Z]{2}$"}},
        "required": ["score", "ok", "code"], "additionalProperties": False},
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": NAME, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server():
    from pagedllm import LLM

    llm = LLM(dtype="float32", num_kv_blocks=256, block_size=16, max_model_len=1024, seed=0)
    engine = AsyncEngine(llm.engine)
    engine.start()
    with serving(engine, build_app(engine, api_key=API_KEY, served_model_name="smol")) as live:
        yield live


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def chat(client, content: str, **kw):
    kw.setdefault("max_tokens", 80)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="smol", messages=[{"role": "user", "content": content}], **kw)


def json_schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def test_json_schemas_validate(client):
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # one batch
        resps = dict(zip(SCHEMAS, pool.map(
            lambda n: chat(client, f"Give me a {n} record as JSON.", response_format=json_schema_format(n),
                           temperature=0.7, seed=random.randrange(1 << 30)), SCHEMAS), strict=True))
    for name, r in resps.items():
        assert r.choices[0].finish_reason == "stop", (name, r.choices[0].message.content)
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[name])


def test_completions_json_object_regex_choice(client):
    r = client.completions.create(model="smol", prompt="A JSON object describing a cat:", max_tokens=60,
                                  temperature=0, extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "length" or isinstance(json.loads(r.choices[0].text), dict)
    r = chat(client, "Give a product code.", extra_body={"guided_regex": r"[A-Z]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}", r.choices[0].message.content)
    r = chat(client, "Is water wet?", extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.completions.create(model="smol", prompt="The best color is", max_tokens=10, temperature=0,
                                  extra_body={"guided_choice": ["red", "green"]})
    assert r.choices[0].text in ("red", "green")


def test_stream_equals_non_stream_and_mixed_batch(client):
    fmt = json_schema_format("nested")
    # warm the prefix cache first: a cold prefill and a cache hit run the prompt's tail on different kernel paths,
    # equal only to rounding (test_server.test_n2_seed_reproducible), and an enum can be a near-tie
    chat(client, "Describe a city.", response_format=fmt)
    chat(client, "Say hello.", max_tokens=16)
    whole = chat(client, "Describe a city.", response_format=fmt).choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in
              chat(client, "Describe a city.", response_format=fmt, stream=True) if c.choices]
    assert "".join(pieces) == whole
    free = chat(client, "Say hello.", max_tokens=16).choices[0].message.content
    with ThreadPoolExecutor(4) as pool:  # constrained and unconstrained requests share steps
        futs = [pool.submit(chat, client, *args, **kw) for _ in range(2)
                for args, kw in ((("Describe a city.",), {"response_format": fmt}), (("Say hello.",), {"max_tokens": 16}))]
        texts = [f.result().choices[0].message.content for f in futs]
    assert texts == [whole, free] * 2


def test_tool_calls_named_and_required(client):
    r = chat(client, "What is the weather in Paris?", tools=[WEATHER, TIME],
             tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    r = chat(client, "What time is it in Berlin?", tools=[WEATHER, TIME], tool_choice="required", max_tokens=120)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls
    fns = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in r.choices[0].message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), fns[call.function.name])
    chunks = list(chat(client, "What is the weather in Paris?", tools=[WEATHER], stream=True,
                       tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0][0].function.name == "get_weather"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_invalid_constraints_are_400_naming_the_field(server, client):
    bad = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}}}}, "response_format"),
           ({"extra_body": {"guided_regex": "[a-"}}, "guided_regex"),
           ({"extra_body": {"guided_choice": []}}, "guided_choice"),
           ({"extra_body": {"guided_regex": "a", "guided_choice": ["a"]}}, "guided_choice"),
           ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
           ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice")]
    for kw, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, "Hi", **kw)
        assert e.value.body["param"] == param, (kw, e.value.body)
    assert chat(client, "Say hi.", max_tokens=4).choices[0].message.content  # the server still serves
    stats = wait_idle(server)
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_requests"] == 0
