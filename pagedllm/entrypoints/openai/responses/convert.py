"""A Responses request as the chat request it runs as: input items become chat messages (after the stored
conversation of previous_response_id), function tools become chat tools, text.format becomes response_format.
Every problem is a ValueError whose message starts with the Responses field at fault (a 400)."""

from __future__ import annotations

import json
from typing import Any

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, chat_request, parts_text
from pagedllm.entrypoints.openai.responses.protocol import SAMPLING_EXTRAS, ResponsesRequest
from pagedllm.entrypoints.openai.structured import function_tools

# chat request fields -> the Responses field they came from (for error messages)
CHAT_NAMES = {"messages": "input", "response_format": "text", "max_completion_tokens": "max_output_tokens",
              "max_tokens": "max_output_tokens", "reasoning_effort": "reasoning.effort"}
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal")


def input_messages(items: str | list[dict[str, Any]], history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a request's input, to follow `history` (the stored conversation). A
    function_call_output must answer a function_call of the history or of this input."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    known = {c["id"] for m in history for c in m.get("tool_calls") or ()}
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []  # reasoning items given back: they belong to the next assistant message
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where}: must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ValueError(f"{where}: role must be user, system, developer or assistant, got {role!r}")
            msg = {"role": "system" if role == "developer" else role,
                   "content": parts_text(item.get("content"), f"{where}.content", _TEXT_PARTS)}
            if role == "assistant" and reasoning:
                msg["reasoning_content"] = "".join(reasoning)
                reasoning = []
            out.append(msg)
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise ValueError(f"{where}: a function_call needs call_id and name")
            args = item.get("arguments", "{}")
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)  # parallel calls, or text then a call
            else:
                msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning:
                    msg["reasoning_content"], reasoning = "".join(reasoning), []
                out.append(msg)
            known.add(call_id)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id not in known:
                raise ValueError(f"{where}: function_call_output for call_id {call_id!r}, which no function_call "
                                 "of this conversation made")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": parts_text(item.get("output"), f"{where}.output", _TEXT_PARTS)})
        elif kind == "reasoning":
            content, summary = item.get("content") or [], item.get("summary") or []
            if not isinstance(content, list) or not isinstance(summary, list):
                raise ValueError(f"{where}: a reasoning item's content and summary must be lists of parts")
            parts = content + summary
            reasoning.append(parts_text(parts, f"{where}.content", _TEXT_PARTS))
        else:
            raise ValueError(f"{where}: item type {kind!r} is not supported (message, function_call, "
                             "function_call_output, reasoning)")
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    def read(t: dict[str, Any]) -> dict[str, Any] | None:
        return {k: t.get(k) for k in ("name", "description", "parameters")} if t.get("type") == "function" else None

    return function_tools(tools, read, "function tools with a name")


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ValueError(f"tool_choice: must be 'none', 'auto', 'required' or {{'type': 'function', 'name': ...}}, "
                     f"got {choice!r}")


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise ValueError("text.format: must be an object")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise ValueError(f"text.format: type must be text, json_object or json_schema, got {fmt.get('type')!r}")


def to_chat_request(req: ResponsesRequest, history: list[dict[str, Any]], request_id: str
                    ) -> tuple[list[dict[str, Any]], ChatCompletionRequest]:
    """(this turn's input messages, the chat request of the whole conversation)."""
    for name in ("background", "conversation", "prompt"):
        if getattr(req, name):
            raise ValueError(f"{name}: is not supported")
    new = input_messages(req.input, history)
    if not new and not history:
        raise ValueError("input: must not be empty")
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    extras = {k: v for k, v in (req.model_extra or {}).items() if k in SAMPLING_EXTRAS}
    return new, chat_request(CHAT_NAMES, model=req.model, messages=system + history + new,
                             tools=chat_tools(req.tools), tool_choice=chat_tool_choice(req.tool_choice),
                             parallel_tool_calls=req.parallel_tool_calls, response_format=response_format(req.text),
                             max_completion_tokens=req.max_output_tokens, temperature=req.temperature,
                             top_p=req.top_p, stream=req.stream, user=req.user, request_id=request_id,
                             reasoning_effort=(req.reasoning or {}).get("effort"), **extras)
