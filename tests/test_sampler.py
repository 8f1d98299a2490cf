"""The batched sampler against small explicit oracles."""

from __future__ import annotations

import torch

from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.sampler import Sampler, SamplingRow, apply_penalties, apply_top_k_top_p_min_p


def row(prompt=(), output=(), seed=None, **kw) -> SamplingRow:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingRow(SamplingParams(**kw), list(prompt), list(output), gen)


def kept(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(torch.isfinite(r)).flatten().tolist()) for r in logits]


def test_top_k_top_p_min_p_masks():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    rows = [row(top_k=5), row(top_p=0.6), row(min_p=0.2), row(top_k=10, top_p=0.5)]
    out = apply_top_k_top_p_min_p(logits.clone(), rows)
    probs = logits.softmax(-1)
    order = probs.argsort(-1, descending=True)
    assert kept(out[:1])[0] == set(order[0, :5].tolist())
    # top_p: the smallest prefix of the sorted tokens whose mass reaches p
    cum = probs[1, order[1]].cumsum(0)
    n = int((cum < 0.6).sum()) + 1
    assert kept(out[1:2])[0] == set(order[1, :n].tolist())
    assert kept(out[2:3])[0] == set(torch.nonzero(probs[2] >= 0.2 * probs[2].max()).flatten().tolist())
    p3 = logits[3].topk(10).values.softmax(-1)
    n3 = int((p3.cumsum(0) < 0.5).sum()) + 1
    assert kept(out[3:4])[0] == set(order[3, :n3].tolist())


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
