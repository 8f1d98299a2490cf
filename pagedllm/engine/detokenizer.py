"""Incremental detokenisation and stop strings.

Decoding token by token is wrong for multi-byte UTF-8 (a character split across tokens) and for
SentencePiece spacing (a leading space depends on what came before). `tokenizers.decoders.DecodeStream`
handles both; we prime it with the end of the prompt so the first generated token is decoded in context.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

_PRIME_TOKENS = 6  # prompt tokens of context given to the stream


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True, include_stop: bool = False) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(ids=list(prompt_token_ids[-_PRIME_TOKENS:]),
                                    skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.include_stop = include_stop  # keep the stop string at the end of the text
        self.text = ""
        self._max_stop = max((len(s) for s in stop), default=0)

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one token; return the stop string if the text now contains one (the text is cut before it,
        or after it with include_stop). check_stop=False: not yet (min_tokens)."""
        chunk = self._stream.step(self._backend, token_id)
        if not chunk:
            return None
        start = max(0, len(self.text) - self._max_stop + 1)  # a stop string may straddle the boundary
        self.text += chunk
        if not check_stop:
            return None
        hits = [(pos, s) for s in self.stop if (pos := self.text.find(s, start)) != -1]
        if not hits:
            return None
        pos, stop = min(hits)  # the earliest stop string wins
        self.text = self.text[:pos + len(stop)] if self.include_stop else self.text[:pos]
        return stop
