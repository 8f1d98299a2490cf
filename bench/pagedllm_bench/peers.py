"""Run one system on one offline workload and report its throughput: pagedllm, transformers `generate` (static
batching), transformers `generate_batch` (continuous batching), llama-cpp-python (one stream at a time) and
llama-server (parallel slots, driven over HTTP).

`pagedllm bench peers --system hf-static --workload wl.json --out r.json`: `bench throughput`
runs each system in its own process through this module, so that peak RSS and thread settings are per system.
Every system gets the same token-id prompts and generates exactly the requested number of tokens (EOS ignored,
greedy). The peers are installed by `make bench-setup`, never by the core package.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from pagedllm_bench import common

SYSTEMS = ["pagedllm", "hf-static", "hf-cb", "llama-cpp-python", "llama-server"]


def _result(system: str, wl: common.Workload, elapsed: float, output_tokens: int, **extra) -> dict:
    n = len(wl.prompts)
    return {"system": system, "requests": n, "prompt_tokens": wl.num_prompt_tokens,
            "output_tokens": output_tokens, "elapsed_s": elapsed, "req_per_s": n / elapsed,
            "out_tok_per_s": output_tokens / elapsed,
            "total_tok_per_s": (wl.num_prompt_tokens + output_tokens) / elapsed,
            "peak_rss_mb": common.peak_rss_mb(), **extra}


def _check_counts(system: str, got: list[int], want: list[int]) -> None:
    if got != want:
        bad = sum(g != w for g, w in zip(got, want, strict=True))
        raise RuntimeError(f"{system}: {bad} requests generated a different number of tokens than asked")


# ---- pagedllm ----------------------------------------------------------------------------------------
def run_pagedllm(wl: common.Workload, dtype: str, model: str | None = None, **engine_kwargs) -> dict:
    from pagedllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, dtype=dtype, **engine_kwargs)
    load_s = time.perf_counter() - t0
    common.warm_up(llm)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in wl.output_lens]
    t0 = time.perf_counter()
    outs = llm.generate(wl.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    got = [len(o.outputs[0].token_ids) for o in outs]
    _check_counts("pagedllm", got, wl.output_lens)
    stats = llm.kv_cache_stats()
    return _result("pagedllm", wl, elapsed, sum(got), dtype=dtype, config=f"block {stats['block_size']}",
                   load_s=load_s, kv=stats, **_matmul_floor(llm, wl.num_prompt_tokens + sum(got), sum(got), elapsed))


def _matmul_floor(llm, tokens: int, logit_rows: int, elapsed: float) -> dict:
    """The run's linear-layer FLOPs over the measured matmul rate: every token through every linear once, the
    LM head once per generated token (attention and everything else counted as free). Dense weights only: the
    dense matmul rate is no floor for quantized ones (and their stored sizes are not their FLOPs)."""
    from pagedllm.model.linear import DenseLinearMethod, Linear
    from pagedllm_bench.engine import measured_matmul_rate, model_costs

    model = llm.engine.runner.model
    if any(isinstance(m, Linear) and not isinstance(m.method, DenseLinearMethod) for m in model.modules()):
        return {}
    _, flops_per_token = model_costs(llm)
    flops = tokens * flops_per_token + logit_rows * 2 * model.embed.numel()
    rate = measured_matmul_rate(model.dtype)
    return {"linear_flops": flops, "matmul_flops_per_s": rate, "matmul_floor_s": flops / rate,
            "matmul_floor_x": elapsed / (flops / rate)}


# ---- transformers ------------------------------------------------------------------------------------
def load_hf(model: str | None, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    path = model or common.default_model_path()
    t0 = time.perf_counter()
    if path.endswith(".gguf"):  # transformers dequantises the GGUF itself (15-35 s)
        m = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                 gguf_file=os.path.basename(path), dtype=torch.float32)
    else:
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    m = m.to(getattr(torch, dtype)).eval()
    return m, time.perf_counter() - t0


def _hf_generate_batch(m, prompts: list[list[int]], max_new: int, pad_id: int):
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generation wants
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        # min_new_tokens == max_new_tokens: EOS is masked out, every row generates exactly max_new tokens
        return m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                          do_sample=False, pad_token_id=pad_id)


def run_hf_static(wl: common.Workload, dtype: str, batch_sizes: list[int], model: str | None = None,
                  max_batches: int | None = None) -> dict:
    """transformers generate on fixed batches in arrival order; a batch runs until its longest output is done,
    so the useful tokens are the requested ones (the rest of each batch's work is static batching's waste).
    max_batches: time only the first batches of each size (the requests are i.i.d., so the rate carries over)."""
    m, load_s = load_hf(model, dtype)
    pad_id = 0
    _hf_generate_batch(m, wl.prompts[:2], 2, pad_id)  # warm-up
    sweep = []
    for bs in batch_sizes:
        t0 = time.perf_counter()
        computed = useful = done = 0
        for i in range(0, len(wl.prompts), bs):
            olens = wl.output_lens[i:i + bs]
            out = _hf_generate_batch(m, wl.prompts[i:i + bs], max(olens), pad_id)
            computed += out.shape[0] * max(olens)
            useful += sum(olens)
            done += len(olens)
            if max_batches and i // bs + 1 >= max_batches:
                break
        elapsed = time.perf_counter() - t0
        sweep.append({"batch_size": bs, "elapsed_s": elapsed, "requests_timed": done, "useful_tokens": useful,
                      "out_tok_per_s": useful / elapsed, "computed_output_tokens": computed})
        print(f"hf-static {dtype} batch {bs}: {useful / elapsed:.1f} out tok/s ({done} requests, "
              f"{elapsed:.1f}s)", file=sys.stderr, flush=True)
    best = max(sweep, key=lambda s: s["out_tok_per_s"])
    # whole-workload time at the best batch's measured rate (exact when every batch was timed)
    elapsed = wl.num_output_tokens / best["out_tok_per_s"]
    return _result("hf-static", wl, elapsed, wl.num_output_tokens, dtype=dtype,
                   config=f"batch {best['batch_size']}" + ("" if best["requests_timed"] == len(wl.prompts)
                                                           else f" ({best['requests_timed']} req timed)"),
                   load_s=load_s, sweep=sweep)


def run_hf_cb(wl: common.Workload, dtype: str, model: str | None = None) -> dict:
    """transformers continuous batching (its paged cache + scheduler), each request with its own max_new_tokens."""
    from transformers import GenerationConfig

    m, load_s = load_hf(model, dtype)
    cfg = GenerationConfig(do_sample=False, max_new_tokens=max(wl.output_lens), eos_token_id=-1, pad_token_id=0)
    got: dict[str, int] = {}
    with m.continuous_batching_context_manager(generation_config=cfg, block=True, timeout=30) as manager:
        t0 = time.perf_counter()
        for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens, strict=True)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        while len(got) < len(wl.prompts):
            r = manager.get_result(timeout=5)
            if r is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped")
                continue
            if r.is_finished():
                if r.error:
                    raise RuntimeError(f"hf-cb request {r.request_id} failed: {r.error}")
                got[r.request_id] = len(r.generated_tokens)
        elapsed = time.perf_counter() - t0
    counts = [got[f"r{i}"] for i in range(len(wl.prompts))]
    _check_counts("hf-cb", counts, wl.output_lens)
    return _result("hf-cb", wl, elapsed, sum(counts), dtype=dtype, config="generate_batch", load_s=load_s)


# ---- llama.cpp ---------------------------------------------------------------------------------------
def run_llama_cpp_python(wl: common.Workload, threads: int, model: str | None = None) -> dict:
    """llama-cpp-python's Llama: one sequence at a time (its high-level API has no batching across requests)."""
    from llama_cpp import Llama

    path = model or common.default_model_path()
    ctx = max(len(p) + n for p, n in zip(wl.prompts, wl.output_lens, strict=True)) + 8
    t0 = time.perf_counter()
    llm = Llama(model_path=path, n_ctx=ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                verbose=False)
    load_s = time.perf_counter() - t0
    counts = []
    t0 = time.perf_counter()
    for p, n in zip(wl.prompts, wl.output_lens, strict=True):
        k = 0
        for _ in llm.generate(p, temp=0.0, top_k=1, reset=True):  # yields past EOS: we stop by count
            k += 1
            if k == n:
                break
        counts.append(k)
    elapsed = time.perf_counter() - t0
    _check_counts("llama-cpp-python", counts, wl.output_lens)
    return _result("llama-cpp-python", wl, elapsed, sum(counts), dtype="Q4_1 (GGUF)", config="1 stream",
                   load_s=load_s)


def run_llama_server(wl: common.Workload, threads: int, parallel: int, model: str | None = None,
                     peer: common.LlamaPeer = common.LLAMA_CPP) -> dict:
    """llama-server with `parallel` slots and continuous batching; the client keeps `parallel` requests in flight."""
    from pagedllm_bench import serving

    ctx_per_slot = max(len(p) + n for p, n in zip(wl.prompts, wl.output_lens, strict=True)) + 16
    with serving.LlamaServer(model, threads=threads, parallel=parallel, ctx_per_slot=ctx_per_slot, peer=peer) as srv:
        recs, elapsed = serving.run_closed_loop(srv.url, wl, concurrency=parallel, extra=srv.extra_body)
        rss = srv.peak_rss_mb()
    counts = [r.output_tokens for r in recs]
    _check_counts("llama-server", counts, wl.output_lens)
    res = _result("llama-server", wl, elapsed, sum(counts), dtype="Q4_1 (GGUF)", config=f"{parallel} slots",
                  server=srv.name, load_s=srv.load_s)
    res["peak_rss_mb"] = rss
    return res


# ---- one system, in this process ---------------------------------------------------------------------
def run_system(system: str, wl: common.Workload, args: argparse.Namespace) -> dict:
    common.set_threads(args.threads)
    if system == "pagedllm":
        kw = json.loads(args.engine_kwargs or "{}")
        return run_pagedllm(wl, args.dtype, args.model, **kw)
    if system == "hf-static":
        return run_hf_static(wl, args.dtype, args.batch_sizes, args.model, args.max_batches)
    if system == "hf-cb":
        return run_hf_cb(wl, args.dtype, args.model)
    if system == "llama-cpp-python":
        return run_llama_cpp_python(wl, args.threads, args.gguf)
    if system == "llama-server":
        return run_llama_server(wl, args.threads, args.parallel, args.gguf)
    raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS}")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", required=True, choices=SYSTEMS)
    p.add_argument("--workload", required=True, help="a workload JSON written by the throughput bench")
    p.add_argument("--out", required=True, help="where to write this system's result JSON")
    p.add_argument("--model", default=None)
    p.add_argument("--gguf", default=None, help="GGUF for the llama.cpp peers (default: the embedded model)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=common.DEFAULT_THREADS)
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32, 64])
    p.add_argument("--max-batches", type=int, default=None, help="hf-static: time only the first N batches")
    p.add_argument("--parallel", type=int, default=32, help="llama-server slots")
    p.add_argument("--engine-kwargs", default=None, help="JSON dict of extra pagedllm LLM(...) arguments")


def run(args: argparse.Namespace) -> int:
    with open(args.workload, encoding="utf-8") as f:
        wl = common.Workload.from_json(json.load(f))
    res = run_system(args.system, wl, args)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1)
    return 0
