"""Batched sampling: penalties, temperature, top-k / top-p / min-p, seeded draws, logprobs.

Every step is a tensor op over the whole batch; the only per-row Python is drawing the noise of rows
that carry their own seed (one generator call per row, never a loop over the vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None  # set when the request has a seed


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # log-probability and rank (1 = most likely) of each sampled token under the model's raw distribution;
    # None when no request in the batch asked for logprobs
    logprobs: list[float] | None
    ranks: list[int] | None
    top_ids: list[list[int]] | None  # top-k alternatives per row (k = the largest logprobs asked for)
    top_logprobs: list[list[float]] | None


def _token_mask(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[N, V] counts of each token id per row, built with one scatter_add."""
    width = max((len(r) for r in rows), default=0)
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.float32, device=device)
    if width == 0:
        return counts[:, :vocab_size]
    padded = torch.full((len(rows), width), vocab_size, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            padded[i, : len(r)] = torch.as_tensor(r, dtype=torch.int64)
    counts.scatter_add_(1, padded.to(device), torch.ones_like(padded, dtype=torch.float32, device=device))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    presence = torch.tensor([r.params.presence_penalty for r in rows], dtype=logits.dtype)
    frequency = torch.tensor([r.params.frequency_penalty for r in rows], dtype=logits.dtype)
    repetition = torch.tensor([r.params.repetition_penalty for r in rows], dtype=logits.dtype)
    vocab = logits.shape[1]
    if bool((presence != 0).any() or (frequency != 0).any()):
        counts = _token_mask([r.output_token_ids for r in rows], vocab, logits.device)
        logits = logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)
    if bool((repetition != 1.0).any()):
        seen = _token_mask([r.prompt_token_ids + r.output_token_ids for r in rows], vocab, logits.device) > 0
        rp = repetition[:, None]
        penalised = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(seen, penalised, logits)
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Mask (to -inf) what top_k, top_p and min_p exclude; logits are already temperature-scaled."""
    vocab = logits.shape[1]
    top_k = torch.tensor([r.params.top_k or vocab for r in rows])
    top_p = torch.tensor([r.params.top_p for r in rows], dtype=logits.dtype)
    min_p = torch.tensor([r.params.min_p for r in rows], dtype=logits.dtype)
    if bool((min_p > 0).any()):
        probs = logits.softmax(-1)
        threshold = min_p[:, None] * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if bool((top_k < vocab).any() or (top_p < 1.0).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
        probs = sorted_logits.softmax(-1)  # top-p acts on what top-k kept, renormalised (as vLLM)
        # drop a token once the mass before it already reaches top_p (the first token always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return logits


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        logits = logits.float()
        # Log-probabilities of the raw model output, only when some request asked for them.
        want_logprobs = any(r.params.logprobs is not None for r in rows)
        raw_logprobs = logits.log_softmax(-1) if want_logprobs else None
        logits = apply_penalties(logits, rows)

        greedy = torch.tensor([r.params.greedy for r in rows])
        sampled = logits.argmax(-1)
        if not bool(greedy.all()):
            temperature = torch.tensor([1.0 if r.params.greedy else r.params.temperature for r in rows])
            scaled = apply_top_k_top_p_min_p(logits / temperature[:, None], rows)
            probs = scaled.softmax(-1)
            # Exponential race: argmax(p / E) with E ~ Exp(1) draws exactly from p.
            noise = torch.empty_like(probs).exponential_(generator=self.generator)
            for i, r in enumerate(rows):
                if r.generator is not None:
                    noise[i].exponential_(generator=r.generator)
            drawn = (probs / noise).argmax(-1)
            sampled = torch.where(greedy, sampled, drawn)
        if raw_logprobs is None:
            return SamplerOutput(sampled.tolist(), None, None, None, None)

        chosen = raw_logprobs.gather(1, sampled[:, None]).squeeze(1)
        ranks = (raw_logprobs > chosen[:, None]).sum(-1) + 1
        k = max((r.params.logprobs or 0) for r in rows)
        top_ids = top_lps = None
        if k > 0:
            vals, ids = raw_logprobs.topk(k, dim=-1)
            top_ids, top_lps = ids.tolist(), vals.tolist()
        return SamplerOutput(sampled.tolist(), chosen.tolist(), ranks.tolist(), top_ids, top_lps)
