"""OpenAI's harmony format (gpt-oss), read from the output text with its special tokens kept:
`<|start|>ROLE[ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ [<|constrain|>]TYPE]<|message|>BODY<|end|>`,
where `<|return|>` ends the final answer and `<|call|>` a tool call (both are end-of-sequence tokens, so the
detokenized text usually stops before them). The chat template ends the prompt with `<|start|>assistant`, so the
output begins inside the first message's header.

Shared by the gpt_oss reasoning and tool-call parsers; like theirs, a read of a growing text (final=False)
holds back what may still change, so later reads only extend earlier ones."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from pagedllm.entrypoints.openai.tool_parsers.base import held_tail

logger = logging.getLogger(__name__)

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
TERMINATORS = (END, RETURN, CALL)
CHANNELS = ("analysis", "commentary", "final")
FUNCTIONS = "functions."  # the namespace the template declares the request's tools in
# how an output that begins inside the assistant's header (the prompt wrote `<|start|>assistant`) starts
_HEADER_OPENERS = (CHANNEL, CONSTRAIN, MESSAGE, " to=")
_BODY_ENDS = [*TERMINATORS, START]  # a <|start|> also ends a body the model did not close


@dataclass
class Message:
    role: str
    channel: str | None
    recipient: str | None
    content_type: str | None
    body: str
    closed: bool = False  # a terminator came
    header_done: bool = True  # False only for a header cut short at the end of a final text

    @property
    def function(self) -> str | None:
        """The function an assistant message calls (`to=functions.NAME`), if it is a call."""
        if self.role == "assistant" and self.recipient and self.recipient.startswith(FUNCTIONS):
            return self.recipient[len(FUNCTIONS):]
        return None

    @property
    def known(self) -> bool:
        """An assistant message on a harmony channel, to nobody (the user reads it) or to a function."""
        return (self.role == "assistant" and self.channel in CHANNELS
                and (self.recipient is None or self.function is not None))

    @property
    def reasoning(self) -> bool:
        return self.known and self.channel == "analysis" and self.function is None


Item = str | Message  # text outside any message, or a message


def read(text: str, final: bool) -> list[Item]:
    """The text's messages in order (and any text outside them). Not final: a message whose header is still
    being written is left out, and a tail that may be the start of a special token is held back."""
    stripped = text.lstrip("\n")
    if not final and any(len(stripped) < len(o) and o.startswith(stripped) for o in _HEADER_OPENERS):
        return []  # maybe the first header, maybe not: too early to tell
    out: list[Item] = []
    role: str | None = None
    at: int | None = None
    if stripped.startswith(_HEADER_OPENERS):
        at, role = len(text) - len(stripped), "assistant"
    i = 0
    while True:
        if at is None:
            s = text.find(START, i)
            if s < 0:
                rest = text[i:]
                out.append(rest if final else rest[:len(rest) - held_tail(rest, [START])])
                return [x for x in out if x != ""]
            out.append(text[i:s])
            at, role = s + len(START), None
        m = text.find(MESSAGE, at)
        restart = text.find(START, at)
        if restart >= 0 and (m < 0 or restart < m):  # a header with no body: the next message begins
            if final:
                logger.warning("harmony header %r has no message: dropped", text[at:restart])
            at, role = restart + len(START), None
            continue
        if m < 0:
            if final:  # cut in its header
                out.append(Message(*_header(text[at:], role), body="", header_done=False))
            return [x for x in out if x != ""]
        body_at = m + len(MESSAGE)
        hits = [(p, t) for t in _BODY_ENDS if (p := text.find(t, body_at)) >= 0]
        if not hits:
            body = text[body_at:]
            if not final:
                body = body[:len(body) - held_tail(body, _BODY_ENDS)]
            out.append(Message(*_header(text[at:m], role), body=body))
            return [x for x in out if x != ""]
        p, t = min(hits)
        out.append(Message(*_header(text[at:m], role), body=text[body_at:p], closed=t != START))
        i, at = (p if t == START else p + len(t)), None


def _header(header: str, role: str | None) -> tuple[str, str | None, str | None, str | None]:
    """(role, channel, recipient, content type) of a header's text; `role` when the prompt already wrote it."""
    before, has_channel, after = header.partition(CHANNEL)
    words = before.replace(CONSTRAIN, " " + CONSTRAIN).split()
    rest = after.replace(CONSTRAIN, " " + CONSTRAIN).split()
    if role is None:
        role = words.pop(0) if words and not words[0].startswith("to=") else ""
    channel = None
    if has_channel:
        channel = rest.pop(0) if rest and not rest[0].startswith(("to=", CONSTRAIN)) else ""
    recipient = content_type = None
    for w in words + rest:
        if w.startswith("to="):
            recipient = w[len("to="):]
        else:  # `json` or `<|constrain|>json`
            content_type = w.removeprefix(CONSTRAIN) or content_type
    return role, channel, recipient, content_type


def flatten(items: list[Item], final: bool, keep: Callable[[Message], bool]) -> list[str | Message]:
    """The messages `keep` selects as they are; every other item as text (a message's body, on a line of its
    own after other text). On the final read, a message that is not harmony's (an unknown channel, recipient
    or role) is logged: it comes back as text rather than failing the request."""
    out: list[str | Message] = []
    for item in items:
        if isinstance(item, Message) and keep(item):
            out.append(item)
            continue
        if isinstance(item, Message):
            if final and not item.known:
                logger.warning("harmony message with role %r, channel %r, recipient %r is not one this server "
                               "reads: returned as text", item.role, item.channel, item.recipient)
            text = item.body
            if out and isinstance(out[-1], str) and out[-1].strip():
                text = "\n" + text  # separate messages, separate lines
        else:
            text = item
        if out and isinstance(out[-1], str):
            out[-1] += text
        else:
            out.append(text)
    return out


def is_call(m: Message) -> bool:
    return m.function is not None


def call_arguments(m: Message, done: bool) -> str:
    """A call message's body: its JSON arguments ("{}" for a finished call that has none)."""
    args = m.body.strip()
    return args if args or not done else "{}"


def render_call(m: Message) -> str:
    """A call message as harmony text the tool parser reads back (the header in one canonical form)."""
    content_type = f" {m.content_type}" if m.content_type else ""
    header = f"{START}{m.role} to={m.recipient}{CHANNEL}{m.channel or 'commentary'}{content_type}{MESSAGE}"
    return header + m.body + (CALL if m.closed else "")

