"""The request of OpenAI's Responses API (POST /v1/responses) as we accept it; responses are built as plain dicts
(builder.py) with the field names of OpenAI's reference (the `openai` SDK's `Response` type)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from pagedllm.entrypoints.openai.protocol import OpenAIModel

# vLLM-style extras a Responses request may carry, passed on to the chat request it becomes
SAMPLING_EXTRAS = ("top_k", "min_p", "repetition_penalty", "seed", "stop", "ignore_eos", "presence_penalty",
                   "frequency_penalty", "logit_bias", "min_tokens", "stop_token_ids", "cache_salt",
                   "chat_template", "chat_template_kwargs", "priority")


class ResponsesRequest(OpenAIModel):
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None  # its effort is the chat request's reasoning_effort; summary ignored
    # accepted and ignored: hints that do not change what is generated here
    include: list[str] | None = None
    truncation: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    # not supported: a 400 when set
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
