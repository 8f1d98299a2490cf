"""Draft-model proposer: a second, smaller model with the target's tokenizer, run ahead k greedy tokens for each
speculating request, on its own KV pool and scheduler with the same schedule -> execute -> update step as the
engine (core/step.py).

Each proposal round adds one greedy request per speculating target request (its prompt: the target's tokens; its
max_tokens: k) and steps until they end. The draft pool's prefix cache keeps the K/V of the blocks whose tokens
the target kept, so a round recomputes only the tokens since the last full block it shares with the previous
one; blocks holding drafts the target rejected are never hit again.

The draft runs in the engine's kernel mode (EngineArgs.batch_invariant): the target's verification decides every
output token, so the draft's mode changes only which tokens are proposed, hence acceptance and speed. Following
the engine keeps one setting: invariant, a request's drafts (and so its acceptance and step count) do not depend
on its batch; --no-batch-invariant, the draft takes the faster kernels too.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from pagedllm.model.loader import LoadedModel, load_model
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.model_runner import ModelRunner


class Where(Protocol):
    """What the draft takes of the target's placement (engine/placement.Placement)."""

    device: torch.device
    backend: Any
    quantization: str


_GREEDY = SamplingParams(temperature=0.0)


class DraftModelProposer:
    def __init__(self, path: str, dtype: str, num_blocks: int, block_size: int, attention_backend: str,
                 vocab_size: int, max_model_len: int, *, batch_invariant: bool = True,
                 placement: Where | None = None, loaded: LoadedModel | None = None) -> None:
        """placement: the target's device and attention backend, which the draft shares (None: the CPU, the
        backend by name); loaded: the draft model already loaded (a GPU's KV budget needs its size first)."""
        if loaded is None:
            loaded = load_model(path, dtype, load_tokenizer=False,
                                quantization="auto" if placement is None else placement.quantization)
        if placement is not None:
            loaded.model.to(placement.device)
        if loaded.config.vocab_size != vocab_size:
            raise ValueError(f"draft model {path} has a vocabulary of {loaded.config.vocab_size} tokens, the "
                             f"target {vocab_size}: a draft model must share the target's tokenizer")
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=max(2048, max_model_len),
                                                   max_model_len=max_model_len), self.kv)
        self.runner = ModelRunner(loaded.model, loaded.config, num_blocks=num_blocks, block_size=block_size,
                                  kv_dtype=loaded.dtype, batch_invariant=batch_invariant,
                                  attention_backend=attention_backend if placement is None else placement.backend,
                                  device="cpu" if placement is None else placement.device)

    def retain(self, live_ids: set[str]) -> None:
        pass  # nothing is kept between rounds but the draft pool's prefix cache

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Each target's k greedy draft tokens by request id ([] where the draft pool could not finish them)."""
        drafts: dict[str, Request] = {}
        for target, k in wanted:
            req = Request(target.request_id, list(target.all_token_ids), sampling_params=_GREEDY, max_tokens=k)
            try:
                self.scheduler.add_request(req)
            except ValueError:  # longer than the draft pool holds: no drafts for it
                continue
            drafts[target.request_id] = req
        while self.scheduler.running or self.scheduler.waiting:
            out = self.scheduler.schedule()
            if out.is_empty:  # the draft pool cannot hold them all: the rest go without drafts this step
                break
            sampled = self.runner.execute(out.scheduled, out.block_copies).sampled
            self.scheduler.update_from_output(out, sampled)
        self.scheduler.finish_requests(list(self.scheduler.running) + list(self.scheduler.waiting),
                                       RequestStatus.FINISHED_ABORTED)
        return {target.request_id: _finished_drafts(drafts.get(target.request_id)) for target, _ in wanted}


def _finished_drafts(req: Request | None) -> list[int]:
    """A draft request's tokens if it ran to its k ([] if it was not added or the pool stopped it short)."""
    return list(req.output_token_ids) if req is not None and req.status == RequestStatus.FINISHED_LENGTH else []
