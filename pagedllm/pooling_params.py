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

    def validate(self, hidden_size: int | None = None) -> None:
        """ValueError for a value no request may ask for, or (given the model's hidden size) more dimensions
        than it has."""
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or self.dimensions < 1):
            raise ValueError(f"dimensions must be >= 1, got {self.dimensions!r}")
        if hidden_size is not None and self.dimensions is not None and self.dimensions > hidden_size:
            raise ValueError(f"dimensions {self.dimensions} is more than the model's {hidden_size}")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be >= 1 or -1, got {t!r}")

    def truncated(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's tokens as the request keeps them: as vLLM, the last truncate_prompt_tokens (-1: as many as
        the context holds); all of them where it asks for no truncation."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return ids
        return ids[-(max_model_len if keep == -1 else min(keep, max_model_len)):]
