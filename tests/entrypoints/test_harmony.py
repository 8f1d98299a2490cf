"""gpt-oss's harmony format end to end: `--reasoning-parser gpt_oss` and `--tool-call-parser gpt_oss` on a live
server whose tiny model writes harmony (harmony_harness: scripted analysis, calls and answers), through the
`openai` SDK's Chat Completions and Responses clients and an `openai-agents` loop: a tool round trip with the
reasoning apart from the answer, whole and streamed, a cut call, messages on unknown channels, reasoning_effort
in the prompt; and OpenAI's real gpt-oss template rendered in our sandbox, where the bench build has a copy."""

from __future__ import annotations

import json
import re

import pytest
from agent_harness import (
    API_KEY,
    assembled,
    openai_client,
    same_but_ids,
    scripted_server,
    weather_agent,
    whole,
)
from harmony_harness import LONG_CALL, PARIS_ARGS, REAL_TEMPLATE, harmony_script, make_harmony_model
from server_harness import assert_idle_no_leak

openai = pytest.importorskip("openai")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "description": "The city."}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": WEATHER}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
                    "parameters": WEATHER}]
ASK = "What is the weather in Paris?"
REPORT = "Sunny in Paris, 21C"
ANSWER = f"The weather report says: {REPORT}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_harmony_model(tmp_path_factory.mktemp("harmony"))
    with scripted_server(model, harmony_script, reasoning_parser="gpt_oss", tool_call_parser="gpt_oss") as live:
        yield live


def chat_both(client, messages, **kw):
    """The message whole and streamed (they must agree but for the call ids); the whole one."""
    kw.setdefault("max_tokens", 200)
    w = whole(client.chat.completions.create(model="tiny", messages=messages, **kw))
    s = assembled(client.chat.completions.create(model="tiny", messages=messages, stream=True, **kw))
    assert same_but_ids(w, s), (w, s)
    return w


def prompt_of(server, last: str) -> str:
    """The prompt (the latest scripted) whose last message ends with `last`."""
    return next(p for p in reversed(server.sampler.prompts) if p.endswith(f"{last}<|end|><|start|>assistant"))


def test_chat_tool_round_trip(server):
    client = openai_client(server)
    ask = [{"role": "user", "content": ASK}]
    content, reasoning, (call,), finish = chat_both(client, ask, tools=TOOLS, reasoning_effort="high")
    assert (content, reasoning, finish) == ("", "The user wants the weather: call the tool.", "tool_calls")
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == json.loads(PARIS_ARGS)
    assert "Reasoning: high" in prompt_of(server, ASK)
    turn = ask + [{"role": "assistant", "content": None, "reasoning_content": reasoning,
                   "tool_calls": [{"id": call["id"], "type": "function",
                                   "function": {"name": "get_weather", "arguments": call["arguments"]}}]},
                  {"role": "tool", "tool_call_id": call["id"], "content": REPORT}]
    assert chat_both(client, turn, tools=TOOLS) == (ANSWER, "The tool answered.", [], "stop")
    prompt = prompt_of(server, REPORT)
    assert ("<|start|>assistant<|channel|>analysis<|message|>The user wants the weather: call the tool.<|end|>"
            f"<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{PARIS_ARGS}<|call|>"
            f"<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{REPORT}<|end|>") in prompt
    assert "Reasoning: medium" in prompt  # the template's default
    assert_idle_no_leak(server.engine)


def test_cut_call_stays_a_call(server):
    client = openai_client(server)
    head = LONG_CALL[:LONG_CALL.index("Paris") + len("Paris Paris")]
    budget = len(server.engine.tokenizer.encode(head, add_special_tokens=False))
    content, reasoning, (call,), finish = chat_both(client, [{"role": "user", "content": "a long call"}],
                                                    tools=TOOLS, max_tokens=budget)
    assert (content, reasoning, finish) == ("", "A long one.", "length")
    assert call["name"] == "get_weather" and call["arguments"].startswith('{"city": "Paris Paris')


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_unknown_channels_come_back_as_content(server, tools, caplog):
    w = chat_both(openai_client(server), [{"role": "user", "content": "odd"}], tools=tools)
    assert w == ('odd\n{"id": 1}\nfine', "", [], "stop")
    assert any("not one this server reads" in r.getMessage() for r in caplog.records)


def test_chat_without_tools_keeps_reasoning_apart(server):
    w = chat_both(openai_client(server), [{"role": "user", "content": "Please say hello."}], reasoning_effort="low")
    assert w == ("Hello there!", "A greeting.", [], "stop")
    assert "Reasoning: low" in prompt_of(server, "Please say hello.")


def test_bad_reasoning_effort_is_a_400(server):
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                             "reasoning_effort": "extreme"}, key=API_KEY)
    assert r.status_code == 400 and "reasoning_effort" in r.text


def _items(output) -> list[tuple]:
    """A Response's output as (type, text or (name, arguments))."""
    out = []
    for item in output:
        if item.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in item.content or [])))
        elif item.type == "message":
            out.append(("message", "".join(c.text for c in item.content)))
        else:
            out.append(("function_call", item.name, json.loads(item.arguments)))
    return out


def _streamed(client, **kw):
    """The Response a stream completes with, checked against the deltas it sent."""
    text, args, final = {}, {}, None
    for ev in client.responses.create(stream=True, **kw):
        if ev.type in ("response.output_text.delta", "response.reasoning_text.delta"):
            text[ev.item_id] = text.get(ev.item_id, "") + ev.delta
        elif ev.type == "response.function_call_arguments.delta":
            args[ev.item_id] = args.get(ev.item_id, "") + ev.delta
        elif ev.type == "response.completed":
            final = ev.response
    for item in final.output:
        sent = args.get(item.id) if item.type == "function_call" else text.get(item.id)
        assert sent == (item.arguments if item.type == "function_call" else _items([item])[0][1]), item
    return final


@pytest.mark.parametrize("stream", [False, True])
def test_responses_tool_round_trip(server, stream):
    client = openai_client(server)
    create = (lambda **kw: _streamed(client, **kw)) if stream else client.responses.create
    r = create(model="tiny", input=ASK, tools=RESPONSES_TOOLS, reasoning={"effort": "high"})
    assert _items(r.output) == [("reasoning", "The user wants the weather: call the tool."),
                                ("function_call", "get_weather", {"city": "Paris"})]
    assert "Reasoning: high" in prompt_of(server, ASK)
    call_id = r.output[1].call_id
    r2 = create(model="tiny", previous_response_id=r.id, tools=RESPONSES_TOOLS,
                input=[{"type": "function_call_output", "call_id": call_id, "output": REPORT}])
    assert _items(r2.output) == [("reasoning", "The tool answered."), ("message", ANSWER)]
    assert r2.output_text == ANSWER


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_agents_sdk_tool_round_trip(server, api):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # no trace export: nothing may leave this machine
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=600)
    model = (agents.OpenAIResponsesModel("tiny", client) if api == "responses"
             else agents.OpenAIChatCompletionsModel("tiny", client))
    calls: list[str] = []
    result = agents.Runner.run_sync(weather_agent(model, calls), ASK)
    assert calls == ["Paris"]
    assert result.final_output == ANSWER  # the answer alone: the reasoning came as reasoning items
    reasoning = [i for i in result.new_items if isinstance(i, agents.ReasoningItem)]
    assert len(reasoning) == 2
    assert "to=functions.get_weather" in prompt_of(server, REPORT)  # the call went back in harmony
    assert_idle_no_leak(server.engine)


needs_real_template = pytest.mark.skipif(not REAL_TEMPLATE.exists(), reason="no copy of OpenAI's gpt-oss template")
CONVERSATION = [
    {"role": "developer", "content": "Answer briefly."},
    {"role": "user", "content": ASK},
    {"role": "assistant", "content": None, "reasoning_content": "Call the tool.",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": PARIS_ARGS}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": REPORT},
]


def _undated(text: str) -> str:
    return re.sub(r"Current date: \d{4}-\d\d-\d\d", "Current date: D", text)


@needs_real_template
def test_real_template_renders_as_transformers_does():
    """Every role, the three channels, tool definitions, a call to=functions.NAME and its result, in our sandbox
    (strftime_now, namespace, macros, filters) exactly as transformers renders them."""
    from pagedllm.entrypoints.openai.protocol import ChatMessage
    from pagedllm.templating.sandbox import TemplateSandbox, render_chat_template

    template = REAL_TEMPLATE.read_text()
    tok = type("Tok", (), {"chat_template": template, "special_tokens_map": {}})()
    history = CONVERSATION + [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": "Thanks!"}]
    sandbox = TemplateSandbox()
    try:
        for conversation, effort in ((CONVERSATION, "high"), (history, None)):
            messages = [ChatMessage(**m).to_template_dict() for m in conversation]
            kwargs = {"reasoning_effort": effort} if effort else {}
            ours = render_chat_template(tok, messages, tools=TOOLS, chat_template_kwargs=kwargs, sandbox=sandbox)
            assert ("Reasoning: " + (effort or "medium")) in ours
            assert "# Instructions\n\nAnswer briefly." in ours and "type get_weather = (_: {\n// The city.\ncity: string" in ours
            assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
                    f'{PARIS_ARGS}<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary'
                    f'<|message|>"{REPORT}"<|end|>') in ours
            # the analysis before a call is kept until a final answer follows it
            assert ("<|channel|>analysis<|message|>Call the tool.<|end|>" in ours) is (conversation is CONVERSATION)
            assert ours.endswith("<|start|>assistant")
            chat_utils = pytest.importorskip("transformers.utils.chat_template_utils")
            theirs, _ = chat_utils.render_jinja_template(conversations=[messages], tools=TOOLS, chat_template=template,
                                                         add_generation_prompt=True, **kwargs)
            assert _undated(ours) == _undated(theirs[0])
    finally:
        sandbox.close()


@needs_real_template
def test_real_template_tool_round_trip(tmp_path):
    """The tiny model with OpenAI's template as its own: the tool parser is read from the template (no flag)."""
    model = make_harmony_model(tmp_path / "real", template=REAL_TEMPLATE.read_text())
    with scripted_server(model, harmony_script, reasoning_parser="gpt_oss") as live:
        client = openai_client(live)
        ask = [{"role": "user", "content": ASK}]
        _, reasoning, (call,), finish = chat_both(client, ask, tools=TOOLS, reasoning_effort="high")
        assert (reasoning, call["name"], finish) == ("The user wants the weather: call the tool.", "get_weather",
                                                     "tool_calls")
        assert "Reasoning: high" in prompt_of(live, ASK) and "type get_weather" in prompt_of(live, ASK)
        turn = ask + [{"role": "assistant", "content": None, "reasoning_content": reasoning,
                       "tool_calls": [{"id": call["id"], "type": "function",
                                       "function": {"name": "get_weather", "arguments": call["arguments"]}}]},
                      {"role": "tool", "tool_call_id": call["id"], "content": REPORT}]
        assert chat_both(client, turn, tools=TOOLS) == (ANSWER, "The tool answered.", [], "stop")
