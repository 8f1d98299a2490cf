"""Speculative decoding: a cheap proposer guesses the next k tokens of a request, the target model verifies all of
them in one forward (the drafts run as a short prefill over the cached context), and the sampler keeps the
longest prefix it agrees with plus one token of its own (core/scheduler.py); the paged cache gives the
slots of rejected drafts back (`Scheduler.accept_draft_tokens`). Proposers return their drafts by request id and
the engine hands them to `Scheduler.update_draft_token_ids` (as vLLM v1): only the scheduler sets them.

Proposers are deterministic (one guess per position), so verification by sampling each position from the target's
own distribution is exact rejection sampling: the output follows the same distribution as without speculation.
A seeded sample draws the uniform of position i as a function of (seed, i) (worker/sampler.seeded_uniform), so it
gives the same tokens with or without speculation, not only the same distribution.

Adaptive, per request: k doubles while whole drafts are accepted and halves when they fail twice in a row; a
request whose drafts keep failing pauses speculation for a growing number of steps. Nobody speculates while more than
`disable_by_batch_size` requests run (a large batch's step is compute-bound: extra tokens are no longer free).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagedllm.core.request import Request

_METHODS = ("ngram", "draft_model")
_MAX_BACKOFF = 64  # steps a request at most waits before it tries a draft again


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2  # ngram: shortest suffix that must match earlier in the request
    prompt_lookup_max: int = 4  # ngram: longest suffix tried first
    model: str | None = None  # draft_model: HF directory or .gguf with the target's tokenizer
    disable_by_batch_size: int = 8  # no speculation while more requests than this run
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in _METHODS:
            raise ValueError(f"speculative_config method must be one of {_METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "num_speculative_tokens" else 1):
                raise ValueError(f"speculative_config {name} must be a positive integer, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config: 'model' (the draft) is required by method 'draft_model' and "
                             "only by it")

    @classmethod
    def from_dict(cls, d: dict | SpeculativeConfig) -> SpeculativeConfig:
        if isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict) or "method" not in d:
            raise ValueError(f"speculative_config must be a dict with a 'method', got {d!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown} (known: {sorted(known)})")
        return cls(**d)


DraftTokenIds = dict[str, list[int]]  # request id -> its draft tokens ([]: none this step)


class Proposer(Protocol):
    def propose(self, wanted: list[tuple[Request, int]]) -> DraftTokenIds:
        """At most k guessed next tokens for each (request, k), by request id (every one of them)."""

    def retain(self, live_ids: set[str]) -> None:
        """Drop any state kept for requests not in live_ids."""


def ngram_lookup(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Prompt lookup: the tokens that followed the most recent earlier occurrence of the longest suffix of
    `tokens` (n_max down to n_min tokens long); [] when no suffix occurs earlier."""
    arr = np.fromiter(tokens, dtype=np.int64, count=len(tokens))
    total = len(arr)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        windows = sliding_window_view(arr[:total - 1], n)  # starts 0 .. total-n-1: never the suffix itself
        hits = np.flatnonzero((windows == arr[total - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return arr[start:start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, wanted: list[tuple[Request, int]]) -> DraftTokenIds:
        return {req.request_id: ngram_lookup(req.all_token_ids, self.n_min, self.n_max, k) for req, k in wanted}

    def retain(self, live_ids: set[str]) -> None:
        pass


@dataclass
class _Pace:
    k: int  # draft length to ask for next
    backoff: int = 0  # steps to wait after a fully rejected draft of length 1
    wait: int = 0  # steps left to wait
    last_full: bool = False  # the last draft was accepted whole


class Speculator:
    """Chooses each request's k (0 = no speculation this step) and asks the proposer for the drafts."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        self._pace: dict[str, _Pace] = {}

    def propose(self, running: Iterable[Request], room: Callable[[Request], int]) -> DraftTokenIds:
        """Drafts for the running requests that decode next step, by request id (for
        Scheduler.update_draft_token_ids); room(request) bounds a request's drafts (tokens it may still generate
        minus the one the verification itself adds)."""
        running = list(running)
        live = {r.request_id for r in running}
        self.proposer.retain(live)
        self._pace = {rid: p for rid, p in self._pace.items() if rid in live}
        if len(running) > self.config.disable_by_batch_size:
            return {}
        wanted = []
        for req in running:
            if req.num_computed_tokens != req.num_tokens - 1:  # still prefilling
                continue
            pace = self._pace.setdefault(req.request_id, _Pace(self.config.num_speculative_tokens))
            if pace.wait:
                pace.wait -= 1
                continue
            k = min(pace.k, room(req))
            if k > 0:
                wanted.append((req, k))
        return self.proposer.propose(wanted) if wanted else {}

    def observe(self, request: Request, num_draft: int, num_accepted: int) -> None:
        """Adapt the request's k to how its last draft fared: all accepted, twice as many next time (copied runs
        are long, and one more a step took ten steps to win back the k that one rejected draft had halved); some,
        the same k (below disable_by_batch_size a verification costs little more than a decode step: the weights
        are read once for all its rows, so a longer draft that is partly wrong still pays); none, half, unless the
        draft before was accepted whole (where a copy diverges for a token, such as a renamed name, and the next
        draft copies again); a one-token draft rejected, a pause that doubles each time it happens again."""
        pace = self._pace.get(request.request_id)
        if pace is None or not self.config.adaptive:
            return
        after_full, pace.last_full = pace.last_full, num_accepted == num_draft
        if num_accepted == num_draft:
            pace.k = min(self.config.num_speculative_tokens, 2 * pace.k)
            pace.backoff = 0
        elif num_accepted or after_full:  # the same k
            pace.backoff = 0
        elif pace.k > 1:
            pace.k //= 2
        else:  # even one-token drafts fail: pause, longer each time
            pace.backoff = min(_MAX_BACKOFF, 2 * pace.backoff or 1)
            pace.wait = pace.backoff


def make_speculator(spec: dict | SpeculativeConfig, *, dtype: str, num_blocks: int, block_size: int,
                    attention_backend: str, vocab_size: int, max_model_len: int,
                    batch_invariant: bool = True, **draft: Any) -> Speculator:
    """batch_invariant: the engine's kernel mode, which a draft model runs in too (one setting for the engine).
    draft: DraftModelProposer's placement and loaded (the target's device and backend; the model loaded before)."""
    config = SpeculativeConfig.from_dict(spec)
    if config.method == "ngram":
        return Speculator(config, NgramProposer(config))
    from pagedllm.engine.draft_model import DraftModelProposer

    return Speculator(config, DraftModelProposer(config.model, dtype, num_blocks, block_size, attention_backend,
                                                 vocab_size, max_model_len, batch_invariant=batch_invariant, **draft))
