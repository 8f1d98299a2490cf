"""Hermes / Qwen2.5 / Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in free text."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import TaggedJsonParser


class HermesToolParser(TaggedJsonParser):
    name = "hermes"
    tags = [("<tool_call>", "</tool_call>")]
