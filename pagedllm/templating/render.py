"""Chat templates, rendered in jinja2's ImmutableSandboxedEnvironment: a template (the model's, or one a server
operator passed with --chat-template) cannot reach Python internals or mutate its inputs. The engine and the server
render in a separate process with a time, memory and output limit (sandbox.py), so that a runaway
template fails its own request and nothing else; `**` and `*` are checked before they compute (and so are never
folded at compile time), so the usual blow-ups fail at once with a clear message.

The environment is the one transformers renders chat templates in (trim_blocks, lstrip_blocks, loop controls, the
`{% generation %}` tag, `raise_exception`, `strftime_now`, an unescaped `tojson`, underscore-free namespaces), so a
model's template gives the same text here as under `AutoTokenizer.apply_chat_template`
(tests/model/test_tokenizer.py), without importing transformers (~1.5 s of every load).
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

RESERVED_VARIABLES = {"messages", "tokenize", "chat_template", "add_generation_prompt", "continue_final_message",
             "return_dict", "tools", "documents"}
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # marks where a continued final message ends in the rendered text
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first is the one templates read
MAX_OUTPUT_CHARS = 1 << 24  # a rendered prompt longer than this is refused (prompts are checked again later)
_MAX_POWER_BITS = 4096  # the largest integer ** may produce


class TemplateLimitError(ValueError):
    """A chat template ran past a limit: time, memory, output size, or the size of a value it computes."""


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with `**` and `*` checked before they run: jinja would otherwise fold `10 ** (10 ** 10)` at
    compile time, in one C call that holds the GIL for hours; `'x' * 10 ** 9` builds a gigabyte."""

    intercepted_binops = frozenset({"**", "*"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1 \
                and right * math.log2(abs(left)) > _MAX_POWER_BITS:
            raise TemplateLimitError(f"chat template computes {left} ** {right}, an integer of more than "
                                     f"{_MAX_POWER_BITS} bits")
        if operator == "*":
            seq, n = (left, right) if _is_int(right) else (right, left)
            if isinstance(seq, str | list | tuple) and _is_int(n) and len(seq) * n > MAX_OUTPUT_CHARS:
                raise TemplateLimitError(f"chat template repeats a {type(seq).__name__} of length {len(seq)} {n} times, "
                                         f"past the limit of {MAX_OUTPUT_CHARS}")
        return super().call_binop(context, operator, left, right)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's tokens for training masks; it renders its
    body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _Namespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore attributes (a way towards Python internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature trick: `namespace(self=...)` works
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot set underscore attributes on a namespace ({name!r})")


class _DictBuilder:
    """dict(...) and dict.fromkeys(...) without handing the template the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters, which would change the prompt text
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=_DictBuilder(), namespace=_Namespace)
    return env.from_string(template)


def plain(value: Any) -> Any:
    """What a template may see: JSON-like data rebuilt from plain types (objects with methods the sandbox does
    not know become an inert "<TypeName>")."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (bool, str, int, float):  # subclasses (enums, numpy scalars) lose their extra methods
        if isinstance(value, base):
            return base(value)
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _with_reasoning_aliases(message: dict) -> dict:
    """A message's reasoning under every name templates read it by."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _tag_final_message(messages: list[dict]) -> str:
    """Append the continuation tag to the final message's text (its last text block if it has parts); return
    that text."""
    content = messages[-1].get("content") if messages else None
    if isinstance(content, str):
        messages[-1]["content"] = content + _CONTINUE_TAG
        return content
    for block in reversed(content if isinstance(content, list) else []):
        if isinstance(block, dict) and isinstance(block.get("text"), str):
            final, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
            return final
    raise ValueError("continue_final_message: the final message has no text to continue")


def apply_template(tokenizer: Any, conversation: list[dict], *, chat_template: str | None = None,
                   tools: list[dict] | None = None, documents: list[dict] | None = None,
                   add_generation_prompt: bool = False, continue_final_message: bool = False,
                   max_chars: int = MAX_OUTPUT_CHARS, **kwargs: Any) -> str:
    """The text of one conversation under `chat_template` (default: the tokenizer's), in this process. The
    template also sees the tokenizer's named special tokens (bos_token, ...) and any extra kwargs; its output
    stops with TemplateLimitError past max_chars characters."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("the tokenizer has no chat template")
    messages = [_with_reasoning_aliases(m) for m in plain(list(conversation))]
    if any(not isinstance(m, dict) for m in messages):
        raise TypeError("chat messages must be dicts")
    final = _tag_final_message(messages) if continue_final_message else None
    variables = {**getattr(tokenizer, "special_tokens_map", {}), **plain(kwargs)}
    chunks, size = [], 0
    for chunk in _compile(template).generate(messages=messages, tools=plain(tools), documents=plain(documents),
                                             add_generation_prompt=add_generation_prompt, **variables):
        size += len(chunk)
        if size > max_chars:
            raise TemplateLimitError(f"the chat template's output passed the limit of {max_chars} characters")
        chunks.append(chunk)
    text = "".join(chunks)
    if final is not None:  # the text ends where the final message does, with nothing the template appends
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise ValueError("continue_final_message: the chat template dropped part of the final message")
        at = text.rindex(tag)
        text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text

