"""Tool-call and reasoning parsers on model-shaped text: whole, and streamed in every prefix and in seeded
random chunks (the deltas must assemble into exactly the whole parse), including malformed and cut calls."""

from __future__ import annotations

import json
import random

import pytest

from pagedllm.entrypoints.openai.output_parser import OutputParser, SegmentStream, parse_final
from pagedllm.entrypoints.openai.reasoning import Start, make_reasoning_parser
from pagedllm.entrypoints.openai.tool_parsers import (
    NamedToolParser,
    RequiredToolParser,
    make_tool_parser,
    tool_parser_for_template,
)
from pagedllm.entrypoints.openai.tool_parsers.jsonscan import close_partial

TOOLS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}}},
    "get_time": {"type": "object", "properties": {"zone": {"type": "string"}, "exact": {"type": "boolean"},
                                                  "offsets": {"type": "array"}}},
}
W = '{"city": "Paris", "unit": "celsius"}'
T = '{"zone": "CET"}'

# (parser, text, expected segments as (kind, text, name, complete)); "final" parse of the whole text
CASES = [
    ("hermes", f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>\n'
               f'<tool_call>\n{{"name": "get_time", "arguments": {T}}}\n</tool_call>',
     [("text", "Let me check.", "", True), ("call", W, "get_weather", True), ("call", T, "get_time", True)]),
    ("hermes", f'<tool_call>{{"name": "get_time", "arguments": {T}}}</tool_call>\nDone, see above.',
     [("call", T, "get_time", True), ("text", "Done, see above.", "", True)]),
    ("hermes", "<tool_call>\nnot json at all\n</tool_call> and more",
     [("text", "<tool_call>\nnot json at all\n</tool_call> and more", "", True)]),
    ("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
     [("text", "Sure.", "", True), ("call", '{"city": "Par', "get_weather", False)]),
    ("hermes", '<tool_call>\n{"na', [("call", "", "", False)]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>',
     [("call", '{"zone": "UTC"}', "get_time", True)]),
    ("hermes", '<tool_call>{"arguments": {"zone": "UTC"}, "name": "get_time"}</tool_call>',
     [("call", '{"zone": "UTC"}', "get_time", True)]),
    ("hermes", '<tool_call>{"name": "get_time"}</tool_call>', [("call", "{}", "get_time", True)]),
    ("hermes", "Plain text with <b>tags</b>, a < sign and a trailing space ",
     [("text", "Plain text with <b>tags</b>, a < sign and a trailing space ", "", True)]),
    # untagged, as small models write them: a whole-message object or a ```json fence, of an offered tool with
    # arguments valid against its schema; any other JSON is text
    ("hermes", f'{{"name": "get_weather", "arguments": {W}}}', [("call", W, "get_weather", True)]),
    ("hermes", f'```json\n{{"name": "get_time", "arguments": {T}}}\n```\n', [("call", T, "get_time", True)]),
    ("hermes", ' ```\n{"name": "get_time", "parameters": "{\\"zone\\": \\"CET\\"}"}```',
     [("call", T, "get_time", True)]),
    ("hermes", '{"name": "get_weather", "arguments": {"city": "Paris", "days": "three"}}',
     [("text", '{"name": "get_weather", "arguments": {"city": "Paris", "days": "three"}}', "", True)]),
    ("hermes", '{"name": "send_mail", "arguments": {}}', [("text", '{"name": "send_mail", "arguments": {}}', "", True)]),
    ("hermes", '```json\n{"city": "Paris"}\n```', [("text", '```json\n{"city": "Paris"}\n```', "", True)]),
    ("hermes", '```python\nprint({"name": "get_time"})\n```',
     [("text", '```python\nprint({"name": "get_time"})\n```', "", True)]),
    ("hermes", f'Here: {{"name": "get_time", "arguments": {T}}}',
     [("text", f'Here: {{"name": "get_time", "arguments": {T}}}', "", True)]),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {W}}}', [("call", W, "get_weather", True)]),
    ("llama3_json", f'<|python_tag|>{{"name": "get_time", "parameters": {T}}}; '
                    f'{{"name": "get_weather", "parameters": {W}}}',
     [("call", T, "get_time", True), ("call", W, "get_weather", True)]),
    ("llama3_json", '{"answer": 42}', [("text", '{"answer": 42}', "", True)]),
    ("llama3_json", '{"name": "Bob", "age": 3}', [("text", '{"name": "Bob", "age": 3}', "", True)]),
    ("llama3_json", 'The call would be {"name": "get_time"}', [("text", 'The call would be {"name": "get_time"}', "",
                                                                 True)]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Pa',
     [("call", '{"city": "Pa', "get_weather", False)]),
    ("mistral", f'Checking.[TOOL_CALLS][{{"name": "get_weather", "arguments": {W}}}, '
                f'{{"name": "get_time", "arguments": {T}}}]',
     [("text", "Checking.", "", True), ("call", W, "get_weather", True), ("call", T, "get_time", True)]),
    ("mistral", f"[TOOL_CALLS]get_weather[ARGS]{W}[TOOL_CALLS]get_time[ARGS]{T}",
     [("call", W, "get_weather", True), ("call", T, "get_time", True)]),
    ("mistral", f"[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{T}", [("call", T, "get_time", True)]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', [("call", '{"city": "Pa', "get_weather", False)]),
    ("mistral", "[TOOL_CALLS][1, 2]", [("text", "[TOOL_CALLS][1, 2]", "", True)]),
    ("qwen3_coder", "I will call.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
     [("text", "I will call.", "", True), ("call", '{"city": "Paris", "days": 3}', "get_weather", True)]),
    ("qwen3_coder", "<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n<parameter=exact>\ntrue\n"
                    "</parameter>\n<parameter=offsets>\n[1, 2]\n</parameter>\n</function>",
     [("call", '{"zone": "CET", "exact": true, "offsets": [1, 2]}', "get_time", True)]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n1",
     [("call", '{"city": "Paris"', "get_weather", False)]),
    ("qwen3_coder", "<tool_call>\nhello\n</tool_call>", [("text", "<tool_call>\nhello\n</tool_call>", "", True)]),
    # harmony (gpt-oss), as the model writes it after the prompt's `<|start|>assistant`; <|call|> and <|return|>
    # end the sequence, so the text usually stops before them. Without a reasoning parser the analysis is text.
    ("gpt_oss", f"<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
                f"to=functions.get_weather <|constrain|>json<|message|>{W}",
     [("text", "Need the weather.", "", True), ("call", W, "get_weather", True)]),
    ("gpt_oss", f" to=functions.get_time<|channel|>commentary json<|message|>{T}<|call|>",
     [("call", T, "get_time", True)]),
    ("gpt_oss", f"<|channel|>commentary<|message|>Checking both.<|end|><|start|>assistant to=functions.get_time"
                f"<|channel|>commentary json<|message|>{T}<|call|><|start|>assistant to=functions.get_weather"
                f"<|channel|>commentary json<|message|>{W}",
     [("text", "Checking both.", "", True), ("call", T, "get_time", True), ("call", W, "get_weather", True)]),
    ("gpt_oss", '<|channel|>commentary to=functions.get_weather json<|message|>{"city": "Par',
     [("call", '{"city": "Par', "get_weather", True)]),  # cut: max_tokens marks it (mark_cut)
    ("gpt_oss", "<|channel|>commentary to=functions.get_time<|message|><|call|>", [("call", "{}", "get_time", True)]),
    ("gpt_oss", "<|channel|>commentary to=functions.get_weather", [("call", "", "get_weather", False)]),
    ("gpt_oss", "<|channel|>final<|message|>It is 3 < 4, sunny.<|return|>",
     [("text", "It is 3 < 4, sunny.", "", True)]),
    ("gpt_oss", "<|channel|>chatter<|message|>odd channel<|end|><|start|>assistant<|channel|>analysis to=browser.search"
                ' json<|message|>{"q": 1}<|end|><|start|>assistant<|channel|>final<|message|>ok',
     [("text", 'odd channel\n{"q": 1}\nok', "", True)]),
    ("gpt_oss", "Plain words, no harmony at all.", [("text", "Plain words, no harmony at all.", "", True)]),
    ("gpt_oss", "<|start|><|start|>assistant<|channel|>final<|message|>fine", [("text", "fine", "", True)]),
]


def shape(segments):
    return [(s.kind, s.text, s.name, s.complete) for s in segments]


def stream_chunks(parser: OutputParser, chunks: list[str]):
    """Feed growing text; return the segments rebuilt from the events alone."""
    stream, rebuilt, text = SegmentStream(parser), [], ""
    for k, chunk in enumerate(chunks):
        text += chunk
        for ev in stream.update(text, final=k == len(chunks) - 1):
            if ev.type == "start":
                assert ev.index == len(rebuilt)
                rebuilt.append([ev.segment.kind, "", ev.segment.name, ev.segment.call_id])
            elif ev.type == "delta":
                rebuilt[ev.index][1] += ev.delta
    assert not stream._warned
    return rebuilt, stream.segments


def check_streams(make_parser, text: str, seed: int) -> None:
    whole = shape(parse_final(make_parser(), text))
    rng = random.Random(seed)
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)]  # every prefix, then the rest
    for _ in range(20):
        points = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
        cuts.append([text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)])
    for chunks in cuts:
        rebuilt, sent = stream_chunks(make_parser(), chunks)
        assert [(k, t, n) for k, t, n, _ in rebuilt] == [w[:3] for w in whole], (seed, chunks)
        assert shape(sent) == whole, (seed, chunks)
        assert all(r[3] == s.call_id for r, s in zip(rebuilt, sent, strict=True))


@pytest.mark.parametrize("case", range(len(CASES)))
def test_parser_whole_and_streamed(case):
    name, text, expected = CASES[case]
    make = lambda: OutputParser(tools=make_tool_parser(name, TOOLS))  # noqa: E731
    assert shape(parse_final(make(), text)) == expected
    check_streams(make, text, seed=case)


def test_calls_get_ids_and_arguments_parse():
    segs = parse_final(OutputParser(tools=make_tool_parser("hermes", TOOLS)), CASES[0][1])
    ids = [s.call_id for s in segs if s.kind == "call"]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    assert [json.loads(s.text) for s in segs if s.kind == "call"] == [json.loads(W), json.loads(T)]
    mistral = parse_final(OutputParser(tools=make_tool_parser("mistral", TOOLS)), CASES[24][1])
    assert all(len(s.call_id) == 9 and s.call_id.isalnum() for s in mistral)


REASONING = [
    ("deepseek_r1", Start.OPEN, "Let me think: 2 + 2.\n</think>\n\nThe answer is 4.",
     [("reasoning", "Let me think: 2 + 2.", "", True), ("text", "The answer is 4.", "", True)]),
    ("deepseek_r1", Start.OPEN, "<think>\nStill thinking and then cut", [("reasoning", "Still thinking and then cut",
                                                                          "", True)]),
    ("qwen3", Start.MAY_OPEN, "<think>\nHmm.\n</think>\n\nHello!", [("reasoning", "Hmm.", "", True),
                                                                      ("text", "Hello!", "", True)]),
    ("qwen3", Start.MAY_OPEN, "Hello without thinking <think> here", [("text", "Hello without thinking <think> here",
                                                                        "", True)]),
    ("qwen3", Start.OFF, "<think>x</think>y", [("text", "<think>x</think>y", "", True)]),
    ("gpt_oss", Start.OPEN, "<|channel|>analysis<|message|>2 + 2 is 4.<|end|>\n<|start|>assistant<|channel|>final"
                            "<|message|>The answer is 4.<|return|>",
     [("reasoning", "2 + 2 is 4.", "", True), ("text", "The answer is 4.", "", True)]),
    ("gpt_oss", Start.OPEN, "<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>analysis"
                            "<|message|>Second.<|end|><|start|>assistant<|channel|>final<|message|>Done.",
     [("reasoning", "First.\nSecond.", "", True), ("text", "Done.", "", True)]),
    ("gpt_oss", Start.OPEN, "<|channel|>analysis<|message|>Cut while thinki",
     [("reasoning", "Cut while thinki", "", True)]),
    ("gpt_oss", Start.OPEN, "<|channel|>final<|message|>No reasoning.", [("text", "No reasoning.", "", True)]),
    ("gpt_oss", Start.OPEN, "<|channel|>commentary<|message|>Preamble.<|end|><|start|>assistant<|channel|>analysis"
                            "<|message|>Late thought.<|end|><|start|>assistant<|channel|>final<|message|>Answer.",
     [("text", "Preamble.\nLate thought.\nAnswer.", "", True)]),  # reasoning after content stays content
    ("gpt_oss", Start.OFF, '{"json": "constrained"}', [("text", '{"json": "constrained"}', "", True)]),
]


@pytest.mark.parametrize("case", range(len(REASONING)))
def test_reasoning_whole_and_streamed(case):
    name, start, text, expected = REASONING[case]
    make = lambda: OutputParser(make_reasoning_parser(name), start)  # noqa: E731
    assert shape(parse_final(make(), text)) == expected
    check_streams(make, text, seed=100 + case)


def test_reasoning_then_tool_calls():
    text = f'<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>'
    make = lambda: OutputParser(make_reasoning_parser("qwen3"), Start.MAY_OPEN, make_tool_parser("hermes", TOOLS))  # noqa: E731
    assert shape(parse_final(make(), text)) == [("reasoning", "The user wants weather.", "", True),
                                                ("call", W, "get_weather", True)]
    check_streams(make, text, seed=7)


@pytest.mark.parametrize("text, expected", [
    (f"<|channel|>analysis<|message|>The user wants weather.<|end|><|start|>assistant<|channel|>commentary "
     f"to=functions.get_weather <|constrain|>json<|message|>{W}",
     [("reasoning", "The user wants weather.", "", True), ("call", W, "get_weather", True)]),
    (f"<|channel|>analysis<|message|>Two calls.<|end|><|start|>assistant<|channel|>commentary<|message|>On it."
     f"<|end|><|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{T}<|call|>"
     f"<|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>{W}",
     [("reasoning", "Two calls.", "", True), ("text", "On it.", "", True), ("call", T, "get_time", True),
      ("call", W, "get_weather", True)]),
    ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Hi!",
     [("reasoning", "Easy.", "", True), ("text", "Hi!", "", True)]),
    ("<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>commentary to=python<|message|>1+1",
     [("reasoning", "Hmm.", "", True), ("text", "1+1", "", True)]),  # a built-in tool this server does not run
])
def test_harmony_reasoning_then_tool_calls(text, expected, caplog):
    make = lambda: OutputParser(make_reasoning_parser("gpt_oss"), Start.OPEN, make_tool_parser("gpt_oss", TOOLS))  # noqa: E731
    assert shape(parse_final(make(), text)) == expected
    unknown = [r for r in caplog.records if "not one this server reads" in r.getMessage()]
    assert len(unknown) == (1 if "to=python" in text else 0)  # warned once (the final parse), never raised
    assert make().keeps_special_tokens
    check_streams(make, text, seed=11)


HARMONY_SOUP = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>",
                "assistant", " to=functions.get_weather", " to=python", "analysis", "commentary", "final", " json",
                '{"a": 1}', "hi", " ", "\n", "<", "to=", "x"]


def test_harmony_token_soup_never_breaks_a_stream():
    """Harmony's markers and words in random order (what a confused model may write): every parser combination
    parses it, and its streams, in every prefix and random chunks, assemble into the whole parse."""
    from tiny_models import fresh_seed

    makers = [lambda: OutputParser(make_reasoning_parser("gpt_oss"), Start.OPEN, make_tool_parser("gpt_oss", TOOLS)),
              lambda: OutputParser(make_reasoning_parser("gpt_oss"), Start.OPEN),
              lambda: OutputParser(tools=make_tool_parser("gpt_oss", TOOLS))]
    rng = random.Random(fresh_seed())
    for _ in range(60):
        text = "".join(rng.choice(HARMONY_SOUP) for _ in range(rng.randint(1, 14)))
        for make in makers:
            check_streams(make, text, seed=rng.randrange(1 << 16))


def test_start_state_from_the_prompt():
    r1, q3 = make_reasoning_parser("deepseek_r1"), make_reasoning_parser("qwen3")
    assert q3.start_state("<|im_start|>assistant\n<think>\n") is Start.OPEN
    assert q3.start_state("<|im_start|>assistant\n<think>\n\n</think>\n\n") is Start.OFF
    assert q3.start_state("<|im_start|>assistant\n") is Start.MAY_OPEN
    assert r1.start_state("<|Assistant|>") is Start.OPEN


def test_forced_parsers_stream():
    named = lambda: OutputParser(tools=NamedToolParser(TOOLS, "get_weather"))  # noqa: E731
    assert shape(parse_final(named(), " " + W)) == [("call", W, "get_weather", True)]
    check_streams(named, W, seed=3)
    text = f'[{{"name": "get_time", "parameters": {T}}}, {{"name": "get_weather", "parameters": {W}}}]'
    required = lambda: OutputParser(tools=RequiredToolParser(TOOLS))  # noqa: E731
    assert shape(parse_final(required(), text)) == [("call", T, "get_time", True), ("call", W, "get_weather", True)]
    check_streams(required, text, seed=4)


def test_template_default_parser():
    assert tool_parser_for_template("{% if tools %}<tool_call>{{ x }}</tool_call>{% endif %}") == "hermes"
    assert tool_parser_for_template("{% if tools %}<tool_call><function={{ n }}>{% endif %}") == "qwen3_coder"
    assert tool_parser_for_template("{% for t in tools %}[TOOL_CALLS]{% endfor %}") == "mistral"
    assert tool_parser_for_template('{{ tools }} <|python_tag|> {"name": x, "parameters": y}') == "llama3_json"
    assert tool_parser_for_template('{% if tools %}"<|start|>assistant to=" + name + "<|channel|>commentary "') \
        == "gpt_oss"
    assert tool_parser_for_template("{{ tools }} <tool_call> [TOOL_CALLS]") is None  # ambiguous
    assert tool_parser_for_template("{{ messages }}") is None


def test_close_partial():
    assert close_partial('{"a": 1, "b') == {"a": 1}
    assert close_partial('{"a": "xy') == {"a": "xy"}
    assert close_partial('{"a": [1, {"b": "c') == {"a": [1, {"b": "c"}]}
    assert close_partial('{"a": tr') == {}
    assert close_partial("") is None


def test_auto_parser_and_serve_flags():
    import argparse

    from pagedllm.entrypoints.openai.server import add_serve_args
    from pagedllm.entrypoints.openai.structured import auto_tool_parser

    assert auto_tool_parser("mistral", "{{ tools }} <tool_call>") == "mistral"  # the server's flag wins
    assert auto_tool_parser(None, "{{ tools }} <tool_call><function={{ n }}>") == "qwen3_coder"
    assert auto_tool_parser(None, "{% if tools %}{{ tools }}{% endif %}") == "hermes"  # renders tools, no marker
    assert auto_tool_parser(None, "{{ messages }}") is None  # no tool calling: "auto" is a 400
    args = add_serve_args(argparse.ArgumentParser()).parse_args(
        ["--tool-call-parser", "qwen3_coder", "--reasoning-parser", "deepseek_r1", "--max-stored-responses", "8"])
    assert (args.tool_call_parser, args.reasoning_parser, args.max_stored_responses) == ("qwen3_coder", "deepseek_r1", 8)
    with pytest.raises(SystemExit):
        add_serve_args(argparse.ArgumentParser()).parse_args(["--tool-call-parser", "nope"])


def test_response_store_is_bounded():
    from pagedllm.entrypoints.openai.responses.store import ResponseStore, StoredResponse

    store = ResponseStore(max_responses=3, max_chars=10_000)
    for i in range(5):
        store.put(f"r{i}", StoredResponse({"id": f"r{i}"}, [{"role": "user", "content": "x" * 100}]))
    assert len(store) == 3 and store.get("r0") is None and store.get("r4") is not None
    store.get("r2")  # used: r3 is now the least recently used
    store.put("big", StoredResponse({"id": "big"}, [{"role": "user", "content": "y" * 9_000}]))
    assert store.get("r3") is None and store.get("r2") is not None and store.get("big") is not None
    store.put("huge", StoredResponse({"id": "huge"}, [{"role": "user", "content": "z" * 20_000}]))
    assert store.get("huge") is None  # larger than the whole store: not kept
    assert store.delete("big") and not store.delete("big")
