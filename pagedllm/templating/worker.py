"""The chat-template rendering process (`python -m pagedllm.templating.worker`): reads render requests from
stdin and writes results to stdout, one length-prefixed JSON message each, until stdin closes.

It runs under an address-space limit (the first argument: bytes beyond what it maps at start) and stops a rendering whose output passes the
size limit of its request; the parent (sandbox.py) kills it when a rendering runs past its time limit.
JSON both ways: the parent never unpickles anything a template could have shaped."""

from __future__ import annotations

import json
import os
import signal
import struct
import sys
from typing import Any, BinaryIO

_HEADER = struct.Struct("<Q")
_OUT_OF_MEMORY = "the chat template ran out of its memory limit"


def send(fh: BinaryIO, message: dict[str, Any]) -> None:
    data = json.dumps(message, ensure_ascii=False).encode("utf-8", "surrogatepass")
    fh.write(_HEADER.pack(len(data)) + data)
    fh.flush()


def recv(fh: BinaryIO) -> dict[str, Any] | None:
    """The next message, or None at end of input."""
    head = fh.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack(head)
    return json.loads(fh.read(n).decode("utf-8", "surrogatepass"))


class _SpecialTokens:
    """What a template sees of the tokenizer: its named special tokens (apply_template reads only these)."""

    def __init__(self, special_tokens_map: dict[str, str]) -> None:
        self.special_tokens_map = special_tokens_map
        self.chat_template = None


def render(request: dict[str, Any]) -> dict[str, Any]:
    """{"text": ...} or {"error": kind, "message": ...}; kind: security | template | value | limit."""
    from jinja2.exceptions import SecurityError, TemplateError

    from pagedllm.templating.render import TemplateLimitError, apply_template

    try:
        text = apply_template(_SpecialTokens(request["special_tokens"]), request["messages"],
                              chat_template=request["template"], max_chars=request["max_chars"],
                              **request["options"])
    except TemplateLimitError as e:
        return {"error": "limit", "message": str(e)}
    except SecurityError as e:
        return {"error": "security", "message": str(e)}
    except TemplateError as e:
        return {"error": "template", "message": str(e)}
    except (ValueError, TypeError) as e:
        return {"error": "value", "message": str(e)}
    except MemoryError:
        return {"error": "limit", "message": _OUT_OF_MEMORY}
    except RecursionError:
        return {"error": "template", "message": "the chat template recursed too deeply"}
    except Exception as e:  # whatever a template provokes in jinja is that template's failure
        return {"error": "template", "message": f"{type(e).__name__}: {e}"}
    return {"text": text}


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent, which stops us by closing stdin
    import pagedllm.templating.render  # noqa: F401  (imported before the limit is measured from here)

    budget = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    if budget > 0:
        import resource

        with open("/proc/self/statm") as f:
            limit = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE") + budget
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but messages on the pipe
    send(stdout, {"ready": os.getpid()})
    while (request := recv(stdin)) is not None:
        try:
            reply = render(request)
        except MemoryError:
            reply = {"error": "limit", "message": _OUT_OF_MEMORY}
        send(stdout, reply)


if __name__ == "__main__":
    main()
