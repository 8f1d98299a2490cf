"""Requests wait here, outside the scheduler, until their grammar is compiled (vLLM's WAITING_FOR_FSM): the
engine thread never blocks on a compile while it has other work."""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any


class GrammarGate:
    def __init__(self) -> None:
        self._held: list[tuple[Future, Any]] = []

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, grammar: Future, item: Any) -> None:
        self._held.append((grammar, item))

    def release(self) -> list[tuple[Any, BaseException | None]]:
        """The items whose grammar is done, in arrival order, each with its compile error (None: compiled)."""
        done = [(f, item) for f, item in self._held if f.done()]
        if done:
            self._held = [(f, item) for f, item in self._held if not f.done()]
        return [(item, f.exception()) for f, item in done]

    def drop(self, item: Any) -> bool:
        n = len(self._held)
        self._held = [(f, it) for f, it in self._held if it != item]
        return len(self._held) != n

    def wait(self, timeout: float) -> None:
        """Block until some held grammar is done (or timeout): for an engine with nothing else to run."""
        if self._held:
            wait([f for f, _ in self._held], timeout=timeout, return_when=FIRST_COMPLETED)
