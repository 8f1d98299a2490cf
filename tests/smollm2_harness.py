"""The embedded SmolLM2-135M-Instruct run by hand, for the tests that hold it against an oracle (model/,
attention/, bench/): paged batches built without the engine, perplexity by chunked prefill, chat prompts, and the
perplexity text (tests/data)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import torch

from pagedllm.attention import build_attention_metadata
from pagedllm.model import allocate_kv_caches

BS = 16
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a hash table is.",
    "Name three primary colors.",
]
TEXT = str(Path(__file__).resolve().parent / "data" / "perplexity_text.txt")


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


def chat_ids(tok, prompt: str) -> list[int]:
    """The token ids of one user turn under the model's chat template, generation prompt added."""
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
