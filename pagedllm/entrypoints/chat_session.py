"""`pagedllm chat`: an interactive conversation that streams each reply as it is generated."""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
from collections.abc import Iterator

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams


def stream_reply(engine: LLMEngine, messages: list[dict], params: SamplingParams, request_id: str,
                 out=sys.stdout) -> str:
    """Generate one assistant turn, writing text to `out` as it arrives; return the whole reply."""
    engine.add_request(request_id, engine.apply_chat_template(messages), params)
    shown = 0
    text = ""
    try:
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id != request_id:
                    continue
                text = o.outputs[0].text
                out.write(text[shown:])
                out.flush()
                shown = len(text)
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        out.write(" [interrupted]")
    out.write("\n")
    return text


HISTORY_FILE = os.path.join(os.path.expanduser("~"), ".cache", "pagedllm", "chat_history")


@contextlib.contextmanager
def line_editing(history_file: str = HISTORY_FILE) -> Iterator[bool]:
    """readline on an interactive terminal: arrow keys, Ctrl-R, and history kept across sessions. Yields
    whether it is on (never on for piped input, or where Python has no readline)."""
    if not sys.stdin.isatty():
        yield False
        return
    try:
        import readline
    except ImportError:
        yield False
        return
    with contextlib.suppress(OSError):
        readline.read_history_file(history_file)
    readline.set_history_length(1000)
    try:
        yield True
    finally:
        with contextlib.suppress(OSError):
            os.makedirs(os.path.dirname(history_file), exist_ok=True)
            readline.write_history_file(history_file)


def _read_line(stdin, out, editing: bool) -> str:
    """One line of user input ("" at end of input)."""
    if editing and stdin is sys.stdin:
        try:
            return input("> ") + "\n"  # input() goes through readline
        except EOFError:
            return ""
    out.write("> ")
    out.flush()
    return stdin.readline()


def run_chat(engine: LLMEngine, params: SamplingParams, system: str | None = None,
             stdin=sys.stdin, out=sys.stdout) -> int:
    with line_editing() as editing:
        return _chat_loop(engine, params, system, stdin, out, editing)


def _chat_loop(engine: LLMEngine, params: SamplingParams, system: str | None, stdin, out, editing: bool) -> int:
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    ids = itertools.count()
    out.write(f"Chatting with {engine.model_name}. Empty line or Ctrl-D to quit, /reset to start over.\n")
    while True:
        line = _read_line(stdin, out, editing)
        if not line or not line.strip():
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if system else []
            continue
        messages.append({"role": "user", "content": line.strip()})
        reply = stream_reply(engine, messages, params, f"chat-{next(ids)}", out)
        messages.append({"role": "assistant", "content": reply})
