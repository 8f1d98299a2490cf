"""Compiles constraints off the engine thread (one worker thread, results cached by key) and builds each step's
token bitmask for the constrained rows only."""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from pagedllm.faults import is_request_fault
from pagedllm.structured.backend import DEFAULT_BACKEND, Backend, Matcher, bitmask_words, make_backend
from pagedllm.structured.params import GrammarError, StructuredOutputsParams

CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int],
                 backend: str = DEFAULT_BACKEND) -> None:
        self.backend_name = backend
        self.vocab_size = vocab_size
        self._tokenizer, self._eos = tokenizer, list(eos_token_ids)
        self._backend: Backend | None = None  # built on first use (a second or two: it walks the vocabulary)
        self._backend_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-grammar")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._bitmask = np.zeros((0, bitmask_words(vocab_size)), np.int32)

    @property
    def backend(self) -> Backend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = make_backend(self.backend_name, self._tokenizer, self.vocab_size, self._eos)
            return self._backend

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar as a future (done at once when cached). A failed compile's GrammarError is the
        future's exception, cached too: the same bad schema fails fast."""
        key = params.key
        with self._cache_lock:  # the server's event loop validates through here too
            fut = self._cache.get(key)
            if fut is None:
                fut = self._pool.submit(self._compile, params)
                self._cache[key] = fut
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
            return fut

    def _compile(self, params: StructuredOutputsParams) -> Any:
        try:
            return self.backend.compile(params)
        except BaseException as e:  # a panic in the native compiler fails this constraint, not its caller
            if isinstance(e, Exception) or not is_request_fault(e):
                raise
            raise GrammarError(params.field_name, f"the grammar compiler failed: {type(e).__name__}: {e}") from e

    def compile(self, params: StructuredOutputsParams) -> Any:
        """Blocking compile (through the same thread and cache); raises GrammarError."""
        return self.submit(params).result()

    def matcher(self, compiled: Any) -> Matcher:
        return self.backend.matcher(compiled)

    def bitmask(self, walks: list[tuple[Matcher, list[int]]]) -> np.ndarray:
        """One int32 row of ceil(vocab / 32) words per (matcher, draft tokens) and draft prefix: what the matcher
        allows next after 0, 1, ... len(drafts) of the drafts. A draft the grammar rejects ends the walk (the
        rows after it repeat the last mask: the sampler's token there differs from the draft, so the rows
        beyond are never used). Matchers end where they started, even when a fill fails: they are the requests'
        own, and a failed step is retried. A view of a reused buffer."""
        n = sum(1 + len(d) for _, d in walks)
        if self._bitmask.shape[0] < n:
            self._bitmask = np.zeros((n, self._bitmask.shape[1]), np.int32)
        out, starts, row = self._bitmask[:n], [], 0
        for _, drafts in walks:
            starts.append(row)
            row += 1 + len(drafts)
        self.backend.fill_bitmasks([m for m, _ in walks], out, starts)  # all current states in one batch
        for (m, drafts), start in zip(walks, starts, strict=True):
            if drafts:
                self._fill_draft_rows(m, drafts, out, start)
        return out

    def _fill_draft_rows(self, m: Matcher, drafts: list[int], out: np.ndarray, start: int) -> None:
        """Rows start + 1 ... of `out` (row `start` holds m's current mask): m walked along the drafts it accepts,
        the mask after each, then rolled back."""
        walked = 0
        try:
            for j, token in enumerate(drafts):
                row = start + 1 + j
                if walked == j and m.accept(token):
                    walked += 1
                    self.backend.fill_bitmasks([m], out, [row])
                else:
                    out[row] = out[row - 1]
        finally:
            if walked:
                m.rollback(walked)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
