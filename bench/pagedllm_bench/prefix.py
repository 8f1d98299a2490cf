"""Prefix caching on vs off: 64 requests sharing a 1024-token system prompt plus 64 unique tokens, 64 out.

`pagedllm bench prefix [--quick] [--num-requests 64] [--prefix-len 1024]`; `--disk` measures the prefix cache's
disk tier instead (benchmarks/prefix_disk.py). Two scenarios, each with caching on
and off: "burst" submits all requests at once (TTFT then includes queueing behind the others' prefills: the
DESIGN.md workload), "isolated" sends requests one at a time after one warm request (TTFT is then the prefill
latency alone: what a cached prefix saves one user). Reports TTFT p50/p99, total time, peak KV blocks and the
prefix-cache hit rate.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from pagedllm_bench import common, prefix_disk


def add_args(p: argparse.ArgumentParser) -> None:
    common.add_common_args(p, "8 requests, 256-token prefix, 8 output tokens")
    p.add_argument("--num-requests", type=int, default=None, help="default 64 (--quick 8)")
    p.add_argument("--prefix-len", type=int, default=None, help="shared tokens (default 1024; --quick 256)")
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=None, help="default 64 (--quick 8)")
    p.add_argument("--isolated-requests", type=int, default=None,
                   help="requests in the one-at-a-time scenario (default 8; --quick 3; 0 skips it)")
    p.add_argument("--block-size", type=int, default=16)
    prefix_disk.add_args(p)


def make_workload(n: int, prefix_len: int, suffix_len: int, output_len: int, seed: int,
                  model_path: str | None) -> common.Workload:
    rng = np.random.default_rng(seed)
    ids = common.normal_token_ids(model_path)
    prefix = rng.choice(ids, size=prefix_len).tolist()
    prompts = [prefix + rng.choice(ids, size=suffix_len).tolist() for _ in range(n)]
    return common.Workload("prefix", prompts, [output_len] * n, seed,
                           {"prefix_len": prefix_len, "suffix_len": suffix_len})


def _run(llm, wl: common.Workload, tag: str, isolated: bool) -> dict:
    from pagedllm import SamplingParams

    eng = llm.engine
    common.reset_peak(llm)
    s0 = llm.kv_cache_stats()
    reqs = [(f"{tag}{i}", p, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0))
            for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens, strict=True))]
    if isolated:
        ttft, elapsed = [], 0.0
        for r in reqs:
            res = common.drive(eng, [r], sample=False)
            ttft.append(res.first_token_time[r[0]])
            elapsed += res.elapsed
    else:
        res = common.drive(eng, reqs, sample=False)
        ttft, elapsed = [res.first_token_time[r[0]] for r in reqs], res.elapsed
    s1 = llm.kv_cache_stats()
    q = s1["prefix_cache_queries"] - s0["prefix_cache_queries"]
    h = s1["prefix_cache_hits"] - s0["prefix_cache_hits"]
    return {"ttft_p50": common.pct(ttft, 50), "ttft_p99": common.pct(ttft, 99), "ttft_mean": float(np.mean(ttft)),
            "total_s": elapsed, "peak_used_blocks": s1["peak_used_blocks"], "hit_rate": h / q if q else 0.0,
            "ttft": ttft}


def measure(args: argparse.Namespace) -> dict:
    from pagedllm import LLM, SamplingParams

    if args.disk:
        return prefix_disk.measure(args)
    common.set_threads(args.threads)
    q = args.quick
    n = args.num_requests or (8 if q else 64)
    plen = args.prefix_len or (256 if q else 1024)
    olen = args.output_len or (8 if q else 64)
    n_iso = args.isolated_requests if args.isolated_requests is not None else (3 if q else 8)
    wl = make_workload(n, plen, args.suffix_len, olen, args.seed, args.model)
    iso = make_workload(n_iso + 1, plen, args.suffix_len, 1, args.seed + 1, args.model) if n_iso else None
    rows = []
    for caching in (True, False):
        llm = LLM(**common.llm_kwargs(args, enable_prefix_caching=caching, block_size=args.block_size))
        common.warm_up(llm)
        for scenario in ("burst", "isolated"):
            if scenario == "isolated" and not iso:
                continue
            reps = []
            for rep in range(max(1, args.repeats)):
                llm.engine.kv.reset_prefix_cache()
                w = wl
                if scenario == "isolated":  # one warm request computes (and, if on, caches) the prefix
                    llm.generate([iso.prompts[0]], SamplingParams(max_tokens=1), use_tqdm=False)
                    w = iso.head(n_iso + 1)
                    w = common.Workload("iso", w.prompts[1:], w.output_lens[1:])
                reps.append(_run(llm, w, f"{scenario}{rep}-", scenario == "isolated"))
            reps.sort(key=lambda r: r["ttft_p50"])
            r = reps[len(reps) // 2]
            r.update(scenario=scenario, prefix_caching="on" if caching else "off",
                     requests=len(r["ttft"]))
            rows.append(r)
            print(f"{scenario} caching {'on' if caching else 'off'}: TTFT p50 {r['ttft_p50']:.3f}s, "
                  f"total {r['total_s']:.1f}s", file=sys.stderr, flush=True)
        del llm
    ratios = {}
    for scenario in ("burst", "isolated"):
        on = next((r for r in rows if r["scenario"] == scenario and r["prefix_caching"] == "on"), None)
        off = next((r for r in rows if r["scenario"] == scenario and r["prefix_caching"] == "off"), None)
        if on and off:
            ratios[scenario] = {"ttft_p50_x": off["ttft_p50"] / on["ttft_p50"],
                                "ttft_p99_x": off["ttft_p99"] / on["ttft_p99"],
                                "total_x": off["total_s"] / on["total_s"],
                                "blocks_x": off["peak_used_blocks"] / max(1, on["peak_used_blocks"])}
    cols = ["scenario", "prefix_caching", "requests", "ttft_p50", "ttft_p99", "total_s", "peak_used_blocks",
            "hit_rate"]
    print(common.table(rows, cols, title=f"prefix caching: {n} x ({plen} shared + {args.suffix_len} unique) "
                                         f"tokens, {olen} out (times in s)"))
    for s, r in ratios.items():
        print(f"{s}: caching cuts TTFT p50 x{r['ttft_p50_x']:.1f}, p99 x{r['ttft_p99_x']:.1f}, total time "
              f"x{r['total_x']:.2f}, peak blocks x{r['blocks_x']:.2f} (target: TTFT p50 >= 5x)")
    payload = {"bench": "prefix", "env": common.environment(args.threads), "workload": wl.summary(),
               "results": rows, "ratios": ratios}
    fig = _plot(rows)
    jp, pp = common.save("prefix" + args.tag, payload, fig, args.out_dir)
    print(f"wrote {jp}" + (f" and {pp}" if pp else ""))
    return payload


def _plot(rows: list[dict]):
    plt = common.pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, scenario in zip(axes, ("burst", "isolated"), strict=True):
        for r in rows:
            if r["scenario"] == scenario:
                x = np.sort(r["ttft"])
                ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=f"caching {r['prefix_caching']} "
                        f"(p50 {r['ttft_p50']:.2f}s)")
        ax.set(xlabel="TTFT (s)", ylabel="fraction of requests", title=f"TTFT CDF, {scenario}")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    return fig


run = measure  # what `pagedllm bench` calls
