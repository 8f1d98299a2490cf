"""A tiny random Qwen3 with a Qwen3-style chat template (tools, <tool_call>, <think>), and a scripted sampler:
the real engine, server and parsers run, but the tokens a request samples spell the text a script gives for
its prompt (a random model would not write tool calls). A script returning None leaves the model's own tokens
(under any grammar mask)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx
from server_harness import MAX_MODEL_LEN, LiveServer
from tiny_models import make_tiny_model, make_tokenizer

from pagedllm.engine.args import EngineArgs
from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.server import build_app

API_KEY = "sk-agents"
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# Qwen3's template, reduced to what the tests exercise: tools in the system turn, <tool_call> blocks for the
# assistant's calls (arguments rendered with tojson), tool results as <tool_response> user turns, the last
# assistant turn's reasoning kept, and enable_thinking=false closing an empty <think> span in the prompt.
QWEN3_TEMPLATE = (
    r"""{%- if tools %}{{- '<|im_start|>system\n' }}"""
    r"""{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}"""
    r"""{{- '# Tools\n\n<tools>' }}{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"""
    r"""{{- '\n</tools>\n\nFor each function call, return a json object within <tool_call></tool_call> tags:\n"""
    r"""<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n' }}"""
    r"""{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"""
    r"""{%- endif %}"""
    r"""{%- for m in messages %}"""
    r"""{%- if m.role == 'user' %}{{- '<|im_start|>user\n' + m.content + '<|im_end|>\n' }}"""
    r"""{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\n' }}"""
    r"""{%- if m.reasoning_content and loop.last %}{{- '<think>\n' + m.reasoning_content + '\n</think>\n\n' }}"""
    r"""{%- endif %}{{- m.content or '' }}"""
    r"""{%- for tc in m.tool_calls or [] %}{%- set f = tc.function %}"""
    r"""{{- '\n<tool_call>\n{\"name\": \"' + f.name + '\", \"arguments\": ' }}"""
    r"""{{- f.arguments if f.arguments is string else f.arguments | tojson }}{{- '}\n</tool_call>' }}"""
    r"""{%- endfor %}{{- '<|im_end|>\n' }}"""
    r"""{%- elif m.role == 'tool' %}"""
    r"""{{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}"""
    r"""{%- endif %}{%- endfor %}"""
    r"""{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"""
    r"""{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"""
    r"""{%- endif %}"""
)


def make_agent_model(path: Path, seed: int = 0) -> Path:
    tokenizer = make_tokenizer()
    tokenizer.add_tokens(ADDED)
    tokenizer.chat_template = QWEN3_TEMPLATE
    return make_tiny_model(path, "qwen3", seed=seed, tokenizer=tokenizer)


@dataclass
class ModelText:
    """A script's answer that the model continues on its own once it is written (e.g. a reasoning span, then
    the model's own JSON under a constraint)."""

    text: str


Script = Callable[[str], "str | ModelText | None"]


class ScriptedSampler:
    """Wraps the engine's sampler: each row's token becomes the next token of its script's text, then EOS."""

    def __init__(self, sampler, tokenizer, eos: int, script: Script) -> None:
        self.sampler, self.tokenizer, self.eos, self.script = sampler, tokenizer, eos, script
        self._cache: dict[tuple[int, ...], tuple[list[int], bool] | None] = {}
        self.prompts: list[str] = []  # every prompt scripted, in order

    def _tokens(self, prompt_ids: list[int]) -> tuple[list[int], bool] | None:
        key = tuple(prompt_ids)
        if key not in self._cache:
            prompt = self.tokenizer.decode(prompt_ids)
            self.prompts.append(prompt)
            answer = self.script(prompt)
            if answer is None:
                self._cache[key] = None
            else:
                text, then_model = (answer.text, True) if isinstance(answer, ModelText) else (answer, False)
                self._cache[key] = (self.tokenizer.encode(text, add_special_tokens=False), then_model)
        return self._cache[key]

    def __call__(self, logits, rows, token_bitmask=None):
        out = self.sampler(logits, rows, token_bitmask)
        for r, row in enumerate(rows):
            scripted = self._tokens(row.prompt_token_ids)
            if scripted is None:
                continue
            tokens, then_model = scripted
            k = len(row.output_token_ids)
            if k < len(tokens):
                out.token_ids[r] = tokens[k]
            elif not then_model:
                out.token_ids[r] = self.eos
        return out


def scripted_engine(model_dir: Path, script: Script, num_blocks: int = 256) -> tuple[AsyncEngine, ScriptedSampler]:
    # the reference attention: these tests are about the APIs, and it needs no kernel build
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(model_dir), dtype="float32", num_kv_blocks=num_blocks,
                                                   block_size=16, max_model_len=MAX_MODEL_LEN, seed=0,
                                                   attention_backend="reference"))
    sampler = ScriptedSampler(engine.runner.sampler, engine.tokenizer, min(engine.eos_token_ids), script)
    engine.runner.sampler = sampler  # the runner samples every row of a step
    return AsyncEngine(engine), sampler


@contextlib.contextmanager
def scripted_server(model_dir: Path, script: Script, **app_options) -> Iterator[LiveServer]:
    engine, sampler = scripted_engine(model_dir, script)
    engine.start()
    try:
        with LiveServer(build_app(engine, api_key=API_KEY, served_model_name="tiny", **app_options)) as live:
            live.engine, live.sampler = engine, sampler
            warm_up(live.url)
            yield live
    finally:
        engine.shutdown()


def warm_up(url: str) -> None:
    """One token through the server: the first forward may build (or wait for another process building) the
    CPU kernels, which must not eat the timeouts of the tests."""
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=1800)
    assert r.status_code == 200, r.text


def last_turn(prompt: str) -> str:
    """The text of the prompt's last user turn (a tool response included)."""
    turns = re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", prompt, re.DOTALL)
    return turns[-1] if turns else ""


WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"}},
                  "required": ["city"], "additionalProperties": False}
REASONED_CALL = ("<think>\nThe user wants the weather: call the tool.\n</think>\n\nLet me look that up.\n"
                 '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
PARALLEL_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                  '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
LONG_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "' + "Paris " * 40 + '"}}\n</tool_call>'


def tool_response(turn: str) -> str | None:
    m = re.search(r"<tool_response>\n(.*?)\n</tool_response>", turn, re.DOTALL)
    return m.group(1) if m else None


def weather_script(prompt: str) -> str | ModelText | None:
    """What a tool-using reasoning model would write, by the last user turn; None: the model's own tokens."""
    turn = last_turn(prompt)
    result = tool_response(turn)
    if result is not None:
        return f"<think>\nThe tool answered.\n</think>\n\nThe weather report says: {result}"
    for trigger, text in (("weather in Paris", REASONED_CALL), ("Paris and Rome", PARALLEL_CALLS),
                          ("long call", LONG_CALL), ("say hello", "<think>\nA greeting.\n</think>\n\nHello there!"),
                          ("stop word", "Before the STOP after"),
                          ("mistral style", 'Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}')):
        if trigger in turn:
            return text
    if "think first" in turn:
        return ModelText("<think>\nPlan the answer.\n</think>")  # then the model, under the constraint
    return None


def weather_agent(model, calls: list[str], **kw):
    """An `openai-agents` agent with one Python tool, get_weather, which records the cities it is called for."""
    import agents

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}, 21C"

    return agents.Agent(name="weather", instructions="Answer with the tools.", tools=[get_weather], model=model, **kw)


def openai_client(server: LiveServer):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=600)


# chat completions as a client reads them: (content, reasoning, calls, finish reason)
def assembled(chunks):
    """The message a client builds from the stream: content, reasoning and tool calls by index."""
    content, reasoning, calls, finish = "", "", {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        for tc in d.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or tc.id
            call["name"] += (tc.function.name or "") if tc.function else ""
            call["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = ch.choices[0].finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


def whole(r):
    m = r.choices[0].message
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls or []]
    return m.content or "", getattr(m, "reasoning_content", None) or "", calls, r.choices[0].finish_reason


def same_but_ids(a, b):
    strip = lambda x: (x[0], x[1], [{k: v for k, v in c.items() if k != "id"} for c in x[2]], x[3])  # noqa: E731
    return strip(a) == strip(b)
