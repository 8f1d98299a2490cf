"""Realistic sizes: pagedllm (weights as stored, and dequantized) vs llama.cpp on the same GGUF file.

`pagedllm bench realistic --model F.gguf` or `--shape tinyllama-1.1b --type Q4_0` (the file is written once by
`bench make-model` into the cache). Every system runs in its own processes (peak RSS is per process): a
"single" process loads the model with a 2048-token context budget and measures load time, single-stream decode
(8-token prompt, greedy, EOS ignored), decode deep in the context (64 tokens after a 1536-token prompt: the KV
rows each step reads come to ~10-20% of the weight bytes on 1-3B shapes) and prefill (llama.cpp: llama-server with
one slot and its own timings, where it was built); an "offline" process runs 32 concurrent requests (prompts of
64-448 tokens, 128 output tokens each): pagedllm batches them, llama.cpp runs them batched too, through
llama-server with one slot per request (`--parallel 32`, continuous batching; llama-cpp-python's one-stream API
only where no llama-server was built, and then over the first few requests). Ratios are of numbers taken in the
same run.

Roofline columns: decode GB/s is the weight bytes a token reads (every matrix of the file but an untied token
embedding; of a mixture of experts, the experts a token uses: the active bytes) times tokens/s, against the read bandwidth `bench membw` measures with the same threads; prefill
GOP/s is 2 x the layer matrices' elements per prompt token (the linears; attention and the head, which runs for
the prompt's last token only, left out), against the measured int8 dot peak.

`--repeats N` runs every system's processes N times, the systems alternating within each round (a noisy machine
moves both between rounds), and reports each figure's median over the rounds, with each round's ratios. Each
round's roofline fractions are against the limits measured just before it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from functools import partial

from pagedllm.dtypes import auto_dtype
from pagedllm.kernels.variants import MATRIX_ENGINE_ENV
from pagedllm_bench import common

# pagedllm-vnni: the same as pagedllm with the packed GEMM kept off AMX ($PAGEDLLM_MATRIX_ENGINE=0), on CPUs with it
SYSTEMS = {"pagedllm": {"quantization": "auto"}, "pagedllm-dequant": {"quantization": "none"},
           "pagedllm-vnni": {"quantization": "auto", "env": {MATRIX_ENGINE_ENV: "0"}},
           **{name: {} for name in common.LLAMA_PEERS}}
CONTEXT = 2048  # tokens of KV cache for the single-stream process (llama.cpp's n_ctx, pagedllm's blocks)
LONG_PROMPT = 1536  # the prompt of the decode-deep-in-the-context figure


def _workloads(model: str, quick: bool) -> dict:
    import numpy as np

    rng = np.random.default_rng(0)
    ids = common.normal_token_ids(model)
    n_req, prompt_len, out_len = (8, (32, 128), (16, 16)) if quick else (32, (64, 448), (128, 128))
    offline = common.offline_workload(n_req, prompt_len, out_len, seed=1, model_path=model)
    return {"decode_prompt": common.random_prompts(rng, ids, [8])[0], "decode_tokens": 16 if quick else 64,
            "prefill_prompts": common.random_prompts(rng, ids, [128 if quick else 512] * 2),
            "long_prompt": common.random_prompts(rng, ids, [256 if quick else LONG_PROMPT])[0],
            "offline": offline.to_json(), "llama_offline_requests": 2 if quick else 8}


# ---- the systems, behind one small interface --------------------------------------------------------------
def _context_blocks(model: str, tokens: int, block_size: int = 16) -> int:
    """KV blocks one request of `tokens` tokens holds (llama.cpp's n_ctx): tokens / block_size per KV group, so a
    hybrid model (Gemma 3: sliding-window and full layers) gets a block table's worth for each of its groups."""
    from pagedllm.core.kv_groups import plan_kv_groups, request_blocks
    from pagedllm.model.gguf_config import config_from_gguf
    from pagedllm.model.gguf_reader import read_gguf

    cfg = config_from_gguf(read_gguf(model))
    layout = plan_kv_groups([cfg.layer_window(i) for i in range(cfg.num_layers)], tokens)
    return request_blocks(layout.windows, block_size, tokens, step_tokens=tokens)


class _Pagedllm:
    def __init__(self, model: str, quantization: str, kv_tokens: int | None, dtype: str):
        from pagedllm import LLM

        kw = {"num_kv_blocks": _context_blocks(model, kv_tokens), "block_size": 16} if kv_tokens \
            else {"kv_cache_memory": "1GiB"}
        t0 = time.perf_counter()
        self.llm = LLM(model, dtype=dtype, quantization=quantization, **kw)
        self.load_s = time.perf_counter() - t0

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> int:
        from pagedllm import SamplingParams

        params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in max_tokens]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        self.llm.engine.kv.reset_prefix_cache()
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def decode_rate(self, prompt: list[int], n: int) -> float:
        """Tokens/s of the n tokens after the first (the request's own token times: its prefill left out)."""
        from pagedllm import SamplingParams

        out = self.llm.generate([prompt], SamplingParams(max_tokens=n + 1, ignore_eos=True, temperature=0.0),
                                use_tqdm=False)[0]
        self.llm.engine.kv.reset_prefix_cache()
        return n / (out.metrics.last_token_time - out.metrics.first_token_time)


class _LlamaCpp:
    def __init__(self, model: str, kv_tokens: int | None, threads: int):
        from llama_cpp import Llama

        t0 = time.perf_counter()
        self.llm = Llama(model_path=model, n_ctx=kv_tokens or CONTEXT, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, verbose=False)
        self.load_s = time.perf_counter() - t0

    def _tokens(self, prompt: list[int], n: int) -> Iterator[int]:
        """The first n greedy tokens of one stream (llama-cpp-python yields past EOS: stopped by count)."""
        return itertools.islice(self.llm.generate(prompt, temp=0.0, top_k=1, reset=True), n)

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> int:
        return sum(sum(1 for _ in self._tokens(p, n)) for p, n in zip(prompts, max_tokens, strict=True))

    def decode_rate(self, prompt: list[int], n: int) -> float:
        tokens = self._tokens(prompt, n + 1)
        next(tokens)  # the first token ends the prefill
        t0 = time.perf_counter()
        k = sum(1 for _ in tokens)
        return k / (time.perf_counter() - t0)


def _open(system: str, model: str, kv_tokens: int | None, threads: int, dtype: str):
    if system == "llama.cpp":
        return _LlamaCpp(model, kv_tokens, threads)
    return _Pagedllm(model, SYSTEMS[system]["quantization"], kv_tokens, dtype)


def _best(f, repeats: int = 2) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


def run_single_llama_server(model: str, wl: dict, threads: int, peer: common.LlamaPeer) -> dict:
    """llama.cpp's single stream through llama-server (-np 1): its sampling runs in C++ and it reports its own
    prompt and decode timings. llama-cpp-python's generate() samples in Python over the whole vocabulary, which
    on a 151,936-token vocabulary cost more than the decode step itself: that peer was not at its best."""
    from pagedllm_bench.serving import LlamaServer

    def completion(srv: LlamaServer, prompt: list[int], n: int) -> dict:
        return srv.completion(prompt, n, ignore_eos=True)["timings"]

    p, d = wl["decode_prompt"], wl["decode_tokens"]
    with LlamaServer(model, threads, 1, CONTEXT, peer=peer) as srv:
        completion(srv, p, 2)  # warm-up
        decode = [completion(srv, p, 1 + d) for _ in range(2)]
        deep = [completion(srv, wl["long_prompt"], 1 + d) for _ in range(2)]
        prefill = [completion(srv, q, 1) for q in wl["prefill_prompts"]]
        rss = srv.peak_rss_mb()
    return {"load_s": srv.load_s, "decode_tok_s": max(t["predicted_per_second"] for t in decode),
            "decode_deep_tok_s": max(t["predicted_per_second"] for t in deep),
            "ttft_s": min(t["prompt_ms"] for t in decode) / 1e3,
            "prefill_tok_s": max(t["prompt_per_second"] for t in prefill), "peak_rss_mb": rss,
            "config": f"{srv.name} -np 1"}


def run_single(system: str, model: str, wl: dict, threads: int, dtype: str, *, decode_only: bool = False) -> dict:
    """Load, single-stream decode, then (unless decode_only: for files whose prefill would take long on this CPU)
    prefill and decode deep in the context."""
    if _served(system):
        return run_single_llama_server(model, wl, threads, common.LLAMA_PEERS[system])
    m = _open(system, model, CONTEXT, threads, dtype)
    p, d = wl["decode_prompt"], wl["decode_tokens"]
    m.generate([p], [2])  # warm-up (kernel load, allocator)
    t_first = _best(lambda: m.generate([p], [1]))
    t_all = _best(lambda: m.generate([p], [1 + d]))
    out = {"load_s": m.load_s, "decode_tok_s": d / max(t_all - t_first, 1e-9), "ttft_s": t_first}
    if not decode_only:
        prefill = wl["prefill_prompts"]
        t_prefill = min(_best(lambda q=q: m.generate([q], [1]), 1) for q in prefill)
        out["decode_deep_tok_s"] = max(m.decode_rate(wl["long_prompt"], d) for _ in range(2))
        out["prefill_tok_s"] = len(prefill[0]) / t_prefill
    return out | {"peak_rss_mb": common.peak_rss_mb()}


def run_offline(system: str, model: str, wl: dict, threads: int, dtype: str) -> dict:
    off = common.Workload.from_json(wl["offline"])
    if _served(system):
        from pagedllm_bench.peers import run_llama_server

        res = run_llama_server(off, threads, len(off.prompts), model, common.LLAMA_PEERS[system])
        return {"offline_requests": len(off.prompts), "offline_out_tok_s": res["out_tok_per_s"],
                "offline_req_s": res["req_per_s"], "offline_peak_rss_mb": res["peak_rss_mb"],
                "offline_config": f"{res['server']} --parallel {len(off.prompts)}"}
    if system == "llama.cpp":
        off = off.head(wl["llama_offline_requests"])
    m = _open(system, model, None, threads, dtype)
    m.generate([off.prompts[0][:16]], [2])  # warm-up
    t0 = time.perf_counter()
    n = m.generate(off.prompts, off.output_lens)
    elapsed = time.perf_counter() - t0
    return {"offline_requests": len(off.prompts), "offline_out_tok_s": n / elapsed,
            "offline_req_s": len(off.prompts) / elapsed, "offline_peak_rss_mb": common.peak_rss_mb(),
            "offline_config": "one stream" if system == "llama.cpp" else "batched"}


def weights_per_token(model: str) -> tuple[int, int]:
    """(bytes of the matrices a decode token reads, multiply-adds of a prompt token): a decode token reads every
    layer matrix and the output head (the token embedding where the file ties them), and of a mixture of experts
    only the experts it uses (expert_used_count of each stacked expert tensor: the active bytes); a prompt token
    multiplies by the same layer matrices (the head runs for a prompt's last token, an embedding is one row read)."""
    from pagedllm.model.gguf_reader import read_gguf
    from pagedllm.quantization.types import BY_ID

    f = read_gguf(model)
    head = "output.weight" if "output.weight" in f.tensors else "token_embd.weight"
    used = int(f.metadata.get(f"{f.architecture}.expert_used_count", 0) or 0)
    nbytes = layer_elements = 0
    for name, t in f.tensors.items():
        if len(t.shape) not in (2, 3) or not (name.startswith("blk.") or name == head):
            continue
        active = min(used, t.shape[0]) if len(t.shape) == 3 else 1  # experts a token reads of a stack
        n = t.shape[-2] * t.shape[-1] * active
        nbytes += n // BY_ID[t.ggml_type].block * BY_ID[t.ggml_type].bytes
        if name != head:
            layer_elements += n
    return nbytes, layer_elements


def add_roofline(rows: list[dict], model: str, lim: dict) -> None:
    """Decode GB/s and prefill GOP/s of each system, and their fractions of the machine's limits."""
    nbytes, layer_elements = weights_per_token(model)
    for r in rows:
        if "decode_tok_s" in r:
            r["decode_gb_s"] = r["decode_tok_s"] * nbytes / 1e9
            r["decode_of_read_bw"] = r["decode_gb_s"] / lim["read_gb_s"]
        if "prefill_tok_s" in r:
            r["prefill_gop_s"] = r["prefill_tok_s"] * 2 * layer_elements / 1e9
            if lim["int8_peak_gops"]:
                r["prefill_of_int8_peak"] = r["prefill_gop_s"] / lim["int8_peak_gops"]
            if lim.get("amx_int8_peak_gops"):
                r["prefill_of_amx_peak"] = r["prefill_gop_s"] / lim["amx_int8_peak_gops"]


# ---- driver ------------------------------------------------------------------------------------------
def _subprocess(phase: str, system: str, model: str, wl_path: str, threads: int, dtype: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "pagedllm_bench", "realistic", "--worker", phase, "--system", system,
           "--model", model, "--workload", wl_path, "--out", out, "--threads", str(threads), "--dtype", dtype]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), **SYSTEMS.get(system, {}).get("env", {})}
    subprocess.run(cmd, check=True, env=env)
    with open(out, encoding="utf-8") as f:
        res = json.load(f)
    os.unlink(out)
    return res


def resolve_model(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    from pagedllm_bench.make_model import cached_model

    return cached_model(args.shape, args.type, args.layers)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a GGUF file (default: --shape/--type, written once)")
    p.add_argument("--shape", default="tinyllama-1.1b")
    p.add_argument("--type", default="Q4_0")
    p.add_argument("--layers", type=int, default=None, help="the shape with fewer layers (same widths)")
    p.add_argument("--systems", default="pagedllm,pagedllm-dequant,llama.cpp",
                   help=f"comma-separated, from {list(SYSTEMS)}")
    p.add_argument("--phases", default="single,offline",
                   help="single (load, decode, prefill, long context), offline (32 concurrent), or decode (load "
                        "and decode alone)")
    p.add_argument("--threads", type=int, default=common.DEFAULT_THREADS)
    p.add_argument("--dtype", default=auto_dtype(quantized=True), choices=["float32", "bfloat16"],
                   help="pagedllm's activations (default: bfloat16 where the CPU has avx512_bf16, else float32)")
    p.add_argument("--quick", action="store_true", help="fewer tokens and requests (checks the command runs)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of every system, alternating; medians reported")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--system", default=None, help=argparse.SUPPRESS)
    p.add_argument("--workload", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> dict:
    if args.worker:
        common.set_threads(args.threads)
        with open(args.workload, encoding="utf-8") as f:
            wl = json.load(f)
        fn = {"single": run_single, "decode": partial(run_single, decode_only=True), "offline": run_offline}[
            args.worker]
        res = fn(args.system, args.model, wl, args.threads, args.dtype)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(res, f)
        return res
    model = resolve_model(args)
    systems = [s for s in args.systems.split(",") if s]
    if "llama.cpp" in systems and not _has_llama_cpp():
        print("neither llama-server nor llama-cpp-python is installed (make bench-setup): skipping llama.cpp")
        systems.remove("llama.cpp")
    for name in [s for s in systems if s.startswith("ik_llama") and not _served(s)]:
        print(f"{name}: no ik-llama-server (make bench-setup IK_LLAMA_SRC=path): skipping it")
        systems.remove(name)
    wl = _workloads(model, args.quick)
    wl_path = common.out_path("realistic-workload", "json")
    with open(wl_path, "w", encoding="utf-8") as f:
        json.dump(wl, f)
    from pagedllm_bench.membw import limits

    rounds, lims = [], []
    for _ in range(max(1, args.repeats)):
        limits.cache_clear()  # each round against the limits measured just before it: they move between minutes
        lim = limits(args.threads)
        lims.append(lim)
        print(f"machine limits: {json.dumps(lim)}", flush=True)
        rows = []
        for system in systems:
            row = {"system": system}
            for phase in args.phases.split(","):
                row.update(_subprocess(phase, system, model, wl_path, args.threads, args.dtype))
            rows.append(row)
            print(json.dumps(row), flush=True)
        add_roofline(rows, model, lim)
        rounds.append(rows)
    rows = _medians(rounds) if len(rounds) > 1 else rounds[0]
    ratios = _ratios(rows)
    if len(rounds) > 1:
        print(common.table([{"round": i + 1, **r} for i, rs in enumerate(rounds) for r in _ratios(rs)],
                           title="ratios of each round"))
    title = (f"realistic: {os.path.basename(model)}, {args.threads} threads, pagedllm {args.dtype}"
             + (f", median of {len(rounds)} rounds" if len(rounds) > 1 else "") + (" (quick)" if args.quick else ""))
    print(common.table(rows, title=title))
    print(common.table(ratios, title="ratios (same run)"))
    payload = {"model": model, "rows": rows, "ratios": ratios, "rounds": rounds, "limits": lims,
               "env": common.environment(args.threads), "quick": args.quick}
    common.save(f"realistic-{os.path.basename(model).removesuffix('.gguf')}", payload)
    return payload


def _medians(rounds: list[list[dict]]) -> list[dict]:
    """One row per system: the median of each of its numeric figures over the rounds."""
    out = []
    for i, first in enumerate(rounds[0]):
        rs = [rows[i] for rows in rounds]
        out.append({k: common.median([r[k] for r in rs]) if isinstance(v, (int, float)) else v
                    for k, v in first.items()})
    return out


def _ratios(rows: list[dict]) -> list[dict]:
    by = {r["system"]: r for r in rows}
    out = []
    for base in (*common.LLAMA_PEERS, "pagedllm-dequant", "pagedllm-vnni"):
        if "pagedllm" not in by or base not in by:
            continue
        ours, ref = by["pagedllm"], by[base]
        out.append({"pagedllm vs": base, **{k: ours[k] / ref[k] for k in
                    ("decode_tok_s", "decode_deep_tok_s", "prefill_tok_s", "offline_out_tok_s", "peak_rss_mb", "load_s")
                    if k in ours and k in ref and ref[k]}})
    return out


def _served(system: str) -> bool:
    """Whether the system is a llama.cpp-family peer whose llama-server is built (else llama.cpp falls back to
    llama-cpp-python)."""
    return system in common.LLAMA_PEERS and common.LLAMA_PEERS[system].tool("llama-server") is not None


def _has_llama_cpp() -> bool:
    import importlib.util

    return _served("llama.cpp") or importlib.util.find_spec("llama_cpp") is not None
