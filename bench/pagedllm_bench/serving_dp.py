"""`pagedllm bench serving --data-parallel-size N`: N Ray replicas vs one engine with the same total threads,
on a prefix-heavy workload (a few shared prompt prefixes with a Zipf popularity, each request a unique tail):
the router's prefix affinity decides how much of each replica's prefix cache is reused."""

from __future__ import annotations

import argparse

import numpy as np

from pagedllm_bench import common


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data parallel")
    g.add_argument("--data-parallel-size", type=int, default=None,
                   help="compare N Ray replicas (threads/N each) with one engine (all threads) on a "
                        "prefix-heavy workload")
    g.add_argument("--prefix-families", type=int, default=8, help="distinct shared prefixes")
    g.add_argument("--prefix-len", type=int, default=None, help="tokens per shared prefix (default 512; --quick 256)")
    g.add_argument("--suffix-len", type=int, default=32)


def prefix_workload(n: int, families: int, prefix_len: int, suffix_len: int, output_len: tuple[int, int],
                    seed: int, model_path: str | None) -> common.Workload:
    rng = np.random.default_rng(seed)
    ids = common.normal_token_ids(model_path)
    prefixes = [rng.choice(ids, size=prefix_len).tolist() for _ in range(families)]
    weights = 1.0 / np.arange(1, families + 1) ** 1.1
    picks = rng.choice(families, size=n, p=weights / weights.sum())
    prompts = [prefixes[f] + rng.choice(ids, size=suffix_len).tolist() for f in picks]
    outs = rng.integers(output_len[0], output_len[1] + 1, size=n).tolist()
    return common.Workload("prefix-heavy", prompts, outs, seed, {"families": families, "prefix_len": prefix_len,
                                                                 "suffix_len": suffix_len})


def systems(args: argparse.Namespace, server_cls) -> list[tuple[str, object]]:
    """(name, server) pairs: one engine with all threads, then N replicas sharing them."""
    n = args.data_parallel_size
    per = max(1, args.threads // n)
    extra = args.server_args.split()
    return [("pagedllm-dp1", server_cls(args.model, args.dtype, args.threads, extra)),
            (f"pagedllm-dp{n}", server_cls(args.model, args.dtype, per,
                                           [*extra, "--data-parallel-size", str(n), "--threads", str(per)]))]


def workloads(args: argparse.Namespace, rates: list[float], n: int, max_out: int) -> dict[float, common.Workload]:
    plen = args.prefix_len or (256 if args.quick else 512)
    return {rate: prefix_workload(n, args.prefix_families, plen, args.suffix_len, (min(16, max_out), max_out),
                                  args.seed + 1000 * (i + 1), args.model) for i, rate in enumerate(rates)}
