"""AsyncEngine alone, over a fake LLMEngine (no model): threading, abort paths, fault isolation, metrics.
Fast; the live-server tests with the real model are in test_server.py."""

from __future__ import annotations

import asyncio
import gc
import random
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import fresh_seed, wait_until

from pagedllm.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams


class FakeEngine:
    """Each step appends token (prompt_sum + step) % 1000 to every request; asserts single-threaded use."""

    model_name = "fake"
    max_model_len = 128
    tokenizer = None

    def __init__(self, step_time: float = 0.002) -> None:
        self.requests: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self.aborted: list[str] = []
        self.owner: threading.Thread | None = None
        self.step_time = step_time
        self.fail_step_once = False
        self.poison: set[str] = set()

    def _check_thread(self) -> None:
        self.owner = self.owner or threading.current_thread()
        assert threading.current_thread() is self.owner, "engine touched from two threads"

    def add_request(self, request_id, prompt, params, *, cache_salt=None, arrival_time=None, priority=0) -> None:
        self._check_thread()
        ids = [ord(c) for c in prompt] if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens, max_model_len={self.max_model_len}")
        self.requests[request_id] = (ids, params, [])

    def step(self) -> list[RequestOutput]:
        self._check_thread()
        time.sleep(self.step_time)
        if self.fail_step_once:
            self.fail_step_once = False
            raise RuntimeError("injected step fault")
        outs = []
        for rid, (ids, params, gen) in list(self.requests.items()):
            gen.append((sum(ids) + len(gen)) % 1000)
            done = len(gen) >= params.max_tokens
            error = "RuntimeError: poisoned" if rid in self.poison else None
            outs.append(RequestOutput(rid, None, ids, [CompletionOutput(0, " ".join(map(str, gen)), gen,
                                                                        finish_reason="length" if done else None)],
                                      finished=done or error is not None, error=error))
            if done or error:
                del self.requests[rid]
        return outs

    def abort_request(self, request_id: str) -> None:
        self._check_thread()
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        self._check_thread()
        return bool(self.requests)

    def num_running(self) -> int:
        return len(self.requests)

    def num_waiting(self) -> int:
        return 0

    def kv_cache_stats(self) -> dict:
        self._check_thread()
        used = len(self.requests)
        return {"num_blocks": 100, "num_free_blocks": 100 - used, "block_size": 16, "prefix_cache_queries": 7,
                "prefix_cache_hits": 3, "num_preemptions": 0}


def expected_tokens(prompt: str, n: int) -> list[int]:
    s = sum(ord(c) for c in prompt)
    return [(s + i) % 1000 for i in range(n)]


@pytest.fixture
def engine():
    fake = FakeEngine()
    eng = AsyncEngine(fake)
    eng.start()
    yield eng
    eng.shutdown()


def samples(eng: AsyncEngine) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(eng.metrics.render().decode())
            for s in f.samples}


def test_concurrent_generate_and_metrics(engine):
    rng = random.Random(fresh_seed())
    prompts = ["".join(rng.choices("abcdefgh", k=rng.randint(1, 20))) for _ in range(32)]
    lens = [rng.randint(1, 12) for _ in prompts]

    async def one(p, n):
        outs = [o async for o in engine.generate(p, SamplingParams(max_tokens=n))]
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        return outs[-1].outputs[0].token_ids

    async def main():
        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lens, strict=True)))

    assert asyncio.run(main()) == [expected_tokens(p, n) for p, n in zip(prompts, lens, strict=True)]
    m = samples(engine)
    assert m["pagedllm_generation_tokens_total"] == sum(lens)
    assert m["pagedllm_prompt_tokens_total"] == sum(len(p) for p in prompts)
    assert m["pagedllm_time_to_first_token_seconds_count"] == len(prompts)
    # one gap per token after the first, unless outputs of several steps were observed at once (never here:
    # the loop records each step's outputs as they come)
    assert m["pagedllm_inter_token_latency_seconds_count"] == sum(lens) - len(prompts)
    # the gauges follow the loop's stats refresh (every 50 ms, and once idle), not the outputs
    m = wait_until(lambda: (g := samples(engine))["pagedllm_num_requests_running"] == 0
                   and g["pagedllm_kv_cache_usage_ratio"] == 0 and g, "the gauges to show an idle engine")
    assert m["pagedllm_prefix_cache_queries_total"] == 7 and m["pagedllm_prefix_cache_hits_total"] == 3


def test_cancelled_consumer_aborts(engine):
    async def main():
        async def consume():
            async for _ in engine.generate("long", SamplingParams(max_tokens=10_000), request_id="r-cancel"):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await engine.call(lambda e: (list(e.aborted), e.has_unfinished_requests()))

    aborted, busy = asyncio.run(main())
    assert aborted == ["r-cancel"] and not busy


def test_abandoned_stream_is_aborted(engine):
    async def main():
        stream = await engine.add_request("x", SamplingParams(max_tokens=10_000), request_id="r-drop")
        del stream
        gc.collect()
        await asyncio.sleep(0.05)
        return await engine.call(lambda e: (list(e.aborted), e.has_unfinished_requests()))

    assert asyncio.run(main()) == (["r-drop"], False)


def test_rejected_add_and_faults_fail_only_their_request(engine):
    fake: FakeEngine = engine.engine

    async def run(prompt, n=5, rid=None):
        return [o async for o in engine.generate(prompt, SamplingParams(max_tokens=n), request_id=rid)][-1]

    async def main():
        with pytest.raises(ValueError, match="prompt"):
            await run("")
        with pytest.raises(ValueError, match="max_model_len"):
            await run("y" * 500)
        fake.poison.add("bad")
        good, bad = await asyncio.gather(run("good", 30), run("b", 30, rid="bad"), return_exceptions=True)
        assert isinstance(bad, RequestFailedError) and "poisoned" in str(bad)
        assert good.outputs[0].token_ids == expected_tokens("good", 30)
        # a failing step fails the requests in flight; the loop goes on for the next ones
        task = asyncio.create_task(run("victim", 1000))
        await asyncio.sleep(0.02)
        fake.fail_step_once = True
        with pytest.raises(RequestFailedError, match="injected step fault"):
            await task
        assert (await run("after", 4)).outputs[0].token_ids == expected_tokens("after", 4)
        return await engine.call(lambda e: e.has_unfinished_requests())

    assert asyncio.run(main()) is False
    assert engine.is_running


def test_shutdown_fails_in_flight_and_rejects_new():
    eng = AsyncEngine(FakeEngine())
    eng.start()

    async def main():
        task = asyncio.create_task(_drain(eng.generate("z", SamplingParams(max_tokens=100_000))))
        await asyncio.sleep(0.05)
        await asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
        with pytest.raises(EngineDeadError):
            await task
        with pytest.raises(EngineDeadError):
            await eng.add_request("z", SamplingParams())

    asyncio.run(main())
    assert not eng.is_running


async def _drain(gen) -> None:
    async for _ in gen:
        pass


def test_idle_loop_does_not_spin():
    fake = FakeEngine()
    eng = AsyncEngine(fake)
    turns = [0]
    has_unfinished = fake.has_unfinished_requests

    def counted() -> bool:  # called once per turn of the loop
        turns[0] += 1
        return has_unfinished()

    fake.has_unfinished_requests = counted
    eng.start()
    try:
        # Count the loop's turns, not CPU time (other threads and other processes share it): an idle loop waits
        # 0.5 s a turn, a spinning one turns thousands of times; a slow machine makes fewer turns, never more.
        t0, n0 = time.monotonic(), turns[0]
        time.sleep(0.5)
        elapsed, n = time.monotonic() - t0, turns[0] - n0
        assert n <= 2 + 2 * elapsed / 0.5, f"the idle loop turned {n} times in {elapsed:.2f} s"
        assert eng.is_running
    finally:
        eng.shutdown()
