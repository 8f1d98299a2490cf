"""The seam between the engine and a grammar library: a backend compiles a constraint once (per key) into a
compiled grammar, from which every sample gets its own matcher. Masks are numpy int32 bitmasks [rows,
ceil(vocab / 32)] (bit t % 32 of word t // 32 set = token t allowed), filled for many matchers at once."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from pagedllm.structured.params import StructuredOutputsParams


class Matcher(Protocol):
    def accept(self, token_id: int) -> bool: ...  # False (and no state change) if the grammar forbids it
    def rollback(self, num_tokens: int) -> None: ...
    def is_terminated(self) -> bool: ...  # the grammar is complete: only a stop token may follow


class Backend(Protocol):
    name: str

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (opaque); GrammarError naming the field if the constraint is invalid.
        Thread-safe: runs on the compile thread."""
        ...

    def matcher(self, compiled: Any) -> Matcher: ...

    def fill_bitmasks(self, matchers: list[Matcher], bitmask: np.ndarray, rows: list[int]) -> None:
        """Row rows[i] of bitmask = the tokens matchers[i] allows next."""
        ...


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allow_token(bitmask: np.ndarray, row: int, token_id: int) -> None:
    """Set token_id's bit in one row (bit 31 of a word is its sign bit: set through the unsigned view)."""
    bitmask[row:row + 1].view(np.uint32)[0, token_id // 32] |= np.uint32(1 << (token_id % 32))


BACKENDS = ("llguidance", "xgrammar")
DEFAULT_BACKEND = "llguidance"


def make_backend(name: str, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> Backend:
    """A backend over the engine's tokenizer (model/tokenizer.py)."""
    if name == "llguidance":
        from pagedllm.structured.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer, vocab_size, eos_token_ids)
    if name == "xgrammar":
        from pagedllm.structured.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, eos_token_ids)
    raise ValueError(f"structured outputs backend must be one of {BACKENDS}, got {name!r}")
