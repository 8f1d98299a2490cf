"""The router simulation: trace structure, and prefix affinity against round-robin over simulated replicas
that run the engine's real scheduler and KV cache manager."""

from __future__ import annotations

from collections import Counter

import pytest
from tiny_models import fresh_seed

from pagedllm.distributed.routing import make_policy
from pagedllm.distributed.simulation import ReplicaConfig, TraceConfig, make_trace, simulate

# max / mean queued tokens of prefix affinity: above the tail of fresh seeds at 32 replicas (where it is widest), far
# below what affinity that ignored load would give (a hot prefix's whole traffic on one replica: up to the replica
# count); round-robin stays near 1
IMBALANCE_BOUND = 3.5


def test_trace_has_multi_turn_and_zipf_structure():
    seed = fresh_seed()
    cfg = TraceConfig(num_conversations=400, num_system_prompts=16, seed=seed)
    trace = make_trace(cfg)
    assert trace == make_trace(cfg)  # seeded
    assert all(a.start <= b.start for a, b in zip(trace, trace[1:], strict=False))
    popularity = Counter(id(c.system) for c in trace).most_common()
    assert popularity[0][1] > 3 * popularity[-1][1]  # a Zipf head and a tail
    assert max(len(c.turns) for c in trace) > 1
    assert all(cfg.system_len[0] <= len(c.system) <= cfg.system_len[1] for c in trace)


@pytest.mark.parametrize("replicas", [2, 4, 8, 16, 32])
def test_prefix_affinity_beats_round_robin(replicas):
    seed = fresh_seed()
    trace = make_trace(TraceConfig(num_conversations=6 * replicas, arrival_rate=3.0 * replicas, seed=seed))
    turns = sum(len(c.turns) for c in trace)
    rcfg = ReplicaConfig(num_blocks=1024)
    prefix = simulate(trace, make_policy("prefix", replicas, 16, table_blocks=1024), replicas, rcfg, seed=seed)
    rr = simulate(trace, make_policy("round-robin", replicas), replicas, rcfg, seed=seed)
    for r in (prefix, rr):
        assert r.requests == turns and r.extra["leaked_blocks"] == 0
    assert prefix.hit_rate > rr.hit_rate, (prefix, rr)
    assert prefix.imbalance < IMBALANCE_BOUND, prefix
    assert prefix.ttft_p50 <= rr.ttft_p50 * 1.1


def test_bench_router_sim_quick_through_the_cli(tmp_path, capsys):
    import json

    from pagedllm.cli import main

    assert main(["bench", "router_sim", "--quick", "--replicas", "2", "--conversations-per-replica", "4",
                 "--out-dir", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "router_sim.json").read_text())["results"]
    assert {r["policy"] for r in rows} == {"prefix", "least-loaded", "round-robin"}
    assert "| replicas | policy" in capsys.readouterr().out
