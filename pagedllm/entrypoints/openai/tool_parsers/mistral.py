"""Mistral: `[TOOL_CALLS]` then either a JSON array of {"name", "arguments"} objects (v3 tokenizers) or
`name[ARGS]{...}` (v11+, optionally `name[CALL_ID]id[ARGS]{...}`), repeated for parallel calls. Text before
the first marker is content. Mistral's templates want 9-character alphanumeric call ids."""

from __future__ import annotations

import random
import string

from pagedllm.entrypoints.openai.tool_parsers.base import (
    ParsedCall,
    Piece,
    ToolParser,
    held_tail,
    json_call_array,
)
from pagedllm.entrypoints.openai.tool_parsers.jsonscan import skip_ws, value_end

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_ID_CHARS = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True  # [TOOL_CALLS] and [ARGS] are control tokens

    def pieces(self, text: str, final: bool) -> list[Piece]:
        first = text.find(TOOL_CALLS)
        if first < 0:
            return [text if final else text[:len(text) - held_tail(text, [TOOL_CALLS])]]
        out: list[Piece] = [text[:first]]
        parts = text[first + len(TOOL_CALLS):].split(TOOL_CALLS)
        for k, part in enumerate(parts):
            last = k == len(parts) - 1
            done = final or not last
            body = part if done else part[:len(part) - held_tail(part, [TOOL_CALLS])]
            out.extend(self._calls(body, done))
        return out

    def _calls(self, body: str, done: bool) -> list[Piece]:
        at = skip_ws(body, 0)
        if at < len(body) and body[at] == "[":
            calls, end, broken = json_call_array(body, at, done)
            if broken and not calls:
                return [TOOL_CALLS + body]  # not calls: the model's text
            if end is None:
                return [*calls, ParsedCall("", "", complete=False)] if done and not calls else list(calls)
            return [*calls, body[end:]]
        head_end = min((p for p in (body.find(ARGS), body.find(CALL_ID)) if p >= 0), default=-1)
        if head_end < 0:
            return [ParsedCall(body.strip(), "", complete=False)] if done and body.strip() else []
        name = body[:head_end].strip()
        args_at = body.find(ARGS, head_end)
        if args_at < 0:
            return [ParsedCall(name, "", complete=False)]
        start = skip_ws(body, args_at + len(ARGS))
        end = value_end(body, start) if start < len(body) else None
        if end is None:
            return [ParsedCall(name, body[start:].rstrip(), complete=False)]
        return [ParsedCall(name, body[start:end]), body[end:]]

    def new_call_id(self) -> str:
        return "".join(random.choices(_ID_CHARS, k=9))
