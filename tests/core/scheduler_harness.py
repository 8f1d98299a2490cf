"""The scheduler's test driver, for test_scheduler.py and test_scheduler_policy.py: a scheduler over a bare
KVCacheManager, a stand-in for the model runner that checks every step, and the leak check. No model and no torch
(test_scheduler.py holds that)."""

from __future__ import annotations

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedllm.core.step import SamplerOutput


def create_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 16,
                     max_num_batched_tokens: int = 64, max_model_len: int = 128, chunked: bool = True,
                     watermark: float = 0.01, prefix_caching: bool = True, prefill_order: str = "fcfs",
                     policy: str = "fcfs") -> Scheduler:
    """(Arrival-order prefill by default: test_scheduler.py's scenarios spell out which prompt gets the budget;
    the shortest-first order has its own tests in test_scheduler_policy.py.)"""
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching, max_model_len=max_model_len)
    return Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, chunked, watermark,
                                     policy=policy, prefill_order=prefill_order), kv)


class Driver:
    """Plays the model runner: runs steps, 'samples' the first `accept` drafts then token = position
    (deterministic); the scheduler finishes each request at its max_tokens."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.finished: list[Request] = []

    def add(self, req: Request, max_tokens: int | None) -> int:
        req.max_tokens = self.sched.check_fits(req.num_prompt_tokens, max_tokens)
        self.sched.add_request(req)
        return req.max_tokens

    def step(self, accept: int = 0, prefill_budget: int | None = None) -> SchedulerOutput:
        out = self.sched.schedule(prefill_budget)
        check_step(self.sched, out)
        rows = []
        for s in out.scheduled:
            drafts = s.draft_token_ids
            k = min(accept, len(drafts))
            position = s.request.num_tokens + k  # a token id no draft holds (drafts are small ids in these tests)
            rows += [drafts[j] if j < k else position for j in range(s.num_rows)]
        for u in self.sched.update_from_output(out, SamplerOutput(rows)):
            if u.finished:
                self.finished.append(u.request)
        return out

    def run(self, max_steps: int = 10_000) -> int:
        steps = 0
        while self.sched.running or self.sched.waiting:
            out = self.step()
            assert not out.is_empty, "no progress: the scheduler scheduled nothing with requests pending"
            steps += 1
            assert steps < max_steps
        return steps


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    cfg = sched.config
    assert sum(s.num_new_tokens for s in out.scheduled) <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    for s in out.scheduled:
        req = s.request
        assert req.status == RequestStatus.RUNNING
        assert 0 < s.num_new_tokens - s.num_draft_tokens <= req.num_tokens - req.num_computed_tokens
        table = sched.kv.get_block_ids(req)
        assert len(table) * sched.kv.block_size >= req.num_computed_tokens + s.num_new_tokens


def assert_no_leaks(sched: Scheduler) -> None:
    kv = sched.kv
    assert not sched.running and not sched.waiting
    assert kv.num_free_blocks() == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    s = kv.stats()
    assert s["used_slots"] == s["logical_slots"] == 0
