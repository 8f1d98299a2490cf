"""Structured outputs on llguidance (Rust; a lazily built lexer and an Earley parser over the token trie)."""

from __future__ import annotations

import json
import os
from copy import copy
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from pagedllm.structured.params import GrammarError, StructuredOutputsParams

# Compact JSON (no free whitespace between tokens): with flexible whitespace a small model can pad with newlines
# until max_tokens; xgrammar's backend is configured the same way.
_JSON_OPTIONS = {"whitespace_flexible": False}


class _Matcher:
    __slots__ = ("m",)

    def __init__(self, m: llguidance.LLMatcher) -> None:
        self.m = m

    def accept(self, token_id: int) -> bool:
        return self.m.try_consume_tokens([token_id]) == 1  # a rejected token leaves no error state behind

    def rollback(self, num_tokens: int) -> None:
        self.m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.m.is_stopped()


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        # llguidance reads the Rust tokenizer's JSON directly (its `hf` helper would import transformers)
        backend = copy(tokenizer.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        self.tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size,
                                                eos_token=list(eos_token_ids) or tokenizer.eos_token_id)
        self.executor = llguidance.LLExecutor(num_threads=max(1, len(os.sched_getaffinity(0))))

    def grammar_text(self, params: StructuredOutputsParams) -> str:
        kind, M = params.kind, llguidance.LLMatcher
        if kind == "json":
            return M.grammar_from_json_schema(params.json, defaults=_JSON_OPTIONS)
        if kind == "json_object":
            return M.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if kind == "regex":
            return M.grammar_from_regex(params.regex)
        if kind == "choice":
            return M.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                            for c in params.choice))
        return M.grammar_from_lark(any_to_lark(params.grammar))

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A template matcher (never advanced): each sample's matcher is a copy of it."""
        try:
            text = self.grammar_text(params)
        except Exception as e:  # malformed schema JSON, GBNF syntax errors
            raise GrammarError(params.field_name, str(e)) from None
        err = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        if err:
            raise GrammarError(params.field_name, err)
        template = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if template.is_error():
            raise GrammarError(params.field_name, template.get_error())
        return template

    def matcher(self, compiled: llguidance.LLMatcher) -> _Matcher:
        return _Matcher(compiled.deep_copy())

    def fill_bitmasks(self, matchers: list[_Matcher], bitmask: np.ndarray, rows: list[int]) -> None:
        llguidance.numpy.fill_next_token_bitmask_par(self.executor, [(m.m, r) for m, r in zip(matchers, rows, strict=True)],
                                                     bitmask)
