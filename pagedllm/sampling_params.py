"""User-facing generation parameters, named as in vLLM."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedllm.structured.params import StructuredOutputsParams

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # what torch.Generator.manual_seed takes (and the server's bound)
_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    max_tokens: int | None = 16  # None: up to the model's context
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # number of top logprobs to return besides the sampled token's
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema / regex / choice / grammar
    min_tokens: int = 0  # EOS, stop token ids and stop strings are held back until this many tokens exist
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None  # top logprobs per prompt token besides the prompt's own token
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (clamped to [-100, 100])
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    bad_words: list[str] | None = None  # words never generated (their last token is banned after the rest)
    truncate_prompt_tokens: int | None = None  # keep only the last k prompt tokens
    # derived by prepare() when the engine accepts the request: what the sampler masks
    bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False)
    eos_token_ids: frozenset[int] = field(default_factory=frozenset, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:  # JSON keys arrive as strings
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError) as e:
                raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from e
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        for name in _FLOATS:  # NaN passes every `<` check below, so finiteness comes first
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
                raise bad(name, "must be a finite number")
        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "must be 0 (disabled), -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", "must be an integer in [0, 20]")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            # rejected rather than reduced modulo 2**64: two different seeds must not silently give one stream
            raise bad("seed", "must be an integer in [-2**63, 2**63 - 1]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must contain only non-empty strings")
        if any(not _is_int(t) for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must contain only integers")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            raise bad("prompt_logprobs", "must be an integer in [0, 20]")
        if self.logit_bias and any(not math.isfinite(v) for v in self.logit_bias.values()):
            raise bad("logit_bias", "values must be finite numbers")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids or any(
                not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids", "must be a non-empty list of token ids")
        if self.bad_words is not None and any(not isinstance(w, str) or not w for w in self.bad_words):
            raise bad("bad_words", "must be a list of non-empty strings")
        if self.truncate_prompt_tokens is not None and (not isinstance(self.truncate_prompt_tokens, int)
                                                        or self.truncate_prompt_tokens < 1):
            raise bad("truncate_prompt_tokens", "must be an integer >= 1")

    def prepare(self, tokenizer, eos_token_ids: set[int], vocab_size: int) -> None:
        """Check the token ids against the vocabulary; tokenize bad_words (with and without a leading space,
        as they may start a word or follow one)."""
        self.check_token_ids(vocab_size)
        self.eos_token_ids = frozenset(eos_token_ids)
        words = []
        for w in self.bad_words or ():
            for variant in dict.fromkeys((w, " " + w.lstrip())):
                ids = tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in words:
                    words.append(ids)
        self.bad_words_token_ids = words

    def check_token_ids(self, vocab_size: int) -> None:
        """Token ids named by the parameters must exist in the model's vocabulary."""
        for name, ids in (("logit_bias", self.logit_bias or ()), ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name} has token ids outside the vocabulary (size {vocab_size}): {bad[:5]}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


@dataclass
class BeamSearchParams:
    beam_width: int = 4
    max_tokens: int = 16
    length_penalty: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
