"""What one step hands from the model runner to the scheduler, and from the scheduler to the output processor.

A step is schedule -> execute -> update: `Scheduler.schedule()` picks the work, the model runner runs it and
samples (`RunnerOutput`), and `Scheduler.update_from_output` changes every sequence's state on those tokens
(appends them, accepts or rolls back drafts, forks samples, advances beams, finishes on EOS, a stop token or
length) and reports each sequence that got tokens (`SequenceUpdate`). Plain Python lists: no tensors here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.core.request import Request


@dataclass
class PromptLogprobs:
    """Log-probabilities of prompt tokens first_position, first_position + 1, ... given the tokens before each."""

    first_position: int
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]  # the k most likely tokens at each position (k = the request's prompt_logprobs)
    top_logprobs: list[list[float]]


@dataclass
class SamplerOutput:
    """Sampled rows, in the order of the scheduled entries that sample (an entry's rows: its last token and each
    draft prefix; or, when it forks n samples, one row per sample)."""

    token_ids: list[int] = field(default_factory=list)
    # log-probability and rank of each sampled token under the model's raw distribution, and the top alternatives
    # (k = the largest logprobs any row asked for); None when no row asked for logprobs
    logprobs: list[float] | None = None
    ranks: list[int] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


@dataclass
class RunnerOutput:
    """What the model runner returns for one step: the sampled rows, the prompt logprobs it computed and the
    embeddings of the prefill-only requests it completed."""

    sampled: SamplerOutput = field(default_factory=SamplerOutput)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)  # by request id
    nonfinite: list[int] = field(default_factory=list)  # scheduled entries whose logits hold a NaN or infinity
    pooled: dict[str, list[float]] = field(default_factory=dict)  # prefill-only requests done: id -> embedding


@dataclass
class SequenceUpdate:
    """The tokens one sequence took this step (each with its row of the RunnerOutput, for its logprobs)."""

    request: Request
    token_ids: list[int]
    rows: list[int]
    num_draft_tokens: int = 0  # drafts verified this step
    num_accepted_tokens: int = 0  # of which accepted
    forked_from: Request | None = None  # a sample forked this step from this one (n > 1)

    @property
    def finished(self) -> bool:
        return self.request.status.is_finished
