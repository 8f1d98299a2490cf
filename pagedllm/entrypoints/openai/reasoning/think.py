"""The two `<think>` conventions, by vLLM's names."""

from __future__ import annotations

from pagedllm.entrypoints.openai.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    """R1 and its distills reason first: their templates open the span, and the output counts as reasoning up
    to `</think>` even without a start tag."""

    name = "deepseek_r1"
    opens_by_default = True


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 / QwQ: reasoning when the output (or the prompt) opens `<think>`; `enable_thinking=False` templates
    close the span in the prompt."""

    name = "qwen3"
