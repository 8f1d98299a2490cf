"""Structured outputs on xgrammar (C++; a pushdown automaton with a per-state cache of token masks, built at
compile time). Swappable with llguidance: `LLM(structured_outputs_backend="xgrammar")`."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import xgrammar as xgr

from pagedllm.structured.params import GrammarError, StructuredOutputsParams


class _Matcher:
    __slots__ = ("m",)

    def __init__(self, m: xgr.GrammarMatcher) -> None:
        self.m = m

    def accept(self, token_id: int) -> bool:
        return self.m.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self.m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.m.is_terminated()


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        info = xgr.TokenizerInfo.from_huggingface(getattr(tokenizer, "hf", tokenizer), vocab_size=vocab_size,
                                                  stop_token_ids=list(eos_token_ids) or None)
        # our own cache keys compiled grammars (manager.py); xgrammar's would hide cold compile times
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        c, kind = self.compiler, params.kind
        try:
            if kind == "json":
                return c.compile_json_schema(json.dumps(params.json), any_whitespace=False, separators=(",", ":"))
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=(",", ":"))
            if kind == "regex":
                return c.compile_regex(params.regex)
            if kind == "choice":
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(s, ensure_ascii=False)
                                                                   for s in params.choice))
            return c.compile_grammar(params.grammar)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError subclasses with the parser's message
            raise GrammarError(params.field_name, str(e)) from None

    def matcher(self, compiled: xgr.CompiledGrammar) -> _Matcher:
        return _Matcher(xgr.GrammarMatcher(compiled))

    def fill_bitmasks(self, matchers: list[_Matcher], bitmask: np.ndarray, rows: list[int]) -> None:
        for m, r in zip(matchers, rows, strict=True):
            m.m.fill_next_token_bitmask(bitmask, r)
