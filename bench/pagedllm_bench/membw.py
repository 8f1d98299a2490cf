"""The machine's limits with the engine's thread count: `pagedllm bench membw [--threads N]`.

- read bandwidth: every byte of a buffer far larger than the last-level cache read once (kernels/csrc/
  machine_limits.cpp, split across threads as the GEMMs split their weights), best of several passes. The buffer
  is in huge pages like the packed weights (kernels/csrc/huge_pages.cpp), which read a few % faster here;
- int8 compute peak: the measured rate of independent AVX-512 VNNI vpdpbusd chains on every thread (2 ops per
  multiply-add); 0 where the build has no VNNI;
- AMX int8 peak, where the CPU has it: independent 16 x 16 x 64 tile products (tdpbssd) on every thread (the packed
  GEMM's 32-element blocks use half of each product's depth: see BENCHMARKS.md, AMX).
Decode is measured against the first (weight bytes per token / time) and prefill against the second (`bench
quant`, `bench realistic` print both columns).
"""

from __future__ import annotations

import argparse
import time
from functools import cache

import torch

from pagedllm_bench import common

BUFFER_BYTES = 1 << 30  # well past any last-level cache here


@cache
def limits(threads: int = common.DEFAULT_THREADS, buffer_bytes: int = BUFFER_BYTES, passes: int = 5) -> dict:
    """{"read_gb_s": ..., "int8_peak_gops": ...} with `threads` threads (cached per process)."""
    from pagedllm.kernels.library import load_ops

    ops = load_ops()
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # in the 2 MiB pages the packed weights live in, written once so the pages exist before timing
        buf = ops.empty_huge_paged(buffer_bytes // 8, 8).view(torch.int64).fill_(1)
        times = []
        for _ in range(passes):
            t0 = time.perf_counter()
            ops.read_stream(buf)
            times.append(time.perf_counter() - t0)
        del buf
        out = {"threads": threads, "read_gb_s": buffer_bytes / min(times) / 1e9,
               "int8_peak_gops": _peak_gops(ops.int8_dot_ops, 2_000_000)}
        if ops.amx_dot_ops(1):
            out["amx_int8_peak_gops"] = _peak_gops(ops.amx_dot_ops, 200_000)
    finally:
        torch.set_num_threads(old)
    return out


def _peak_gops(dot_ops, iters: int) -> float:
    """The best of 3 timed runs of a machine_limits op (it returns the int8 operations it did), after a warm-up
    (frequency, thread pool)."""
    dot_ops(1000)
    rates = []
    for _ in range(3):
        t0 = time.perf_counter()
        n = dot_ops(iters)
        rates.append(n / (time.perf_counter() - t0))
    return max(rates) / 1e9


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=common.DEFAULT_THREADS)
    p.add_argument("--quick", action="store_true", help="the same run: it takes a few seconds already")


def run(args: argparse.Namespace) -> dict:
    res = limits(args.threads)
    print(common.table([res], title=f"machine limits, {args.threads} threads ({common.environment()['cpu']})"))
    common.save("membw", {"limits": res, "env": common.environment(args.threads)})
    return res
