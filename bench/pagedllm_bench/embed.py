"""Embeddings throughput on a BERT-family GGUF: pagedllm offline and `pagedllm serve` against llama-server
`--embeddings`, on the same file, inputs and threads.

`pagedllm bench embed [--quick] [--num-inputs 256] [--repeats N] [--model PATH.gguf]`. The default model is a
random-weight BERT of bge-small-en-v1.5's shape (12 layers, hidden 384, vocab 30522; CLS pooling, normalised),
converted by llama.cpp's own convert_hf_to_gguf.py (embed_model.py; cached). The workload: N inputs (--quick 32) of
token-id lengths uniform in --len-range (16..256, seeded), each [CLS] ids [SEP], sent as token ids (no tokenizer
differences). llama-server (`--embeddings --pooling cls`, the same -t) first runs a few inputs at each slot count of
--llama-parallel, -b = -ub = slots x the longest input; the fastest count is the one measured. Then, alternating,
medians over --repeats: LLM(runner="pooling").embed of all inputs; `pagedllm serve --runner pooling` and
llama-server, each given them as /v1/embeddings requests of --chunk inputs, --concurrency in flight. Reports
inputs/s, tokens/s, the ratio to llama-server, the useful GFLOP/s (matrices and attention, no padding) against
torch's fp32 GEMM rate measured in the same run, and 1 - cosine of each input's vector to llama-server's.
Target (issue 57): pagedllm >= 1.5x llama-server.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import statistics
import sys
import time

import numpy as np

from pagedllm_bench import common, embed_model
from pagedllm_bench.serving import LlamaServer, PagedllmServer


def add_args(p: argparse.ArgumentParser) -> None:
    common.add_common_args(p, "32 inputs, one repeat")
    p.set_defaults(dtype="auto")  # the engine's own choice (fp32 here: encoders are compute-bound)
    p.add_argument("--type", default="f16", choices=["f16", "f32"], help="GGUF type of the default model")
    p.add_argument("--num-inputs", type=int, default=None, help="inputs per run (default 256; --quick 32)")
    p.add_argument("--len-range", type=common.int_range, default=(16, 256), help="token lengths, inclusive")
    p.add_argument("--batch-tokens", type=int, default=4096, help="pagedllm's max_num_batched_tokens")
    p.add_argument("--chunk", type=int, default=16, help="inputs per HTTP request")
    p.add_argument("--concurrency", type=int, default=4, help="HTTP requests in flight")
    p.add_argument("--llama-parallel", default="1,2,4,8",
                   help="llama-server slot counts (-np) to try on the first --sweep-inputs inputs; the fastest runs")
    p.add_argument("--sweep-inputs", type=int, default=None,
                   help="inputs of each llama-server slot-count trial (default 48; --quick 16)")
    p.add_argument("--llama-args", default="", help="extra llama-server arguments, space separated")
    p.add_argument("--systems", default="offline,serve,llama-server",
                   help="comma list of offline, serve, llama-server")


def workload(tok, n: int, lens: tuple[int, int], seed: int) -> list[list[int]]:
    """n inputs [CLS] ... [SEP] of uniform lengths, their middle drawn from the tokenizer's ordinary tokens."""
    special = set(tok.all_special_ids)
    ids = np.array([i for i, t in enumerate(tok.convert_ids_to_tokens(list(range(len(tok)))))
                    if i not in special and not t.startswith("[unused")], dtype=np.int64)
    rng = np.random.default_rng(seed)
    sizes = rng.integers(lens[0], lens[1] + 1, size=n)
    return [[tok.cls_token_id, *rng.choice(ids, size=int(k) - 2).tolist(), tok.sep_token_id] for k in sizes]


def _decode(item: dict) -> np.ndarray:
    e = item["embedding"]
    return np.frombuffer(base64.b64decode(e), dtype="<f4") if isinstance(e, str) else np.asarray(e, np.float32)


async def _embed_http(url: str, inputs: list[list[int]], chunk: int, concurrency: int, model: str) -> np.ndarray:
    """Every input's vector, from /v1/embeddings requests of `chunk` inputs, `concurrency` in flight."""
    import httpx

    out: list[np.ndarray | None] = [None] * len(inputs)
    sem = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, start: int) -> None:
        async with sem:
            body = {"input": inputs[start:start + chunk], "model": model, "encoding_format": "base64"}
            r = await client.post(url + "/v1/embeddings", json=body)
            r.raise_for_status()
            for item in r.json()["data"]:
                out[start + item["index"]] = _decode(item)

    async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as client:
        await asyncio.gather(*(one(client, s) for s in range(0, len(inputs), chunk)))
    return np.stack(out)


def _http_runner(srv, args: argparse.Namespace):
    def run(inputs: list[list[int]]) -> np.ndarray:
        return asyncio.run(_embed_http(srv.url, inputs, args.chunk, args.concurrency, srv.extra_body["model"]))
    return run


def _offline_runner(llm):
    def run(inputs: list[list[int]]) -> np.ndarray:
        outs = llm.embed([{"prompt_token_ids": p} for p in inputs], use_tqdm=False)
        return np.stack([np.asarray(o.outputs.embedding, np.float32) for o in outs])
    return run


def encoder_flops(cfg, lens: list[int]) -> float:
    """2 x the multiply-adds of inputs of `lens` tokens for an EncoderConfig: every layer's matrices per token, and
    attention's QK^T and PV (tokens^2 x hidden each)."""
    h, ff = cfg.hidden_size, cfg.intermediate_size
    per_token = 4 * h * h + (3 if cfg.gated else 2) * h * ff
    return sum(2.0 * cfg.num_layers * (t * per_token + 2 * t * t * h) for t in lens)


def gemm_peak_gflops(threads: int, m: int = 4096, k: int = 384, n: int = 1536) -> float:
    """torch's fp32 GEMM rate on the encoder's FFN shape with `threads` threads: the practical matmul limit."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(m, k), torch.randn(n, k)
    torch.nn.functional.linear(a, b)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        torch.nn.functional.linear(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * m * k * n / best / 1e9


def llama_server(model: str, args: argparse.Namespace, slots: int) -> LlamaServer:
    """llama-server for embeddings with `slots` slots; -b = -ub = every slot's longest input, so that the inputs of
    all slots can share a ubatch (a non-causal input must fit one ubatch whole)."""
    ub = max(512, slots * args.len_range[1])
    return LlamaServer(model, args.threads, slots, ctx_per_slot=args.len_range[1],
                       extra_args=["--embeddings", "--pooling", "cls", "-b", str(ub), "-ub", str(ub),
                                   *args.llama_args.split()])


def best_llama_slots(model: str, args: argparse.Namespace, inputs: list[list[int]]) -> tuple[int, dict[int, float]]:
    """The slot count at which llama-server embeds `inputs` fastest (inputs/s per count). More slots batch more
    inputs per ubatch, but its attention then spans the whole ubatch (masked to each sequence): the best is small."""
    rates = {}
    for slots in (int(x) for x in str(args.llama_parallel).split(",")):
        with llama_server(model, args, slots) as srv:
            run = _http_runner(srv, args)
            run(inputs[:4])
            t0 = time.perf_counter()
            run(inputs)
            rates[slots] = len(inputs) / (time.perf_counter() - t0)
        print(f"llama-server -np {slots}: {rates[slots]:.1f} inputs/s", file=sys.stderr, flush=True)
    return max(rates, key=rates.__getitem__), rates


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def measure(args: argparse.Namespace) -> dict:
    from pagedllm import LLM

    common.set_threads(args.threads)
    model = args.model or embed_model.cached_embedder(args.type)
    n = args.num_inputs or (32 if args.quick else 256)
    from pagedllm.model.encoder_loader import load_encoder

    facts = load_encoder(model, "float32")  # the tokenizer (for the workload's ids) and config (for the FLOPs)
    inputs = workload(facts.tokenizer, n, args.len_range, args.seed)
    tokens = sum(len(p) for p in inputs)
    systems = args.systems.split(",")
    if "llama-server" in systems and not common.LLAMA_CPP.tool("llama-server"):
        print("llama-server not found (make bench-setup): pagedllm only", file=sys.stderr)
        systems.remove("llama-server")
    runners, servers, slots, sweep = {}, [], None, {}
    batch_args = ["--max-num-batched-tokens", str(args.batch_tokens), "--max-num-seqs", str(max(256, n))]
    if "offline" in systems:
        llm = LLM(model, runner="pooling", dtype=args.dtype, max_num_batched_tokens=args.batch_tokens,
                  max_num_seqs=max(256, n), seed=args.seed)
        runners["pagedllm offline"] = _offline_runner(llm)
    if "serve" in systems:
        srv = PagedllmServer(model, args.dtype, args.threads, ["--runner", "pooling", *batch_args])
        servers.append(srv)
        runners["pagedllm serve"] = _http_runner(srv, args)
    if "llama-server" in systems:
        slots, sweep = best_llama_slots(model, args, inputs[:args.sweep_inputs or (16 if args.quick else 48)])
        srv = llama_server(model, args, slots)
        servers.append(srv)
        runners["llama-server"] = _http_runner(srv, args)
    for srv in servers:
        srv.__enter__()
    try:
        for run in runners.values():  # warm-up: first-use costs stay out of the timings
            run(inputs[:4])
        times: dict[str, list[float]] = {name: [] for name in runners}
        vectors: dict[str, np.ndarray] = {}
        for rep in range(max(1, args.repeats)):
            for name in (list(runners) if rep % 2 == 0 else list(reversed(runners))):
                t0 = time.perf_counter()
                vectors[name] = runners[name](inputs)
                times[name].append(time.perf_counter() - t0)
                print(f"{name}: {n / times[name][-1]:.1f} inputs/s", file=sys.stderr, flush=True)
    finally:
        for srv in servers:
            srv.__exit__(None, None, None)
    flops = encoder_flops(facts.config, [len(p) for p in inputs])
    peak = gemm_peak_gflops(args.threads)
    ref = vectors.get("llama-server")
    base = n / statistics.median(times["llama-server"]) if ref is not None else None
    rows = []
    for name, ts in times.items():
        t = statistics.median(ts)
        cos = _cosines(vectors[name], ref) if ref is not None else None
        rows.append({"system": name, "inputs": n, "tokens": tokens, "seconds": t, "inputs_s": n / t,
                     "tokens_s": tokens / t, "vs_llama_server": n / t / base if base else None,
                     # the median of each round's own ratio: steadier than the ratio of medians on a busy machine
                     "vs_llama_pairwise": statistics.median(a / b for a, b in zip(times["llama-server"], ts,
                                                                                   strict=True)) if base else None,
                     "gflop_s": flops / t / 1e9, "of_gemm_peak": flops / t / 1e9 / peak,
                     # 1 - cosine to llama-server's vector of the same input: the worst and the mean
                     "max_1-cos": None if cos is None else float(1 - cos.min()),
                     "mean_1-cos": None if cos is None else float(1 - cos.mean())})
    print(common.table(rows, title=f"embeddings: {n} inputs of {args.len_range[0]}..{args.len_range[1]} tokens "
                                   f"({tokens} in all), {args.threads} threads, medians of {max(1, args.repeats)}; "
                                   f"fp32 GEMM peak {peak:.0f} GFLOP/s"
                                   + (f"; llama-server -np {slots} (inputs/s by -np: "
                                      + ", ".join(f"{k}: {v:.1f}" for k, v in sweep.items()) + ")" if slots else "")))
    payload = {"bench": "embed", "env": common.environment(args.threads), "model": model, "dtype": args.dtype,
               "settings": {k: getattr(args, k) for k in ("batch_tokens", "chunk", "concurrency", "len_range",
                                                          "seed", "llama_args")},
               "llama_slots": slots, "llama_slots_sweep": sweep,
               "llama_server": common.LLAMA_CPP.version(), "gemm_peak_gflops": peak, "results": rows,
               "times": times}
    jp, _ = common.save("embed" + args.tag, payload, None, args.out_dir)
    print(f"wrote {jp}")
    return payload


run = measure  # what `pagedllm bench` calls
