"""Structured outputs on the OpenAI endpoints: `response_format`, vLLM's `structured_outputs` / `guided_*` extras,
and `tools` + `tool_choice` (a forced call is generated under the function's parameter schema and returned as
`tool_calls`). Every problem is a ValueError whose message starts with the request field at fault (a 400)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers import (
    NamedToolParser,
    RequiredToolParser,
    ToolParser,
    make_tool_parser,
    tool_parser_for_template,
)
from pagedllm.structured.params import KINDS, GrammarError, StructuredOutputsParams

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _single(field_name: str, **kind: Any) -> StructuredOutputsParams:
    (k,) = kind
    return StructuredOutputsParams(**kind, source={k: field_name})


def requested_structure(req: Any) -> StructuredOutputsParams | None:
    """The constraint a request asks for through response_format, structured_outputs or guided_* (at most one)."""
    found: list[StructuredOutputsParams] = []
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type == "json_object":
        found.append(_single("response_format", json_object=True))
    elif rf is not None and rf.type == "json_schema":
        spec = rf.json_schema or {}
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ValueError("response_format: json_schema needs a 'name' and a 'schema'")
        schema = spec.get("schema")
        found.append(_single("response_format", json_object=True) if schema is None
                     else _single("response_format", json=schema))
    if req.structured_outputs is not None:
        try:
            so = StructuredOutputsParams(**req.structured_outputs)
        except TypeError:
            raise ValueError(f"structured_outputs: expected one of {', '.join(KINDS)}") from None
        so.source = dict.fromkeys(KINDS, "structured_outputs")
        found.append(so)
    for name, kind in GUIDED.items():
        if getattr(req, name) is not None:
            found.append(_single(name, **{kind: getattr(req, name)}))
    if len(found) > 1:
        raise ValueError(f"{found[1].field_name}: give only one of response_format, structured_outputs, "
                         + ", ".join(GUIDED))
    return found[0] if found else None


# --- tools ---------------------------------------------------------------------------------------------------
@dataclass
class ToolPlan:
    """How a request with tools is generated and read back."""

    structure: StructuredOutputsParams | None  # the constraint (None: free text, calls parsed from it)
    parser: ToolParser  # reads the calls from the output (a named or "required" choice's constrained JSON too)


def function_schemas(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Function name -> parameters schema of OpenAI chat tools; ValueError naming the bad entry."""
    out = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools: tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ValueError(f"tools: tools[{i}].function.parameters must be a JSON Schema object")
        out[fn["name"]] = params
    return out


def function_tools(tools: list[dict[str, Any]] | None, read: Callable[[dict[str, Any]], dict[str, Any] | None],
                   expected: str) -> list[dict[str, Any]] | None:
    """Another API's tools as chat function tools; `read` gives a tool's {"name", "description", "parameters"}
    (None: not a kind we serve)."""
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        fn = read(t) if isinstance(t, dict) else None
        if fn is None or not isinstance(fn.get("name"), str):
            kind = t.get("type") if isinstance(t, dict) else None
            raise ValueError(f"tools: tools[{i}]: only {expected} are supported (got type {kind!r})")
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
               auto_parser: str | None, model_name: str, parallel: bool | None = None) -> ToolPlan | None:
    """auto_parser: the tool-call parser of free text (--tool-call-parser or the template's); None when the
    model's template has no tool calling. parallel=False: "required" makes exactly one call."""
    if not tools and (isinstance(tool_choice, dict) or tool_choice == "required"):
        raise ValueError(f"tool_choice: {tool_choice!r} needs tools")
    if not tools or tool_choice == "none":
        return None
    fns = function_schemas(tools)
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        if name not in fns:
            raise ValueError(f"tool_choice: names no function of tools: {tool_choice!r}")
        return ToolPlan(_single("tools", json=fns[name]), NamedToolParser(fns, name))
    if tool_choice == "required":
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": n}, "parameters": p},
             "required": ["name", "parameters"], "additionalProperties": False} for n, p in fns.items()]}}
        if parallel is False:
            calls["maxItems"] = 1
        return ToolPlan(_single("tools", json=calls), RequiredToolParser(fns))
    if tool_choice in (None, "auto"):
        if auto_parser is None:
            raise ValueError(f"tool_choice: 'auto' is not supported for model {model_name} (its chat template "
                             "has no tool calling and no --tool-call-parser is set); use tool_choice 'required' "
                             "or a named function")
        return ToolPlan(None, make_tool_parser(auto_parser, fns))
    raise ValueError(f"tool_choice: must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}")


def template_supports_tools(template: str | None) -> bool:
    return "tools" in (template or "")


def auto_tool_parser(configured: str | None, template: str | None) -> str | None:
    """The parser for tool_choice "auto": the server's, else the one the template's format names, else Hermes
    (the most common) for a template that renders tools; None when the template cannot take tools."""
    if configured is not None:
        return configured
    if not template_supports_tools(template):
        return None
    return tool_parser_for_template(template) or "hermes"


__all__ = ["GrammarError", "ToolPlan", "auto_tool_parser", "function_schemas", "function_tools", "plan_tools", "requested_structure",
           "template_supports_tools"]
