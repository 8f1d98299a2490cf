"""The batched sampler against small explicit oracles."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import kernel_op
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.sampler import Sampler, SamplingRow, apply_penalties


def row(prompt=(), output=(), seed=None, **kw) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), list(prompt), list(output), seed)


def reference_probs(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """The sampling distribution by its definition: full sort, top-k, then top-p over what top-k kept."""
    probs = (logits / temperature).softmax(-1)
    if min_p > 0:
        probs = torch.where(probs >= min_p * probs.max(), probs, 0.0)
    order = probs.argsort(descending=True)
    p = probs[order]
    if top_k:
        p[top_k:] = 0
        p = p / p.sum()
    elif min_p > 0:
        p = p / p.sum()
    before = p.cumsum(0) - p
    p = torch.where(before < top_p, p, 0.0)
    out = torch.zeros_like(probs)
    out[order] = p / p.sum()
    return out


@pytest.mark.parametrize("vocab,scale,kw", [
    (40, 2.0, dict(top_k=5)), (40, 2.0, dict(top_p=0.6)), (40, 2.0, dict(min_p=0.2)),
    (40, 2.0, dict(top_k=10, top_p=0.5)), (40, 2.0, dict(temperature=0.7)),
    (3000, 0.3, dict(top_p=0.9)),  # a flat distribution: the nucleus is wider than the first candidates
    (3000, 0.3, dict(top_k=1000, top_p=0.8, temperature=1.3)),
    (3000, 0.3, dict(min_p=0.3, top_p=0.9)), (3000, 0.3, dict(top_k=2500)),
])
@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "sorting"])
def test_sampling_distribution_matches_definition(vocab, scale, kw, use_kernel):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(vocab, generator=g) * scale
    draws = 6000
    sampler = Sampler(seed=1, use_kernel=use_kernel)
    out = sampler(logits.expand(draws, vocab).clone(), [row(**kw) for _ in range(draws)]).token_ids
    freq = torch.bincount(torch.tensor(out), minlength=vocab).float() / draws
    expected = reference_probs(logits, **kw)
    assert set(torch.nonzero(freq).flatten().tolist()) <= set(torch.nonzero(expected).flatten().tolist())
    assert (freq - expected).abs().max() < 0.03
    if vocab > 100:  # a wide support: compare the mass of 20 groups of tokens ranked by probability
        order = expected.argsort(descending=True)
        groups = torch.arange(vocab) * 20 // vocab
        got = torch.zeros(20).index_add_(0, groups, freq[order])
        want = torch.zeros(20).index_add_(0, groups, expected[order])
        assert (got - want).abs().max() < 0.03


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "sorting"])
def test_top_k_1_is_greedy_and_masked_tokens_never_drawn(use_kernel):
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 5000, generator=g) * 4
    sampler = Sampler(seed=3, use_kernel=use_kernel)
    out = sampler(logits.clone(), [row(top_k=1, temperature=1.5) for _ in range(64)]).token_ids
    assert out == logits.argmax(-1).tolist()
    logits[:, ::2] = float("-inf")  # half the vocabulary impossible
    out = sampler(logits.clone(), [row(top_p=0.999, temperature=2.0) for _ in range(64)]).token_ids
    assert all(t % 2 == 1 for t in out)


def test_penalties_match_their_definitions():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    r = row(prompt=[0], output=[1, 1, 3], presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    out = apply_penalties(logits.clone(), [r])[0]
    counts = torch.tensor([0.0, 2, 0, 1, 0])
    expect = logits[0] - 0.25 * counts - 0.5 * (counts > 0)
    seen = torch.tensor([True, True, False, True, False])
    expect = torch.where(seen, torch.where(expect > 0, expect / 2.0, expect * 2.0), expect)
    assert torch.allclose(out, expect)


def test_sampling_follows_the_distribution():
    torch.manual_seed(1)
    logits = torch.randn(1, 8) * 2
    sampler = Sampler(seed=0)
    draws = torch.tensor([sampler(logits, [row(temperature=0.7)]).token_ids[0] for _ in range(4000)])
    freq = torch.bincount(draws, minlength=8).float() / len(draws)
    assert torch.allclose(freq, (logits[0] / 0.7).softmax(-1), atol=0.03)


def test_seeded_rows_ignore_the_rest_of_the_batch():
    torch.manual_seed(2)
    logits = torch.randn(3, 100)
    b = Sampler(seed=99)(logits, [row(temperature=1.0), row(seed=7, temperature=1.0), row(temperature=0.5)])
    c = Sampler(seed=0)(logits[1:2], [row(seed=7, temperature=1.0)]).token_ids[0]
    # row 1 of the batch sees logits[1]; its draw depends only on its own generator
    assert b.token_ids[1] == c
    draws = {Sampler(seed=0)(logits[1:2], [row(seed=s, temperature=1.0)]).token_ids[0] for s in range(20)}
    assert len(draws) > 1  # the seed matters


def test_greedy_logprobs_and_ranks():
    torch.manual_seed(3)
    logits = torch.randn(2, 30)
    out = Sampler()(logits, [row(temperature=0.0, logprobs=3), row(temperature=0.0)])
    lp = logits.log_softmax(-1)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.ranks == [1, 1]
    assert torch.allclose(torch.tensor(out.logprobs), lp.max(-1).values)
    assert out.top_ids[0] == lp[0].topk(3).indices.tolist()


@pytest.mark.parametrize("vocab,scale,top_p", [(49152, 0.5, 0.999), (49152, 3.0, 0.95), (5000, 1.0, 0.5),
                                               (5000, 0.05, 0.99)])
def test_kernel_nucleus_edges_equal_the_definition(vocab, scale, top_p):
    """Uniforms at 0 and just below 1 draw the first and last kept token in vocabulary order: both must be the
    definition's, including where the nucleus is nearly the whole vocabulary (the kernel skips tokens below
    (1 - top_p) * mass / vocab before its histograms)."""
    from pagedllm.kernels import kernel_op

    op = kernel_op("sample_from_logits")
    if op is None:
        pytest.skip("C++ sampler not built")
    g = torch.Generator().manual_seed(vocab + int(scale * 100))
    logits = torch.randn(4, vocab, generator=g) * scale
    for r in range(4):
        expected = reference_probs(logits[r], top_p=top_p)
        kept = torch.nonzero(expected).flatten()
        args = (torch.ones(2), torch.zeros(2, dtype=torch.int64), torch.full((2,), top_p), torch.zeros(2))
        first, last = op(logits[r].expand(2, vocab).contiguous(), *args,
                         torch.tensor([0.0, 1 - 1e-12], dtype=torch.float64)).tolist()
        assert (first, last) == (kept.min().item(), kept.max().item())


@pytest.mark.parametrize("vocab", [1, 7, 16, 49152, 1000])
def test_kernel_argmax_equals_torch_including_ties(vocab):
    from pagedllm.kernels import kernel_op

    op = kernel_op("argmax_rows")
    if op is None:
        pytest.skip("C++ sampler not built")
    g = torch.Generator().manual_seed(vocab)
    logits = torch.cat([torch.randn(5, vocab, generator=g),
                        torch.randint(0, 3, (5, vocab), generator=g).float(),  # many ties: the first one wins
                        torch.full((1, vocab), float("-inf"))])
    logits[2, -1] = 100.0  # the maximum in the tail after the vectorised part
    assert op(logits).tolist() == logits.argmax(-1).tolist()
    greedy = [row(temperature=0.0) for _ in range(len(logits))]
    assert Sampler(use_kernel=True)(logits, greedy).token_ids == Sampler(use_kernel=False)(logits, greedy).token_ids


def test_torch_sampler_draws_the_tokens_of_the_cpp_sampler():
    """The GPU samples with the torch path (the C++ sampler runs on the CPU only): for the same logits and seeds it
    must draw the same tokens as the C++ sampler, with every filter on."""
    if kernel_op("sample_from_logits") is None:
        pytest.skip("C++ sampler not built")
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(48, 3000, generator=g) * 3
    settings = [dict(temperature=0.7), dict(temperature=1.3, top_k=40), dict(temperature=1.0, top_p=0.8),
                dict(temperature=0.9, min_p=0.05, top_k=100, top_p=0.95)]
    rows = [row(seed=1000 + i, **settings[i % len(settings)]) for i in range(len(logits))]
    assert Sampler(use_kernel=True)(logits, rows).token_ids == Sampler(use_kernel=False)(logits, rows).token_ids
