"""PoolingParams: what one embedding request asks for, named as vLLM's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolingParams:
    """dimensions: keep the first `dimensions` values (Matryoshka), then re-normalise where the model normalises.
    normalize: None follows the checkpoint (sentence-transformers' Normalize module, else on for decoders).
    truncate_prompt_tokens: keep the prompt's last N tokens (-1: the model's context), else a longer prompt fails."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    n = 1  # one embedding per prompt (the output processor counts samples per request)

    def validate(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or self.dimensions < 1):
            raise ValueError(f"dimensions must be >= 1, got {self.dimensions!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be >= 1 or -1, got {t!r}")
