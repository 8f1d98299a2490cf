"""The scheduler's unit of work: one token sequence, its progress and its draft tokens. No tensors.

A user request with n > 1 samples (or a beam search) is several of these: the engine forks one core Request per
sample or beam, each with its own block table (shared blocks are ref-counted)."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


class Grammar(Protocol):
    """A structured-outputs matcher (pagedllm/structured), opaque to the core but for these two questions (and,
    where it has one, `mask_changed`: its last token changed the mask the next row needs, as a reasoning gate
    does when the reasoning ends: draft rows sampled after it are not taken)."""

    def accept(self, token_id: int) -> bool: ...  # False (and no state change) if the grammar forbids the token
    def is_terminated(self) -> bool: ...  # the grammar is complete: only a stop token could follow


@dataclass(eq=False)
class Request:
    """One sequence. `all_token_ids` = prompt + generated tokens; the first `num_computed_tokens` of them have
    their K/V in the cache. `spec_token_ids` are proposed (unverified) next tokens, set by
    `Scheduler.update_draft_token_ids`: the scheduler runs them through the model after the sequence's last token,
    and `Scheduler.accept_draft_tokens` keeps the K/V of the ones the sampler accepted and releases the slots of
    the rest.

    A request is complete when it is built: outside core/ nothing assigns its fields afterwards (the scheduler
    owns its progress; tests/core/test_request_ownership.py holds this)."""

    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    priority: int = 0  # the priority scheduling policy serves lower values first
    prompt_work_at_arrival: int = 0  # the scheduler's count of prompt tokens computed when this one arrived (its age)
    spec_token_ids: list[int] = field(default_factory=list)
    # How the sequence samples and ends. The engine builds it with these; the runner samples with `sampling_params` and
    # `seed`, and Scheduler.update_from_output appends the sampled tokens and ends the sequence on them.
    sampling_params: Any = None  # pagedllm.SamplingParams (opaque here)
    seed: int | None = None  # this sequence's own seed (its request's seed + its sample index)
    max_tokens: int | None = None  # "length" after this many output tokens (None: only the context bounds it)
    eos_token_ids: frozenset[int] = frozenset()  # "stop" (empty under ignore_eos)
    stop_token_ids: frozenset[int] = frozenset()  # "stop", with the token as the stop reason
    fork_ids: list[str] = field(default_factory=list)  # n > 1: the other samples, forked once the prompt is done
    grammar: Grammar | None = None  # structured outputs: every token must be accepted by it
    # a fresh matcher: the scheduler makes `grammar` from it on add_request (unless given) and for each forked sample
    new_grammar: Callable[[], Grammar] | None = None
    beam: Any = None  # the beam-search group this sequence is a beam of (core/beam_search.py)
    stop_reason: int | None = None  # the stop token that ended it
    error: str | None = None  # why it was aborted, when it failed
    # pooling (embeddings): the prompt is computed and the sequence ends, no logits, no sampling, no decode
    prefill_only: bool = False
    # the LoRA adapter its tokens run with (None: the base model); the scheduler keeps at most max_loras distinct
    # adapters running, and the engine keys its prefix-cache blocks by it (through cache_salt)
    lora_id: int | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
