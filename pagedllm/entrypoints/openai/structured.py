"""Structured outputs on the OpenAI endpoints: `response_format`, vLLM's `structured_outputs` / `guided_*` extras,
and `tools` + `tool_choice` (a forced call is generated under the function's parameter schema and returned as
`tool_calls`). Every problem is a ValueError whose message starts with the request field at fault (a 400)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

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
    """How a chat request with tools is generated and read back."""

    structure: StructuredOutputsParams | None  # the constraint (None: free text, tool calls parsed from it)
    forced: str | None = None  # named tool_choice: the output is that function's arguments
    required: bool = False  # tool_choice "required": the output is a JSON array of {"name", "parameters"}
    auto: bool = False  # tool_choice "auto": <tool_call>{...}</tool_call> blocks in free text (Hermes format)


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
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


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
               template_supports_tools: bool, model_name: str) -> ToolPlan | None:
    if not tools or tool_choice == "none":
        return None
    fns = _functions(tools)
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        if name not in fns:
            raise ValueError(f"tool_choice: names no function of tools: {tool_choice!r}")
        return ToolPlan(_single("tools", json=fns[name]), forced=name)
    if tool_choice == "required":
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": n}, "parameters": p},
             "required": ["name", "parameters"], "additionalProperties": False} for n, p in fns.items()]}}
        return ToolPlan(_single("tools", json=calls), required=True)
    if tool_choice in (None, "auto"):
        if not template_supports_tools:
            raise ValueError(f"tool_choice: 'auto' is not supported for model {model_name} (its chat template "
                             "has no tool calling); use tool_choice 'required' or a named function")
        return ToolPlan(None, auto=True)
    raise ValueError(f"tool_choice: must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}")


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def tool_calls_of(plan: ToolPlan, text: str) -> tuple[list[dict[str, Any]], str | None]:
    """(tool calls, remaining content) read from a finished output; no calls if the text does not parse (a
    generation cut by max_tokens)."""
    try:
        if plan.forced is not None:
            json.loads(text)
            return [_call(plan.forced, text)], None
        if plan.required:
            return [_call(c["name"], c["parameters"]) for c in json.loads(text)], None
        calls = [json.loads(m) for m in _HERMES.findall(text)]
        calls = [_call(c["name"], c.get("arguments", {})) for c in calls]
    except (ValueError, KeyError, TypeError):
        return [], text
    return calls, (_HERMES.sub("", text).strip() or None) if calls else text


def template_supports_tools(tokenizer: Any) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


__all__ = ["GrammarError", "ToolPlan", "plan_tools", "requested_structure", "template_supports_tools",
           "tool_calls_of"]
