"""The disk tier through the real server (build_app + uvicorn, as `pagedllm serve --kv-disk-cache-dir`): a prefix
computed before a shutdown is a hit after the restart (same greedy text, cached_tokens counted), the operator sees
the tier in /metrics and /kv, and POST /reset_prefix_cache?reset_external=true empties it."""

from __future__ import annotations

import logging

import httpx
import pytest
from server_harness import API_KEY, LiveServer, assert_idle_no_leak, engine_state
from tiny_models import CORPUS, make_tiny_model

from pagedllm.engine.args import EngineArgs
from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.server import build_app

PROMPT = CORPUS[:600]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("disk_tier_model"), "llama", seed=5)


def serve(model_dir, disk_dir) -> tuple[LiveServer, AsyncEngine]:
    engine = AsyncEngine(LLMEngine.from_engine_args(EngineArgs(
        model=str(model_dir), dtype="float32", num_kv_blocks=256, block_size=16, max_model_len=1024, seed=0,
        kv_disk_cache_dir=str(disk_dir), kv_disk_cache_size="64MiB")))
    return LiveServer(build_app(engine, api_key=API_KEY, owns_engine=True)), engine


def complete(server: LiveServer) -> dict:
    r = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_restart_finds_the_prefix_on_disk(model_dir, tmp_path):
    server, engine = serve(model_dir, tmp_path)
    with server:
        first = complete(server)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert_idle_no_leak(engine)
    # the lifespan shut the engine down: its cached blocks were written on the way out
    server, engine = serve(model_dir, tmp_path)
    with server:
        second = complete(server)
        prompt_tokens = second["usage"]["prompt_tokens"]
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (prompt_tokens - 1) // 16 * 16 > 0
        assert engine_state(engine)["prefix_cache_disk_hits"] == cached
        metrics = httpx.get(server.url + "/metrics").text
        assert metric(metrics, 'pagedllm_prefix_cache_hits_by_tier_total{model_name') == cached
        assert 'tier="disk"' in metrics and metric(metrics, "pagedllm_kv_disk_store_bytes") > 0
        assert metric(metrics, "pagedllm_kv_disk_load_latency_seconds_count") == 1
        snap = httpx.get(server.url + "/kv/snapshot").json()
        assert snap["stats"]["kv_disk_store_blocks"] >= cached // 16
        assert "disk tier" in httpx.get(server.url + "/kv").text
        r = server.post("/reset_prefix_cache?reset_external=true", {})
        assert r.status_code == 200 and r.json() == {"reset": True}
        assert engine_state(engine)["kv_disk_store_blocks"] == 0
        assert_idle_no_leak(engine)


def test_stats_line_shows_the_tiers(caplog):
    from pagedllm.metrics import StatsLogger

    stats = {"num_blocks": 10, "num_free_blocks": 10, "num_running": 1, "prefix_cache_queries": 1000,
             "prefix_cache_hits": 600, "prefix_cache_disk_hits": 400, "kv_disk_store_bytes": 3 << 20,
             "kv_disk_loaded_bytes": 2 << 20, "kv_disk_spilled_bytes": 1 << 20, "kv_disk_dropped_spills": 2,
             "kv_disk_load_seconds": {"count": 4, "sum": 0.2}, "kv_disk_spill_seconds": {"count": 8, "sum": 0.016}}
    logger = StatsLogger(interval=10.0)
    with caplog.at_level(logging.INFO, logger="pagedllm.stats"):
        assert logger.maybe_log(stats, 100, 10, now=logger._last_time + 11)
    line = caplog.records[-1].getMessage()
    assert "Prefix hits by tier: RAM 20.0%, disk 40.0%" in line
    assert "read 2.0 MiB in 4 loads (50 ms each), wrote 1.0 MiB (2.0 ms per block), 2 spills dropped" in line
    assert "store 3.0 MiB" in line
