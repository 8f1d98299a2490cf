"""Anthropic's Messages request (POST /v1/messages) and the chat request it runs as: content blocks become chat
messages (tool_result blocks tool messages, tool_use blocks tool calls, thinking blocks reasoning), tools with
input_schema become function tools, tool_choice auto / any / tool / none become auto / required / named / none.
Every problem is a ValueError whose message starts with the Messages field at fault (a 400)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIModel, chat_request, parts_text
from pagedllm.entrypoints.openai.structured import function_tools

# chat request fields -> the Messages field they came from (for error messages)
CHAT_NAMES = {"messages": "messages", "max_tokens": "max_tokens", "max_completion_tokens": "max_tokens",
              "stop": "stop_sequences", "tools": "tools", "tool_choice": "tool_choice"}
SAMPLING_EXTRAS = ("min_p", "repetition_penalty", "seed", "ignore_eos", "presence_penalty", "frequency_penalty",
                   "min_tokens", "cache_salt", "chat_template", "chat_template_kwargs", "priority")


class MessagesRequest(OpenAIModel):
    model: str | None = None
    max_tokens: int
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


class CountTokensRequest(MessagesRequest):
    max_tokens: int = 1  # not part of a count request


def chat_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": parts_text(req.system, "system")})
    called: set[str] = set()
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise ValueError(f"{where}.role: must be user or assistant, got {role!r}")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise ValueError(f"{where}.content: must be a string or a list of content blocks")
        text, calls, reasoning, results = [], [], [], []
        for j, b in enumerate(blocks):
            kind = b.get("type") if isinstance(b, dict) else None
            at = f"{where}.content[{j}]"
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                    raise ValueError(f"{at}: a tool_use block needs id and name")
                calls.append({"id": b["id"], "type": "function", "function": {
                    "name": b["name"], "arguments": json.dumps(b.get("input") or {}, ensure_ascii=False)}})
                called.add(b["id"])
            elif kind == "tool_result" and role == "user":
                if not isinstance(b.get("tool_use_id"), str) or b["tool_use_id"] not in called:
                    raise ValueError(f"{at}: tool_result for tool_use_id {b.get('tool_use_id')!r}, which no "
                                     "earlier tool_use block made")
                result = parts_text(b.get("content"), f"{at}.content")
                if b.get("is_error"):
                    result = f"Error: {result}"
                results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": result})
            elif kind == "thinking" and role == "assistant":
                reasoning.append(str(b.get("thinking", "")))
            elif kind == "redacted_thinking" and role == "assistant":
                continue  # nothing readable to give the template
            else:
                raise ValueError(f"{at}: block type {kind!r} is not supported in a {role} message (text, "
                                 "tool_use, tool_result, thinking)")
        out.extend(results)  # the tool results answer the previous turn: they come before the user's text
        if role == "assistant" or text or not results:
            msg: dict[str, Any] = {"role": role, "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            if reasoning:
                msg["reasoning_content"] = "".join(reasoning)
            out.append(msg)
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    def read(t: dict[str, Any]) -> dict[str, Any] | None:
        if t.get("type") not in (None, "custom"):
            return None  # server tools (web search, code execution, ...) run at Anthropic
        schema = t.get("input_schema") or {"type": "object", "properties": {}}
        return {"name": t.get("name"), "description": t.get("description") or None, "parameters": schema}

    return function_tools(tools, read, "client tools with a name and input_schema")


def chat_tool_choice(choice: dict[str, Any] | None) -> str | dict[str, Any] | None:
    kind = (choice or {}).get("type")
    if choice is None or kind == "auto":
        return None
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ValueError(f"tool_choice: type must be auto, any, tool (with a name) or none, got {choice!r}")


def to_chat_request(req: MessagesRequest, request_id: str | None = None) -> ChatCompletionRequest:
    extras = {k: v for k, v in (req.model_extra or {}).items() if k in SAMPLING_EXTRAS}
    thinking = (req.thinking or {}).get("type")
    kwargs = extras.get("chat_template_kwargs")
    if thinking in ("enabled", "disabled", "adaptive") and isinstance(kwargs, dict | None):
        # Qwen3-style templates switch on this (the request's own chat_template_kwargs win)
        extras["chat_template_kwargs"] = {"enable_thinking": thinking != "disabled", **(kwargs or {})}
    return chat_request(CHAT_NAMES, model=req.model, messages=chat_messages(req), max_tokens=req.max_tokens,
                        stop=req.stop_sequences, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                        tools=chat_tools(req.tools), tool_choice=chat_tool_choice(req.tool_choice),
                        parallel_tool_calls=not (req.tool_choice or {}).get("disable_parallel_tool_use", False),
                        stream=req.stream, request_id=request_id, **extras)
