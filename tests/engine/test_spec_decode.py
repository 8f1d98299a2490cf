"""Speculative decoding end to end on tiny random models: greedy output token-for-token equal to plain decoding
(n-gram prompt lookup, the model as its own draft -> 100% acceptance, a random-weight draft -> ~0), stops and
max_tokens inside a draft, preemption, no leaked blocks in either pool, and the sampled distribution unchanged."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from tiny_models import assert_no_leaks, make_llm, make_tiny_model, random_prompts, tokens

from pagedllm import SamplingParams
from pagedllm.core.request import Request
from pagedllm.engine.args import EngineArgs
from pagedllm.engine.speculative import SpeculativeConfig, Speculator, ngram_lookup

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def random_draft_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_draft"), "llama", seed=11)


def grounded_prompts() -> list[list[int]]:
    """Prompts that repeat themselves (n-gram lookups find matches) and plain random ones."""
    rng = random.Random(4)
    base = [rng.randrange(3, 300) for _ in range(20)]
    return [base * 3, random_prompts(1, seed=30)[0], base + base[:7], random_prompts(1, seed=31, lo=50, hi=60)[0]]


def spec_configs(tiny_dir, random_draft_dir) -> dict[str, dict]:
    return {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
            "self_draft": {"method": "draft_model", "model": str(tiny_dir), "num_speculative_tokens": 3},
            "random_draft": {"method": "draft_model", "model": str(random_draft_dir), "num_speculative_tokens": 3}}


def assert_no_draft_leaks(llm) -> None:
    proposer = llm.engine.speculator.proposer
    if hasattr(proposer, "kv"):
        sched = proposer.scheduler
        assert proposer.kv.num_free_blocks() == proposer.kv.num_blocks and not sched.running and not sched.waiting


@pytest.mark.parametrize("name", ["ngram", "self_draft", "random_draft"])
def test_greedy_equals_plain_decoding_batched_and_alone(tiny_dir, random_draft_dir, name):
    prompts = grounded_prompts()
    reference = tokens(make_llm(tiny_dir).generate(prompts, GREEDY, use_tqdm=False))
    llm = make_llm(tiny_dir, speculative_config=spec_configs(tiny_dir, random_draft_dir)[name])
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
    assert [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts] == reference
    stats = llm.engine.spec_decode_stats()
    assert stats["num_draft_tokens"] > 0
    if name == "self_draft":
        assert stats["acceptance_rate"] == 1.0 and stats["mean_accepted_length"] > 3
    elif name == "random_draft":
        assert stats["acceptance_rate"] < 0.2
    else:
        assert stats["num_accepted_tokens"] > 0
    kv = llm.kv_cache_stats()
    assert kv["spec_decode_num_draft_tokens"] == stats["num_draft_tokens"]
    assert_no_leaks(llm)
    assert_no_draft_leaks(llm)


def test_stops_and_max_tokens_inside_a_draft(tiny_dir):
    llm = make_llm(tiny_dir, speculative_config={"method": "draft_model", "model": str(tiny_dir),
                                                 "num_speculative_tokens": 5})
    plain = make_llm(tiny_dir)
    prompt = grounded_prompts()[1]
    free = plain.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    for max_tokens in range(1, 12):
        p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        assert llm.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids == free.token_ids[:max_tokens]
    for stop_token in free.token_ids[3:9]:  # each lands somewhere inside a 5-token draft
        p = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_token])
        ref, out = (m.generate([prompt], p, use_tqdm=False)[0].outputs[0] for m in (plain, llm))
        assert (out.token_ids, out.finish_reason, out.stop_reason) == (ref.token_ids, ref.finish_reason,
                                                                       ref.stop_reason)
    text = free.text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    p = SamplingParams(temperature=0, max_tokens=40, stop=[stop], ignore_eos=True)
    ref, out = (m.generate([prompt], p, use_tqdm=False)[0].outputs[0] for m in (plain, llm))
    assert (out.text, out.token_ids, out.stop_reason) == (ref.text, ref.token_ids, stop)
    assert llm.engine.spec_decode_stats()["num_accepted_tokens"] > 0
    assert_no_leaks(llm)
    assert_no_draft_leaks(llm)


@pytest.mark.parametrize("invariant", [True, False])
def test_draft_model_runs_in_the_engine_kernel_mode(tiny_dir, invariant):
    """One setting: the draft model's forwards run in EngineArgs.batch_invariant's kernel mode, as the target's
    (verification decides the tokens; the draft's mode only moves acceptance, so it follows the engine's)."""
    from pagedllm.kernels.dispatch import current_mode

    llm = make_llm(tiny_dir, batch_invariant=invariant, speculative_config={
        "method": "draft_model", "model": str(tiny_dir), "num_speculative_tokens": 3})
    runner = llm.engine.speculator.proposer.runner
    modes, forward = [], runner.forward

    def recording_forward(*args, **kwargs):
        modes.append(current_mode().invariant)
        return forward(*args, **kwargs)

    runner.forward = recording_forward
    llm.generate(grounded_prompts()[:2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    assert llm.engine.runner.kernel_mode.invariant is invariant
    assert modes and set(modes) == {invariant}
    assert llm.engine.spec_decode_stats()["num_draft_tokens"] > 0
    assert_no_leaks(llm)
    assert_no_draft_leaks(llm)


def test_preemption_and_parallel_sampling_with_speculation(tiny_dir):
    spec = {"method": "draft_model", "model": str(tiny_dir), "num_speculative_tokens": 4}
    prompts = random_prompts(6, seed=32, lo=20, hi=40)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    reference = tokens(make_llm(tiny_dir).generate(prompts, params, use_tqdm=False))
    small = make_llm(tiny_dir, num_kv_blocks=24, max_num_batched_tokens=64, speculative_config=spec)
    assert tokens(small.generate(prompts, params, use_tqdm=False)) == reference
    assert small.kv_cache_stats()["num_preemptions"] > 0
    assert small.engine.spec_decode_stats()["num_accepted_tokens"] > 0
    assert_no_leaks(small)
    n3 = small.generate([prompts[0]], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12,
                                                     ignore_eos=True), use_tqdm=False)[0]
    assert [len(c.token_ids) for c in n3.outputs] == [12, 12, 12]
    assert_no_leaks(small)
    assert_no_draft_leaks(small)


@pytest.mark.parametrize("name", ["ngram", "self_draft", "random_draft"])
def test_seeded_sampling_gives_the_same_tokens_as_without_speculation(tiny_dir, random_draft_dir, name):
    """A seeded sample's draw for output position i is a function of (seed, i): with or without speculation (drafts
    accepted, rejected, k changing), after a preemption, the same request gives the same tokens, not just the
    same distribution."""
    prompts = grounded_prompts()
    params = [SamplingParams(temperature=0.9, top_p=0.95, n=2, seed=40 + i, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]

    def samples(llm) -> list[list[list[int]]]:
        return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]

    reference = samples(make_llm(tiny_dir))
    llm = make_llm(tiny_dir, speculative_config=spec_configs(tiny_dir, random_draft_dir)[name])
    assert samples(llm) == reference
    assert llm.engine.spec_decode_stats()["num_draft_tokens"] > 0
    small = make_llm(tiny_dir, num_kv_blocks=24, max_num_batched_tokens=64,
                     speculative_config=spec_configs(tiny_dir, random_draft_dir)[name])
    assert samples(small) == reference
    assert small.kv_cache_stats()["num_preemptions"] > 0
    assert_no_leaks(small)


def test_no_speculation_in_large_batches_or_with_k_zero(tiny_dir):
    llm = make_llm(tiny_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                 "prompt_lookup_min": 1, "disable_by_batch_size": 2})
    llm.generate(grounded_prompts(), GREEDY, use_tqdm=False)  # 4 running > 2: nobody speculates
    assert llm.engine.spec_decode_stats()["num_draft_tokens"] == 0
    zero = make_llm(tiny_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    zero.generate(grounded_prompts()[:1], GREEDY, use_tqdm=False)
    assert zero.engine.spec_decode_stats()["num_draft_tokens"] == 0


def _two_sample_chi_square(a: Counter, b: Counter, min_count: int = 5) -> tuple[float, int]:
    """Chi-square statistic of homogeneity of two samples (rare categories pooled) and its degrees of freedom."""
    cats = [c for c in set(a) | set(b) if a[c] + b[c] >= min_count]
    rows = [[a[c] for c in cats] + [sum(a.values()) - sum(a[c] for c in cats)],
            [b[c] for c in cats] + [sum(b.values()) - sum(b[c] for c in cats)]]
    if rows[0][-1] + rows[1][-1] == 0:
        rows = [r[:-1] for r in rows]
    total = sum(map(sum, rows))
    stat = 0.0
    for j in range(len(rows[0])):
        col = rows[0][j] + rows[1][j]
        for r in rows:
            expected = sum(r) * col / total
            stat += (r[j] - expected) ** 2 / expected
    return stat, len(rows[0]) - 1


def _chi2_critical(dof: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at the normal quantile z (3.09: 0.1% upper tail)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("params", [dict(temperature=1.3), dict(temperature=0.8, top_p=0.7)])
def test_sampling_distribution_is_unchanged(tiny_dir, params):
    """1,000 seeded draws of the first four tokens with and without speculation (the model as its own draft, so
    drafts are proposed and accepted or rejected at every position): the per-position token distributions must
    not differ. The test statistic is compared at a 0.1% false-alarm rate per position (fixed seeds: the result
    is deterministic)."""
    prompt = grounded_prompts()[0][:24]
    n = 1000
    runs = []
    for spec in (None, {"method": "draft_model", "model": str(tiny_dir), "num_speculative_tokens": 2,
                        "disable_by_batch_size": 4096}):
        llm = make_llm(tiny_dir, num_kv_blocks=4096, max_num_seqs=512, seed=7, speculative_config=spec)
        sp = [SamplingParams(max_tokens=4, ignore_eos=True, seed=i, **params) for i in range(n)]
        runs.append(tokens(llm.generate([prompt] * n, sp, use_tqdm=False)))
    assert llm.engine.spec_decode_stats()["num_draft_tokens"] >= n
    for pos in range(4):
        stat, dof = _two_sample_chi_square(Counter(t[pos] for t in runs[0]), Counter(t[pos] for t in runs[1]))
        assert dof >= 2, "too few distinct tokens for a meaningful test"
        assert stat < _chi2_critical(dof), (pos, stat, dof)


class _AskedK:
    """A proposer that records the k asked for and drafts that many tokens."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def propose(self, wanted):
        self.asked += [k for _, k in wanted]
        return {req.request_id: [7] * k for req, k in wanted}

    def retain(self, live_ids):
        pass


def test_adaptive_k_doubles_on_full_acceptance_keeps_on_partial_halves_on_second_none_and_pauses():
    proposer = _AskedK()
    spec = Speculator(SpeculativeConfig("ngram", num_speculative_tokens=4, disable_by_batch_size=2), proposer)
    req = Request("r", [1, 2, 3])
    req.num_computed_tokens = req.num_tokens - 1  # decoding

    def step(accepted: int | None) -> int | None:
        """One step: the k asked for (None: no draft), then how many of the draft the verification accepted."""
        before = len(proposer.asked)
        spec.propose([req], room=lambda r: 100)
        if len(proposer.asked) == before:
            return None
        k = proposer.asked[-1]
        spec.observe(req, k, k if accepted is None else min(accepted, k))
        return k

    # full (at the cap), partial: the same k; none: halve; full again: double; none right after a full draft: the
    # same k, none again: halve
    assert [step(a) for a in (None, 1, 2, 0, None, 0, 0, 0, 0)] == [4, 4, 4, 4, 2, 4, 4, 2, 1]
    assert [step(0) for _ in range(4)] == [None, 1, None, None]  # a rejected one-token draft: pause 1, then 2
    assert step(None) == 1 and step(None) == 2 and step(None) == 4  # accepted again: grow back, doubling
    spec.propose([req, Request("a", [1]), Request("b", [1])], room=lambda r: 100)  # 3 running > 2: nobody drafts
    assert len(proposer.asked) == 13
    req.num_computed_tokens = 0  # prefilling: no draft
    assert step(None) is None


def test_ngram_lookup_and_config_validation():
    assert ngram_lookup([1, 2, 3, 4, 9, 1, 2, 3], 2, 3, 3) == [4, 9, 1]
    assert ngram_lookup([1, 2, 3, 4, 5], 1, 3, 2) == []
    assert ngram_lookup([5, 6, 7, 5, 6, 8, 5, 6], 2, 2, 2) == [8, 5]  # the most recent occurrence
    assert ngram_lookup([7], 1, 3, 4) == []
    with pytest.raises(ValueError, match="unknown keys"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_token": 3})
    with pytest.raises(ValueError, match="method"):
        EngineArgs(speculative_config={"method": "medusa"})
    with pytest.raises(ValueError, match="'model'"):
        SpeculativeConfig.from_dict({"method": "draft_model"})
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert EngineArgs.from_cli_args(ns).speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
