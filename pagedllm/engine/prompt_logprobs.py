"""prompt_logprobs: the log-probability of every prompt token given the tokens before it (plus the top k), taken
from the hidden states the model computes while prefilling. A request asking for them never takes prompt blocks
from the prefix cache (cached tokens are not recomputed, so they would have no logits)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pagedllm.outputs import Logprob


def no_cache_salt(request_id: str, cache_salt: str | None) -> str:
    """A salt no other request shares: the prompt is computed in full."""
    return f"{cache_salt or ''}\x00prompt_logprobs\x00{request_id}"


def collect_prompt_logprobs(model: Any, hidden: torch.Tensor, scheduled: list, wanted: Callable[[Any], Any],
                            decode: Callable[[int], str]) -> None:
    """For each scheduled request whose `wanted(request)` returns (k, entries): fill entries[p] for the prompt
    positions p this step computes (position p - 1's hidden state predicts token p). Call before the scheduler
    advances num_computed_tokens."""
    start = 0
    for s in scheduled:
        req, n = s.request, s.num_new_tokens
        want = wanted(req)
        c = req.num_computed_tokens
        last = min(c + n, req.num_prompt_tokens - 1)  # hidden rows c..last-1 predict prompt tokens c+1..last
        if want is not None and last > c:
            k, entries = want
            logprobs = model.compute_logits(hidden[start:start + last - c]).float().log_softmax(-1)
            targets = torch.tensor(req.prompt_token_ids[c + 1:last + 1], dtype=torch.int64)
            chosen = logprobs.gather(1, targets[:, None]).squeeze(1)
            ranks = ((logprobs > chosen[:, None]).sum(-1) + 1).tolist()
            top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
            for i, (tid, lp) in enumerate(zip(targets.tolist(), chosen.tolist(), strict=True)):
                entry = {tid: Logprob(lp, ranks[i], decode(tid))}
                if k:
                    for rank, (t, v) in enumerate(zip(top_ids[i].tolist(), top_vals[i].tolist(), strict=True), 1):
                        entry.setdefault(t, Logprob(v, rank, decode(t)))
                entries[c + 1 + i] = entry
        start += n
