"""Speculative decoding: output tok/s with n-gram prompt lookup against plain decoding, in the same run.

`pagedllm bench spec [--quick] [--k 4] [--repeats N]`. Three workloads, each run plain and speculative on two
engines with the same weights (runs alternate, medians over --repeats):
- grounded: one stream that edits a given piece of code (most of the answer is in the prompt);
- open: one stream of open-ended writing (few n-gram matches);
- batch: 64 running requests (16 with --quick), half grounded, half open (speculation switches off above
  `disable_by_batch_size`).
Greedy, so the two engines must produce the same text (the `same` column). Targets: grounded >= 2x, open and
batch no more than 3% slower. Reports acceptance rate and mean accepted length (tokens per verification), and the
rates end to end and of the decode phase alone (first token to last: the prompt's prefill, the same work on both
engines, left out).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from pagedllm_bench import common

CODE = '''def moving_average(values, window):
    """Mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result


def exponential_average(values, alpha):
    """Exponentially weighted mean, newest value weighted by alpha."""
    if not 0 < alpha <= 1:
        raise ValueError("alpha must be in (0, 1]")
    result = []
    current = None
    for value in values:
        current = value if current is None else alpha * value + (1 - alpha) * current
        result.append(current)
    return result
'''

GROUNDED = [f"Rewrite this Python code with the function moving_average renamed to rolling_mean. Output only the "
            f"code.\n\n{CODE}",
            f"Copy the following code exactly, adding type hints to every function signature:\n\n{CODE}"]
OPEN = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Describe, in a few paragraphs, how a city might change over the next hundred years."]


def add_args(p: argparse.ArgumentParser) -> None:
    common.add_common_args(p, "short outputs, 16 running in the batch workload")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--prompt-lookup", type=common.int_range, default=(2, 4), help="n-gram lengths 'min,max'")
    p.add_argument("--output-len", type=int, default=None, help="tokens per stream (default 256; --quick 48)")
    p.add_argument("--batch", type=int, default=None, help="requests of the batch workload (default 64)")
    p.add_argument("--llama-cpp", action="store_true",
                   help="also run the grounded and open streams on llama-server, plain and with its n-gram "
                        "prompt lookup (--spec-type ngram-simple), on the same token ids")
    p.add_argument("--llama-spec-args", default="--spec-type ngram-simple",
                   help="llama-server's speculative options for --llama-cpp")
    p.add_argument("--ik-llama", action="store_true",
                   help="the same on ik_llama.cpp's llama-server (make bench-setup IK_LLAMA_SRC=path)")
    p.add_argument("--ik-llama-spec-args", default="--spec-type ngram-simple",
                   help="ik_llama.cpp's speculative options for --ik-llama (its --spec-type takes NAME:k=v,...)")
    p.set_defaults(quantization="auto", dtype="auto")  # the engine's defaults: both engines run the same weights


def _run(llm, prompts: list[str], params) -> tuple[float, float, list[str], int]:
    """(seconds end to end, seconds from the first token to the last of the slowest request, texts, tokens)."""
    llm.engine.reset_stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    decoding = max(o.metrics.last_token_time for o in outs) - min(o.metrics.first_token_time for o in outs)
    return elapsed, decoding, [o.outputs[0].text for o in outs], sum(len(o.outputs[0].token_ids) for o in outs)


def llama_cpp_streams(model: str | None, streams: dict[str, list[int]], olen: int, threads: int, spec_args: str,
                      repeats: int, peer: common.LlamaPeer = common.LLAMA_CPP, key: str = "llama") -> list[dict]:
    """Each stream on the peer's llama-server (one slot), plain and with its speculation: decode tok/s from its own
    timings (the prompt's prefill left out, as in the decode columns above), median over repeats. Columns are
    named `{key}_...`."""
    from pagedllm_bench.serving import LlamaServer

    rates: dict[tuple[str, str], list[float]] = {}
    texts: dict[tuple[str, str], str] = {}
    for mode, extra in (("plain", []), ("spec", spec_args.split())):
        with LlamaServer(model, threads, 1, 4096, extra, peer=peer) as srv:
            for name, prompt in streams.items():
                for _ in range(max(1, repeats)):
                    out = srv.completion(prompt, olen, timeout=1200)
                    rates.setdefault((name, mode), []).append(out["timings"]["predicted_per_second"])
                    texts[(name, mode)] = out["content"]
    return [{"workload": name, f"{key}_plain_decode_tok_s": statistics.median(rates[(name, "plain")]),
             f"{key}_spec_decode_tok_s": statistics.median(rates[(name, "spec")]),
             f"{key}_same": texts[(name, "plain")] == texts[(name, "spec")]} for name in streams]


def measure(args: argparse.Namespace) -> dict:
    from pagedllm import LLM, SamplingParams

    common.set_threads(args.threads)
    q = args.quick
    olen = args.output_len or (48 if q else 256)
    batch = args.batch or (16 if q else 64)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.prompt_lookup[0],
            "prompt_lookup_max": args.prompt_lookup[1]}
    plain = LLM(**common.llm_kwargs(args))
    fast = LLM(**common.llm_kwargs(args, speculative_config=spec))
    for llm in (plain, fast):
        common.warm_up(llm)
    def prompt(text: str) -> str:
        """The user turn through the chat template. A base model (no template, e.g. Gemma 3 270M) continues the
        text instead; a grounded request ends with the opening of its answer (a code fence), which the model then
        fills by copying from the prompt."""
        if plain.engine.tokenizer.chat_template is None:
            return text + ("\n\n```python\n" if text in GROUNDED else "\n\n")
        return plain.engine.apply_chat_template([{"role": "user", "content": text}])

    workloads = {"grounded": [prompt(GROUNDED[0])], "open": [prompt(OPEN[0])],
                 "batch": [prompt((GROUNDED + OPEN)[i % 4]) for i in range(batch)]}
    params = SamplingParams(temperature=0.0, max_tokens=olen)
    rows = []
    for name, prompts in workloads.items():
        times: dict[str, list[float]] = {"plain": [], "spec": [], "plain_dec": [], "spec_dec": []}
        for rep in range(max(1, args.repeats)):  # alternate which engine runs first (caches, clock drift)
            if rep % 2:
                (ts, ds, text_s, n_s), (tp, dp, text_p, n_p) = _run(fast, prompts, params), _run(plain, prompts, params)
            else:
                (tp, dp, text_p, n_p), (ts, ds, text_s, n_s) = _run(plain, prompts, params), _run(fast, prompts, params)
            for key, t in (("plain", tp), ("spec", ts), ("plain_dec", dp), ("spec_dec", ds)):
                times[key].append(t)
        stats = fast.engine.spec_decode_stats()
        plain_tps, spec_tps = n_p / statistics.median(times["plain"]), n_s / statistics.median(times["spec"])
        # the decode phase alone: tokens after each request's first over the time they took (the prompt's prefill,
        # the same for both engines, left out)
        after_first = n_s - len(prompts)
        decode_x = statistics.median(times["plain_dec"]) / statistics.median(times["spec_dec"])
        rows.append({"workload": name, "requests": len(prompts), "output_tokens": n_s, "plain_tok_s": plain_tps,
                     "spec_tok_s": spec_tps, "speedup": spec_tps / plain_tps,
                     "plain_decode_tok_s": after_first / statistics.median(times["plain_dec"]),
                     "spec_decode_tok_s": after_first / statistics.median(times["spec_dec"]), "decode_speedup": decode_x,
                     "acceptance_rate": stats["acceptance_rate"],
                     "mean_accepted_length": stats["mean_accepted_length"], "same": text_p == text_s})
        print(f"{name}: plain {plain_tps:.1f} tok/s, n-gram {spec_tps:.1f} tok/s", file=sys.stderr, flush=True)
    print(common.table(rows, title=f"speculative decoding, n-gram k={args.k} lookup {args.prompt_lookup}, "
                                   f"{olen} output tokens, greedy"))
    peers = [(common.LLAMA_CPP, "llama", args.llama_spec_args)] if args.llama_cpp else []
    peers += [(common.IK_LLAMA, "ik", args.ik_llama_spec_args)] if args.ik_llama else []
    tok = plain.get_tokenizer()
    streams = {name: tok.encode(workloads[name][0], add_special_tokens=False) for name in ("grounded", "open")}
    for peer, key, spec_args in peers:
        for got in llama_cpp_streams(args.model, streams, olen, args.threads, spec_args, args.repeats, peer, key):
            row = next(r for r in rows if r["workload"] == got["workload"])
            row.update(got, **{f"spec_vs_{key}_spec": row["spec_decode_tok_s"] / got[f"{key}_spec_decode_tok_s"]})
        print(common.table([{k: r.get(k) for k in ("workload", "spec_decode_tok_s", f"{key}_plain_decode_tok_s",
                                                  f"{key}_spec_decode_tok_s", f"spec_vs_{key}_spec", f"{key}_same")}
                            for r in rows if f"{key}_same" in r],
                           title=f"pagedllm n-gram vs {peer.name} llama-server {spec_args} (decode tok/s, one "
                                 "stream)"))
    payload = {"bench": "spec", "env": common.environment(args.threads), "speculative_config": spec,
               "output_len": olen, "results": rows}
    jp, _ = common.save("spec" + args.tag, payload, None, args.out_dir)
    print(f"wrote {jp}")
    return payload


run = measure  # what `pagedllm bench` calls
