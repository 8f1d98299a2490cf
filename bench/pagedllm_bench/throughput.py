"""Offline throughput: pagedllm vs transformers generate (static batching), generate_batch and llama.cpp.

`pagedllm bench throughput [--quick] [--num-requests 256] [--systems ...]`. The DESIGN.md offline workload
(prompts U[32,512] tokens, outputs U[16,256] tokens with ignore_eos, seeded synthetic token ids) goes through
every system, each in its own process (clean peak RSS), all with the same thread count: pagedllm (bf16 and fp32),
transformers `generate` with static batches of 8/16/32/64 (its best batch counts; fp32 and bf16), transformers
continuous batching (`generate_batch`), llama-server from the same llama.cpp build as llama-cpp-python with
parallel slots, and optionally llama-cpp-python one stream at a time. Ratios are pagedllm's output tokens/s over
each peer's, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from pagedllm_bench import common

# (system, dtype) in run order; the llama.cpp peers run the GGUF's own Q4_1 weights
DEFAULT_SYSTEMS = ["pagedllm:bfloat16", "pagedllm:float32", "hf-static:float32", "hf-static:bfloat16",
                   "hf-cb:float32", "llama-server", "llama-cpp-python"]
TARGETS = {  # DESIGN/issue 7: pagedllm output tok/s over the peer's, at least
    "llama.cpp best": 3.0, "hf-static bf16": 5.0, "hf-static fp32 (pagedllm fp32)": 2.5}


def add_args(p: argparse.ArgumentParser) -> None:
    common.add_common_args(p, "8 requests, short outputs, pagedllm + hf-static fp32 batch 8 only")
    p.add_argument("--num-requests", type=int, default=None, help="requests (default 256; --quick 8)")
    p.add_argument("--prompt-len", type=common.int_range, default=(32, 512), help="inclusive range 'lo,hi'")
    p.add_argument("--output-len", type=common.int_range, default=None,
                   help="inclusive range 'lo,hi' (default 16,256; --quick 16,32)")
    p.add_argument("--systems", default=None,
                   help="comma list of system[:dtype] among pagedllm, hf-static, hf-cb, llama-server, "
                        f"llama-cpp-python (default: {','.join(DEFAULT_SYSTEMS)})")
    p.add_argument("--hf-batch-sizes", default="8,16,32,64", help="static batch sizes to try (best counts)")
    p.add_argument("--hf-max-batches", type=int, default=None,
                   help="time only the first N static batches of each size (i.i.d. requests: same rate, less time)")
    p.add_argument("--llama-parallel", type=int, default=32, help="llama-server slots (and client concurrency)")
    p.add_argument("--gguf", default=None, help="GGUF for the llama.cpp peers (default: the embedded model)")
    p.add_argument("--engine-kwargs", default=None, help='JSON of extra pagedllm LLM(...) args, e.g. {"block_size": 32}')
    p.add_argument("--peer-repeats", type=int, default=1, help="repeats for the peers (pagedllm uses --repeats)")
    p.add_argument("--in-process", action="store_true", help="run the systems in this process (tests)")
    p.add_argument("--kernels", choices=["invariant", "current", "both"], default="invariant",
                   help="pagedllm's kernels: batch-invariant (the default), the batch-dependent ones, or both in "
                        "this run (an A/B: ratio invariant / current)")


def _run_one(spec: str, wl_path: str, wl: common.Workload, args: argparse.Namespace) -> dict:
    system, _, dtype = spec.partition(":")
    ns = argparse.Namespace(system=system, dtype=dtype or args.dtype, threads=args.threads, model=args.model,
                            gguf=args.gguf, batch_sizes=[int(x) for x in args.hf_batch_sizes.split(",")],
                            parallel=args.llama_parallel, engine_kwargs=_engine_kwargs(args),
                            max_batches=args.hf_max_batches)
    if args.in_process:
        from pagedllm_bench import peers

        return peers.run_system(system, wl, ns)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "pagedllm_bench", "peers", "--system", system, "--dtype", ns.dtype,
           "--workload", wl_path, "--out", out, "--threads", str(args.threads),
           "--batch-sizes", args.hf_batch_sizes, "--parallel", str(args.llama_parallel)]
    cmd += ["--model", args.model] if args.model else []
    cmd += ["--gguf", args.gguf] if args.gguf else []
    cmd += ["--engine-kwargs", ns.engine_kwargs]
    cmd += ["--max-batches", str(args.hf_max_batches)] if args.hf_max_batches else []
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, env=env)
    try:
        if proc.returncode != 0:
            raise RuntimeError(f"{spec} failed with exit code {proc.returncode}")
        with open(out, encoding="utf-8") as f:
            return json.load(f)
    finally:
        os.unlink(out)


def _engine_kwargs(args: argparse.Namespace) -> str:
    return json.dumps({"quantization": args.quantization, **json.loads(args.engine_kwargs or "{}")})


def _label(r: dict) -> str:
    short = {"bfloat16": "bf16", "float32": "fp32"}.get(r.get("dtype", ""), r.get("dtype", ""))
    return f"{r['system']} {short} {r.get('kernels', '')}".strip()


def _kernel_variants(specs: list[str], kernels: str) -> list[tuple[str, str | None]]:
    """(spec, kernels) to run: pagedllm once per kernel set asked for (both: invariant, then current)."""
    sets = ["invariant", "current"] if kernels == "both" else [kernels]
    return [(s, k) for s in specs for k in (sets if s.startswith("pagedllm") else [None])]


def _with_kernels(args: argparse.Namespace, kernels: str | None) -> argparse.Namespace:
    if kernels is None:
        return args
    extra = json.loads(args.engine_kwargs) if args.engine_kwargs else {}
    return argparse.Namespace(**{**vars(args), "engine_kwargs": json.dumps(
        {**extra, "batch_invariant": kernels == "invariant"})})


def _kernel_ratios(results: list[dict]) -> list[dict]:
    """Output tok/s of the batch-invariant kernels over the current ones, per dtype (--kernels both)."""
    out = []
    for dtype in sorted({r.get("dtype") for r in results if r.get("kernels")}):
        inv, cur = (next((r for r in results if r.get("kernels") == k and r.get("dtype") == dtype), None)
                    for k in ("invariant", "current"))
        if inv and cur:
            ratio = inv["out_tok_per_s"] / cur["out_tok_per_s"]
            out.append({"comparison": f"pagedllm {dtype}: invariant / current kernels", "ratio": ratio,
                        "target": ">= 0.95", "met": ratio >= 0.95})
    return out


def measure(args: argparse.Namespace) -> dict:
    common.set_threads(args.threads)
    n = args.num_requests or (8 if args.quick else 256)
    olen = args.output_len or ((16, 32) if args.quick else (16, 256))
    wl = common.offline_workload(n, args.prompt_len, olen, seed=args.seed, model_path=args.model)
    specs = (args.systems.split(",") if args.systems else
             ["pagedllm:bfloat16", "hf-static:float32"] if args.quick else DEFAULT_SYSTEMS)
    if args.quick and not args.systems:
        args.hf_batch_sizes = "8"
    print(f"workload: {wl.summary()}", file=sys.stderr)
    results: list[dict] = []
    failures: dict[str, str] = {}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(wl.to_json(), f)
        wl_path = f.name
    try:
        for spec, kernels in _kernel_variants(specs, args.kernels):
            reps = args.repeats if spec.startswith("pagedllm") else args.peer_repeats
            runs = []
            run_args = _with_kernels(args, kernels)
            for _ in range(max(1, reps)):
                try:
                    runs.append(_run_one(spec, wl_path, wl, run_args) | ({"kernels": kernels} if kernels else {}))
                except Exception as e:  # a missing or broken peer is reported, the others still run
                    failures[spec] = f"{type(e).__name__}: {e}"
                    print(f"{spec}: {failures[spec]}", file=sys.stderr)
                    break
            if runs:
                runs.sort(key=lambda r: r["out_tok_per_s"])
                best = dict(runs[(len(runs) - 1) // 2])  # the median run (the slower middle one if even)
                best["repeats_out_tok_per_s"] = [r["out_tok_per_s"] for r in runs]
                results.append(best)
                print(f"{_label(best)} ({best.get('config')}): {best['out_tok_per_s']:.1f} out tok/s",
                      file=sys.stderr, flush=True)
    finally:
        os.unlink(wl_path)
    ratios = _ratios(results) + _kernel_ratios(results)
    for r in results:
        r["label"] = _label(r)
    ref = next((r for r in results if r["system"] == "pagedllm" and r.get("dtype") == args.dtype), None)
    for r in results:
        r["pagedllm_x"] = ref["out_tok_per_s"] / r["out_tok_per_s"] if ref else None
    cols = ["label", "config", "req_per_s", "out_tok_per_s", "total_tok_per_s", "elapsed_s", "peak_rss_mb",
            "pagedllm_x", "matmul_floor_x"]  # matmul_floor_x: time / (linear FLOPs / measured matmul rate)
    print(common.table(results, cols, title=f"offline throughput: {wl.summary()['num_requests']} requests, "
                                            f"{wl.num_prompt_tokens} prompt + {wl.num_output_tokens} output "
                                            f"tokens, {args.threads} threads (pagedllm_x: pagedllm "
                                            f"{args.dtype} over this row)"))
    print(common.table(ratios, ["comparison", "ratio", "target", "met"], title="targets"))
    payload = {"bench": "throughput", "env": common.environment(args.threads), "workload": wl.summary(),
               "results": results, "ratios": ratios, "failures": failures}
    fig = _plot(results)
    jp, pp = common.save("throughput" + args.tag, payload, fig, args.out_dir)
    print(f"wrote {jp}" + (f" and {pp}" if pp else ""))
    return payload


def _ratios(results: list[dict]) -> list[dict]:
    def best(system_prefixes: tuple[str, ...], dtype: str | None = None) -> dict | None:
        rows = [r for r in results if r["system"].startswith(system_prefixes)
                and (dtype is None or r.get("dtype") == dtype)]
        return max(rows, key=lambda r: r["out_tok_per_s"], default=None)

    ours_bf16, ours_fp32 = best(("pagedllm",), "bfloat16"), best(("pagedllm",), "float32")
    ours = best(("pagedllm",))
    pairs = [("llama.cpp best", ours, best(("llama-server", "llama-cpp-python"))),
             ("hf-static bf16", ours_bf16 or ours, best(("hf-static",), "bfloat16")),
             ("hf-static fp32 (pagedllm fp32)", ours_fp32, best(("hf-static",), "float32")),
             ("hf-cb fp32", ours_fp32 or ours, best(("hf-cb",), "float32")),
             ("hf-static best (any dtype)", ours, best(("hf-static",)))]
    rows = []
    for name, a, b in pairs:
        if a and b:
            ratio = a["out_tok_per_s"] / b["out_tok_per_s"]
            target = TARGETS.get(name)
            rows.append({"comparison": f"{_label(a)} / {_label(b)} ({name})", "ratio": ratio, "target": target,
                         "met": None if target is None else ("yes" if ratio >= target else
                                                            f"no ({ratio / target:.0%} of target)")})
    return rows


def _plot(results: list[dict]):
    plt = common.pyplot()
    if plt is None or not results:
        return None
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(14, 4.5))
    labels = [f"{_label(r)}\n{r.get('config', '')}" for r in results]
    vals = [r["out_tok_per_s"] for r in results]
    colors = ["tab:blue" if r["system"] == "pagedllm" else "tab:grey" for r in results]
    ax0.bar(range(len(vals)), vals, color=colors)
    ax0.set_xticks(range(len(vals)), labels, fontsize=7, rotation=30, ha="right")
    ax0.set(ylabel="output tokens/s", title="offline throughput (same workload, same threads)")
    for i, v in enumerate(vals):
        ax0.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    colors = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 2)
    for r in results:
        c = next(colors)
        if r["system"] == "hf-static" and r.get("sweep"):
            bs = [s["batch_size"] for s in r["sweep"]]
            ax1.plot(bs, [s["out_tok_per_s"] for s in r["sweep"]], "o-", color=c, label=_label(r))
        elif r["system"] != "hf-static":
            ax1.axhline(r["out_tok_per_s"], ls="-" if r["system"] == "pagedllm" else "--", lw=1.2, color=c,
                        label=f"{_label(r)} ({r.get('config', '')})")
    ax1.set(xscale="log", xlabel="static batch size", ylabel="output tokens/s",
            title="transformers generate: throughput vs batch size")
    ax1.set_xticks([8, 16, 32, 64], ["8", "16", "32", "64"])
    ax1.minorticks_off()
    ax1.legend(fontsize=7)
    ax1.grid(alpha=0.3)
    return fig


run = measure  # what `pagedllm bench` calls
