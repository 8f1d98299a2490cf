"""Data-parallel serving on Ray, end to end: two engine replicas (one thread each) behind one OpenAI endpoint,
the real `openai` client; prefix routing, a replica killed mid-stream, no leaked blocks. The replicas serve a
tiny random Llama (with a real BPE tokenizer and chat template): what is tested is the serving, and a small
model keeps the replicas' start and restart short on this busy 2-core machine."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import httpx
import pytest

os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
from live_server import LiveServer  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from tiny_models import fresh_seed, make_tiny_model  # noqa: E402

from pagedllm.distributed.args import DataParallelArgs  # noqa: E402
from pagedllm.distributed.client import DataParallelEngine  # noqa: E402
from pagedllm.engine.args import EngineArgs  # noqa: E402
from pagedllm.entrypoints.openai.server import build_app  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]  # replica start waits for any kernel build

API_KEY = "sk-dp-" + "".join(random.choices("abcdef0123456789", k=12))
BLOCK = 16
NUM_BLOCKS = 192
VOCAB_LOW, VOCAB_HIGH = 3, 300  # ordinary token ids of the tiny model's vocabulary (320)
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One small local Ray for the module, always shut down."""
    model = make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
    # On this shared machine Ray's own memory monitor kills workers when the whole node passes 95% of its
    # memory, whoever uses it; the replicas here are small, so let only the kernel decide.
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    from pagedllm.kernels.library import load_ops

    load_ops()  # build the C++ kernel here, once, rather than in two replicas at once
    ray.init(num_cpus=2, object_store_memory=80 << 20, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    dp = None
    try:
        dp = DataParallelEngine(
            EngineArgs(model=str(model), dtype="float32", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK,
                       max_model_len=MAX_MODEL_LEN),
            DataParallelArgs(data_parallel_size=2, threads=1, health_interval=0.2, max_restarts=2,
                             startup_timeout=600))
        yield dp
    finally:
        if dp is not None:
            dp.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with LiveServer(build_app(engine, api_key=API_KEY, served_model_name="smol")) as live:
        yield live


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def rng() -> random.Random:
    """Fresh prompts every run; the seed is printed, so a failure's captured output shows it."""
    return random.Random(fresh_seed())


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def replica_metric(server, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for s in fam.samples:
            if s.name == name:
                out[s.labels["replica"]] = out.get(s.labels["replica"], 0.0) + s.value
    return out


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (result := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return result


def test_both_replicas_serve_and_report(server, client, engine, rng):
    for _ in range(6):  # distinct prompts: no useful prefix, so least-loaded spreads them
        r = client.completions.create(model="smol", prompt=ids(rng, 40), max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})  # a random model may pick EOS first
        assert r.usage.completion_tokens == 3
    served = wait_for(lambda: (m := replica_metric(server, "pagedllm_prompt_tokens_total"))
                      and all(m.get(k, 0) > 0 for k in ("0", "1")) and m, 10, "both replicas' metrics")
    assert set(served) == {"0", "1"}
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and [r["healthy"] for r in health["replicas"]] == [True, True]
    assert len({r["pid"] for r in health["replicas"]}) == 2  # two processes
    # errors raised inside a replica come back as the single-process server's OpenAI errors
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model="smol", prompt=ids(rng, 600), max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_kv_map_and_prefix_reset_per_replica(server, client, rng):
    """/kv/snapshot?replica=i shows replica i's pool; POST /reset_prefix_cache empties every replica's cache."""
    for _ in range(4):  # full blocks on both replicas, cached once the requests finish
        client.completions.create(model="smol", prompt=ids(rng, 3 * BLOCK + 1), max_tokens=1)
    def snapshot(i: int) -> dict:
        r = httpx.get(server.url + f"/kv/snapshot?replica={i}")
        assert r.status_code == 200, r.text
        return r.json()

    snaps = [snapshot(0), snapshot(1)]
    assert [(s["replica"], s["replicas"], s["num_blocks"]) for s in snaps] == [(0, 2, NUM_BLOCKS), (1, 2, NUM_BLOCKS)]
    assert httpx.get(server.url + "/kv/snapshot?replica=2").status_code == 400
    r = httpx.post(server.url + "/reset_prefix_cache", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200 and r.json() == {"reset": True}
    for i in (0, 1):
        assert snapshot(i)["stats"]["num_cached_blocks"] == 0


def test_prefix_family_hits_the_cache(client, rng):
    shared = ids(rng, 6 * BLOCK + 5)  # 6 full blocks shared by the family
    hits = []
    for _ in range(20):
        r = client.completions.create(model="smol", prompt=shared + ids(rng, 12), max_tokens=2, temperature=0)
        hits.append(r.usage.prompt_tokens_details.cached_tokens >= 6 * BLOCK)
    assert sum(hits) >= 0.9 * len(hits), hits  # only the family's first request may miss


def test_conversation_turns_hit_under_prefix_routing_not_round_robin(client, engine, rng):
    """Each turn's prompt extends the previous one: with prefix routing it lands where the previous turn's
    blocks are cached; round-robin sends it to the other replica, which only has the turn before that."""
    from pagedllm.distributed.routing import make_policy

    covered = {}
    try:
        for name in ("round-robin", "prefix"):
            engine.policy = make_policy(name, 2, BLOCK)
            prompt, previous_blocks, covered[name] = ids(rng, 2 * BLOCK), None, 0
            for _ in range(8):
                r = client.completions.create(model="smol", prompt=prompt, max_tokens=2, temperature=0)
                # covered: every full block of the previous turn's prompt came from the cache
                if previous_blocks is not None:
                    covered[name] += r.usage.prompt_tokens_details.cached_tokens >= previous_blocks
                previous_blocks = len(prompt) // BLOCK * BLOCK
                prompt = prompt + ids(rng, BLOCK + 8)  # the reply and the next user message
    finally:
        engine.policy = make_policy("prefix", 2, BLOCK, table_blocks=NUM_BLOCKS)
    assert covered["prefix"] >= 0.9 * 7, covered
    assert covered["round-robin"] <= 0.5 * 7, covered


def test_chat_stream_and_n(client):
    chunks = list(client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Say hi."}], max_tokens=5, temperature=0,
        stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    r = client.completions.create(model="smol", prompt="Once upon a time", max_tokens=4, n=2, temperature=1.0,
                                  seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1]


def test_killed_replica_fails_only_its_requests_and_comes_back(server, engine, rng):
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    first_chunk = [asyncio.Event() for _ in range(4)]
    ids_seen: list[str | None] = [None] * 4

    async def one(i: int) -> tuple[str, str]:
        stream = await aclient.completions.create(model="smol", prompt=ids(rng, 30), max_tokens=460,
                                                  temperature=0, stream=True, extra_body={"ignore_eos": True})
        text = ""
        try:
            async for chunk in stream:
                ids_seen[i] = chunk.id
                first_chunk[i].set()
                text += chunk.choices[0].text if chunk.choices else ""
        except openai.APIError as e:
            first_chunk[i].set()
            return "error", str(e)
        return "ok", text

    async def main():
        tasks = [asyncio.create_task(one(i)) for i in range(4)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first_chunk)), 120)
        where = {rid: r.index for r in engine.replicas for rid in r.in_flight}
        os.kill(engine.replicas[0].pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 180)
        return where, results

    old_pid = engine.replicas[0].pid
    where, results = asyncio.run(main())
    assert sorted(where.values()) == [0, 0, 1, 1], where  # least-loaded put two on each
    for rid, (status, detail) in zip(ids_seen, results, strict=True):
        if where[rid] == 0:
            assert status == "error" and "replica 0 died" in detail, (status, detail)
        else:
            assert status == "ok", detail
    # new requests go to the survivor at once
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    t0 = time.monotonic()
    for _ in range(3):
        r = client.completions.create(model="smol", prompt=ids(rng, 20), max_tokens=2, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 2
    assert time.monotonic() - t0 < 60
    health = httpx.get(server.url + "/health").json()
    assert health["replicas"][1]["healthy"]
    # Ray restarts the replica; the router takes it back
    back = wait_for(lambda: (h := httpx.get(server.url + "/health").json()["replicas"][0])["healthy"] and h,
                    600, "replica 0 to come back")
    assert back["restarts"] == 1 and back["pid"] not in (old_pid, None)
    for _ in range(4):
        client.completions.create(model="smol", prompt=ids(rng, 20), max_tokens=2, temperature=0)
    wait_for(lambda: replica_metric(server, "pagedllm_prompt_tokens_total").get("0", 0) > 0, 10,
             "the restarted replica to serve")


def test_disconnect_aborts_and_no_leaked_blocks(server, engine, rng):
    with httpx.stream("POST", server.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": "smol", "prompt": ids(rng, 40), "max_tokens": 200, "ignore_eos": True,
                            "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one token, then hang up

    def idle():
        stats = asyncio.run(engine.replica_kv_stats())
        return all(s is not None and s["num_free_blocks"] == s["num_blocks"] for s in stats) and stats

    stats = wait_for(idle, 60, "both replicas to free every block")
    assert len(stats) == 2 and all(not r.in_flight for r in engine.replicas)


def test_serve_cli_has_dp_flags():
    from pagedllm.cli import build_parser

    a = build_parser().parse_args(["serve", "--data-parallel-size", "2", "--ray-address", "auto", "--threads", "1"])
    dp = DataParallelArgs.from_cli_args(a)
    assert dp.enabled and dp.data_parallel_size == 2 and dp.threads_per_replica == 1
    assert not DataParallelArgs.from_cli_args(build_parser().parse_args(["serve"])).enabled

