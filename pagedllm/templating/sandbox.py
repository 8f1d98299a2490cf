"""Chat templates rendered in child processes (worker.py) that a runaway template cannot take down with it.

A template is a program: jinja's sandbox stops it reaching Python internals, but not from looping for hours,
holding the GIL inside one C call (`10 ** (10 ** 10)` is folded at compile time), or building gigabytes. Here each
rendering runs in a worker process under a memory limit and an output limit, and the calling thread waits on a
pipe (the GIL free: the server's loop, /health and SIGTERM go on); a worker that runs past the time limit is killed
and the request gets TemplateLimitError. Workers are started once and reused (a rendering costs one round trip).
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

from pagedllm.templating.render import MAX_OUTPUT_CHARS, RESERVED_VARIABLES, TemplateLimitError, plain
from pagedllm.templating.worker import recv, send

RENDER_TIMEOUT_S = 5.0  # wall clock a rendering may take (real templates render in milliseconds)
MEMORY_BUDGET = 512 << 20  # address space a worker may add to what it maps at start
START_TIMEOUT_S = 120.0  # a worker's start-up (Python + jinja), generous for a loaded machine
MAX_WORKERS = 4  # renderings at once; more wait for a worker


class _Timeout(Exception):
    pass


class _Worker:
    def __init__(self, memory_budget: int) -> None:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedllm.templating.worker", str(memory_budget)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     start_new_session=True)  # the terminal's Ctrl-C is for the parent
        self.ready = False

    def call(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        if not self.ready:
            self._read(time.monotonic() + START_TIMEOUT_S, "start")
            self.ready = True
        try:
            send(self.proc.stdin, request)
        except (BrokenPipeError, OSError) as e:
            raise self._died(f"it could not take the request: {e}") from e
        return self._read(time.monotonic() + timeout, "render")

    def _read(self, deadline: float, what: str) -> dict[str, Any]:
        fd = self.proc.stdout.fileno()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                if what == "render":
                    raise _Timeout
                raise TemplateLimitError("the chat template renderer did not start in time")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                break
        try:
            message = recv(self.proc.stdout)  # the whole reply is on its way: the worker writes it in one go
        except ValueError as e:  # cut short
            raise self._died("its reply was cut short") from e
        if message is None:
            raise self._died("it exited")
        return message

    def _died(self, detail: str) -> TemplateLimitError:
        self.kill()
        code = self.proc.returncode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return TemplateLimitError(f"messages: the chat template's renderer died ({detail}, {how}): the template exhausted "
                                  f"its limits")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for fh in (self.proc.stdin, self.proc.stdout):
            try:
                fh.close()
            except OSError:
                pass


class TemplateSandbox:
    """Renders templates in worker processes with a time limit (seconds, wall clock), a memory budget (bytes)
    and an output limit (characters). Thread-safe."""

    def __init__(self, timeout: float = RENDER_TIMEOUT_S, memory_budget: int = MEMORY_BUDGET,
                 max_chars: int = MAX_OUTPUT_CHARS, max_workers: int = MAX_WORKERS) -> None:
        self.timeout, self.memory_budget, self.max_chars = timeout, memory_budget, max_chars
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_workers)
        self._closed = False

    def start(self) -> None:
        """Start one worker ahead of the first rendering (its start-up then overlaps other work)."""
        with self._lock:
            if not self._idle and not self._closed:
                self._idle.append(_Worker(self.memory_budget))

    def render(self, template: str, messages: list[dict], special_tokens: dict[str, str],
               options: dict[str, Any]) -> str:
        """The rendered text; ValueError (TemplateLimitError for the limits) naming what went wrong."""
        request = {"template": template, "messages": messages, "special_tokens": special_tokens,
                   "options": options, "max_chars": self.max_chars}
        with self._slots:
            worker = self._checkout()
            try:
                reply = worker.call(request, self.timeout)
            except _Timeout:
                raise TemplateLimitError(f"messages: the chat template ran past its time limit of {self.timeout:g} "
                                         f"s; its rendering was stopped") from None
            except BaseException:
                worker.kill()
                raise
            self._checkin(worker)
        if "text" in reply:
            return reply["text"]
        raise _error(reply.get("error"), str(reply.get("message")))

    def _checkout(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise RuntimeError("the template sandbox is closed")
            return self._idle.pop() if self._idle else _Worker(self.memory_budget)

    def _checkin(self, worker: _Worker) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(worker)
                return
        worker.kill()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()


def _error(kind: str | None, message: str) -> ValueError:
    if kind == "security":
        return ValueError(f"messages: the chat template was refused by the sandbox (it reached for Python "
                          f"internals): {message}")
    if kind == "template":
        return ValueError(f"messages: chat template failed: {message}")
    if kind == "limit":
        return TemplateLimitError(f"messages: {message}")
    return ValueError(message)


_shared: TemplateSandbox | None = None
_shared_lock = threading.Lock()


def shared_sandbox() -> TemplateSandbox:
    """The process's sandbox (its workers exit with the process: they read until their stdin closes)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = TemplateSandbox()
        return _shared


def render_chat_template(tokenizer: Any, messages: list[dict], *, chat_template: str | None = None,
                         add_generation_prompt: bool = True, continue_final_message: bool = False,
                         chat_template_kwargs: dict[str, Any] | None = None,
                         tools: list[dict[str, Any]] | None = None, sandbox: Any = None) -> str:
    """The prompt text of a conversation, rendered in the template sandbox's worker processes (`sandbox`: a
    TemplateSandbox; default: the process's shared one). Raises ValueError naming what is wrong
    (TemplateLimitError when the template ran past a time, memory or size limit)."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("messages: the model has no chat template (pass one with --chat-template)")
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message: cannot be combined with add_generation_prompt=true")
    if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
        raise ValueError("continue_final_message: the last message must be the assistant's")
    extra = dict(chat_template_kwargs or {})
    clash = sorted(RESERVED_VARIABLES & extra.keys())
    if clash:
        raise ValueError(f"chat_template_kwargs: may not set {clash}")
    options = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
               "tools": plain(tools), **plain(extra)}
    return (sandbox or shared_sandbox()).render(template, plain(list(messages)),
                                                dict(getattr(tokenizer, "special_tokens_map", {})), options)
