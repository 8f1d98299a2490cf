"""Tool calls parsed from a model's free text (`--tool-call-parser NAME`), one module per format; the default
is read from the chat template when exactly one format's markers appear in it."""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.base import ParsedCall, Piece, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.forced import NamedToolParser, RequiredToolParser
from pagedllm.entrypoints.openai.tool_parsers.gpt_oss import GptOssToolParser
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedllm.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from pagedllm.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesToolParser, Llama3JsonToolParser, MistralToolParser, Qwen3CoderToolParser, GptOssToolParser)}

# what a chat template that renders tool calls in each format contains (the first marker that matches wins
# within a format; a template matching two formats is ambiguous)
_TEMPLATE_MARKERS: dict[str, tuple[str, ...]] = {
    "qwen3_coder": ("<function=",),
    "hermes": ("<tool_call>",),
    "mistral": ("[TOOL_CALLS]",),
    "llama3_json": ("<|python_tag|>", '"parameters": '),
    "gpt_oss": ("<|channel|>commentary",),
}


def tool_parser_for_template(template: str | None) -> str | None:
    """The parser whose format the chat template writes, when exactly one does (qwen3_coder's templates also
    carry <tool_call>: its own marker decides)."""
    if not template or "tool" not in template:
        return None
    found = [name for name, markers in _TEMPLATE_MARKERS.items() if any(m in template for m in markers)]
    if "qwen3_coder" in found and "hermes" in found:
        found.remove("hermes")
    return found[0] if len(found) == 1 else None


def make_tool_parser(name: str, tools: dict[str, dict[str, Any]]) -> ToolParser:
    try:
        return TOOL_PARSERS[name](tools)
    except KeyError:
        raise ValueError(f"tool call parser must be one of {', '.join(TOOL_PARSERS)}, got {name!r}") from None


__all__ = ["TOOL_PARSERS", "NamedToolParser", "ParsedCall", "Piece", "RequiredToolParser", "ToolParser",
           "make_tool_parser", "tool_parser_for_template"]
