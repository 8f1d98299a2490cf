"""What generation returns, shaped as vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # one dict per generated token: token id -> Logprob (the sampled token and the top-k)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None


@dataclass
class RequestMetrics:
    """When things happened to a request (time.monotonic() seconds), as vLLM's RequestOutput.metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None  # set when this request failed inside the engine (the others go on)
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # None for the first prompt token


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt, as vLLM's (`.outputs.embedding`); the pooling runner's output."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | None = None  # None until finished (or when the request failed)
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: RequestMetrics | None = None


def completions_of(out: RequestOutput | EmbeddingRequestOutput) -> list[CompletionOutput]:
    """A generation's completions; an embedding has none (it generates no token)."""
    return out.outputs if isinstance(out, RequestOutput) else []


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """What `LLM.score` returns per pair, as vLLM's (`.outputs.score`): a cross-encoder's relevance score, or the
    cosine similarity of a bi-encoder's two embeddings (prompt_token_ids: both texts' tokens then)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
