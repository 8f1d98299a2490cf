"""`pagedllm bench blocks`: cost of the paged-KV bookkeeping per block as the pool grows.

For pools of 1k, 100k and 1M blocks, measures in microseconds per block:
- pool get / free / touch: the BlockPool primitives alone (free-queue pop, append, remove-from-middle);
- random block access (floor): one attribute update on a randomly chosen block, the memory-latency floor
  that any structure touching random blocks pays once the pool outgrows the CPU caches;
- allocate (no cache): KVCacheManager.allocate_slots for 256-token prompts, prefix caching off;
- allocate (cache miss): the same with prefix caching on (sha256 of each full block, registration,
  eviction of an old cached block from the LRU head: the pool is pre-filled with cached blocks);
- cache hit: get_computed_blocks + allocate_slots for a prompt whose blocks sit, freed but cached, at
  random places in the free queue (lookup hashing + removal from the middle of the queue, plus one new
  block for the last token), per block hit;
- free: KVCacheManager.free of those requests;
- decode: allocate_slots(request, 1) per decode step (one new block every block_size steps), per call.
O(1) bookkeeping shows as a flat cost per block from 1k to 1M blocks.
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import sys
import time
from collections.abc import Callable

from pagedllm.core.block_pool import BlockPool
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request

PROMPT_BLOCKS = 16  # 256-token prompts with block_size 16
# CPU time of this process by default: on a shared machine, wall time mostly measures the neighbours.
_clock: Callable[[], float] = time.process_time
QUICK_SIZES, QUICK_OPS = "1000,10000", 4000


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="1000,100000,1000000",
                        help="comma-separated pool sizes in blocks (default: 1000,100000,1000000)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--ops", type=int, default=60000, help="block operations timed per row and size")
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions; the best is reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                        help="cpu: process CPU time (robust on a busy machine); wall: perf_counter")
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke run: pools of {QUICK_SIZES} blocks, {QUICK_OPS} operations, one repetition")


def _best(fn: Callable[[], tuple[float, int]], repeat: int) -> float:
    """fn returns (seconds, operations); report the best microseconds per operation."""
    return min(sec / ops for sec, ops in (fn() for _ in range(repeat))) * 1e6


def _prompts(rng: random.Random, n: int, num_tokens: int) -> list[list[int]]:
    return [[rng.randrange(1, 49152) for _ in range(num_tokens)] for _ in range(n)]


def bench_pool(num_blocks: int, ops: int, repeat: int, rng: random.Random) -> dict[str, float]:
    pool = BlockPool(num_blocks)
    chunk = min(PROMPT_BLOCKS, num_blocks)
    rounds = max(1, ops // chunk)
    held = max(1, min(num_blocks // chunk // 2, 4096))  # requests' worth of blocks kept out at once

    def get_free() -> tuple[float, float, int]:
        t_get = t_free = 0.0
        n = 0
        while n < rounds:
            k = min(held, rounds - n)
            t0 = _clock()
            taken = [pool.get_new_blocks(chunk) for _ in range(k)]
            t1 = _clock()
            for blocks in reversed(taken):
                pool.free_blocks(reversed(blocks))
            t2 = _clock()
            t_get += t1 - t0
            t_free += t2 - t1
            n += k
        return t_get, t_free, n * chunk

    runs = [get_free() for _ in range(repeat)]
    get_us = min(r[0] / r[2] for r in runs) * 1e6
    free_us = min(r[1] / r[2] for r in runs) * 1e6

    def touch() -> tuple[float, int]:  # remove from random places in the free queue, then put back
        n = min(ops, num_blocks)
        picks = rng.sample(pool.blocks, n)
        t0 = _clock()
        pool.touch(picks)
        t1 = _clock()
        pool.free_blocks(picks)
        return t1 - t0, n

    def floor() -> tuple[float, int]:  # the hardware floor: one attribute access on a random block
        n = min(ops, num_blocks)
        picks = rng.sample(pool.blocks, n)
        t0 = _clock()
        for blk in picks:
            blk.ref_cnt += 0
        return _clock() - t0, n

    return {"pool get": get_us, "pool free": free_us, "pool touch": _best(touch, repeat),
            "random block access (floor)": _best(floor, repeat)}


def bench_manager(num_blocks: int, block_size: int, ops: int, repeat: int,
                  rng: random.Random) -> dict[str, float]:
    num_tokens = PROMPT_BLOCKS * block_size
    per_round = max(1, min(num_blocks // PROMPT_BLOCKS // 2, 2048))  # requests alive at once
    prompts = _prompts(rng, per_round, num_tokens)
    rounds = max(1, ops // (per_round * PROMPT_BLOCKS))
    out: dict[str, float] = {}

    # Allocate / free without prefix caching: pure bookkeeping.
    m = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
    salt_counter = [0]

    def alloc_free(mgr: KVCacheManager) -> tuple[float, float, int]:
        t_alloc = t_free = 0.0
        for _ in range(rounds):
            salt_counter[0] += 1
            salt = f"round-{salt_counter[0]}"  # fresh hashes every round: always a cache miss
            reqs = [Request(f"r{i}", p, cache_salt=salt) for i, p in enumerate(prompts)]
            t0 = _clock()
            for r in reqs:
                mgr.allocate_slots(r, num_tokens)
            t1 = _clock()
            for r in reqs:
                r.num_computed_tokens = num_tokens
                mgr.free(r)
            t2 = _clock()
            t_alloc += t1 - t0
            t_free += t2 - t1
        return t_alloc, t_free, rounds * per_round * PROMPT_BLOCKS

    runs = [alloc_free(m) for _ in range(repeat)]
    out["allocate (no cache)"] = min(r[0] / r[2] for r in runs) * 1e6

    # With prefix caching on a pool already full of cached blocks (every allocation evicts one).
    m = KVCacheManager(num_blocks, block_size)
    warm_prompts = _fill_with_cached_blocks(m, block_size, rng)
    runs = [alloc_free(m) for _ in range(repeat)]
    out["allocate (cache miss)"] = min(r[0] / r[2] for r in runs) * 1e6
    out["free"] = min(r[1] / r[2] for r in runs) * 1e6

    # Cache hits: prompts whose 16 blocks are cached and free, somewhere in the queue.
    m = KVCacheManager(num_blocks, block_size)
    warm_prompts = _fill_with_cached_blocks(m, block_size, rng)

    def hits() -> tuple[float, int]:
        chosen = rng.sample(warm_prompts, min(per_round, len(warm_prompts)))
        reqs = [Request(f"h{i}", p + [7]) for i, p in enumerate(chosen)]  # +1 token: all 16 blocks hit
        n_hit = 0
        t0 = _clock()
        for r in reqs:
            blocks, n_cached = m.get_computed_blocks(r)
            m.allocate_slots(r, r.num_tokens - n_cached, blocks)
            n_hit += len(blocks)
        t1 = _clock()
        for r in reqs:
            r.num_computed_tokens = r.num_tokens
            m.free(r)
        # Each admission also takes one new block for its last token, evicting an LRU cached block:
        # a few prompts lose a block, so divide by the blocks actually hit.
        return t1 - t0, max(1, n_hit)

    out["cache hit"] = _best(hits, repeat)

    # Decode: one allocate_slots(r, 1) per step; a new block every block_size steps.
    m = KVCacheManager(num_blocks, block_size)
    steps = min(ops, (num_blocks // 2) * block_size)

    def decode() -> tuple[float, int]:
        r = Request("d", [1] * block_size)
        m.allocate_slots(r, r.num_tokens)
        r.num_computed_tokens = r.num_tokens
        t = 0.0
        for i in range(steps):
            r.all_token_ids.append(i & 0xFFFF)  # as append_output_token, without the output list
            t0 = _clock()
            m.allocate_slots(r, 1)
            t += _clock() - t0
            r.num_computed_tokens += 1
        m.free(r)
        return t, steps

    out["decode step (per call)"] = _best(decode, repeat)
    return out


def _fill_with_cached_blocks(m: KVCacheManager, block_size: int, rng: random.Random) -> list[list[int]]:
    """Allocate unique prompts until the pool is full, then free them all: every block cached and free."""
    num_tokens = PROMPT_BLOCKS * block_size
    base = [rng.randrange(1, 49152) for _ in range(num_tokens)]
    prompts, reqs = [], []
    for i in range(m.num_blocks // PROMPT_BLOCKS):
        p = [i] + base[1:]  # distinct first token: distinct hash chain, cheap to make
        r = Request(f"w{i}", p)
        m.allocate_slots(r, num_tokens)
        r.num_computed_tokens = num_tokens
        prompts.append(p)
        reqs.append(r)
    for r in reqs:
        m.free(r)
    return prompts


def run(args: argparse.Namespace) -> dict[int, dict[str, float]]:
    global _clock
    _clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if getattr(args, "quick", False):
        args.sizes, args.ops, args.repeat = QUICK_SIZES, QUICK_OPS, 1
    sizes = [int(s) for s in str(args.sizes).split(",") if s.strip()]
    rng = random.Random(args.seed)
    results: dict[int, dict[str, float]] = {}
    for n in sizes:
        t0 = time.perf_counter()
        # Like timeit: no cyclic GC inside the measurements (a full collection walks every block object:
        # ~0.1 s for a 1M-block pool), and none of the previous size's pools left to walk.
        gc.collect()
        gc.disable()
        try:
            row = bench_pool(n, args.ops, args.repeat, rng)
            row.update(bench_manager(n, args.block_size, args.ops, args.repeat, rng))
        finally:
            gc.enable()
        results[n] = row
        print(f"  pool of {n} blocks measured in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    _print_table(results, args.block_size)
    return results


def _print_table(results: dict[int, dict[str, float]], block_size: int) -> None:
    sizes = list(results)
    ops = list(results[sizes[0]])
    print(f"# pagedllm bench blocks: microseconds per block (per call for decode), block_size={block_size}, "
          f"clock={'process CPU time' if _clock is time.process_time else 'wall'}")
    print(f"# Python {platform.python_version()} ({platform.python_implementation()}), {platform.machine()}, "
          f"{platform.processor() or platform.platform()}")
    ratios = [(sizes[-1], sizes[0])] + ([(sizes[-1], sizes[-2])] if len(sizes) > 2 else [])
    head = ("| operation | " + " | ".join(f"{n:,} blocks" for n in sizes) + " | "
            + " | ".join(f"{a:,} / {b:,}" for a, b in ratios) + " |")
    print(head)
    print("|" + "---|" * (len(sizes) + 1 + len(ratios)))
    for op in ops:
        vals = [results[n][op] for n in sizes]
        rs = [results[a][op] / results[b][op] if results[b][op] > 0 else float("nan") for a, b in ratios]
        print(f"| {op} | " + " | ".join(f"{v:.2f}" for v in vals) + " | "
              + " | ".join(f"{r:.2f}x" for r in rs) + " |")
