"""A tiny random model that speaks OpenAI's harmony format (gpt-oss): its tokenizer has harmony's special tokens,
<|return|> and <|call|> end its sequences, and its chat template is a minimal harmony one of ours (or OpenAI's
real gpt-oss template, where the bench build has a copy). With agent_harness's scripted sampler it writes what
gpt-oss would: analysis, then a call to a function or the final answer."""

from __future__ import annotations

import os
import re
from pathlib import Path

from agent_harness import ModelText
from tiny_models import make_tiny_model, make_tokenizer

HARMONY_ARCH = "gpt_oss"  # the tiny checkpoint: a random gpt-oss (sinks, alternating windows, experts)
SPECIAL = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
EOS = ["<|return|>", "<|call|>"]  # as gpt-oss's generation_config lists them


def _real_template() -> Path:
    """OpenAI's gpt-oss template: $PAGEDLLM_GPT_OSS_TEMPLATE, else the copy in the bench build's llama.cpp
    sources (`make bench-setup`); a path that does not exist when there is neither."""
    if os.environ.get("PAGEDLLM_GPT_OSS_TEMPLATE"):
        return Path(os.environ["PAGEDLLM_GPT_OSS_TEMPLATE"])
    root = Path(__file__).resolve().parents[2]
    found = sorted(root.glob(".venv/bench-build/llama_cpp_python-*/vendor/llama.cpp/models/templates/"
                             "openai-gpt-oss-120b.jinja"))
    return found[-1] if found else root / "openai-gpt-oss-120b.jinja (not found)"


REAL_TEMPLATE = _real_template()

# harmony as gpt-oss's template renders it, reduced to what the tests exercise: the reasoning effort in the
# system message, the developer message's instructions and tools, the calls addressed to=functions.NAME with
# their arguments as JSON, the tool results from functions.NAME, and the analysis kept before a call
HARMONY_TEMPLATE = (
    r"""{{- '<|start|>system<|message|>Reasoning: ' + (reasoning_effort | default('medium')) + '\n\n' }}"""
    r"""{{- '# Valid channels: analysis, commentary, final.<|end|>' }}"""
    r"""{%- set first = messages[0] if messages[0].role == 'system' else none %}"""
    r"""{%- if first or tools %}{{- '<|start|>developer<|message|>' }}"""
    r"""{%- if first %}{{- '# Instructions\n\n' + first.content + '\n\n' }}{%- endif %}"""
    r"""{%- if tools %}{{- '# Tools\n\nnamespace functions {\n' }}{%- for t in tools %}"""
    r"""{{- 'type ' + t.function.name + ' = (_: ' + (t.function.parameters | tojson) + ') => any;\n' }}"""
    r"""{%- endfor %}{{- '} // namespace functions' }}{%- endif %}{{- '<|end|>' }}{%- endif %}"""
    r"""{%- set last = namespace(name=none) %}"""
    r"""{%- for m in (messages[1:] if first else messages) %}"""
    r"""{%- if m.role == 'user' %}{{- '<|start|>user<|message|>' + m.content + '<|end|>' }}"""
    r"""{%- elif m.role == 'assistant' and m.tool_calls %}"""
    r"""{%- if m.thinking %}{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' }}"""
    r"""{%- endif %}{%- for tc in m.tool_calls %}{%- set last.name = tc.function.name %}"""
    r"""{{- '<|start|>assistant to=functions.' + tc.function.name + '<|channel|>commentary json<|message|>' }}"""
    r"""{{- (tc.function.arguments | tojson) + '<|call|>' }}{%- endfor %}"""
    r"""{%- elif m.role == 'assistant' %}"""
    r"""{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}"""
    r"""{%- elif m.role == 'tool' %}"""
    r"""{{- '<|start|>functions.' + last.name + ' to=assistant<|channel|>commentary<|message|>' + m.content }}"""
    r"""{{- '<|end|>' }}{%- endif %}{%- endfor %}"""
    r"""{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"""
)


def make_harmony_model(path: Path, template: str = HARMONY_TEMPLATE, seed: int = 0) -> Path:
    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    tokenizer.chat_template = template
    eos = [tokenizer.convert_tokens_to_ids(t) for t in EOS]
    return make_tiny_model(path, HARMONY_ARCH, seed=seed, tokenizer=tokenizer, eos_token_id=eos)


PARIS_ARGS = '{"city": "Paris"}'
REASONED_CALL = ("<|channel|>analysis<|message|>The user wants the weather: call the tool.<|end|>"
                 "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                 f"{PARIS_ARGS}<|call|>")
LONG_CALL = ("<|channel|>analysis<|message|>A long one.<|end|><|start|>assistant to=functions.get_weather"
             '<|channel|>commentary json<|message|>{"city": "' + "Paris " * 40 + '"}<|call|>')
ODD_CHANNELS = ("<|channel|>chatter<|message|>odd<|end|><|start|>assistant<|channel|>commentary to=browser.open"
                '<|message|>{"id": 1}<|end|><|start|><|start|>assistant<|channel|>final<|message|>fine<|return|>')


def final_answer(reasoning: str, answer: str) -> str:
    return (f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant<|channel|>final<|message|>"
            f"{answer}<|return|>")


def harmony_script(prompt: str) -> str | ModelText | None:
    """What gpt-oss would write after this prompt, by its last message; None: the model's own tokens."""
    result = re.search(r"<\|start\|>functions\.get_weather to=assistant<\|channel\|>commentary<\|message\|>(.*?)"
                       r"<\|end\|><\|start\|>assistant$", prompt, re.DOTALL)
    if result is not None:
        report = result.group(1).strip('"')  # OpenAI's template writes the result as a JSON string
        return final_answer("The tool answered.", f"The weather report says: {report}")
    turns = re.findall(r"<\|start\|>user<\|message\|>(.*?)<\|end\|>", prompt, re.DOTALL)
    turn = turns[-1] if turns else ""
    for trigger, text in (("weather in Paris", REASONED_CALL), ("long call", LONG_CALL),
                          ("say hello", final_answer("A greeting.", "Hello there!")), ("odd", ODD_CHANNELS)):
        if trigger in turn:
            return text
    return None
