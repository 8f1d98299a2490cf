"""How long a prompt's text may be before it is tokenized: a text with more characters than max_model_len of the
vocabulary's longest tokens could spell cannot fit, and handing megabytes (or a gigabyte a template built) to the
Rust tokenizer only burns CPU, or aborts the process inside it."""

from __future__ import annotations

from typing import Any

# A normalizer may shrink text before it is split (NFKC composes characters): leave a wide margin so that the
# character bound below can never reject a prompt that would fit.
_NORMALIZER_MARGIN = 4


class PromptTooLongError(ValueError):
    """The prompt cannot fit in max_model_len (known from its length alone)."""


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token of this vocabulary spells (vocabulary and added tokens)."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return max(longest, 1)


def check_text_length(text: str, max_model_len: int, chars_per_token: int, param: str = "prompt") -> None:
    """PromptTooLongError when `text` has more characters than max_model_len tokens can hold."""
    bound = max_model_len * chars_per_token * _NORMALIZER_MARGIN
    if len(text) > bound:
        raise PromptTooLongError(f"{param} has {len(text)} characters: more than the {max_model_len} tokens of "
                                 f"max_model_len={max_model_len} can hold")
