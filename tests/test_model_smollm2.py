"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers loading the same GGUF file:
identical greedy answers to chat prompts, equal perplexity over tests/data/perplexity_text.txt, and the
on-disk tokenizer cache."""

from __future__ import annotations

import logging
import math
import os
import random
import time

import pytest
import torch

from pagedllm.attention import build_attention_metadata
from pagedllm.model import allocate_kv_caches, load_model

pytestmark = pytest.mark.slow

BS = 16
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a hash table is.",
    "Name three primary colors.",
]
TEXT = os.path.join(os.path.dirname(__file__), "data", "perplexity_text.txt")


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


class Greedy:
    """Hand-built paged batches over a shuffled block pool (the engine is tested elsewhere)."""

    def __init__(self, loaded, num_blocks: int = 256, kv_dtype: torch.dtype | None = None):
        self.m = loaded.model
        self.kv = allocate_kv_caches(loaded.config, BS, kv_dtype or loaded.dtype, num_blocks=num_blocks)
        self.free = list(range(num_blocks))
        random.Random(0).shuffle(self.free)

    def step(self, seqs: list[dict], counts: list[int]) -> torch.Tensor:
        """Compute counts[i] new tokens of seqs[i]; returns logits of each one's last new token."""
        for s, n in zip(seqs, counts, strict=True):
            need = -(-(s["done"] + n) // BS) - len(s["table"])
            s["table"] += [self.free.pop() for _ in range(need)]
        meta = build_attention_metadata([s["table"] for s in seqs], [s["done"] for s in seqs], counts, BS)
        ids = [t for s, n in zip(seqs, counts, strict=True) for t in s["tokens"][s["done"]:s["done"] + n]]
        pos = [p for s, n in zip(seqs, counts, strict=True) for p in range(s["done"], s["done"] + n)]
        hidden = self.m(torch.tensor(ids), torch.tensor(pos), self.kv, meta)
        ends = torch.tensor(counts).cumsum(0) - 1
        for s, n in zip(seqs, counts, strict=True):
            s["done"] += n
        return self.m.compute_logits(hidden[ends]), hidden


def perplexity(loaded, ids: list[int], kv_dtype: torch.dtype | None = None) -> float:
    """Perplexity of ids under the model, by chunked prefill of 512 tokens through scattered blocks (later chunks
    read the KV that earlier ones wrote)."""
    runner = Greedy(loaded, num_blocks=-(-len(ids) // BS) + 8, kv_dtype=kv_dtype)
    seq = {"tokens": ids, "table": [], "done": 0}
    nll = 0.0
    while seq["done"] < len(ids):
        start = seq["done"]
        count = min(512, len(ids) - start)
        _, hidden = runner.step([seq], [count])
        logp = torch.log_softmax(loaded.model.compute_logits(hidden), -1)
        targets = torch.tensor(ids[start + 1:start + count + 1])
        nll -= logp[:len(targets)].gather(1, targets[:, None]).sum().item()
    return math.exp(nll / (len(ids) - 1))


def _chat_ids(tok, prompt: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_greedy_chat_answers_match_transformers(ours, hf):
    tok, eos = ours.tokenizer, set(ours.eos_token_ids)
    assert eos == {2}  # <|im_end|>
    prompts = [_chat_ids(tok, p) for p in PROMPTS]
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
    assert len(ids) > 2000
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
    seq = {"tokens": _chat_ids(again.tokenizer, PROMPTS[0]), "table": [], "done": 0}
    runner = Greedy(again, num_blocks=16)
    count, out = len(seq["tokens"]), []
    while len(out) < 24 and (not out or out[-1] != 2):
        logits, _ = runner.step([seq], [count])
        out.append(int(logits[0].argmax()))
        seq["tokens"].append(out[-1])
        count = 1
    assert "Paris" in again.tokenizer.decode(out)
