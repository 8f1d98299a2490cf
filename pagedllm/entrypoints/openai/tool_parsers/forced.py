"""The constrained tool choices: a named function (the output is its arguments) and "required" (the output is
a JSON array of {"name", "parameters"} objects). The grammar guarantees the shape; these only read it, as it
streams, the same way the free-text parsers do."""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.base import ParsedCall, Piece, ToolParser, json_call_array
from pagedllm.entrypoints.openai.tool_parsers.jsonscan import skip_ws


class NamedToolParser(ToolParser):
    name = "named"

    def __init__(self, tools: dict[str, dict[str, Any]], function: str) -> None:
        super().__init__(tools)
        self.function = function

    def pieces(self, text: str, final: bool) -> list[Piece]:
        return [ParsedCall(self.function, text.strip(), complete=final)]


class RequiredToolParser(ToolParser):
    name = "required"

    def pieces(self, text: str, final: bool) -> list[Piece]:
        at = skip_ws(text, 0)
        if at >= len(text):
            return [ParsedCall("", "", complete=False)] if final else []
        if text[at] != "[":
            return [text]
        calls, end, broken = json_call_array(text, at, final)
        if end is None and not calls and final:
            return [ParsedCall("", "", complete=False)]
        return [*calls, text[end:]] if end is not None else list(calls)
