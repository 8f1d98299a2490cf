"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers loading the same GGUF file:
identical greedy answers to chat prompts, equal perplexity over tests/data/perplexity_text.txt, and the
on-disk tokenizer cache."""

from __future__ import annotations

import logging
import math
import os
import time

import pytest
import torch
from smollm2_harness import PROMPTS, TEXT, Greedy, chat_ids, perplexity

from pagedllm.model import load_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A private tokenizer cache, so the first load really builds it and the second really reads it."""
    d = str(tmp_path_factory.mktemp("pagedllm-cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CACHE_DIR", d)
        yield d


@pytest.fixture(scope="module")
def ours(cache_dir):
    return load_model(None, "float32", attention_backend="reference", quantization="none")  # the transformers-exact path


@pytest.fixture(scope="module")
def hf(hf_smollm2):
    return hf_smollm2


def test_greedy_chat_answers_match_transformers(ours, hf):
    tok, eos = ours.tokenizer, set(ours.eos_token_ids)
    assert eos == {2}  # <|im_end|>
    prompts = [chat_ids(tok, p) for p in PROMPTS]
    seqs = [{"tokens": list(p), "table": [], "done": 0, "out": []} for p in prompts]
    runner = Greedy(ours)
    live = list(seqs)
    counts = [len(s["tokens"]) for s in live]  # all prompts prefilled in one flat batch
    for _ in range(64):
        logits, _ = runner.step(live, counts)
        for s, tok_id in zip(live, logits.argmax(-1).tolist(), strict=True):
            s["tokens"].append(tok_id)
            s["out"].append(tok_id)
        live = [s for s in live if s["out"][-1] not in eos]
        if not live:
            break
        counts = [1] * len(live)
    for p, s in zip(prompts, seqs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=64, do_sample=False, eos_token_id=2,
                              pad_token_id=2)[0, len(p):].tolist()
        assert s["out"] == ref, (tok.decode(s["out"]), tok.decode(ref))
    answer = tok.decode(seqs[0]["out"], skip_special_tokens=True)
    print(f"\nQ: {PROMPTS[0]}\nA: {answer}")
    assert "Paris" in answer


def test_perplexity_matches_transformers(ours, hf):
    text = open(TEXT, encoding="utf-8").read()
    ids = ours.tokenizer(text)["input_ids"]
    assert len(ids) > 1280
    ids = ids[:1280]  # past 1,024 keys (the kernels' long-context paths), at half the whole text's time
    ppl = perplexity(ours, ids)
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    ref_nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum").item()
    ref_ppl = math.exp(ref_nll / (len(ids) - 1))
    print(f"\nperplexity over {len(ids)} tokens: pagedllm {ppl:.4f}, transformers {ref_ppl:.4f}")
    assert abs(ppl - ref_ppl) / ref_ppl < 1e-3
    assert 1.5 < ppl < 100  # a real language model on English prose


def test_tokenizer_cache_reused(ours, cache_dir, caplog):
    entries = os.listdir(os.path.join(cache_dir, "tokenizers"))
    assert len(entries) == 1 and os.path.isfile(os.path.join(cache_dir, "tokenizers", entries[0],
                                                             "tokenizer.json"))
    t0 = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="pagedllm.model.tokenizer"):
        again = load_model(None, "bfloat16", attention_backend="reference", quantization="none")
    elapsed = time.perf_counter() - t0
    print(f"\nwarm load of the default model (bfloat16): {elapsed:.2f} s")
    assert not any("built the tokenizer" in r.getMessage() for r in caplog.records)
    text = open(TEXT, encoding="utf-8").read()[:2000]
    assert again.tokenizer(text)["input_ids"] == ours.tokenizer(text)["input_ids"]
    msgs = [{"role": "user", "content": "Hi there"}]
    assert (again.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            == ours.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    assert again.model.embed.dtype == torch.bfloat16
    # and the bfloat16 model answers sensibly too (its KV pool in bfloat16)
    seq = {"tokens": chat_ids(again.tokenizer, PROMPTS[0]), "table": [], "done": 0}
    runner = Greedy(again, num_blocks=16)
    count, out = len(seq["tokens"]), []
    while len(out) < 24 and (not out or out[-1] != 2):
        logits, _ = runner.step([seq], [count])
        out.append(int(logits[0].argmax()))
        seq["tokens"].append(out[-1])
        count = 1
    assert "Paris" in again.tokenizer.decode(out)
