"""`pagedllm generate | chat | serve | bench <name>`."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from pagedllm.engine.args import EngineArgs

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about memory pages.",
    "Explain in two sentences why a KV cache speeds up text generation.",
    "List three prime numbers greater than 10.",
]


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate per output")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability")
    g.add_argument("--n", type=int, default=1, help="outputs per prompt")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeated tokens")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")


def _sampling_params(a: argparse.Namespace):
    from pagedllm.sampling_params import SamplingParams

    return SamplingParams(n=a.n, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
                          max_tokens=a.max_tokens, stop=a.stop, ignore_eos=a.ignore_eos,
                          repetition_penalty=a.repetition_penalty, seed=a.sampling_seed)


def _llm(a: argparse.Namespace):
    from pagedllm.entrypoints.llm import LLM

    args = EngineArgs.from_cli_args(a)
    kwargs = {k: v for k, v in vars(args).items() if k != "model"}
    # a start takes seconds (a first one also assembles the default model): at a terminal, say what it is doing
    # (a script reading stderr gets errors alone, one line each)
    progress = sys.stderr.isatty()
    if progress:
        print(f"pagedllm: loading {args.model or 'the default model'}...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    llm = LLM(args.model, **kwargs)
    if progress:
        print(f"pagedllm: loaded {llm.engine.model_name} in {time.perf_counter() - t0:.1f} s", file=sys.stderr,
              flush=True)
    return llm


def cmd_generate(a: argparse.Namespace) -> int:
    prompts = list(a.prompts)
    if a.file:
        with open(a.file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    prompts = prompts or DEFAULT_PROMPTS
    llm = _llm(a)
    params = _sampling_params(a)
    t0 = time.perf_counter()
    if a.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    for p, out in zip(prompts, outs, strict=True):
        print(f"\n### Prompt: {p!r}")
        for c in out.outputs:
            tag = f"[{c.index}] " if len(out.outputs) > 1 else ""
            print(f"{tag}{c.text.strip()}\n    ({len(c.token_ids)} tokens, finish_reason={c.finish_reason})")
    s = llm.kv_cache_stats()
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    print(f"\n--- {len(outs)} requests, {n_in} prompt + {n_out} generated tokens in {elapsed:.2f}s: "
          f"{n_out / elapsed:.1f} output tok/s, {(n_in + n_out) / elapsed:.1f} total tok/s")
    print(f"--- KV blocks: {s['num_blocks'] - s['num_free_blocks']} used / {s['num_free_blocks']} free of "
          f"{s['num_blocks']} (block size {s['block_size']}, peak used {s['peak_used_blocks']}); mean slot "
          f"utilisation {s['mean_slot_utilisation']:.1%}; prefix cache hits {s['prefix_cache_hits']}/{s['prefix_cache_queries']} "
          f"tokens; preemptions {s['num_preemptions']}")
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    from pagedllm.entrypoints.chat_session import run_chat

    return run_chat(_llm(a).engine, _sampling_params(a), system=a.system)


def cmd_serve(a: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.server import serve_main

    return serve_main(a) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description=__doc__)
    parser.add_argument("--log-level", default=None,
                        help="logging level (default: INFO for serve, WARNING for the other commands)")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate completions for prompts (arguments or --file)")
    g.add_argument("prompts", nargs="*", help="prompts (default: a few built-in ones)")
    g.add_argument("--file", help="a text file with one prompt per line")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    EngineArgs.add_cli_args(g)
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat with streaming output")
    c.add_argument("--system", default=None, help="a system prompt")
    EngineArgs.add_cli_args(c)
    _add_sampling_args(c)
    c.set_defaults(func=cmd_chat, max_tokens=512)

    try:
        from pagedllm.entrypoints.openai.server import add_serve_args
    except ImportError:  # server extras missing: the other commands still work
        add_serve_args = None
    if add_serve_args is not None:
        s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
        add_serve_args(s)
        s.set_defaults(func=cmd_serve)

    # the lab is a distribution of its own, imported only for `pagedllm bench` (which parses its own arguments)
    b = sub.add_parser("bench", help="benchmarks (see BENCHMARKS.md): `pagedllm bench --help` lists them",
                       add_help=False)
    b.add_argument("bench_argv", nargs=argparse.REMAINDER)
    b.set_defaults(func=cmd_bench)
    return parser


def cmd_bench(a: argparse.Namespace) -> int:
    try:
        import pagedllm_bench
    except ImportError:
        print("pagedllm: error: the benchmark lab is not installed: from a checkout, `pip install -e bench` "
              "(`make install` does it)", file=sys.stderr)
        return 2
    return pagedllm_bench.main(a.bench_argv)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command == "bench":  # the lab parses its own arguments, --help included
        args.bench_argv = unknown + args.bench_argv
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    level = args.log_level or ("INFO" if args.command == "serve" else "WARNING")
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pagedllm.engine.args import EngineConfigError
    from pagedllm.model.errors import InvalidModelError

    try:
        return args.func(args)
    except InvalidModelError as e:  # a damaged or hostile model file: one line naming file and field
        print(f"pagedllm: error: cannot load the model: {e}", file=sys.stderr)
        return 2
    except EngineConfigError as e:  # settings that cannot run here
        print(f"pagedllm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
