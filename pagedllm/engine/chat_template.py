"""Chat templates, rendered in jinja2's ImmutableSandboxedEnvironment: a template (the model's, or one a server
operator passed with --chat-template) cannot reach Python internals or mutate its inputs.

The environment is the one transformers renders chat templates in (trim_blocks, lstrip_blocks, loop controls, the
`{% generation %}` tag, `raise_exception`, `strftime_now`, an unescaped `tojson`, underscore-free namespaces), so a
model's template gives the same text here as under `AutoTokenizer.apply_chat_template` (tests/test_tokenizer.py),
without importing transformers (~1.5 s of every load).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

_RESERVED = {"messages", "tokenize", "chat_template", "add_generation_prompt", "continue_final_message",
             "return_dict", "tools", "documents"}
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # marks where a continued final message ends in the rendered text
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first is the one templates read


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
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=_DictBuilder(), namespace=_Namespace)
    return env.from_string(template)


def _plain(value: Any) -> Any:
    """What a template may see: JSON-like data rebuilt from plain types (objects with methods the sandbox does
    not know become an inert "<TypeName>")."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (bool, str, int, float):  # subclasses (enums, numpy scalars) lose their extra methods
        if isinstance(value, base):
            return base(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return _plain(value.model_dump())
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
                   **kwargs: Any) -> str:
    """The text of one conversation under `chat_template` (default: the tokenizer's). The template also sees the
    tokenizer's named special tokens (bos_token, ...) and any extra kwargs."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("the tokenizer has no chat template")
    messages = [_with_reasoning_aliases(m) for m in _plain(list(conversation))]
    if any(not isinstance(m, dict) for m in messages):
        raise TypeError("chat messages must be dicts")
    final = _tag_final_message(messages) if continue_final_message else None
    variables = {**getattr(tokenizer, "special_tokens_map", {}), **_plain(kwargs)}
    text = _compile(template).render(messages=messages, tools=_plain(tools), documents=_plain(documents),
                                     add_generation_prompt=add_generation_prompt, **variables)
    if final is not None:  # the text ends where the final message does, with nothing the template appends
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise ValueError("continue_final_message: the chat template dropped part of the final message")
        at = text.rindex(tag)
        text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text


def render_chat_template(tokenizer: Any, messages: list[dict], *, chat_template: str | None = None,
                         add_generation_prompt: bool = True, continue_final_message: bool = False,
                         chat_template_kwargs: dict[str, Any] | None = None,
                         tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt text of a conversation. Raises ValueError naming what is wrong."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("messages: the model has no chat template (pass one with --chat-template)")
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message: cannot be combined with add_generation_prompt=true")
    if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
        raise ValueError("continue_final_message: the last message must be the assistant's")
    extra = dict(chat_template_kwargs or {})
    clash = sorted(_RESERVED & extra.keys())
    if clash:
        raise ValueError(f"chat_template_kwargs: may not set {clash}")
    try:
        return apply_template(tokenizer, messages, chat_template=template, add_generation_prompt=add_generation_prompt,
                              continue_final_message=continue_final_message, tools=tools, **extra)
    except SecurityError as e:
        raise ValueError(f"messages: the chat template was refused by the sandbox (it reached for Python "
                         f"internals): {e}") from e
    except TemplateError as e:
        raise ValueError(f"messages: chat template failed: {e}") from e
