"""How a request's output is generated and read back: the reasoning parser's start (from the rendered prompt),
the tool plan's parser, and the gate that holds a constraint back while the model reasons."""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.output_parser import OutputParser
from pagedllm.entrypoints.openai.reasoning import ReasoningParser, Start
from pagedllm.entrypoints.openai.structured import ToolPlan
from pagedllm.structured.params import ReasoningGate, StructuredOutputsParams


def _single_token(tokenizer: Any, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def _gate(tokenizer: Any, reasoning: ReasoningParser, start: Start) -> tuple[ReasoningGate | None, Start]:
    """The gate for a constrained output, and the start the parser may then assume. The gate follows tokens:
    tags that are not single tokens cannot be followed, so such a model gets the constraint from its first
    token, and nothing of that output is read as reasoning."""
    end = _single_token(tokenizer, reasoning.end)
    if start is Start.OFF or end is None:
        return None, Start.OFF
    if start is Start.OPEN:
        return ReasoningGate((end,), open=True), start
    first = _single_token(tokenizer, reasoning.start)
    return (ReasoningGate((end,), start=first), start) if first is not None else (None, Start.OFF)


def plan_output(tokenizer: Any, reasoning: ReasoningParser | None, prompt: str | list[int],
                tools: ToolPlan | None, structure: StructuredOutputsParams | None) -> OutputParser:
    """The output parser of a request; sets `structure.after_reasoning` when the model reasons first."""
    start = Start.OFF
    if reasoning is not None:
        text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
        start = reasoning.start_state(text)
        if structure is not None:
            structure.after_reasoning, start = _gate(tokenizer, reasoning, start)
    return OutputParser(reasoning, start, tools.parser if tools is not None else None)
