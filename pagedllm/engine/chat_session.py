"""`pagedllm chat`: an interactive conversation that streams each reply as it is generated."""

from __future__ import annotations

import itertools
import sys

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


def run_chat(engine: LLMEngine, params: SamplingParams, system: str | None = None,
             stdin=sys.stdin, out=sys.stdout) -> int:
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    ids = itertools.count()
    out.write(f"Chatting with {engine.model_name}. Empty line or Ctrl-D to quit, /reset to start over.\n")
    while True:
        out.write("> ")
        out.flush()
        line = stdin.readline()
        if not line or not line.strip():
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if system else []
            continue
        messages.append({"role": "user", "content": line.strip()})
        reply = stream_reply(engine, messages, params, f"chat-{next(ids)}", out)
        messages.append({"role": "assistant", "content": reply})
