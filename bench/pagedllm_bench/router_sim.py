"""Router simulation: prefix-affinity vs least-loaded vs round-robin routing over 2-64 simulated replicas.

`pagedllm bench router_sim [--quick] [--replicas 2,4,8,16,32,64]`. A multi-turn chat trace (shared system
prompts with Zipf popularity, conversations of 1-6 turns, think times) replayed through the real routing
classes (pagedllm/distributed/routing.py) over replicas that each run the engine's real Scheduler and
KVCacheManager (pure Python, no model, simulated time). The trace grows with the replica count (the same
conversations and arrival rate per replica). Reports the prefix-cache hit rate, the load imbalance (max / mean
over replicas of the mean queued tokens) and the estimated throughput, TTFT p50/p99 from the step cost model.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from pagedllm.distributed.routing import POLICIES, make_policy
from pagedllm.distributed.simulation import ReplicaConfig, SimResult, TraceConfig, make_trace, simulate
from pagedllm_bench import common


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", default=None, help="comma-separated replica counts (default 2,4,8,16,32,64; "
                                                    "--quick 2,4,8)")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--conversations-per-replica", type=int, default=None, help="default 24 (--quick 8)")
    p.add_argument("--rate-per-replica", type=float, default=3.0, help="new conversations per second per replica")
    p.add_argument("--system-prompts", type=int, default=32)
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per replica (16 tokens each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=None)
    p.add_argument("--tag", default="")
    p.add_argument("--quick", action="store_true", help="2-8 replicas, a small trace (a few seconds)")


def sweep(replica_counts: list[int], policies: list[str], conv_per_replica: int, rate_per_replica: float,
          system_prompts: int, num_blocks: int, seed: int) -> list[SimResult]:
    results = []
    rcfg = ReplicaConfig(num_blocks=num_blocks)
    for n in replica_counts:
        trace = make_trace(TraceConfig(num_conversations=conv_per_replica * n, num_system_prompts=system_prompts,
                                       arrival_rate=rate_per_replica * n, seed=seed))
        for name in policies:
            kw = {"table_blocks": num_blocks} if name == "prefix" else {}
            t0 = time.perf_counter()
            r = simulate(trace, make_policy(name, n, rcfg.block_size, **kw), n, rcfg, seed=seed)
            r.extra["wall_s"] = time.perf_counter() - t0
            results.append(r)
            print(f"{n:>3} replicas {name:>12}: hit {r.hit_rate:.3f}, imbalance {r.imbalance:.2f} "
                  f"({r.extra['wall_s']:.1f}s)", file=sys.stderr, flush=True)
    return results


def run(args: argparse.Namespace) -> dict:
    q = args.quick
    counts = [int(x) for x in (args.replicas or ("2,4,8" if q else "2,4,8,16,32,64")).split(",")]
    policies = args.policies.split(",")
    cpr = args.conversations_per_replica or (8 if q else 24)
    results = sweep(counts, policies, cpr, args.rate_per_replica, args.system_prompts, args.num_blocks, args.seed)
    rows = [dataclasses.asdict(r) | {"leaked_blocks": r.extra["leaked_blocks"]} for r in results]
    cols = ["replicas", "policy", "requests", "hit_rate", "imbalance", "throughput", "ttft_p50", "ttft_p99",
            "preemptions", "leaked_blocks"]
    print(common.table(rows, cols, title=f"router simulation: {cpr} conversations and {args.rate_per_replica}/s "
                                         f"per replica, {args.num_blocks} KV blocks per replica (throughput in "
                                         f"tokens/s, TTFT in s, from the step cost model)"))
    for n in counts:
        by = {r.policy: r for r in results if r.replicas == n}
        if "prefix" in by and "round-robin" in by:
            print(f"{n} replicas: prefix hit rate {by['prefix'].hit_rate:.1%} vs round-robin "
                  f"{by['round-robin'].hit_rate:.1%}; throughput x{by['prefix'].throughput / by['round-robin'].throughput:.2f}")
    payload = {"bench": "router_sim", "args": vars(args), "results": rows}
    jp, _ = common.save("router_sim" + args.tag, payload, None, args.out_dir)
    print(f"wrote {jp}")
    return payload
