"""What a request's output must match: vLLM's StructuredOutputsParams (one of json / regex / choice / grammar /
json_object). Pure Python: validated here for shape, compiled by a backend (see backend.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class ReasoningGate:
    """The constraint applies only once the model has finished reasoning (a `<think>...</think>` span): from
    the start when the prompt left no reasoning open, after the `end` tokens when it did (`open`), or, when
    `start` is set, the model may open a span with that token as its first one (else the constraint applies)."""

    end: tuple[int, ...]  # the token ids that close a reasoning span
    start: int | None = None  # a first output token that opens a span
    open: bool = False  # the prompt opened a span: the output starts inside it

    def __post_init__(self) -> None:
        if not self.end or not all(isinstance(t, int) for t in self.end):
            raise ValueError("ReasoningGate.end must be a non-empty tuple of token ids")


class GrammarError(ValueError):
    """A constraint that cannot be compiled; `field` names the request field at fault (for a 400)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None  # a JSON Schema (dict or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF `root ::= ...`) or Lark
    json_object: bool | None = None  # any JSON object
    # the request field each kind came from, for error messages (the server sets e.g. "response_format")
    source: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    # set by the server for a reasoning model: the constraint waits for the reasoning to end (not in `key`)
    after_reasoning: ReasoningGate | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}, got "
                             f"{', '.join(set_kinds) or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise GrammarError(self.field_name, "choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise GrammarError(self.field_name, f"{name} must be a non-empty string")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise GrammarError(self.field_name, f"the JSON schema is not valid JSON: {e}") from None
            if self.json is None or self.json is False:  # "null" / "false": no schema any output could match
                raise GrammarError(self.source.get("json", "structured_outputs.json"),
                                   "the JSON schema must be an object or true")
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise GrammarError(self.field_name, "the JSON schema must be an object")
        if self.after_reasoning is not None and not isinstance(self.after_reasoning, ReasoningGate):
            raise GrammarError(self.field_name, "after_reasoning is set by the server, not by a request")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def field_name(self) -> str:
        kind = next((k for k in KINDS if getattr(self, k) not in (None, False)), "structured_outputs")
        return self.source.get(kind, f"structured_outputs.{kind}")

    @property
    def spec(self) -> str:
        """The constraint as one canonical string (with the kind, the grammar cache key)."""
        v = getattr(self, self.kind)
        if self.kind in ("json", "choice"):
            return json.dumps(v, sort_keys=True, separators=(",", ":"))
        return "" if self.kind == "json_object" else v

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.spec
