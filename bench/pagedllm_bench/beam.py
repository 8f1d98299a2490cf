"""Beam search and parallel sampling on shared blocks: peak KV blocks with sharing vs without.

`pagedllm bench beam [--quick] [--num-prompts 16] [--widths 1,2,4,8]`. For each width W: beam search (beam_width
W) and parallel sampling (n=W, temperature 1) on the same prompts, both sharing the prompt's blocks by reference
count and copying on write; the unshared baseline runs W independent copies of every prompt with prefix caching
off (what a system without block sharing allocates). Outputs have a fixed length (ignore_eos) so the runs
compare the same token counts. Reports peak used blocks, shared/unshared ratio and time.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from pagedllm_bench import common


def add_args(p: argparse.ArgumentParser) -> None:
    common.add_common_args(p, "4 prompts, widths 1 and 4, 8 output tokens")
    p.add_argument("--num-prompts", type=int, default=None, help="default 16 (--quick 4)")
    p.add_argument("--widths", default=None, help="beam widths / n values (default 1,2,4,8; --quick 1,4)")
    p.add_argument("--output-len", type=int, default=None, help="tokens per beam/sample (default 64; --quick 8)")
    p.add_argument("--prompt-len", type=common.int_range, default=(32, 512), help="inclusive range 'lo,hi'")
    p.add_argument("--block-size", type=int, default=16)


def _peak(llm, fn) -> tuple[int, float]:
    llm.engine.kv.reset_prefix_cache()
    common.reset_peak(llm)
    t0 = time.perf_counter()
    fn()
    return llm.kv_cache_stats()["peak_used_blocks"], time.perf_counter() - t0


def measure(args: argparse.Namespace) -> dict:
    from pagedllm import LLM, BeamSearchParams, SamplingParams

    common.set_threads(args.threads)
    q = args.quick
    n = args.num_prompts or (4 if q else 16)
    widths = [int(x) for x in (args.widths or ("1,4" if q else "1,2,4,8")).split(",")]
    olen = args.output_len or (8 if q else 64)
    wl = common.offline_workload(n, args.prompt_len, (olen, olen), seed=args.seed, model_path=args.model)
    shared = LLM(**common.llm_kwargs(args, block_size=args.block_size))
    common.warm_up(shared)
    unshared = LLM(**common.llm_kwargs(args, block_size=args.block_size, enable_prefix_caching=False))
    common.warm_up(unshared)
    rows = []
    for w in widths:
        beam_blocks, beam_s = _peak(shared, lambda w=w: shared.beam_search(
            wl.prompts, BeamSearchParams(beam_width=w, max_tokens=olen, ignore_eos=True)))
        sp = SamplingParams(n=w, temperature=1.0, max_tokens=olen, ignore_eos=True, seed=args.seed)
        par_blocks, par_s = _peak(shared, lambda sp=sp: shared.generate(wl.prompts, sp, use_tqdm=False))
        copies = [p for p in wl.prompts for _ in range(w)]
        one = SamplingParams(n=1, temperature=1.0, max_tokens=olen, ignore_eos=True, seed=args.seed)
        base_blocks, base_s = _peak(unshared, lambda c=copies, o=one: unshared.generate(c, o, use_tqdm=False))
        rows.append({"width": w, "beam_blocks": beam_blocks, "n_blocks": par_blocks, "unshared_blocks": base_blocks,
                     "beam_vs_unshared": beam_blocks / base_blocks, "n_vs_unshared": par_blocks / base_blocks,
                     "beam_s": beam_s, "n_s": par_s, "unshared_s": base_s})
        print(f"width {w}: beam {beam_blocks}, n={w} {par_blocks}, unshared {base_blocks} blocks",
              file=sys.stderr, flush=True)
    cols = ["width", "beam_blocks", "n_blocks", "unshared_blocks", "beam_vs_unshared", "n_vs_unshared", "beam_s",
            "n_s", "unshared_s"]
    print(common.table(rows, cols, title=f"peak KV blocks (block size {args.block_size}): {n} prompts of "
                                         f"{wl.summary()['prompt_len_range']} tokens, {olen} tokens per "
                                         f"beam/sample"))
    w4 = next((r for r in rows if r["width"] == 4), None)
    if w4:
        print(f"beam width 4 uses {w4['beam_vs_unshared']:.0%} of the unshared blocks, n=4 "
              f"{w4['n_vs_unshared']:.0%} (target: beam <= 40%)")
    payload = {"bench": "beam", "env": common.environment(args.threads), "workload": wl.summary(),
               "block_size": args.block_size, "results": rows}
    fig = _plot(rows)
    jp, pp = common.save("beam" + args.tag, payload, fig, args.out_dir)
    print(f"wrote {jp}" + (f" and {pp}" if pp else ""))
    return payload


def _plot(rows: list[dict]):
    plt = common.pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    w = np.array([r["width"] for r in rows])
    for key, label, style in (("unshared_blocks", "unshared (W independent copies)", "s--"),
                              ("n_blocks", "parallel sampling n=W, shared", "o-"),
                              ("beam_blocks", "beam search width W, shared", "^-")):
        ax.plot(w, [r[key] for r in rows], style, label=label)
    ax.set(xlabel="beam width / n", ylabel="peak used KV blocks", title="KV blocks vs beam width")
    ax.set_xticks(w, [str(x) for x in w])
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


run = measure  # what `pagedllm bench` calls
