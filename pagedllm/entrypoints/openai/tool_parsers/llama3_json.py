"""Llama 3.1 / 3.2 JSON tool calls: the whole message is `{"name": ..., "parameters": {...}}` (several joined by
`;`), optionally after `<|python_tag|>`. A message that does not start that way is plain content."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import ParsedCall, Piece, ToolParser, json_call
from pagedllm.entrypoints.openai.tool_parsers.jsonscan import skip_ws

PYTHON_TAG = "<|python_tag|>"
_HEAD = '{"name"'  # how a call object starts (whitespace aside)


def _may_start_call(text: str) -> bool:
    """text (no leading whitespace) is, or may grow into, the start of a call object."""
    compact = "".join(text.split())
    return compact.startswith(_HEAD) or _HEAD.startswith(compact)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    keeps_special_tokens = True  # <|python_tag|> is a special token

    def pieces(self, text: str, final: bool) -> list[Piece]:
        at = skip_ws(text, 0)
        tagged = text.startswith(PYTHON_TAG, at)
        if tagged:
            at = skip_ws(text, at + len(PYTHON_TAG))
        elif text[at:] and PYTHON_TAG.startswith(text[at:]) and not final:
            return []  # maybe the tag
        if at >= len(text):
            return [ParsedCall("", "", complete=False)] if tagged and final else [] if tagged else [text]
        if not _may_start_call(text[at:]):
            return [text]
        calls: list[Piece] = []
        i = at
        while i < len(text):
            if text[i] != "{":
                return [*calls, text[i:]]  # text after the calls stays content
            call, end = json_call(text, i, final)
            if call is not None and self.tools and call.name not in self.tools:
                call = None  # no tag marks a call here: JSON naming no tool is the model's answer
                end = end if end is not None else len(text) if final else None
                if end is None:
                    return calls if calls else []
            if call is None:
                if end is None:  # the name is still coming (or never came: cut)
                    return [*calls, ParsedCall("", "", complete=False)] if final else calls
                return [*calls, text[i:]] if calls else [text]  # a finished object with no name: content
            calls.append(call)
            if end is None:
                return calls
            i = skip_ws(text, end)
            if i < len(text) and text[i] == ";":
                i = skip_ws(text, i + 1)
        return calls
