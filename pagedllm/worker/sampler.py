"""Batched sampling: penalties, temperature, top-k / top-p / min-p, seeded draws, logprobs.

Every step is a tensor op over the whole batch; the only per-row Python is the uniform of rows that carry their
own seed (a few integer operations per row, never a loop over the vocabulary). Temperature, min-p,
top-k, top-p and the draw run in the C++ sampler (kernels/csrc/sampler.cpp: a radix select on the probabilities instead of
a sort, so a wide top-p nucleus costs the same as a narrow one), or, where it is not built, in torch by sorting.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.core.step import SamplerOutput
from pagedllm.kernels import kernel_op
from pagedllm.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    seed: int | None  # the sample's own seed (the request's seed + sample index), when it has one


@dataclass
class TokenBitmask:
    """Structured outputs: the tokens some rows may take next. Bit t % 32 of word t // 32 of a row's mask set =
    token t allowed (the packed layout grammar libraries fill)."""

    rows: list[int]  # rows of the batch the masks apply to, in order
    bitmask: np.ndarray  # int32 [len(rows), ceil(vocab / 32)]


def apply_token_bitmask(logits: torch.Tensor, mask: TokenBitmask) -> None:
    """-inf for the tokens each constrained row may not take, in place: the packed bits go to the logits' device
    as they are (a GPU unpacks them there: 32x fewer bytes over the bus), one unpack and one masked fill over those
    rows (the other rows are not touched)."""
    device = logits.device
    token = torch.arange(logits.shape[1], device=device)
    words = torch.from_numpy(np.ascontiguousarray(mask.bitmask)).to(device)
    allowed = (words[:, token // 32] >> (token % 32)) & 1
    rows = torch.tensor(mask.rows, dtype=torch.int64).to(device)
    with torch.inference_mode():  # the logits may be the runner's (inference-mode) buffer
        logits[rows] = logits[rows].masked_fill_(allowed == 0, float("-inf"))


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
    """Presence, frequency and repetition penalties; the logits untouched (no tensor op) where no row has any."""
    counted = any(r.params.presence_penalty or r.params.frequency_penalty for r in rows)
    repeated = any(r.params.repetition_penalty != 1.0 for r in rows)
    vocab = logits.shape[1]
    if counted:
        presence = torch.tensor([r.params.presence_penalty for r in rows], dtype=logits.dtype).to(logits.device)
        frequency = torch.tensor([r.params.frequency_penalty for r in rows], dtype=logits.dtype).to(logits.device)
        counts = _token_mask([r.output_token_ids for r in rows], vocab, logits.device)
        logits = logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)
    if repeated:
        repetition = torch.tensor([r.params.repetition_penalty for r in rows], dtype=logits.dtype).to(logits.device)
        seen = _token_mask([r.prompt_token_ids + r.output_token_ids for r in rows], vocab, logits.device) > 0
        rp = repetition[:, None]
        penalised = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(seen, penalised, logits)
    return logits


def _has_rules(p: SamplingParams) -> bool:
    return bool(p.logit_bias or p.allowed_token_ids or p.bad_words_token_ids or p.min_tokens)


def _banned_tokens(r: SamplingRow) -> list[int]:
    """Tokens this row may not sample now: EOS / stop ids before min_tokens, the last token of a bad word
    whose other tokens were just generated."""
    p, out = r.params, r.output_token_ids
    banned = []
    if len(out) < p.min_tokens:
        banned += p.stop_token_ids
        if not p.ignore_eos:
            banned += p.eos_token_ids
    for word in p.bad_words_token_ids:
        head = word[:-1]
        if len(out) >= len(head) and (not head or out[len(out) - len(head):] == head):
            banned.append(word[-1])
    return banned


def apply_logit_rules(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """logit_bias, allowed_token_ids, bad_words and min_tokens, row by row for the rows that have any (a few
    index ops each, never a loop over the vocabulary)."""
    if not any(_has_rules(r.params) for r in rows):
        return logits
    logits = logits.clone()
    for i, r in enumerate(rows):
        p = r.params
        if not _has_rules(p):
            continue
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.int64).to(logits.device)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype).clamp_(-100.0, 100.0)
            logits[i].index_add_(0, ids, bias.to(logits.device))
        if p.allowed_token_ids:
            keep = torch.tensor(p.allowed_token_ids, dtype=torch.int64).to(logits.device)
            allowed = logits[i, keep]
            logits[i] = float("-inf")
            logits[i, keep] = allowed
        banned = _banned_tokens(r)
        if banned:
            logits[i, torch.tensor(banned, dtype=torch.int64).to(logits.device)] = float("-inf")
    return logits


_MASK64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers that scatters nearby inputs."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) a seeded sample draws for its output token number `position`. A function of the pair,
    not the state of a generator: the token at a position does not depend on how the request's tokens were grouped
    into steps (speculative drafts verified and rejected, a preemption and its recompute), so a seeded request
    gives the same text with or without speculation."""
    z = _mix64((_mix64(seed & _MASK64) + 0x9E3779B97F4A7C15 * (position + 1)) & _MASK64)
    return (z >> 11) * 2.0 ** -53


def _draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one uniform per row picks the token whose cumulative mass first exceeds it.
    (One cumsum and one search per row: torch.multinomial and exponential noise do more work per row over a
    large vocabulary; the sampling rows of `pagedllm bench engine` measure a step's sampling cost.)"""
    cdf = probs.cumsum(-1)
    target = (uniforms.to(cdf.dtype) * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def sample_by_sorting(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                      uniforms: torch.Tensor) -> torch.Tensor:
    """min-p, then top-k, then top-p over what they kept (vLLM's order), by sorting each row: the plain
    definition, used where the C++ sampler is not built or runs not (a GPU). The kept tokens are drawn from in
    vocabulary order, as the C++ sampler draws: the same uniform picks the same token in both."""
    probs = torch.where(probs >= min_p[:, None] * probs.amax(-1, keepdim=True), probs, 0.0)
    p, ids = probs.sort(-1, descending=True)
    ranks = torch.arange(p.shape[1], device=p.device)[None, :]
    p = p.masked_fill((top_k[:, None] > 0) & (ranks >= top_k[:, None]), 0.0)
    before = p.cumsum(-1) - p  # mass of the more likely tokens
    p = torch.where(before < top_p[:, None] * p.sum(-1, keepdim=True), p, 0.0)
    return _draw(torch.zeros_like(probs).scatter_(1, ids, p), uniforms)


class Sampler:
    def __init__(self, seed: int = 0, use_kernel: bool = True) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.use_kernel = use_kernel

    def _uniforms(self, rows: list[SamplingRow]) -> torch.Tensor:
        """One uniform per row: the sampler's generator, or for a seeded row seeded_uniform(seed, position)."""
        u = torch.rand(len(rows), generator=self.generator, dtype=torch.float64)
        for i, r in enumerate(rows):
            if r.seed is not None:
                u[i] = seeded_uniform(r.seed, len(r.output_token_ids))
        return u

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy tokens: the C++ argmax (rows in parallel) where it is built, else torch's."""
        kernel = kernel_op("argmax_rows") if self.use_kernel else None
        return kernel(logits.contiguous()) if kernel is not None else logits.argmax(-1)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        vocab = logits.shape[1]
        temperature = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype)
        top_k = torch.tensor([r.params.top_k if r.params.top_k < vocab else 0 for r in rows], dtype=torch.int64)
        top_p = torch.tensor([r.params.top_p for r in rows], dtype=torch.float32)
        min_p = torch.tensor([r.params.min_p for r in rows], dtype=torch.float32)
        uniforms = self._uniforms(rows)  # drawn on the host whatever the device: the same draws everywhere
        kernel = kernel_op("sample_from_logits") if self.use_kernel else None
        if kernel is not None:
            return kernel(logits.contiguous(), temperature, top_k, top_p, min_p, uniforms)
        temperature, top_k, top_p, min_p, uniforms = (t.to(logits.device) for t in
                                                      (temperature, top_k, top_p, min_p, uniforms))
        return sample_by_sorting((logits / temperature[:, None]).softmax(-1), top_k, top_p, min_p, uniforms)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 token_bitmask: TokenBitmask | None = None) -> SamplerOutput:
        logits = logits.float()
        # Log-probabilities of the raw model output (before penalties and before a structured-outputs mask), only
        # when some request asked for them.
        want_logprobs = any(r.params.logprobs is not None for r in rows)
        raw_logprobs = logits.log_softmax(-1) if want_logprobs else None
        logits = apply_penalties(apply_logit_rules(logits, rows), rows)
        if token_bitmask is not None and token_bitmask.rows:
            apply_token_bitmask(logits, token_bitmask)

        greedy = [r.params.greedy for r in rows]
        if all(greedy):
            sampled = self._argmax(logits)
        elif not any(greedy):
            sampled = self._sample(logits, rows)
        else:
            g = torch.tensor(greedy).to(logits.device)
            sampled = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
            sampled[g] = self._argmax(logits[g])
            s = (~g).nonzero().squeeze(1)
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
