"""The prefix cache's disk tier (`pagedllm bench prefix --disk`): three measurements, each a ratio within one run.

1. TTFT of a request whose long prefix (--prefix-len, default 4096) plus 64 new tokens is: not cached (cold), in
   RAM (RAM-warm), only on disk (disk-warm: RAM cache reset, files in the page cache), and only on disk after an
   engine restart with the files dropped from the page cache (restarted: posix_fadvise DONTNEED, so they are read
   from the device). Cold once; each warm state --repeats times (new suffixes); medians. Targets: restarted <=
   0.05x cold, <= 1.5x RAM-warm.
2. Multi-turn chats whose working set is 4x the RAM KV budget (--conversations chats, --turns turns each, sent one
   request at a time round robin, so that a chat's history is evicted from RAM before its next turn): prompt tokens
   the model computed with the tier vs without, and the same greedy outputs. Target: <= 0.3x.
3. Decode throughput with spilling on vs off: --decode-requests requests at once under a RAM budget that makes the
   pool evict (so blocks spill as requests finish and new ones are admitted); output tokens/s, median of repeats.
   Target: at most 3% lower.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from pagedllm_bench import common
from pagedllm_bench.kv_store import drop_page_cache


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--disk")
    g.add_argument("--disk", action="store_true", help="measure the disk tier (this module) instead")
    g.add_argument("--disk-dir", default=None, help="where the tier's files go (default: a temporary directory)")
    g.add_argument("--conversations", type=int, default=None, help="chats of the multi-turn run (default 6)")
    g.add_argument("--turns", type=int, default=None, help="turns per chat (default 6)")
    g.add_argument("--decode-requests", type=int, default=None, help="requests of the decode run (default 32)")
    g.add_argument("--skip", default="", help="comma-separated parts to skip: ttft, multiturn, decode")


def _llm(args, disk_dir: str | None, **kw):
    from pagedllm import LLM

    return LLM(**common.llm_kwargs(args, kv_disk_cache_dir=disk_dir, block_size=args.block_size, **kw))


def _ttft(llm, prompt: list[int], rid: str) -> float:
    from pagedllm import SamplingParams

    res = common.drive(llm.engine, [(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0))], sample=False)
    return res.first_token_time[rid]


def measure_ttft(args, disk_dir: str, plen: int, reps: int) -> dict:
    """One prefix, prefilled once (cold: a long prefill, the target's margin is wide); then `reps` requests with
    new suffixes in each warm state: RAM-warm, disk-warm (RAM cache reset) in one engine, and restarted: a second
    engine over the same directory, the files dropped from the page cache and its RAM cache reset before each."""
    rng = np.random.default_rng(args.seed)
    ids = common.normal_token_ids(args.model)
    prefix = rng.choice(ids, size=plen).tolist()

    def prompt(which: int) -> list[int]:
        return prefix + np.random.default_rng([args.seed, which]).choice(ids, size=args.suffix_len).tolist()

    times: dict[str, list[float]] = {"cold": [], "RAM-warm": [], "disk-warm": [], "restarted": []}
    llm = _llm(args, disk_dir)
    common.warm_up(llm)
    times["cold"].append(_ttft(llm, prompt(0), "cold"))
    for rep in range(reps):
        times["RAM-warm"].append(_ttft(llm, prompt(1 + rep), f"ram{rep}"))
        assert llm.engine.disk_tier.worker.flush(600)  # the prefix was written at completion
        assert llm.engine.kv.reset_prefix_cache()  # RAM forgets; the disk keeps it
        times["disk-warm"].append(_ttft(llm, prompt(100 + rep), f"disk{rep}"))
        print(f"rep {rep}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items() if v), file=sys.stderr,
              flush=True)
    hits = llm.kv_cache_stats()["prefix_cache_disk_hits"]
    llm.engine.close()
    del llm
    llm = _llm(args, disk_dir)
    common.warm_up(llm)
    for rep in range(reps):
        assert llm.engine.disk_tier.worker.flush(600) and llm.engine.kv.reset_prefix_cache()
        drop_page_cache(disk_dir)
        times["restarted"].append(_ttft(llm, prompt(200 + rep), f"restart{rep}"))
        print(f"restarted rep {rep}: {times['restarted'][-1]:.3f}s", file=sys.stderr, flush=True)
    hits += llm.kv_cache_stats()["prefix_cache_disk_hits"]
    llm.engine.close()
    med = {k: common.median(v) for k, v in times.items()}
    rows = [{"state": k, "requests": len(times[k]), "ttft_s": med[k], "x_cold": med[k] / med["cold"],
             "x_ram": med[k] / med["RAM-warm"]} for k in times]
    print(common.table(rows, ["state", "requests", "ttft_s", "x_cold", "x_ram"],
                       title=f"TTFT, {plen}-token prefix + {args.suffix_len} new tokens (medians)"))
    print(f"restarted: {med['restarted'] / med['cold']:.3f}x cold (target <= 0.05), "
          f"{med['restarted'] / med['RAM-warm']:.2f}x RAM-warm (target <= 1.5); disk-hit tokens {hits}")
    return {"rows": rows, "times": times, "disk_hit_tokens": hits}


def _chats(args, n: int, turns: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Per chat its first prompt (a system prompt + first message) and the user messages of later turns."""
    rng = np.random.default_rng(args.seed + 7)
    ids = common.normal_token_ids(args.model)
    first = [rng.choice(ids, size=384).tolist() for _ in range(n)]
    later = [[rng.choice(ids, size=96).tolist() for _ in range(turns - 1)] for _ in range(n)]
    return first, later


def measure_multiturn(args, disk_dir: str | None, n: int, turns: int, reply: int = 32) -> dict:
    """Round robin over the chats, one request at a time; each turn's prompt is the chat so far."""
    from pagedllm import SamplingParams

    first, later = _chats(args, n, turns)
    final_len = 384 + (turns - 1) * 96 + turns * reply
    budget_blocks = max(common_blocks(final_len, args.block_size) + 4, n * final_len // 4 // args.block_size)
    llm = _llm(args, disk_dir, num_kv_blocks=budget_blocks)
    history = [list(p) for p in first]
    outputs, computed, prompt_tokens = [], 0, 0
    t0 = time.perf_counter()
    for turn in range(turns):
        for c in range(n):
            if turn:
                history[c] += later[c][turn - 1]
            out = llm.generate([history[c]], SamplingParams(max_tokens=reply, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)[0]
            tokens = list(out.outputs[0].token_ids)
            outputs.append(tokens)
            prompt_tokens += len(history[c])
            computed += len(history[c]) - out.num_cached_tokens
            history[c] += tokens
    elapsed = time.perf_counter() - t0
    stats = llm.kv_cache_stats()
    if disk_dir:
        llm.engine.close()
    return {"tier": "on" if disk_dir else "off", "ram_budget_tokens": budget_blocks * args.block_size,
            "working_set_tokens": n * final_len, "prompt_tokens": prompt_tokens, "computed_prompt_tokens": computed,
            "disk_hit_tokens": stats.get("prefix_cache_disk_hits", 0), "total_s": elapsed, "outputs": outputs}


def common_blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def measure_decode(args, disk_dir: str, n: int, reps: int) -> dict:
    """n requests of 128 prompt + 96 output tokens at once, 16 running at most, in a pool of ~24 requests' blocks:
    finished requests' blocks are cached, then evicted by the next ones (spilled when the tier is on)."""
    from pagedllm import SamplingParams

    wl = common.offline_workload(n, (128, 128), (96, 96), seed=args.seed, model_path=args.model)
    blocks = 24 * common_blocks(128 + 96, args.block_size)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    engines = {"off": _llm(args, None, num_kv_blocks=blocks, max_num_seqs=16),
               "on": _llm(args, disk_dir, num_kv_blocks=blocks, max_num_seqs=16)}
    for llm in engines.values():
        common.warm_up(llm)
    spilled = 0
    tier = engines["on"].engine.disk_tier
    tier_s = [0.0]  # engine-thread time inside the tier's calls (on the step's path)

    def timed(fn):
        def run(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                tier_s[0] += time.perf_counter() - t0
        return run

    tier.before_execute, tier.after_step = timed(tier.before_execute), timed(tier.after_step)
    on_s, cpu0 = 0.0, tier.worker.writer_cpu_seconds
    for rep in range(reps):
        for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):  # alternate: drift hits both alike
            llm = engines[mode]
            llm.engine.kv.reset_prefix_cache()
            s0 = llm.kv_cache_stats().get("kv_disk_spilled_blocks", 0)
            reqs = [(f"{mode}{rep}-{i}", p, SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0))
                    for i, (p, o) in enumerate(zip(wl.prompts, wl.output_lens, strict=True))]
            res = common.drive(llm.engine, reqs, sample=False)
            rates[mode].append(wl.num_output_tokens / res.elapsed)
            if mode == "on":
                on_s += res.elapsed
                spilled += llm.kv_cache_stats()["kv_disk_spilled_blocks"] - s0
                assert llm.engine.disk_tier.worker.flush(600)
                llm.engine.disk_tier.clear()  # every repeat spills afresh
            print(f"decode rep {rep} tier {mode}: {rates[mode][-1]:.1f} output tok/s", file=sys.stderr, flush=True)
    writer_cpu = tier.worker.writer_cpu_seconds - cpu0
    engines["on"].engine.close()
    med = {k: common.median(v) for k, v in rates.items()}
    # What spilling costs, robust to a busy machine: the engine thread's time in the tier (on the step's path) and
    # the writer thread's CPU time (taken from the model's threads at worst), over the runs with the tier on.
    cost = {"engine_thread": tier_s[0] / on_s, "writer_cpu": writer_cpu / (on_s * args.threads)}
    print(f"decode throughput: tier off {med['off']:.1f}, on {med['on']:.1f} output tok/s: on/off "
          f"{med['on'] / med['off']:.3f} (target >= 0.97); {spilled} blocks spilled in the measured runs; cost "
          f"of spilling: {100 * cost['engine_thread']:.2f}% of the time on the engine thread + "
          f"{100 * cost['writer_cpu']:.2f}% of {args.threads} threads' CPU in the writer")
    return {"rates": rates, "median": med, "ratio": med["on"] / med["off"], "spilled_blocks": spilled,
            "cost": cost}


def measure(args: argparse.Namespace) -> dict:
    common.set_threads(args.threads)
    q = args.quick
    reps = max(1, args.repeats)
    plen = args.prefix_len or (256 if q else 4096)
    skip = set(filter(None, args.skip.split(",")))
    root = tempfile.mkdtemp(prefix="kv-disk-", dir=args.disk_dir)
    payload: dict = {"bench": "prefix-disk", "env": common.environment(args.threads)}
    try:
        if "ttft" not in skip:
            payload["ttft"] = measure_ttft(args, os.path.join(root, "ttft"), plen, reps)
        if "multiturn" not in skip:
            n, turns = args.conversations or (3 if q else 6), args.turns or (3 if q else 6)
            off = measure_multiturn(args, None, n, turns)
            on = measure_multiturn(args, os.path.join(root, "chat"), n, turns)
            same = on.pop("outputs") == off.pop("outputs")
            ratio = on["computed_prompt_tokens"] / off["computed_prompt_tokens"]
            print(common.table([off, on], ["tier", "ram_budget_tokens", "working_set_tokens", "prompt_tokens",
                                           "computed_prompt_tokens", "disk_hit_tokens", "total_s"],
                               title=f"multi-turn: {n} chats x {turns} turns, one request at a time"))
            print(f"prompt tokens computed with the tier: {ratio:.3f}x without (target <= 0.3); same outputs: {same}")
            payload["multiturn"] = {"off": off, "on": on, "ratio": ratio, "same_outputs": same}
        if "decode" not in skip:
            payload["decode"] = measure_decode(args, os.path.join(root, "decode"),
                                               args.decode_requests or (8 if q else 32), reps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    jp, _ = common.save("prefix_disk" + args.tag, payload, None, args.out_dir)
    print(f"wrote {jp}")
    return payload
