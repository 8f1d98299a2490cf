"""Single-stream decode and prefill speed against this machine's floors (bandwidth, bf16 matmul) and llama.cpp."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm_bench import common

PROMPT_LEN = 512
DECODE_TOKENS = 128


def measured_bandwidth(nbytes: int = 256 << 20, repeat: int = 5) -> float:
    """Bytes per second of a large tensor copy (read + write), best of `repeat`."""
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeat))
    return 2 * nbytes / best


def measured_matmul_rate(dtype: torch.dtype = torch.bfloat16, repeat: int = 20) -> float:
    """FLOP/s of a prefill-shaped linear ([2048, 576] x [576, 3072]), best of `repeat` after a warm-up call
    (the first calls create oneDNN's kernel; the best of 5 still varied 590-800 GFLOP/s here)."""
    x, w = torch.randn(2048, 576, dtype=dtype), torch.randn(3072, 576, dtype=dtype)
    torch.nn.functional.linear(x, w)
    best = min(_timed(lambda: torch.nn.functional.linear(x, w)) for _ in range(repeat))
    return 2 * 2048 * 576 * 3072 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def model_costs(llm: LLM) -> tuple[int, float]:
    """(weight bytes read per decode step, FLOPs per prompt token without the LM head)."""
    model = llm.engine.runner.model
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed.numel()
    flops = 2 * (sum(p.numel() for p in model.parameters() if p.dim() == 2) - embed
                 - (0 if model.lm_head is None else model.lm_head.weight.numel()))
    return nbytes, flops


def pagedllm_speeds(llm: LLM, prompt: list[int], repeat: int) -> tuple[float, float]:
    """(prefill tok/s for one PROMPT_LEN prompt, single-stream decode tok/s), medians over `repeat`."""
    prefill, decode = [], []
    for i in range(repeat):
        ids = [(t + i) % 40000 + 100 for t in prompt]  # a fresh prompt each time: no prefix-cache hits
        t0 = time.perf_counter()
        llm.generate([ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        prefill.append(PROMPT_LEN / (time.perf_counter() - t0))
        eng = llm.engine
        eng.add_request(f"decode-{i}", ids[:8], SamplingParams(temperature=0, max_tokens=DECODE_TOKENS + 1,
                                                                ignore_eos=True))
        eng.step()  # prefill and first token
        t0 = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        decode.append(DECODE_TOKENS / (time.perf_counter() - t0))
    return statistics.median(prefill), statistics.median(decode)


def python_share(llm: LLM, batch: int, params: SamplingParams, steps: int = 20) -> tuple[float, float, int]:
    """(decode step ms, fraction of it outside the model's forward, requests running) for `batch` requests."""
    eng, model = llm.engine, llm.engine.runner.model
    for i in range(batch):
        eng.add_request(f"share-{batch}-{i}", [(i * 7919 + t) % 40000 + 100 for t in range(200)], params)
    while eng.scheduler.waiting or any(r.num_output_tokens == 0 for r in eng.scheduler.running):
        eng.step()
    in_model = 0.0
    forward, logits = model.forward, model.compute_logits

    def timed(fn):
        def wrapper(*a, **k):
            nonlocal in_model
            t = time.perf_counter()
            out = fn(*a, **k)
            in_model += time.perf_counter() - t
            return out
        return wrapper

    model.forward, model.compute_logits = timed(forward), timed(logits)
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        total = time.perf_counter() - t0
        running = len(eng.scheduler.running)
    finally:
        model.forward, model.compute_logits = forward, logits
        eng.abort_request([f"share-{batch}-{i}" for i in range(batch)])
    return total / steps * 1e3, (total - in_model) / total, running


def llama_cpp_speeds(model_path: str, prompt: list[int], repeat: int) -> tuple[float, float] | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=model_path, n_ctx=2048, n_threads=torch.get_num_threads(), n_batch=512, verbose=False)
    prefill, decode = [], []
    for i in range(repeat):
        ids = [(t + i) % 40000 + 100 for t in prompt]
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        prefill.append(PROMPT_LEN / (time.perf_counter() - t0))
        llm.reset()
        llm.eval(ids[:8])
        t0 = time.perf_counter()
        for _ in range(DECODE_TOKENS):
            llm.eval([int(llm.scores[llm.n_tokens - 1].argmax())])
        decode.append(DECODE_TOKENS / (time.perf_counter() - t0))
    return statistics.median(prefill), statistics.median(decode)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    common.add_quantization_arg(p)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--quick", action="store_true", help="2 repetitions")
    p.add_argument("--kernels", choices=["invariant", "current", "both"], default="invariant",
                   help="batch-invariant kernels (the default), the batch-dependent ones, or both (an A/B)")


def run(args: argparse.Namespace) -> None:
    repeat = 2 if args.quick else args.repeat
    sets = ["invariant", "current"] if args.kernels == "both" else [args.kernels]
    llms = {k: LLM(dtype=args.dtype, kv_cache_memory="2GiB", quantization=args.quantization,
                 batch_invariant=k == "invariant") for k in sets}
    llm = llms[sets[0]]
    prompt = list(range(PROMPT_LEN))
    bandwidth, matmul = measured_bandwidth(), measured_matmul_rate(llm.engine.runner.model.dtype)
    weight_bytes, flops_per_token = model_costs(llm)
    decode_floor = bandwidth / weight_bytes  # every weight read once per token
    prefill_floor = matmul / flops_per_token
    rows = [(f"pagedllm {args.dtype} {k} kernels", *pagedllm_speeds(each, prompt, repeat))
            for k, each in llms.items()]
    peer = None if args.no_llama_cpp else llama_cpp_speeds(llm.engine.args.model or _default_path(), prompt,
                                                            repeat)
    if peer:
        rows.append(("llama.cpp (Q4_1, llama-cpp-python)", *peer))
    print(f"machine: copy bandwidth {bandwidth / 1e9:.1f} GB/s, {args.dtype} matmul {matmul / 1e9:.0f} GFLOP/s, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"floors: decode {decode_floor:.0f} tok/s ({weight_bytes / 1e6:.0f} MB of weights per token), "
          f"prefill {prefill_floor:.0f} tok/s ({flops_per_token / 1e6:.0f} MFLOP per token)")
    print(f"{'system':38} {'prefill tok/s':>14} {'vs floor':>9} {'decode tok/s':>13} {'vs floor':>9}")
    for name, pf, dc in rows:
        print(f"{name:38} {pf:14.0f} {pf / prefill_floor:9.2f} {dc:13.1f} {dc / decode_floor:9.2f}")
    if len(llms) == 2:
        (_, pf_inv, dc_inv), (_, pf_cur, dc_cur) = rows[:2]
        print(f"invariant / current kernels: prefill {pf_inv / pf_cur:.3f}x, decode {dc_inv / dc_cur:.3f}x "
              "(target >= 0.95)")
    if peer:
        prefill, decode = rows[0][1:]
        print(f"pagedllm / llama.cpp: prefill {prefill / peer[0]:.2f}x, decode {decode / peer[1]:.2f}x")
    print("\nPython-side share of a decode step (everything outside the model's forward):")
    for batch in (64, 256):
        for label, params in (("greedy", SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)),
                              ("T=0.8 top_p=0.95", SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64,
                                                                  ignore_eos=True))):
            if args.quick and batch > 64:
                continue
            ms, share, running = python_share(llm, batch, params)
            print(f"  {running:4d} running, {label:17}: step {ms:7.1f} ms, outside the model {share:6.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": bandwidth, "matmul_flops": matmul, "weight_bytes": weight_bytes,
                       "flops_per_token": flops_per_token, "rows": rows}, f, indent=1)


def _default_path() -> str:
    from pagedllm.model.loader import default_model_path

    return default_model_path()
