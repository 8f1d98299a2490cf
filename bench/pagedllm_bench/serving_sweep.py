"""`pagedllm bench serving --concurrency 1,4,16,64`: closed-loop concurrency sweeps against `pagedllm serve` and
llama-server, the same streaming client for both.

At each concurrency c both servers start fresh (llama-server with `--parallel c`, its best for c streams), get the
same seeded prompts (`--prompt-len`, default 100-450 tokens) and exact output lengths (`--output-len`, default 128,
ignore_eos, greedy), and keep c requests in flight until `--num-requests` (default max(2c, 32)) are done. Reported
per system and c: TTFT, inter-token and end-to-end latency p50/p99 and output tokens/s (medians over --repeats),
and the ratios pagedllm / llama-server of the same run. At c=1 the same prompts also run offline, one at a time
through the engine's step loop (offline_stream.py): the ratio serve / offline is what serving costs one user.
"""

from __future__ import annotations

import argparse
import sys

from pagedllm_bench import common, offline_stream


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="closed-loop sweep instead of Poisson rates, e.g. 1,4,16,64 (llama-server --parallel c)")
    p.add_argument("--prompt-len", type=lambda s: tuple(int(x) for x in s.split(",")), default=(100, 450),
                   help="prompt lengths of the sweep, lo,hi (uniform, inclusive)")
    p.add_argument("--output-len", type=int, default=128, help="tokens each request of the sweep generates")


def sweep(args: argparse.Namespace, pagedllm_server, peer_server, systems: list[str], run_closed_loop,
          summarise) -> dict:
    """The sweep; the server classes and the client come from serving.py."""
    levels = args.concurrency
    results: list[dict] = []
    for c in levels:
        n = args.num_requests or max(2 * c, 32)
        wl = common.offline_workload(n, prompt_len=args.prompt_len, output_len=(args.output_len, args.output_len),
                                     seed=args.seed + c, model_path=args.model)
        ctx = max(len(p) for p in wl.prompts) + args.output_len + 16
        row: dict[str, dict] = {}
        for system in systems:
            if system == "pagedllm":
                srv = pagedllm_server(args.model, args.dtype, args.threads,
                                      ["--quantization", args.quantization, *args.server_args.split()])
            else:
                srv = peer_server(system, args.gguf or args.model, args.threads, c, ctx)
            with srv:
                run_closed_loop(srv.url, wl.head(2), 2, srv.extra_body)  # warm-up
                reps = [summarise(*run_closed_loop(srv.url, wl, c, srv.extra_body)) for _ in range(args.repeats)]
            summ = {k: common.median([r[k] for r in reps]) for k in reps[0]}
            summ.update(system=system, concurrency=c, requests=n)
            row[system] = summ
            results.append(summ)
            print(f"{system} @ c={c}: TTFT p50 {summ['ttft_p50']:.2f}s p99 {summ['ttft_p99']:.2f}s, ITL p50 "
                  f"{summ['itl_p50'] * 1e3:.0f}ms p99 {summ['itl_p99'] * 1e3:.0f}ms, {summ['out_tok_per_s']:.1f} "
                  f"out tok/s", file=sys.stderr, flush=True)
        if c == 1 and "pagedllm" in row:
            row["offline"] = _offline_row(args, wl, summarise)
            results += [row["offline"], _ratio("pagedllm serve / offline", row["pagedllm"], row["offline"], c, n)]
        if "pagedllm" in row:
            results += [_ratio(f"pagedllm / {peer}", row["pagedllm"], row[peer], c, n) for peer in row
                        if peer not in ("pagedllm", "offline")]
    cols = ["system", "concurrency", "requests", "out_tok_per_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99",
            "e2e_p50", "e2e_p99"]
    print(common.table(results, cols, title=f"serving sweep: prompts {args.prompt_len[0]}-{args.prompt_len[1]} "
                                            f"tokens, {args.output_len} out each, closed loop (times in s)"))
    return {"bench": "serving-sweep", "env": common.environment(args.threads), "concurrency": levels,
            "prompt_len": list(args.prompt_len), "output_len": args.output_len, "results": results}


def _ratio(name: str, ours: dict, peer: dict, c: int, n: int) -> dict:
    return {"system": name, "concurrency": c, "requests": n,
            **{k: ours[k] / peer[k] if peer[k] else float("nan")
               for k in ("out_tok_per_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "e2e_p50", "e2e_p99")}}


def _offline_row(args: argparse.Namespace, wl: common.Workload, summarise) -> dict:
    """The c=1 workload offline, medians over --repeats, summarised as the client summarises a server run."""
    from pagedllm_bench.serving import RequestRecord

    reps = []
    for _ in range(args.repeats):
        res = offline_stream.measure(args.model, wl, args.threads, args.dtype, args.quantization)
        recs = [RequestRecord(len(p), n, ttft=r["ttft"], e2e=r["chunk_times"][-1], chunk_times=r["chunk_times"],
                              output_tokens=r["output_tokens"])
                for p, n, r in zip(wl.prompts, wl.output_lens, res["records"], strict=True)]
        reps.append(summarise(recs, res["elapsed_s"]))
    summ = {k: common.median([r[k] for r in reps]) for k in reps[0]}
    summ.update(system="pagedllm offline", concurrency=1, requests=len(wl.prompts))
    print(f"pagedllm offline @ c=1: TTFT p50 {summ['ttft_p50']:.2f}s, ITL p50 {summ['itl_p50'] * 1e3:.0f}ms",
          file=sys.stderr, flush=True)
    return summ
