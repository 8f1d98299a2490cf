"""Reading JSON that a model is still writing: where a value ends (None while it is unfinished), the fields of
an object as text spans, and a best-effort value for a truncated text. Spans, not parsed values, so that the
arguments streamed to a client are the model's own characters and a prefix of the final ones."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_WS = " \t\r\n"
_LITERALS = ("true", "false", "null")


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """The index after the JSON string that opens at text[i] == '"'; None if it is not closed yet."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """The index after the JSON value starting at text[i]; None while it is unfinished (a number is never
    known to be finished before something follows it)."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        depth = 0
        while i < len(text):
            c = text[i]
            if c == '"':
                end = string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    for lit in _LITERALS:
        if text.startswith(lit, i):
            return i + len(lit)
    j = i
    while j < len(text) and text[j] in "+-0123456789.eE":
        j += 1
    return j if j > i and j < len(text) else None


@dataclass
class Field:
    start: int  # where the value starts in the text
    end: int | None  # where it ends; None while it is unfinished


@dataclass
class ObjectScan:
    fields: dict[str, Field]
    end: int | None  # after the closing brace; None while the object is open
    ok: bool = True  # False when the text stopped being a JSON object


def scan_object(text: str, i: int) -> ObjectScan:
    """The top-level fields of the object opening at text[i] == '{', as far as they are written."""
    scan = ObjectScan({}, None)
    i = skip_ws(text, i + 1)
    while i < len(text):
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] == ",":
            i = skip_ws(text, i + 1)
            continue
        if text[i] != '"':
            scan.ok = False
            return scan
        key_end = string_end(text, i)
        if key_end is None:
            return scan
        key = json.loads(text[i:key_end])
        i = skip_ws(text, key_end)
        if i >= len(text):
            return scan
        if text[i] != ":":
            scan.ok = False
            return scan
        start = skip_ws(text, i + 1)
        if start >= len(text):
            return scan
        end = value_end(text, start)
        scan.fields[key] = Field(start, end)
        if end is None:
            return scan
        i = skip_ws(text, end)
    return scan


def string_field(text: str, scan: ObjectScan, key: str) -> str | None:
    """The value of a finished string field."""
    f = scan.fields.get(key)
    if f is None or f.end is None or text[f.start] != '"':
        return None
    return json.loads(text[f.start:f.end])


def close_partial(text: str) -> Any:
    """The value a truncated JSON text was on its way to (open strings, arrays and objects closed, a dangling
    key or separator dropped); None when even that does not parse."""
    closers, cuts = _structure(text)
    for cut in [len(text), *reversed(cuts)]:
        candidate = text[:cut].rstrip().rstrip(",")
        try:
            return json.loads(candidate + (closers if cut == len(text) else _structure(candidate)[0]))
        except json.JSONDecodeError:
            continue
    return None


def _structure(text: str) -> tuple[str, list[int]]:
    """(what closes everything still open at the end of text, the positions just after each `{`, `[` or `,`
    outside strings)."""
    open_: list[str] = []
    cuts: list[int] = []
    in_string = False
    i = 0
    while i < len(text):
        c = text[i]
        if in_string:
            if c == "\\":
                i += 1
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            open_.append("}" if c == "{" else "]")
            cuts.append(i + 1)
        elif c == ",":
            cuts.append(i + 1)
        elif c in "}]" and open_:
            open_.pop()
        i += 1
    return ('"' if in_string else "") + "".join(reversed(open_)), cuts
