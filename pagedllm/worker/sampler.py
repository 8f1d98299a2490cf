"""Batched sampling: penalties, temperature, top-k / top-p / min-p, seeded draws, logprobs.

Every step is a tensor op over the whole batch; the only per-row Python is drawing the uniform of rows
that carry their own seed (one generator call per row, never a loop over the vocabulary). Tokens are drawn
by inverse CDF; top-k / top-p look at a few hundred sorted candidates instead of sorting the vocabulary,
and a top-p nucleus wider than that is sampled exactly by rejection, still without a sort.
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


NUM_CANDIDATES = 256  # top-p first looks among this many most likely tokens (exact: see _nucleus)


def apply_min_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the most likely token's."""
    min_p = torch.tensor([r.params.min_p for r in rows], dtype=logits.dtype)
    if not bool((min_p > 0).any()):
        return logits
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, float("-inf"))


def _nucleus(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, k: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The k most likely tokens per row with what top_k / top_p keep of them.

    Returns (candidate ids [N, k], candidate probabilities [N, k] with dropped ones at 0, exact [N] bool).
    top-p acts on what top-k kept, renormalised (as vLLM); without top-k it acts on the full distribution,
    and is exact only if the k candidates already hold top_p of the mass (else the caller samples that row
    another way). Sorting k candidates instead of the whole vocabulary is what makes this cheap.
    """
    vals, ids = logits.topk(k, dim=-1)
    ranks = torch.arange(k)[None, :]
    vals = vals.masked_fill(ranks >= top_k[:, None], float("-inf"))
    full_mass = (vals - logits.logsumexp(-1, keepdim=True)).exp()  # probabilities under the whole vocabulary
    probs = torch.where((top_k < logits.shape[1])[:, None], vals.softmax(-1), full_mass)
    before = probs.cumsum(-1) - probs  # mass of the more likely candidates
    keep = before < top_p[:, None]
    keep[:, 0] = True
    exact = (top_k <= k) | (full_mass.sum(-1) >= top_p)
    return ids, probs * keep, exact


def _draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one uniform per row picks the token whose cumulative mass first exceeds it.
    (torch.multinomial and exponential noise cost 5-20x more over a 49k vocabulary on this CPU.)"""
    cdf = probs.cumsum(-1)
    target = (uniforms * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def _uniforms(self, rows: list[SamplingRow]) -> torch.Tensor:
        """One uniform per row; a row with its own seed draws from its own generator only."""
        u = torch.rand(len(rows), generator=self.generator)
        for i, r in enumerate(rows):
            if r.generator is not None:
                u[i] = torch.rand(1, generator=r.generator)
        return u

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        vocab = logits.shape[1]
        temperature = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype)
        logits = apply_min_p(logits / temperature[:, None], rows)
        uniforms = self._uniforms(rows)
        top_k = torch.tensor([min(r.params.top_k, vocab) or vocab for r in rows])
        top_p = torch.tensor([r.params.top_p for r in rows], dtype=logits.dtype)
        truncated = (top_k < vocab) | (top_p < 1.0)
        sampled = torch.empty(len(rows), dtype=torch.int64)
        if bool(truncated.any()):
            rows_t = truncated.nonzero().squeeze(1)
            widest_top_k = int(torch.where(top_k[rows_t] < vocab, top_k[rows_t], 0).max())
            ids, probs, exact = _nucleus(logits[rows_t], top_k[rows_t], top_p[rows_t],
                                         min(vocab, max(NUM_CANDIDATES, widest_top_k)))
            done = rows_t[exact]
            sampled[done] = ids[exact].gather(1, _draw(probs[exact], uniforms[done])[:, None]).squeeze(1)
            wide = rows_t[~exact]  # top-p rows whose nucleus holds more than the candidates
            if len(wide):
                sampled[wide] = self._sample_wide_nucleus(logits[wide], top_p[wide], uniforms[wide],
                                                          [rows[i] for i in wide.tolist()])
        if not bool(truncated.all()):
            f = (~truncated).nonzero().squeeze(1)
            sampled[f] = _draw(logits[f].softmax(-1), uniforms[f])
        return sampled

    def _sample_wide_nucleus(self, logits: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor,
                             rows: list[SamplingRow]) -> torch.Tensor:
        """Top-p without sorting: draw from the whole distribution and accept a token if the tokens more likely
        than it hold less than top_p of the mass. Accepted draws follow the renormalised nucleus exactly; a
        draw is rejected with probability 1 - (nucleus mass) <= 1 - top_p, so few rounds are needed."""
        probs = logits.softmax(-1)
        sampled = torch.empty(len(rows), dtype=torch.int64)
        pending = torch.arange(len(rows))
        for _ in range(64):
            pp = probs if len(pending) == len(rows) else probs[pending]
            tok = _draw(pp, uniforms)
            p_tok = pp.gather(1, tok[:, None])
            above = torch.where(pp > p_tok, pp, 0.0).sum(-1)
            ok = above < top_p[pending]
            sampled[pending[ok]] = tok[ok]
            pending = pending[~ok]
            if not len(pending):
                return sampled
            uniforms = self._uniforms([rows[i] for i in pending.tolist()])
        ids, kept, _ = _nucleus(logits[pending], torch.full((len(pending),), logits.shape[1]), top_p[pending],
                                logits.shape[1])  # (never in practice) sort the vocabulary
        sampled[pending] = ids.gather(1, _draw(kept, uniforms)[:, None]).squeeze(1)
        return sampled

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        logits = logits.float()
        # Log-probabilities of the raw model output, only when some request asked for them.
        want_logprobs = any(r.params.logprobs is not None for r in rows)
        raw_logprobs = logits.log_softmax(-1) if want_logprobs else None
        logits = apply_penalties(logits, rows)

        greedy = torch.tensor([r.params.greedy for r in rows])
        sampled = logits.argmax(-1)
        if not bool(greedy.all()):
            s = (~greedy).nonzero().squeeze(1)
            sampled[s] = self._sample(logits[s], [rows[i] for i in s.tolist()])
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
