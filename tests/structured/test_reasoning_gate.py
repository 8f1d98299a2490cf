"""Structured outputs that start after the reasoning (ReasoningGate), in the engine with a tiny random model: the
tokens up to the end token are the model's own (those of an unconstrained run), the ones after it follow the
grammar; a start token allowed as the first token opens the reasoning; drafts of speculative decoding that
cross the gate give the same tokens as no speculation."""

from __future__ import annotations

import re

import numpy as np
import pytest
from tiny_models import make_llm, make_tiny_model

from pagedllm import SamplingParams, StructuredOutputsParams
from pagedllm.structured.backend import allow_token
from pagedllm.structured.params import GrammarError, ReasoningGate

PROMPTS = ["The quick brown fox jumps over", "A block table maps logical blocks", "Copy on write keeps"]
REGEX = r"(block|table|shared) (keys|values)"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_gate"))


@pytest.fixture
def llm(tiny):
    return make_llm(tiny, num_kv_blocks=256)  # per test: a fresh engine (and prefix cache) each time


def greedy(llm, prompt: str, structured: StructuredOutputsParams | None = None, max_tokens: int = 40):
    # the presence penalty keeps a random model from repeating one token: the gate's end token is then new
    params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=structured,
                            ignore_eos=structured is None, presence_penalty=2.0)
    return llm.generate([prompt], params)[0].outputs[0]


def first_new(tokens: list[int], at_least: int) -> int:
    """The first position >= at_least whose token did not occur before it (so the gate closes exactly there)."""
    return next(k for k in range(at_least, len(tokens)) if tokens[k] not in tokens[:k])


def tail_text(llm, ids: list[int]) -> str:
    return llm.engine.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_open_gate_frees_the_reasoning_and_constrains_the_answer(llm, prompt):
    free = greedy(llm, prompt, max_tokens=16).token_ids
    k = first_new(free, 3)
    out = greedy(llm, prompt, StructuredOutputsParams(regex=REGEX, after_reasoning=ReasoningGate((free[k],),
                                                                                                 open=True)))
    assert out.token_ids[:k + 1] == free[:k + 1], (prompt, out.token_ids, free)
    assert re.fullmatch(REGEX, tail_text(llm, out.token_ids[k + 1:])), (prompt, out.text)
    assert out.finish_reason == "stop"


def test_may_open_gate(llm):
    closed_as_plain = 0
    for prompt in PROMPTS:
        free = greedy(llm, prompt, max_tokens=16).token_ids
        k = first_new(free, 3)
        # the model's own first token is the start token: it reasons (free tokens) until the end token
        opened = greedy(llm, prompt, StructuredOutputsParams(regex=REGEX, after_reasoning=ReasoningGate(
            (free[k],), start=free[0])))
        assert opened.token_ids[:k + 1] == free[:k + 1], prompt
        assert re.fullmatch(REGEX, tail_text(llm, opened.token_ids[k + 1:])), (prompt, opened.text)
        # a start token the model does not take: constrained from the first token, as without a gate
        plain = greedy(llm, prompt, StructuredOutputsParams(regex=REGEX))
        assert re.fullmatch(REGEX, plain.text), plain.text
        unused = next(t for t in range(3, 300) if t not in free)
        closed = greedy(llm, prompt, StructuredOutputsParams(regex=REGEX, after_reasoning=ReasoningGate(
            (free[k],), start=unused)))
        if closed.token_ids[0] != unused:
            assert closed.token_ids == plain.token_ids, prompt
            closed_as_plain += 1
    assert closed_as_plain >= 1


def test_reasoning_cut_by_max_tokens_is_length(llm):
    free = greedy(llm, PROMPTS[0], max_tokens=16).token_ids
    never = next(t for t in range(3, 300) if t not in free)
    out = greedy(llm, PROMPTS[0], StructuredOutputsParams(regex=REGEX, after_reasoning=ReasoningGate((never,),
                                                                                                   open=True)),
                 max_tokens=8)
    assert out.finish_reason == "length" and out.token_ids == free[:8]


def test_speculative_drafts_across_the_gate_change_nothing(tiny):
    prompt = "block table block table block table block table block table"
    base = make_llm(tiny, num_kv_blocks=256)
    spec = make_llm(tiny, num_kv_blocks=256, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    free = greedy(base, prompt, max_tokens=16).token_ids
    for k in {first_new(free, 2), first_new(free, 4)}:
        for gate in (ReasoningGate((free[k],), open=True), ReasoningGate((free[k],), start=free[0])):
            a = greedy(base, prompt, StructuredOutputsParams(regex=REGEX, after_reasoning=gate))
            b = greedy(spec, prompt, StructuredOutputsParams(regex=REGEX, after_reasoning=gate))
            assert a.token_ids == b.token_ids, (k, gate, a.token_ids, b.token_ids)
            assert re.fullmatch(REGEX, tail_text(base, a.token_ids[k + 1:]))
    assert spec.engine.spec_decode_stats()["num_draft_tokens"] > 0


def test_gate_is_set_by_the_server_only():
    with pytest.raises(GrammarError):
        StructuredOutputsParams(json={"type": "object"}, after_reasoning={"end": [1]})
    with pytest.raises(ValueError):
        ReasoningGate(())


def test_allow_token_sets_one_bit_of_one_row():
    mask = np.zeros((2, 3), np.int32)
    allow_token(mask, 1, 63)  # bit 31 of word 1: the sign bit
    allow_token(mask, 1, 0)
    bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")
    assert bits[0].sum() == 0 and sorted(np.flatnonzero(bits[1])) == [0, 63]
