"""OpenAI's Responses API through the real `openai` SDK (client.responses.create / .stream / retrieve / delete),
on a live server whose engine samples scripted text (agent_harness): reasoning items, messages, function calls
(parallel, cut), a function-call round trip and a two-turn conversation through previous_response_id with
prefix reuse, text.format after reasoning, the constrained tool choices on the real model, and 400s for bad
input that leave other requests alone."""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest
from agent_harness import LONG_CALL, WEATHER_SCHEMA, openai_client
from server_harness import assert_idle_no_leak

openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER_SCHEMA}]


@pytest.fixture
def client(agent_server):
    return openai_client(agent_server)


def create(client, text, **kw):
    kw.setdefault("max_output_tokens", 200)
    return client.responses.create(model="tiny", input=text, tools=TOOLS, **kw)


def items(response):
    """The output as comparable tuples (ids aside)."""
    out = []
    for o in response.output:
        if o.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in o.content or [])))
        elif o.type == "message":
            out.append(("message", "".join(c.text for c in o.content)))
        else:
            out.append(("function_call", o.name, o.arguments, o.status))
    return out


def test_reasoning_message_and_call(client):
    r = create(client, "What is the weather in Paris?")
    assert r.status == "completed"
    assert items(r) == [("reasoning", "The user wants the weather: call the tool."),
                        ("message", "Let me look that up."),
                        ("function_call", "get_weather", '{"city": "Paris"}', "completed")]
    assert r.output[2].call_id and r.usage.output_tokens_details.reasoning_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_stream_events_in_order_and_equal_to_create(client):
    whole = create(client, "What is the weather in Paris?")
    events = []
    with client.responses.stream(model="tiny", input="What is the weather in Paris?", tools=TOOLS,
                                 max_output_tokens=200) as stream:
        for ev in stream:
            events.append(ev)
        final = stream.get_final_response()
    assert items(final) == items(whole)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    for index, item in enumerate(final.output):
        mine = [e.type for e in events if getattr(e, "output_index", None) == index]
        assert mine[0] == "response.output_item.added" and mine[-1] == "response.output_item.done", mine
        if item.type == "function_call":
            deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta"
                             and e.output_index == index)
            assert deltas == item.arguments
            assert mine[-2] == "response.function_call_arguments.done"
        else:
            kind = "output_text" if item.type == "message" else "reasoning_text"
            assert mine[1] == "response.content_part.added" and f"response.{kind}.done" in mine
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Let me look that up." == final.output_text


def test_function_call_round_trip_with_previous_response_id(agent_server, client):
    first = create(client, "What is the weather in Paris?")
    call = next(o for o in first.output if o.type == "function_call")
    second = create(client, [{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21C"}],
                    previous_response_id=first.id)
    assert second.output_text == "The weather report says: Sunny, 21C"
    assert second.previous_response_id == first.id
    prompt = agent_server.sampler.prompts[-1]  # the server rebuilt the whole conversation from its store
    assert "What is the weather in Paris?" in prompt and '"city": "Paris"' in prompt and "Sunny, 21C" in prompt
    assert second.usage.input_tokens_details.cached_tokens >= 16  # the first turn's prompt blocks were reused


def test_two_turns_and_stored_responses(client):
    first = create(client, "Please say hello.", instructions="Be brief.")
    assert first.output_text == "Hello there!"
    second = create(client, "Now the weather in Paris?", previous_response_id=first.id)
    assert second.output[-1].type == "function_call"
    assert second.usage.input_tokens_details.cached_tokens > 0
    got = client.responses.retrieve(second.id)
    assert items(got) == items(second) and got.previous_response_id == first.id
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    unstored = create(client, "Please say hello.", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as e:
        create(client, "Hi", previous_response_id=unstored.id)
    assert e.value.body["param"] == "previous_response_id"


def cut_budget(agent_server) -> int:
    """Enough tokens for LONG_CALL to name its function and start its arguments, not to finish them."""
    head = LONG_CALL[:LONG_CALL.index("Paris") + len("Paris Paris")]
    return len(agent_server.engine.tokenizer.encode(head, add_special_tokens=False))


def test_parallel_calls_and_a_call_cut_by_max_output_tokens(agent_server, client):
    r = create(client, "Weather in Paris and Rome, please.")
    calls = [o for o in r.output if o.type == "function_call"]
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    assert len({c.call_id for c in calls}) == 2
    budget = cut_budget(agent_server)
    cut = create(client, "Make a long call.", max_output_tokens=budget)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    (call,) = cut.output
    assert call.type == "function_call" and call.status == "incomplete" and call.name == "get_weather"
    assert call.arguments.startswith('{"city": "Paris') and not call.arguments.endswith("}")
    events = list(client.responses.create(model="tiny", input="Make a long call.", tools=TOOLS,
                                          max_output_tokens=budget, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output[0].arguments == call.arguments


def test_json_schema_after_reasoning(client):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {
        "type": "integer", "minimum": 1, "maximum": 9}}, "required": ["city", "days"], "additionalProperties": False}
    r = client.responses.create(model="tiny", input="Please think first.", max_output_tokens=60, temperature=0, text={
        "format": {"type": "json_schema", "name": "trip", "schema": schema, "strict": True}})
    assert items(r)[0] == ("reasoning", "Plan the answer.")
    jsonschema.validate(json.loads(r.output_text), schema)


def test_required_and_named_tool_choice_on_the_model(client):
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        r = create(client, "Anything at all.", tool_choice=choice, max_output_tokens=120, temperature=0,
                   parallel_tool_calls=False)
        calls = [o for o in r.output if o.type == "function_call"]
        assert len(calls) == 1 and r.status == "completed", r.output
        for call in calls:
            assert call.name == "get_weather" and call.status == "completed"
            jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)


BAD = [
    ([{"type": "web_search_call", "id": "x"}], {}, "input"),
    ([{"type": "function_call_output", "call_id": "nope", "output": "x"}], {}, "input"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}], {}, "input"),
    ("Hi", {"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools"),
    ("Hi", {"text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}}}}, "text"),
    ("Hi", {"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
    ("Hi", {"tool_choice": "required"}, "tool_choice"),
    ("Hi", {"max_output_tokens": 0}, "max_output_tokens"),
]


def test_bad_input_is_a_400_and_others_are_unaffected(agent_server, client):
    done = {}
    streaming = threading.Thread(target=lambda: done.update(r=create(client, "What is the weather in Paris?")))
    streaming.start()
    for input_, kw, param in BAD:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="tiny", input=input_, **{"max_output_tokens": 20, **kw})
        assert e.value.status_code == 400 and e.value.body["param"] == param, (input_, kw, e.value.body)
    streaming.join(120)
    assert items(done["r"])[-1][:2] == ("function_call", "get_weather")
    assert_idle_no_leak(agent_server.engine)
