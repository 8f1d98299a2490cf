"""The scheduler's policy for the first token, without a model: prompts closest to done get each step's prefill
budget first, decodes run every step, a passed-over prompt is served once the work done since it arrived makes up
its extra length, and the
priority policy serves lower priority values first. (Liveness under every policy and budget is the property test
in test_scheduler.py.)"""

from __future__ import annotations

import random

import pytest
from scheduler_harness import Driver, assert_no_leaks, create_scheduler

from pagedllm.core.request import Request


def burst(seed: int, n: int = 8) -> list[Request]:
    """n prompts of random lengths arriving together (seeded: the seed is in the test id)."""
    rng = random.Random(seed)
    return [Request(f"b{i}", [i * 1000 + t for t in range(rng.randint(3, 60))], arrival_time=float(i))
            for i in range(n)]


def first_token_steps(order: str, requests: list[Request], budget: int) -> dict[str, int]:
    sched = create_scheduler(num_blocks=400, max_num_batched_tokens=64, prefill_order=order)
    d = Driver(sched)
    for r in requests:
        d.add(r, 4)
    first: dict[str, int] = {}
    step = 0
    while sched.running or sched.waiting:
        out = d.step(prefill_budget=budget)
        step += 1
        for s in out.scheduled:
            if s.samples:
                first.setdefault(s.request.request_id, step)
    assert_no_leaks(sched)
    return first


@pytest.mark.parametrize("seed", range(5))
def test_shortest_prompts_get_their_first_token_first(seed):
    requests = burst(seed)
    by_length = sorted(requests, key=lambda r: (r.num_prompt_tokens, r.arrival_time))
    shortest = first_token_steps("shortest", burst(seed), budget=16)
    fcfs = first_token_steps("fcfs", burst(seed), budget=16)
    order = [r.request_id for r in by_length]
    assert [shortest[rid] for rid in order] == sorted(shortest[rid] for rid in order), (seed, shortest)
    assert [fcfs[r.request_id] for r in requests] == sorted(fcfs.values()), (seed, fcfs)  # arrival order
    assert sum(shortest.values()) <= sum(fcfs.values()), (seed, shortest, fcfs)  # the mean TTFT, in steps


def test_decodes_run_every_step_while_prompts_wait():
    sched = create_scheduler(num_blocks=400, max_num_batched_tokens=64, prefill_order="shortest")
    d = Driver(sched)
    decoding = [Request(f"d{i}", [i * 100 + t for t in range(5)]) for i in range(3)]
    for r in decoding:
        d.add(r, 30)
    d.step()  # their prompts
    for i in range(6):
        d.add(Request(f"p{i}", [5000 + i * 100 + t for t in range(50)]), 2)
    for _ in range(12):
        prompting = {r.request_id for r in [*sched.running, *sched.waiting] if not r.output_token_ids}
        out = d.step(prefill_budget=8)
        scheduled = {s.request.request_id: s for s in out.scheduled}
        assert all(r.request_id in scheduled and scheduled[r.request_id].samples for r in decoding)  # one token each
        assert sum(s.num_new_tokens for s in out.scheduled if s.request.request_id in prompting) <= 8
    d.run()
    assert_no_leaks(sched)


@pytest.mark.parametrize("short", [1, 6, 13])
def test_a_long_prompt_is_not_starved_by_a_stream_of_short_ones(short):
    """Shorter prompts keep arriving, one per step, each filling the step's budget: the long one waits only until
    the work done since it arrived makes up the difference in length, and then every newcomer waits for it."""
    sched = create_scheduler(num_blocks=400, max_num_batched_tokens=64, prefill_order="shortest")
    d = Driver(sched)
    long_req = Request("long", list(range(40)))
    d.add(long_req, 2)
    steps_with_long = []
    for step in range(60):
        d.add(Request(f"s{step}", [9000 + step * 100 + t for t in range(short)]), 1)  # always a shorter prompt
        out = d.step(prefill_budget=short)
        if any(s.request is long_req and s.num_new_tokens for s in out.scheduled):
            steps_with_long.append(step)
    first = -(-(40 - short) // short)  # the first step at which 40 - step x short < short
    assert steps_with_long[0] == first
    assert steps_with_long == list(range(first, first + len(steps_with_long)))  # then every step until done
    d.run()
    assert long_req.num_output_tokens == 2
    assert_no_leaks(sched)


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_priority_policy_serves_lower_values_first(policy):
    sched = create_scheduler(num_blocks=400, max_num_batched_tokens=64, max_num_seqs=1, policy=policy)
    d = Driver(sched)
    reqs = [Request(f"r{i}", [i * 100 + t for t in range(8)], priority=p, arrival_time=float(i))
            for i, p in enumerate([3, 1, 2, 0])]
    for r in reqs:
        d.add(r, 1)
    d.run()
    done = [r.request_id for r in d.finished]
    assert done == (["r3", "r1", "r2", "r0"] if policy == "priority" else ["r0", "r1", "r2", "r3"])
    assert_no_leaks(sched)


def test_prefill_budget_is_ignored_without_chunked_prefill():
    """A whole prompt must fit one step when chunking is off: a smaller budget would never admit it."""
    sched = create_scheduler(num_blocks=400, max_num_batched_tokens=64, chunked=False, prefill_order="shortest")
    d = Driver(sched)
    d.add(Request("whole", list(range(40))), 2)
    out = d.step(prefill_budget=4)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("whole", 40)]
    d.run()
    assert_no_leaks(sched)


# ---- the step budget (engine/step_budget.py), on synthetic step costs ------------------------------------------
def test_step_budget_learns_the_costs_and_sizes_steps_for_the_target():
    from pagedllm.engine.step_budget import StepBudget

    rng = random.Random(9)
    a, b, c = 0.030, 0.004, 0.002  # step seconds = a + b x decode rows + c x prompt tokens (with noise)
    budget = StepBudget("auto", 2048, idle_target_s=0.5)
    assert budget.prompt_budget(0) == 256  # nothing measured yet
    for _ in range(200):
        rows, tokens = rng.randint(1, 32), rng.choice([0, 0, rng.randint(16, 600)])
        budget.observe(tokens, rows, (a + b * rows + c * tokens) * rng.uniform(0.97, 1.03))
    decode_s = a + b * 16
    # with 16 decoding: 1.75 decode steps, so prompt tokens may take 0.75 of one
    assert abs(budget.prompt_budget(16) - 0.75 * decode_s / c) <= 0.1 * 0.75 * decode_s / c
    # with 8 of 16 streams decoding (the rest waiting on their prompts): 1.75 steps of all 16
    assert abs(budget.prompt_budget(8, 16) - (1.75 * decode_s - (a + b * 8)) / c) <= 0.1 * decode_s / c
    assert abs(budget.prompt_budget(0) - 0.5 / c) <= 0.1 * 0.5 / c  # idle: the idle target
    fixed = StepBudget(100.0, 2048)
    for _ in range(50):
        fixed.observe(200, 0, 200 * c)
    assert abs(fixed.prompt_budget(0) - 0.1 / c) <= 2
    assert StepBudget("off", 2048).prompt_budget(8) is None
    tiny = StepBudget(1.0, 2048)  # a target below one token: still min_tokens, so prompts progress
    tiny.observe(100, 0, 1.0)
    assert tiny.prompt_budget(0) == 16


def test_step_budget_keeps_prompt_chunks_whole_under_a_mixture_of_experts():
    """A closed loop of 16 streams (prompts of 100-450 tokens, then 128 decode steps) on an MoE's step costs: the
    experts the step's rows pick are read whole (so prompt tokens cost a fixed part beside decode rows), per-token
    compute, a head row per decode row; after a warm-up of 2-row decode steps (the first requests), as a server
    starts. Sized from the average cost per prompt token and a decode fit that the rare decode-only steps under load
    left at the warm-up's rows, and a target from the rows decoding now (fewer while prompts wait), the chunks fell
    to min_tokens and half the streams waited on their prompts (as Qwen3-30B-A3B's shape did in the server). The
    budget keeps chunks several times that, nearly every stream decoding, and each step within twice a 16-row
    decode step."""
    from pagedllm.engine.step_budget import StepBudget

    def cost(decode_rows: int, prompt_tokens: int) -> float:
        rows = decode_rows + prompt_tokens
        return 0.02 + 0.075 * (1 - (1 - 8 / 128) ** rows) + 0.0012 * prompt_tokens + 0.002 * decode_rows

    rng = random.Random(5)
    budget = StepBudget("auto", 2048, idle_target_s=0.5)
    for _ in range(130):
        budget.observe(0, 2, cost(2, 0) * rng.uniform(0.97, 1.03))
    streams = [[rng.randint(100, 450), 128] for _ in range(16)]  # [prompt tokens left, tokens to decode]
    chunks, decoding, steps = [], [], []
    for _ in range(2500):
        rows = sum(1 for s in streams if s[0] == 0)
        allowed = left = budget.prompt_budget(rows, len(streams))
        for s in sorted(streams, key=lambda s: s[0]):  # (shortest prompt first)
            take = min(s[0], left)
            s[0], left = s[0] - take, left - take
        tokens = allowed - left
        seconds = cost(rows, tokens)
        budget.observe(tokens, rows, seconds * rng.uniform(0.97, 1.03))
        for i, s in enumerate(streams):
            if s[0] == 0 and rows:
                s[1] -= 1
                if s[1] == 0:
                    streams[i] = [rng.randint(100, 450), 128]
        chunks += [tokens] if tokens else []
        decoding.append(rows)
        steps.append(seconds)
    assert sorted(chunks)[len(chunks) // 2] >= 2 * budget.min_tokens
    assert sum(decoding) / len(decoding) >= 14
    assert sorted(steps)[int(0.99 * len(steps))] <= 2 * cost(16, 0)
    dense = StepBudget("auto", 2048)  # a cost linear in the prompt tokens: no fixed part learned
    for _ in range(200):
        tokens = rng.choice([0, rng.randint(16, 300)])
        dense.observe(tokens, 16, (0.03 + 0.004 * 16 + 0.0015 * tokens) * rng.uniform(0.97, 1.03))
    fixed, per_token = dense.prompt_cost()
    assert fixed <= 0.005 and abs(per_token - 0.0015) <= 0.1 * 0.0015
