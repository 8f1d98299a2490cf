"""The offline single-stream reference of the serving sweep at concurrency 1: the same prompts, one at a time,
through `LLMEngine.step()` in a process of its own (the server's thread count and defaults), timing the first
token and every token after it as the step that produced it returns. What serving adds on top (HTTP, the
asyncio loop, the engine thread, streaming) is the serving figure over this one.

`pagedllm bench offline-stream --model M --workload W.json --out O.json --threads T [--dtype D]
[--quantization Q] [--max-step-ms auto]` writes {"records": [{"ttft", "chunk_times", "output_tokens"}...],
"elapsed_s"}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from pagedllm_bench import common


def stream(model: str | None, wl: common.Workload, dtype: str, quantization: str, max_step_ms: str,
           **engine_kwargs) -> dict:
    """engine_kwargs: further LLM() arguments (tests size the KV cache); the bench uses the server's defaults."""
    from pagedllm import LLM, SamplingParams

    kw = {"model": model} if model else {}
    llm = LLM(**kw, dtype=dtype, quantization=quantization, max_step_ms=max_step_ms, **engine_kwargs)
    engine = llm.engine

    def one(i: int, prompt: list[int], n: int) -> dict:
        params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
        t0 = time.perf_counter()
        engine.add_request(f"offline-{i}", prompt, params)
        times: list[float] = []
        seen = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                k = len(out.outputs[0].token_ids)
                times += [time.perf_counter() - t0] * (k - seen)  # a step's tokens arrive together
                seen = k
        engine.kv.reset_prefix_cache()  # the server sees no repeated prompt either
        return {"ttft": times[0], "chunk_times": times, "output_tokens": seen}

    one(-1, wl.prompts[0][:16], 4)  # warm-up, as the server gets
    t0 = time.perf_counter()
    records = [one(i, p, n) for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens, strict=True))]
    return {"records": records, "elapsed_s": time.perf_counter() - t0}


def measure(model: str | None, wl: common.Workload, threads: int, dtype: str, quantization: str,
            max_step_ms: str = "auto") -> dict:
    """Run the reference in a child process with the server's environment; its JSON result."""
    wl_path, out_path = common.out_path("offline-stream-workload", "json"), common.out_path("offline-stream", "json")
    with open(wl_path, "w", encoding="utf-8") as f:
        json.dump(wl.to_json(), f)
    cmd = [sys.executable, "-m", "pagedllm_bench", "offline-stream", "--workload", wl_path, "--out", out_path,
           "--dtype", dtype, "--quantization", quantization, "--max-step-ms", max_step_ms]
    cmd += ["--model", model] if model else []
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"})
    with open(out_path, encoding="utf-8") as f:
        return json.load(f)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--workload", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--max-step-ms", default="auto")


def run(args: argparse.Namespace) -> None:
    """The child process `measure` starts: the workload from a file, the result to a file."""
    with open(args.workload, encoding="utf-8") as f:
        wl = common.Workload.from_json(json.load(f))
    result = stream(args.model, wl, args.dtype, args.quantization, args.max_step_ms)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f)
