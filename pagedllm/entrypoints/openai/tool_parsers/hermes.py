"""Hermes / Qwen2.5 / Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in free text.

Small models often leave the tags out (Qwen2.5-Coder-0.5B: a bare `{"name": ..., "arguments": ...}` as the whole
message, or the same object in a ```json fence), as llama.cpp's Hermes parser also accepts. Those untagged forms
are a call only when the object is the whole message, names an offered tool and its arguments are valid against
that tool's schema; anything else (JSON in an ordinary answer) stays text. A message that may still become such a
call is held back while it streams.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.base import ARGUMENT_KEYS, ParsedCall, Piece, TaggedJsonParser

# a whole message that is one fenced object: ```json {...} ``` (or a bare ``` fence)
_FENCED = re.compile(r"```(?:json)?\s*(\{.*\})\s*```", re.DOTALL | re.IGNORECASE)
# the start of a message that may still become a fenced object
_FENCE_START = re.compile(r"```(?:json)?\s*(?:\{|$)", re.IGNORECASE)


def _may_become_untagged_call(text: str) -> bool:
    """Whether a message still being written may turn out to be one bare or fenced call object."""
    return text.startswith("{") or _FENCE_START.match(text) is not None or "```json".startswith(text.lower())


class HermesToolParser(TaggedJsonParser):
    name = "hermes"
    tags = [("<tool_call>", "</tool_call>")]

    def pieces(self, text: str, final: bool) -> list[Piece]:
        stripped = text.strip()
        if self.tools and stripped and self.tags[0][0] not in text:
            if not final and _may_become_untagged_call(stripped):
                return []  # held back: sent as text or as a call once the message is complete
            if final:
                call = self.untagged_call(stripped)
                if call is not None:
                    return [call]
        return super().pieces(text, final)

    def untagged_call(self, message: str) -> ParsedCall | None:
        """The call a whole message writes without tags, if it is one of an offered tool with valid arguments."""
        fenced = _FENCED.fullmatch(message)
        try:
            obj = json.loads(fenced.group(1) if fenced else message)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in self.tools:
            return None
        args: Any = next((obj[k] for k in ARGUMENT_KEYS if k in obj), {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict) or not _valid(args, self.tools[obj["name"]]):
            return None
        return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _valid(args: dict, schema: dict[str, Any] | None) -> bool:
    import jsonschema

    if not schema:
        return True
    try:
        jsonschema.validate(args, schema)
    except jsonschema.ValidationError:
        return False
    except jsonschema.SchemaError:
        return True  # a tool whose schema does not check: its name and an object are all we can ask
    return True
