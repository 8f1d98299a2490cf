"""`bench perplexity` scores what llama-perplexity scores: chunks of ctx tokens (the first replaced by BOS where
the tokenizer adds one), only the second half of each scored. Its pagedllm number (the engine's prompt_logprobs,
all chunks batched) must equal the same sum computed by hand from the model's logits over each chunk alone."""

from __future__ import annotations

import argparse
import math
import random

import pytest
import torch
from pagedllm_bench.perplexity import chunks, pagedllm_perplexity
from smollm2_harness import TEXT, Greedy

from pagedllm.model import load_model

pytestmark = pytest.mark.slow


def test_chunks_are_llama_perplexitys():
    seed = random.randrange(1 << 16)  # fresh tokens every run, the seed in every failure message
    rng = random.Random(seed)
    toks = [rng.randrange(1000) for _ in range(23)]
    assert chunks(toks, 5, None, None) == [toks[0:5], toks[5:10], toks[10:15], toks[15:20]], seed
    assert chunks(toks, 5, 2, 7) == [[7, *toks[1:5]], [7, *toks[6:10]]], seed
    assert chunks(toks, 24, None, None) == [], seed


def test_pagedllm_perplexity_equals_the_models_own_logits():
    ctx, count = 64, 3
    args = argparse.Namespace(ctx=ctx, chunks=count, threads=2, dtype="float32", tokenizer="pagedllm")
    got = pagedllm_perplexity(None, TEXT, args, "none")
    assert got["chunks"] == count and got["scored_tokens"] == count * (ctx - ctx // 2 - 1)

    loaded = load_model(None, "float32", attention_backend="reference", quantization="none")
    ids = loaded.tokenizer(open(TEXT, encoding="utf-8").read())["input_ids"]
    nll, n = 0.0, 0
    for part in chunks(ids, ctx, count, None):
        _, hidden = Greedy(loaded, num_blocks=16).step([{"tokens": part, "table": [], "done": 0}], [ctx])
        logp = torch.log_softmax(loaded.model.compute_logits(hidden).float(), -1)
        for i in range(ctx // 2 + 1, ctx):  # token i given tokens < i
            nll -= logp[i - 1, part[i]].item()
            n += 1
    assert math.isclose(got["ppl"], math.exp(nll / n), rel_tol=2e-3), (got["ppl"], math.exp(nll / n))
