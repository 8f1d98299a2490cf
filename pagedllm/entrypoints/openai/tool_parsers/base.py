"""What every tool-call parser shares: a parse of the text written so far into pieces (text and calls, in the
model's order), the rules that keep successive parses of a growing text consistent (what was parsed before
is a prefix of what is parsed later, so a stream of deltas assembles into the final message), and the
helpers for calls written as JSON objects.

A call whose function name has been read is a call from then on: its arguments are the model's own text
(partial while it writes them; `complete` says whether it closed the call). A tagged block that closes with
no readable name is not a call: its text stays in the content."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

from pagedllm.entrypoints.openai.tool_parsers.jsonscan import ObjectScan, scan_object, skip_ws, string_field


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text (a prefix of it while the model writes it)
    complete: bool = True


Piece = str | ParsedCall


@dataclass
class Block:
    """A tagged block: its body, whether its end tag came, and all its text (tags included)."""

    body: str
    closed: bool
    raw: str


def held_tail(text: str, markers: list[str]) -> int:
    """How many characters at the end of text may be the start of one of the markers."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


def split_blocks(text: str, tags: list[tuple[str, str]], final: bool) -> list[str | Block]:
    """Text and tagged blocks (start tag, end tag) in order. While the text grows (not final) a tail that may
    be the start of a start tag, or of the open block's end tag, is held back."""
    out: list[str | Block] = []
    i = 0
    while True:
        hits = [(pos, s, e) for s, e in tags if (pos := text.find(s, i)) >= 0]
        if not hits:
            rest = text[i:]
            out.append(rest if final else rest[:len(rest) - held_tail(rest, [s for s, _ in tags])])
            return out
        pos, start, end = min(hits)
        out.append(text[i:pos])
        body_at = pos + len(start)
        close = text.find(end, body_at)
        if close < 0:
            body = text[body_at:]
            if not final:
                body = body[:len(body) - held_tail(body, [end])]
            out.append(Block(body, False, text[pos:]))
            return out
        out.append(Block(text[body_at:close], True, text[pos:close + len(end)]))
        i = close + len(end)


def tidy(pieces: list[Piece], final: bool) -> list[Piece]:
    """Adjacent texts merged; whitespace next to a call dropped; empty texts dropped. While the text grows, the
    last text's trailing whitespace is held (a call may follow it)."""
    merged: list[Piece] = []
    for p in pieces:
        if isinstance(p, str) and merged and isinstance(merged[-1], str):
            merged[-1] += p
        else:
            merged.append(p)
    out: list[Piece] = []
    for i, p in enumerate(merged):
        if isinstance(p, str):
            if i > 0:
                p = p.lstrip()
            if i + 1 < len(merged) or not final:
                p = p.rstrip()
            if not p:
                continue
        out.append(p)
    return out


def arguments_text(text: str, scan: ObjectScan, keys: tuple[str, ...], done: bool) -> str:
    """The arguments of a JSON-object call as the model wrote them: an object's own text, the decoded text of
    a JSON string holding them (only once it is complete), or "{}" when a finished call has none."""
    f = next((scan.fields[k] for k in keys if k in scan.fields), None)
    if f is None:
        return "{}" if done or scan.end is not None else ""
    if text[f.start] == '"':
        if f.end is None:
            return ""
        value = json.loads(text[f.start:f.end])
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text[f.start:f.end] if f.end is not None else text[f.start:].rstrip()


ARGUMENT_KEYS = ("arguments", "parameters")


def json_call(text: str, at: int, done: bool) -> tuple[ParsedCall | None, int | None]:
    """The call written as {"name": ..., "arguments" | "parameters": ...} at text[at] (None while its name is
    not readable), and where the object ends (None while it is open). done: nothing more will be written."""
    scan = scan_object(text, at)
    name = string_field(text, scan, "name") if scan.ok else None
    if name is None:
        return None, scan.end
    args = arguments_text(text, scan, ARGUMENT_KEYS, done)
    return ParsedCall(name, args, complete=scan.end is not None), scan.end


def json_call_array(text: str, at: int, done: bool) -> tuple[list[ParsedCall], int | None, bool]:
    """The calls of a JSON array of call objects at text[at] == '[': (calls, where the calls stop, broken).
    The calls stop after the closing bracket, or at an element that is not a call (broken); None while the
    array is still being written."""
    calls: list[ParsedCall] = []
    i = skip_ws(text, at + 1)
    while i < len(text):
        if text[i] == "]":
            return calls, i + 1, False
        if text[i] == ",":
            i = skip_ws(text, i + 1)
            continue
        if text[i] != "{":
            return calls, i, True
        call, end = json_call(text, i, done)
        if call is None:
            return (calls, None, False) if end is None else (calls, i, True)  # name still coming / no name
        calls.append(call)
        if end is None:
            break
        i = skip_ws(text, end)
    return calls, None, False


class ToolParser:
    """Parses one model output; subclasses implement `pieces`. `tools`: function name -> parameters schema."""

    name: ClassVar[str]
    keeps_special_tokens: ClassVar[bool] = False  # its markers are special tokens the detokenizer would drop

    def __init__(self, tools: dict[str, dict[str, Any]]) -> None:
        self.tools = tools

    def parse(self, text: str, final: bool) -> list[Piece]:
        """Text and calls in the model's order. final=False: the text may still grow; what is returned then
        is consistent with every later parse (texts and arguments only grow, calls keep their names)."""
        return tidy(self.pieces(text, final), final)

    def pieces(self, text: str, final: bool) -> list[Piece]:
        raise NotImplementedError

    def new_call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"


class TaggedJsonParser(ToolParser):
    """Calls in tagged blocks (`tags`), each holding one JSON call object."""

    tags: ClassVar[list[tuple[str, str]]]

    def pieces(self, text: str, final: bool) -> list[Piece]:
        out: list[Piece] = []
        for part in split_blocks(text, self.tags, final):
            if isinstance(part, str):
                out.append(part)
                continue
            out.extend(self.block(part, final))
        return out

    def block(self, b: Block, final: bool) -> list[Piece]:
        at = skip_ws(b.body, 0)
        call = None
        if at < len(b.body) and b.body[at] == "{":
            call, _ = json_call(b.body, at, b.closed or final)
        if call is not None:
            call.complete = b.closed
            return [call]
        if b.closed:
            return [b.raw]  # not a call: the model's text as it is
        return [ParsedCall("", "", complete=False)] if final else []  # a call cut before its name
