"""Structured outputs in the engine: the backends' masks, the sampler's masked fill, and constrained generation
with a tiny random model (its tokens are noise, so only the mask can make the output valid): JSON that validates,
regex and choice matches, mixed batches equal to unconstrained runs, n > 1, preemption, logprobs, length."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest
import torch
from tiny_models import CORPUS, fresh_seed, make_llm, make_tiny_model

from pagedllm import SamplingParams, StructuredOutputsParams
from pagedllm.structured import GrammarError
from pagedllm.structured.backend import BACKENDS, bitmask_words, make_backend
from pagedllm.worker.sampler import TokenBitmask, apply_token_bitmask

# Every string, number and array is bounded, so any walk of the grammar ends within MAX_TOKENS bytes.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}, "minItems": 1,
                 "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                                       "ok": {"type": "boolean"}},
                    "required": ["zip", "ok"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
MAX_TOKENS = 160
WORDS = CORPUS.split()


def random_prompts(n: int, lo: int = 3, hi: int = 30) -> list[str]:
    """Text prompts (random token ids can end in half a UTF-8 character, which the output text would finish)."""
    rng = random.Random(fresh_seed())
    return [" ".join(rng.choices(WORDS, k=rng.randint(lo, hi))) for _ in range(n)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def llm(tiny):
    return make_llm(tiny, num_kv_blocks=512)


def so(**kind) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(**kind))


# --- params, backends, the masked fill -------------------------------------------------------------------------
def test_params_need_exactly_one_kind_and_name_the_field():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(GrammarError) as e:
        StructuredOutputsParams(json="{not json", source={"json": "response_format"})
    assert e.value.field == "response_format"
    assert StructuredOutputsParams(json='{"type": "object"}').key == StructuredOutputsParams(json={"type": "object"}).key


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_mask_follows_the_grammar(backend, tiny):
    pytest.importorskip(backend)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    vocab, eos = len(tok), tok.eos_token_id
    b = make_backend(backend, tok, vocab, [eos])
    instance = {"name": "Bo", "age": 42, "role": "user", "tags": ["ab"], "address": {"zip": "12345", "ok": True}}
    ids = tok.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False)
    matchers = [b.matcher(b.compile(StructuredOutputsParams(json=SCHEMA))) for _ in range(2)]
    bitmask = np.zeros((2, bitmask_words(vocab)), np.int32)
    allowed = lambda row, t: bool((bitmask[row, t // 32] >> (t % 32)) & 1)  # noqa: E731
    for i, t in enumerate(ids):
        b.fill_bitmasks(matchers, bitmask, [0, 1])
        assert allowed(0, t), (i, tok.decode([t]))
        if i == 0:
            assert not allowed(0, tok.encode("x", add_special_tokens=False)[0])  # a JSON object starts with {
        assert matchers[0].accept(t)
    b.fill_bitmasks(matchers, bitmask, [0, 1])
    assert allowed(1, ids[0]) and not allowed(1, ids[1])  # the other matcher never moved: still at the start
    if not matchers[0].is_terminated():  # llguidance stops as soon as nothing can follow, xgrammar at the stop
        assert [t for t in range(vocab) if allowed(0, t)] == [eos]  # complete: only the stop token
        assert matchers[0].accept(eos) and matchers[0].is_terminated()
    for bad in (StructuredOutputsParams(regex="(unclosed"), StructuredOutputsParams(grammar="root ::= (")):
        with pytest.raises(GrammarError):
            b.compile(bad)


def test_apply_token_bitmask_masks_only_its_rows():
    rng = np.random.default_rng(fresh_seed())
    vocab = 100  # not a multiple of 32: the last word's high bits lie beyond the vocabulary
    logits = torch.randn(5, vocab)
    bits = rng.integers(0, 2, size=(2, bitmask_words(vocab) * 32)).astype(bool)
    packed = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
    expect = logits.clone()
    for k, row in enumerate((3, 1)):
        expect[row, ~torch.from_numpy(bits[k, :vocab])] = float("-inf")
    apply_token_bitmask(logits, TokenBitmask([3, 1], packed))
    assert torch.equal(logits, expect)


# --- constrained generation ------------------------------------------------------------------------------------
def test_json_regex_choice_in_one_batch_with_unconstrained_rows(llm):
    prompts = random_prompts(6)
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    params = [so(json=SCHEMA), free, so(regex=r"[A-Z][a-z]{2,5}-[0-9]{2}"), so(choice=["red", "green", "blue"]),
              free, so(json_object=True)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    jsonschema.validate(json.loads(outs[0].outputs[0].text), SCHEMA)
    assert re.fullmatch(r"[A-Z][a-z]{2,5}-[0-9]{2}", outs[2].outputs[0].text)
    assert outs[3].outputs[0].text in ("red", "green", "blue")
    json_object = outs[5].outputs[0]
    assert json_object.finish_reason == "length" or isinstance(json.loads(json_object.text), dict)
    assert all(outs[i].outputs[0].finish_reason == "stop" for i in (0, 2, 3))
    # one row, one answer: the unconstrained rows are what they are without constrained neighbours
    alone = llm.generate([prompts[1], prompts[4]], free, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone] == [outs[1].outputs[0].token_ids, outs[4].outputs[0].token_ids]


def test_n_samples_each_follow_the_grammar_and_logprobs_are_the_models(llm):
    prompt = random_prompts(1)[0]
    p = SamplingParams(n=4, temperature=1.0, seed=random.randrange(1 << 30), max_tokens=MAX_TOKENS, logprobs=3,
                       structured_outputs=StructuredOutputsParams(json=SCHEMA))
    (out,) = llm.generate([prompt], p, use_tqdm=False)
    assert len(out.outputs) == 4
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    # logprobs are the model's distribution before the mask: the first token's top 3 equal an unconstrained run's
    (free,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=3), use_tqdm=False)
    first, ref = out.outputs[0].logprobs[0], free.outputs[0].logprobs[0]
    top = lambda d: {t: round(v.logprob, 4) for t, v in d.items() if v.rank <= 3}  # noqa: E731
    assert top(first) == top(ref)
    assert out.outputs[0].token_ids[0] == llm.get_tokenizer().encode("{", add_special_tokens=False)[0]


def test_preemption_keeps_every_output_valid_and_leaks_nothing(tiny):
    from transformers import AutoTokenizer

    prompts = random_prompts(12, lo=15, hi=25)
    longest = max(len(ids) for ids in AutoTokenizer.from_pretrained(tiny)(prompts)["input_ids"])
    # the longest request fits with a few blocks to spare; twelve of them cannot run at once
    llm = make_llm(tiny, num_kv_blocks=-(-(longest + MAX_TOKENS) // 8) + 4, block_size=8)
    outs = llm.generate(prompts, so(json=SCHEMA), use_tqdm=False)
    stats = llm.kv_cache_stats()
    assert stats["num_preemptions"] > 0
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    assert stats["num_free_blocks"] == stats["num_blocks"] and not llm.engine.requests


def test_too_few_tokens_end_with_length_and_bad_grammars_raise(llm):
    prompt = random_prompts(1)[0]
    p = SamplingParams(temperature=0, max_tokens=3, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    (out,) = llm.generate([prompt], p, use_tqdm=False)
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3
    for bad in ({"regex": "[a-"}, {"json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}):
        with pytest.raises(GrammarError):
            llm.generate([prompt], so(**bad), use_tqdm=False)
    assert not llm.engine.requests
    # compiled grammars are cached by key: the same schema again is ready at once
    assert llm.engine.structured_outputs.submit(StructuredOutputsParams(json=dict(SCHEMA))).done()


def test_draft_rows_follow_the_drafts_and_matchers_end_where_they_started(tiny):
    from transformers import AutoTokenizer

    from pagedllm.structured.manager import StructuredOutputManager

    tok = AutoTokenizer.from_pretrained(tiny)
    mgr = StructuredOutputManager(tok, len(tok), [tok.eos_token_id])
    grammar = mgr.compile(StructuredOutputsParams(regex=r"ab(c|d)+"))
    enc = lambda s: [tok.convert_tokens_to_ids(ch) for ch in s]  # noqa: E731  (one token per letter)
    walked, fresh = mgr.matcher(grammar), mgr.matcher(grammar)
    assert walked.accept(enc("a")[0])
    drafts = enc("bcxd")  # "x" breaks the grammar: its row and the rows after repeat the last valid mask
    rows = mgr.bitmask([(fresh, []), (walked, drafts)]).copy()
    assert fresh.accept(enc("a")[0])
    expect = [mgr.bitmask([(fresh, [])])[0].copy()]
    for t in enc("bc"):
        assert fresh.accept(t)
        expect.append(mgr.bitmask([(fresh, [])])[0].copy())
    assert np.array_equal(rows[1:4], np.stack(expect)) and np.array_equal(rows[4], rows[3])
    assert np.array_equal(rows[5], rows[3])
    assert walked.accept(enc("b")[0]) and not walked.accept(enc("a")[0])  # back right after "a"
    mgr.shutdown()


class _CountingMatcher:
    """Accepts any token; its state is the number of tokens taken."""

    def __init__(self) -> None:
        self.taken = 0

    def accept(self, token_id: int) -> bool:
        self.taken += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        self.taken -= num_tokens

    def is_terminated(self) -> bool:
        return False


class _FailingBackend:
    """Fills the current states, then fails on the draft rows after `fills` of them."""

    def __init__(self, fills: int) -> None:
        self.fills = fills

    def fill_bitmasks(self, matchers, bitmask, rows) -> None:
        if len(matchers) == 1 and rows[0] > 0:  # a draft row
            if self.fills == 0:
                raise RuntimeError("fill failed")
            self.fills -= 1


def test_a_failed_draft_fill_leaves_the_matcher_where_it_started():
    """The walk along the drafts changes the request's own matcher: a step that fails in it (and is retried)
    must find the matcher as it was."""
    from pagedllm.structured.manager import StructuredOutputManager

    mgr = StructuredOutputManager(None, 64, [0])
    mgr._backend = _FailingBackend(fills=2)
    m = _CountingMatcher()
    with pytest.raises(RuntimeError, match="fill failed"):
        mgr.bitmask([(m, [5, 6, 7, 8])])
    assert m.taken == 0
    mgr._backend = _FailingBackend(fills=10)
    assert mgr.bitmask([(m, [5, 6, 7])]).shape[0] == 4 and m.taken == 0
    mgr.shutdown()
