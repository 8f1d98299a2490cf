"""Qwen3-Coder's XML calls:
`<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>` (the wrapper is
sometimes left out). Values are raw text, typed by the function's parameter schema. The arguments are built
as JSON one finished parameter at a time, so the streamed text is always a prefix of the final one."""

from __future__ import annotations

import json
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.base import Block, ParsedCall, Piece, ToolParser, split_blocks

FUNCTION, PARAMETER, PARAMETER_END, FUNCTION_END = "<function=", "<parameter=", "</parameter>", "</function>"


def _typed(value: str, schema: dict[str, Any] | None) -> Any:
    """A parameter's raw text as the JSON value its schema asks for (the text itself when it does not fit)."""
    kinds = (schema or {}).get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if value == "null" and "null" in kinds:
        return None
    if "string" in kinds and len(kinds) == 1:
        return value
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    if any(k is None for k in kinds):
        return parsed  # no schema: whatever the text spells
    fits = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
            "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
            "boolean": lambda v: isinstance(v, bool), "object": lambda v: isinstance(v, dict),
            "array": lambda v: isinstance(v, list), "null": lambda v: v is None}
    return parsed if any(fits.get(k, lambda v: False)(parsed) for k in kinds) else value


def _strip_newline(value: str) -> str:
    """The template puts the value on its own lines: one newline on each side is layout, not value."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    tags = [("<tool_call>", "</tool_call>"), (FUNCTION, FUNCTION_END)]

    def pieces(self, text: str, final: bool) -> list[Piece]:
        out: list[Piece] = []
        for part in split_blocks(text, self.tags, final):
            if isinstance(part, str):
                out.append(part)
            else:
                out.extend(self._block(part, final))
        return out

    def _block(self, b: Block, final: bool) -> list[Piece]:
        body = b.body
        if b.raw.startswith(FUNCTION):  # a bare function: its body starts with the name
            body = FUNCTION + body + (FUNCTION_END if b.closed else "")
        at = body.find(FUNCTION)
        head_end = body.find(">", at) if at >= 0 else -1
        if head_end < 0:
            if b.closed:
                return [b.raw]  # no function in it: not a call
            return [ParsedCall("", "", complete=False)] if final else []
        name = body[at + len(FUNCTION):head_end].strip()
        schema = (self.tools.get(name) or {}).get("properties") or {}
        fields, i = [], head_end + 1
        while (p := body.find(PARAMETER, i)) >= 0:
            key_end = body.find(">", p)
            value_end = body.find(PARAMETER_END, key_end + 1) if key_end >= 0 else -1
            if value_end < 0:
                break
            key = body[p + len(PARAMETER):key_end].strip()
            value = _typed(_strip_newline(body[key_end + 1:value_end]), schema.get(key))
            fields.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
            i = value_end + len(PARAMETER_END)
        closed = body.find(FUNCTION_END, i) >= 0 or b.closed
        args = "{" + ", ".join(fields) + ("}" if closed else "")
        return [ParsedCall(name, args, complete=closed)]
