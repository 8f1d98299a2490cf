"""The benchmark lab: `pagedllm bench NAME ...` (or `python -m pagedllm_bench NAME ...`).

A separate distribution from the engine (`pip install -e bench/`, which `make install` does), so that
`pip install pagedllm` installs the engine alone. Each bench is a module with `add_args(parser)` and `run(args)`;
it is imported only when it is asked for.
"""

from __future__ import annotations

import argparse
import importlib
import os

# name -> one line of help; the module is the name with '-' as '_'
BENCHES: dict[str, str] = {
    "blocks": "cost of the paged-KV bookkeeping per block as the pool grows",
    "kernel": "paged attention kernel against gather-then-SDPA and contiguous SDPA",
    "engine": "single-stream decode and prefill against this machine's floors and llama.cpp",
    "compile": "three ways to run a bf16 decoder layer's pointwise parts",
    "throughput": "offline throughput against transformers and llama.cpp",
    "memory": "KV memory: paged against contiguous, and a block-size sweep",
    "prefix": "prefix caching on against off",
    "beam": "beam search and parallel sampling on shared blocks",
    "serving": "online serving against llama-server (Poisson arrivals, sweeps, replicas)",
    "router_sim": "data-parallel routing policies over simulated replicas",
    "soak": "mixed valid, invalid and disconnecting requests against a live server",
    "spec": "speculative decoding against plain decoding",
    "realistic": "real model shapes as stored and dequantized against llama.cpp on the same GGUF",
    "make-model": "write a random-weight GGUF of a real model shape",
    "structured": "structured-output backends and what constraining costs",
    "membw": "the machine's bandwidth and matmul limits",
    "quant": "the quantized GEMM per GGUF type against the machine's limits",
    "kv-store": "stores for the prefix cache's disk tier",
    "fuzz": "hostile GGUF files and chat templates for N minutes",
    "perplexity": "perplexity as stored, dequantized and with llama.cpp",
    "lora": "a batch mixing LoRA adapters and the base model against the base model alone",
    "embed": "embeddings throughput on a BERT-family GGUF against llama-server --embeddings",
    "gpu": "the engine on a CUDA GPU against transformers, in one JSON (issue 58's check)",
}
# worker entry points the benches start as subprocesses (not listed in the help)
WORKERS = ("peers", "offline-stream")
# the benches' default model stays the 135M their figures in BENCHMARKS.md were taken on (the engine's default is
# the 0.5B); --model, or $PAGEDLLM_DEFAULT_MODEL, picks another
BENCH_DEFAULT_MODEL = "smollm2-135m-instruct"


def module_of(name: str):
    return importlib.import_module(f"pagedllm_bench.{name.replace('-', '_')}")


def main(argv: list[str]) -> int:
    """Run the bench `argv[0]` with the rest of `argv` as its arguments."""
    listing = "\n".join(f"  {n:<12} {h}" for n, h in BENCHES.items())
    top = argparse.ArgumentParser(prog="pagedllm bench", formatter_class=argparse.RawDescriptionHelpFormatter,
                                  description="benchmarks (BENCHMARKS.md has their figures)",
                                  epilog=f"benches:\n{listing}\n\n`pagedllm bench NAME --help` for a bench's options")
    top.add_argument("name", choices=[*BENCHES, *WORKERS], metavar="NAME", help="a bench listed below")
    top.add_argument("args", nargs=argparse.REMAINDER, help="its options")
    a = top.parse_args(argv)
    module = module_of(a.name)
    p = argparse.ArgumentParser(prog=f"pagedllm bench {a.name}", description=(module.__doc__ or "").strip())
    module.add_args(p)
    from pagedllm.model.embedded import DEFAULT_MODEL_ENV

    os.environ.setdefault(DEFAULT_MODEL_ENV, BENCH_DEFAULT_MODEL)
    result = module.run(p.parse_args(a.args))  # a bench prints and writes its results; failures raise
    return result if a.name in WORKERS and isinstance(result, int) else 0
