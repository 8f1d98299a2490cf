"""Structured outputs: constrain a request's tokens to a JSON schema, regex, choice or grammar.

params.py is what the user asks for (pure Python); backend.py the seam to a grammar library (llguidance by
default, xgrammar swappable); manager.py compiles off the engine thread and builds per-step bitmasks."""

from pagedllm.structured.params import GrammarError, StructuredOutputsParams

__all__ = ["GrammarError", "StructuredOutputsParams"]
