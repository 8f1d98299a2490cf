"""prompt_logprobs: the log-probability of every prompt token given the tokens before it (plus the top k), taken
from the hidden states the model computes while prefilling. A request asking for them never takes prompt blocks
from the prefix cache (cached tokens are not recomputed, so they would have no logits: the engine salts it)."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.core.scheduler import ScheduledRequest
from pagedllm.core.step import PromptLogprobs


def prompt_logprobs(model: Any, hidden: torch.Tensor, scheduled: list[ScheduledRequest]) -> dict[str, PromptLogprobs]:
    """For each scheduled request whose sampling parameters ask for prompt_logprobs: the prompt positions this
    step computes (position p - 1's hidden state predicts token p). Before the scheduler advances
    num_computed_tokens. hidden: every new token's hidden state, in scheduled order."""
    found: dict[str, PromptLogprobs] = {}
    start = 0
    for s in scheduled:
        req, n = s.request, s.num_new_tokens
        k = getattr(req.sampling_params, "prompt_logprobs", None)
        c = req.num_computed_tokens
        last = min(c + n, req.num_prompt_tokens - 1)  # hidden rows c..last-1 predict prompt tokens c+1..last
        if k is not None and last > c:
            logprobs = model.compute_logits(hidden[start:start + last - c]).float().log_softmax(-1)
            targets = torch.tensor(req.prompt_token_ids[c + 1:last + 1], dtype=torch.int64).to(logprobs.device)
            chosen = logprobs.gather(1, targets[:, None]).squeeze(1)
            ranks = ((logprobs > chosen[:, None]).sum(-1) + 1).tolist()
            top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
            found[req.request_id] = PromptLogprobs(
                c + 1, targets.tolist(), chosen.tolist(), ranks,
                top_ids.tolist() if k else [[] for _ in ranks], top_vals.tolist() if k else [[] for _ in ranks])
        start += n
    return found
