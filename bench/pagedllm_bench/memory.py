"""KV memory: paged vs contiguous at one fixed KV budget, then a paged block-size sweep (8..128).

`pagedllm bench memory [--quick] [--kv-budget-tokens 16384] [--block-sizes 8,16,32,64,128]`. The offline
workload runs under a KV pool of a fixed number of token slots. `kv_layout="contiguous"` reserves max_model_len
(2048) slots per request at admission (the pre-paging baseline); `"paged"` hands out blocks as tokens arrive.
After every engine step we sample running requests and KV slot utilisation (used slots / allocated slots); we
report peak and mean running requests, mean utilisation, waste % (1 - utilisation), preemptions and throughput.
The block-size sweep keeps the same slot budget and reports the same numbers per block size. The KV dtype
comparison (--kv-cache-dtypes) runs the paged layout again with the same KV bytes as the paged run (its pool in the
compute dtype) stored as int8 (kv_cache_dtype="int8": ~1.9x the blocks): peak running requests and throughput.
`--hybrid`: sliding-window models (Gemma 3), hybrid KV groups vs every layer global instead (memory_hybrid.py).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

from pagedllm_bench import common, memory_hybrid


def add_args(p: argparse.ArgumentParser) -> None:
    common.add_common_args(p, "8 requests, 8-16 output tokens, max_model_len 1024, block sizes 16 and 128 only")
    p.add_argument("--num-requests", type=int, default=None, help="requests (default 256; --quick 8)")
    p.add_argument("--kv-budget-tokens", type=int, default=16384,
                   help="KV pool size in token slots, the same for every run (default: 8 x 2048)")
    p.add_argument("--max-model-len", type=int, default=2048, help="what the contiguous layout reserves")
    p.add_argument("--block-size", type=int, default=16, help="block size of the paged-vs-contiguous runs")
    p.add_argument("--block-sizes", default="8,16,32,64,128", help="paged block-size sweep ('' to skip)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-cache-dtypes", default="int8",
                   help="KV dtypes run paged at the paged run's KV bytes, against it ('' to skip)")
    memory_hybrid.add_args(p)


def pool_blocks(budget_tokens: int, block_size: int) -> int:
    """The budget in blocks plus slack for the scheduler's admission watermark (1% of the pool kept free), so
    that exactly budget / max_model_len contiguous reservations fit; both layouts get the same pool."""
    n = budget_tokens // block_size
    return n + math.ceil(0.02 * n) + 1


def run_config(wl: common.Workload, args: argparse.Namespace, layout: str, block_size: int, **engine) -> dict:
    """engine: LLM arguments over the defaults (e.g. kv_cache_dtype, or num_kv_blocks=None + kv_cache_memory)."""
    from pagedllm import LLM, SamplingParams

    kw = dict(kv_layout=layout, block_size=block_size, num_kv_blocks=pool_blocks(args.kv_budget_tokens, block_size),
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs)
    llm = LLM(**common.llm_kwargs(args, **{**kw, **engine}))
    common.warm_up(llm)
    common.reset_peak(llm)
    pre0 = llm.kv_cache_stats()["num_preemptions"]
    reqs = [(f"m{i}", p, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0))
            for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens, strict=True))]
    res = common.drive(llm.engine, reqs)
    got = sum(len(o.outputs[0].token_ids) for o in res.outputs.values())
    s = res.samples
    used = np.array([x.used_slots for x in s], dtype=float)
    alloc = np.array([x.allocated_slots for x in s], dtype=float)
    running = np.array([x.running for x in s], dtype=float)
    live = alloc > 0
    util = used[live] / alloc[live]
    stats = llm.kv_cache_stats()
    return {"layout": layout, "block_size": block_size, "num_blocks": stats["num_blocks"],
            "kv_cache_dtype": stats["kv_cache_dtype"], "kv_mib": stats["num_blocks"] * block_size *
            stats["kv_bytes_per_token"] / 2**20,
            "elapsed_s": res.elapsed, "out_tok_per_s": got / res.elapsed, "output_tokens": got,
            "steps": len(s), "peak_running": int(running.max()), "mean_running": float(running.mean()),
            "mean_util": float(util.mean()), "waste_pct": 100 * (1 - float(util.mean())),
            "slot_weighted_util": float(used[live].sum() / alloc[live].sum()),
            "peak_used_blocks": stats["peak_used_blocks"],
            "preemptions": stats["num_preemptions"] - pre0,
            "trace": {"t": [x.t for x in s], "running": running.tolist(),
                      "util": (np.where(live, used / np.maximum(alloc, 1), np.nan)).tolist()}}


def _median_run(wl, args, layout, bs, **engine) -> dict:
    runs = []
    for _ in range(max(1, args.repeats)):
        runs.append(run_config(wl, args, layout, bs, **engine))
        print(f"{layout} block {bs} {runs[-1]['kv_cache_dtype']} KV: {runs[-1]['out_tok_per_s']:.1f} out tok/s, peak running "
              f"{runs[-1]['peak_running']}, util {runs[-1]['mean_util']:.1%}", file=sys.stderr, flush=True)
    runs.sort(key=lambda r: r["out_tok_per_s"])
    r = runs[(len(runs) - 1) // 2]  # median (the slower middle one if even)
    r["repeats_out_tok_per_s"] = [x["out_tok_per_s"] for x in runs]
    return r


def measure(args: argparse.Namespace) -> dict:
    if args.hybrid:
        return memory_hybrid.measure(args)
    common.set_threads(args.threads)
    n = args.num_requests or (8 if args.quick else 256)
    wl = common.offline_workload(n, output_len=(8, 16) if args.quick else (16, 256), seed=args.seed,
                                 model_path=args.model)
    if args.quick:  # 4 contiguous reservations of 1024
        args.max_model_len = min(args.max_model_len, 1024)
        args.kv_budget_tokens = min(args.kv_budget_tokens, 4 * args.max_model_len)
    t0 = time.perf_counter()
    compare = [_median_run(wl, args, layout, args.block_size) for layout in ("paged", "contiguous")]
    sizes = [int(x) for x in args.block_sizes.split(",") if x] if not args.quick else [16, 128]
    sweep = [next((r for r in compare if r["layout"] == "paged" and r["block_size"] == bs), None)
             or _median_run(wl, args, "paged", bs) for bs in sizes]
    paged, contig = compare
    ratio = {"peak_running_x": paged["peak_running"] / max(1, contig["peak_running"]),
             "mean_running_x": paged["mean_running"] / max(1e-9, contig["mean_running"]),
             "throughput_x": paged["out_tok_per_s"] / contig["out_tok_per_s"],
             "paged_waste_pct": paged["waste_pct"], "contiguous_waste_pct": contig["waste_pct"]}
    cols = ["layout", "block_size", "num_blocks", "peak_running", "mean_running", "mean_util", "waste_pct",
            "preemptions", "out_tok_per_s", "elapsed_s"]
    title = (f"KV layout at a budget of {args.kv_budget_tokens} token slots ({n} requests, "
             f"max_model_len {args.max_model_len})")
    print(common.table(compare, cols, title=title))
    print(f"paged/contiguous: peak running x{ratio['peak_running_x']:.2f}, mean running "
          f"x{ratio['mean_running_x']:.2f}, throughput x{ratio['throughput_x']:.2f}; waste "
          f"{ratio['paged_waste_pct']:.1f}% vs {ratio['contiguous_waste_pct']:.1f}% "
          f"(targets: >= 2.5x concurrency, < 4% waste)")
    best = max(sweep, key=lambda r: r["out_tok_per_s"]) if sweep else None  # (--block-sizes '': no sweep)
    if best:
        print(common.table(sweep, cols, title="paged block-size sweep (same slot budget)"))
        print(f"fastest block size: {best['block_size']} ({best['out_tok_per_s']:.1f} out tok/s, "
              f"waste {best['waste_pct']:.1f}%)")
    kv_dtypes = compare_kv_dtypes(wl, args, paged)
    print(f"total {time.perf_counter() - t0:.0f}s")
    payload = {"bench": "memory", "env": common.environment(args.threads), "workload": wl.summary(),
               "kv_budget_tokens": args.kv_budget_tokens, "max_model_len": args.max_model_len,
               "compare": compare, "ratios": ratio, "block_size_sweep": sweep,
               "fastest_block_size": best["block_size"] if best else None, "kv_dtypes": kv_dtypes}
    fig = _plot(compare, sweep)
    jp, pp = common.save("memory" + args.tag, payload, fig, args.out_dir)
    print(f"wrote {jp}" + (f" and {pp}" if pp else ""))
    return payload


def compare_kv_dtypes(wl: common.Workload, args: argparse.Namespace, paged: dict) -> list[dict]:
    """The paged run's KV bytes given to each of --kv-cache-dtypes (the engine sizes its pool from them)."""
    names = [x for x in args.kv_cache_dtypes.split(",") if x]
    if not names:
        return []
    budget = int(paged["kv_mib"] * 2**20)
    rows = [paged] + [_median_run(wl, args, "paged", paged["block_size"], num_kv_blocks=None,
                                  kv_cache_memory=budget, kv_cache_dtype=n) for n in names]
    cols = ["kv_cache_dtype", "num_blocks", "kv_mib", "peak_running", "mean_running", "preemptions",
            "out_tok_per_s", "elapsed_s"]
    print(common.table(rows, cols, title=f"KV dtype at the same KV memory ({budget / 2**20:.0f} MiB, paged)"))
    for r in rows[1:]:
        r["vs_auto"] = {"peak_running_x": r["peak_running"] / max(1, paged["peak_running"]),
                        "mean_running_x": r["mean_running"] / max(1e-9, paged["mean_running"]),
                        "throughput_x": r["out_tok_per_s"] / paged["out_tok_per_s"],
                        "blocks_x": r["num_blocks"] / paged["num_blocks"]}
        v = r["vs_auto"]
        print(f"{r['kv_cache_dtype']} / {paged['kv_cache_dtype']} KV: blocks x{v['blocks_x']:.2f}, peak running "
              f"x{v['peak_running_x']:.2f}, mean running x{v['mean_running_x']:.2f}, throughput "
              f"x{v['throughput_x']:.2f} (targets: >= 1.8x peak running, throughput no lower)")
    return rows


def _plot(compare: list[dict], sweep: list[dict]):
    plt = common.pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for r in compare:
        tr = r["trace"]
        axes[0].plot(tr["t"], np.array(tr["util"]) * 100, label=f"{r['layout']} (mean {r['mean_util']:.0%})")
        axes[1].plot(tr["t"], tr["running"], label=f"{r['layout']} (peak {r['peak_running']})")
    axes[0].set(xlabel="time (s)", ylabel="used / allocated KV slots (%)", title="KV slot utilisation",
                ylim=(0, 105))
    axes[1].set(xlabel="time (s)", ylabel="running requests", title="concurrency at the same KV budget")
    bs = [r["block_size"] for r in sweep]
    ax = axes[2]
    ax.plot(bs, [r["out_tok_per_s"] for r in sweep], "o-", color="tab:blue", label="output tok/s")
    ax.set(xscale="log", xlabel="block size (tokens)", ylabel="output tokens/s", title="paged block-size sweep")
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.minorticks_off()
    ax2 = ax.twinx()
    ax2.plot(bs, [r["waste_pct"] for r in sweep], "s--", color="tab:red", label="waste %")
    ax2.set_ylabel("waste (% of allocated slots)", color="tab:red")
    for a in (axes[0], axes[1]):
        a.legend(fontsize=8, loc="center right")
        a.grid(alpha=0.3)
    ax.grid(alpha=0.3)
    lines = ax.get_lines() + ax2.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], fontsize=8, loc="center right")
    return fig


run = measure  # what `pagedllm bench` calls
