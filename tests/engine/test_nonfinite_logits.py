"""NaN never becomes a token: a request whose logits are not finite fails alone with a clear error (its blocks
freed), every other request in the same steps gets exactly the tokens it gets without the poisoned one."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import assert_no_leaks, make_llm, make_tiny_model

from pagedllm import RequestFailedError, SamplingParams


@pytest.fixture(scope="module")
def nan_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_nan"), "llama", seed=5)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_poisoned_requests_fail_alone(nan_dir, poison):
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")  # shown if the test fails
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 300) for _ in range(rng.randint(3, 40))] for _ in range(12)]
    poisoned = set(rng.sample(range(len(prompts)), 4))
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=rng.randint(1, 12),
                             ignore_eos=True) for i in range(len(prompts))]
    llm = make_llm(nan_dir, max_num_batched_tokens=64)  # chunked prefill: poison and clean share steps
    clean = [p for i, p in enumerate(prompts) if i not in poisoned]
    expected = llm.generate(clean, [params[i] for i in range(len(prompts)) if i not in poisoned], use_tqdm=False)
    # the poisoned token: one no clean request generates (a clean request sampling it would rightly fail too)
    generated = {t for out in expected for t in out.outputs[0].token_ids}
    bad_token = next(t for t in range(10) if t not in generated)
    for i in poisoned:  # the token that overflows sits anywhere in the prompt
        prompts[i].insert(rng.randrange(len(prompts[i]) + 1), bad_token)
    with torch.no_grad():
        llm.engine.runner.model.embed[bad_token] = poison
    with pytest.raises(RequestFailedError, match="4 of 12 requests failed") as failed:  # offline: raised, with
        llm.generate(prompts, params, use_tqdm=False)                               # every output attached
    outs = failed.value.outputs
    want = iter(expected)
    for i, out in enumerate(outs):
        if i in poisoned:
            assert out.error is not None and "not finite" in out.error, (seed, i, out.error)
            assert all(len(c.token_ids) == 0 for c in out.outputs), (seed, i)  # no token came from a NaN
        else:
            assert out.error is None, (seed, i, out.error)
            assert out.outputs[0].token_ids == next(want).outputs[0].token_ids, (seed, i)
    assert_no_leaks(llm)


def test_the_finite_check_kernel_agrees_with_torch():
    """The step's one-pass check (sampler.cpp's all_finite) finds one special value anywhere in a batch of logits,
    and passes huge and subnormal finite ones."""
    from pagedllm.kernels import kernel_op

    all_finite = kernel_op("all_finite")
    if all_finite is None:
        pytest.skip("needs the C++ extension")
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")  # shown if the test fails
    gen = torch.Generator().manual_seed(seed)
    for rows, vocab in ((1, 49152), (3, 321), (5, 17)):
        logits = torch.randn(rows, vocab, generator=gen) * 30
        logits.view(-1)[torch.randint(0, logits.numel(), (4,), generator=gen)] = torch.tensor(
            [3.4e38, -3.4e38, 1e-45, -0.0])
        assert all_finite(logits)
        for special in (float("nan"), float("inf"), float("-inf")):
            bad = logits.clone()
            bad.view(-1)[int(torch.randint(0, bad.numel(), (1,), generator=gen))] = special
            assert not all_finite(bad)
            assert all_finite(bad) == bool(torch.isfinite(bad).all())
