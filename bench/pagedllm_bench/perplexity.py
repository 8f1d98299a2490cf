"""Perplexity of a GGUF file's weights as stored against the same file dequantized and against llama.cpp:
`pagedllm bench perplexity --model F.gguf [--types Q4_0,Q6_K,...] [--text FILE]`.

Scored the way llama.cpp's `llama-perplexity` scores (so the figures compare with its own on the same file and
text): the text's tokens cut into chunks of --ctx tokens (the first of each chunk replaced by BOS where the
tokenizer adds one), every chunk a separate sequence, and only the second half of each chunk scored: the
log-probability of token i given tokens < i for i in (ctx/2, ctx). pagedllm takes them from `prompt_logprobs`.

With --types, each type is first written by llama.cpp's `llama-quantize --pure --allow-requantize` from --model
(every tensor of that type where its rows allow: llama-quantize falls back, e.g. K-quants to Q5_0 / Q5_1 / Q8_0,
where a row is not a multiple of 256), so one real model covers every type the kernels read. Systems:
pagedllm with weights as stored (`quantization="auto"`), pagedllm with the file dequantized (`"none"`), and
llama-perplexity (built by `make bench-setup`, next to llama-server). pagedllm scores llama.cpp's tokens of the
text by default (llama-tokenize), so that the three differ only in their arithmetic.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import subprocess
import time

from pagedllm_bench import common

SYSTEMS = ("pagedllm", "pagedllm-dequant", "llama.cpp")  # ik_llama.cpp too where built (IK_LLAMA_SRC)
DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"  # long English prose on Debian-family systems


def chunks(tokens: list[int], ctx: int, count: int | None, bos: int | None) -> list[list[int]]:
    """llama-perplexity's chunks: consecutive windows of ctx tokens, each starting with BOS where one is added."""
    n = len(tokens) // ctx if count is None else min(count, len(tokens) // ctx)
    out = [tokens[i * ctx:(i + 1) * ctx] for i in range(n)]
    if bos is not None:
        for c in out:
            c[0] = bos
    return out


def text_tokens(tokenizer, text: str, model: str, text_path: str, source: str) -> tuple[list[int], int | None]:
    """The text's tokens as llama-perplexity takes them (with the tokenizer's BOS, if it adds one), and that BOS.
    source "llama.cpp": llama.cpp's own tokenizer (llama-tokenize), so that every system scores the same ids."""
    bos = getattr(tokenizer, "bos_token_id", None)
    adds_bos = bos is not None and tokenizer.encode("a")[:1] == [bos] != tokenizer.encode("a", add_special_tokens=False)[:1]
    ids = llama_tokens(model, text_path) if source == "llama.cpp" else tokenizer.encode(text, add_special_tokens=True)
    return ids, bos if adds_bos else None


def llama_tokens(model: str, text_path: str) -> list[int]:
    exe = common.LLAMA_CPP.tool("llama-tokenize")
    if not exe:
        raise RuntimeError("llama-tokenize not found: run `make bench-setup` (or --tokenizer pagedllm)")
    out = subprocess.run([exe, "-m", model, "-f", text_path, "--ids", "--log-disable"], capture_output=True,
                         text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"llama-tokenize failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def pagedllm_perplexity(model: str, text_path: str, args: argparse.Namespace, quantization: str) -> dict:
    """exp(mean NLL) over the second half of each chunk, from prompt_logprobs, all chunks in one batch."""
    from pagedllm import LLM, SamplingParams

    ctx = args.ctx
    common.set_threads(args.threads)
    with open(text_path, encoding="utf-8") as f:
        text = f.read()
    t0 = time.perf_counter()
    llm = LLM(model, quantization=quantization, dtype=args.dtype, max_model_len=max(ctx + 8, 256))
    load_s = time.perf_counter() - t0
    tokens, bos = text_tokens(llm.get_tokenizer(), text, model, text_path, args.tokenizer)
    parts = chunks(tokens, ctx, args.chunks, bos)
    if not parts:
        raise ValueError(f"the text has {len(tokens)} tokens: fewer than one chunk of {ctx}")
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in parts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    first = ctx // 2
    nll, n = 0.0, 0
    for part, out in zip(parts, outs, strict=True):
        for i in range(first + 1, ctx):
            nll -= out.prompt_logprobs[i][part[i]].logprob
            n += 1
    dtype = str(llm.engine.dtype).removeprefix("torch.")
    del llm
    gc.collect()
    return {"ppl": math.exp(nll / n), "scored_tokens": n, "chunks": len(parts), "text_tokens": len(tokens),
            "prompt_tok_per_s": len(parts) * ctx / elapsed, "load_s": load_s, "dtype": dtype}


# llama.cpp: "Final estimate: PPL = X"; ik_llama.cpp: "Final estimate: PPL over N chunks for n_ctx=C = X"
_FINAL = re.compile(r"Final estimate: PPL(?: over \d+ chunks for n_ctx=\d+)? = ([0-9.]+)")


def llama_perplexity(model: str, text_path: str, ctx: int, count: int | None, threads: int,
                     peer: common.LlamaPeer = common.LLAMA_CPP) -> dict:
    exe = peer.tool("llama-perplexity")
    if not exe:
        raise RuntimeError(f"{peer.name}'s llama-perplexity not found: run `make bench-setup`")
    cmd = [exe, "-m", model, "-f", text_path, "-c", str(ctx), "-b", str(ctx), "-t", str(threads), "--no-warmup"]
    if count is not None:
        cmd += ["--chunks", str(count)]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    found = _FINAL.search(out.stdout + out.stderr)
    if out.returncode != 0 or not found:
        raise RuntimeError(f"llama-perplexity failed ({out.returncode}): {(out.stdout + out.stderr)[-2000:]}")
    chunks_found = re.search(r"calculating perplexity over (\d+) chunks", out.stderr + out.stdout)
    return {"ppl": float(found.group(1)), "chunks": int(chunks_found.group(1)) if chunks_found else None,
            "elapsed_s": time.perf_counter() - t0}


def requantize(source: str, qtype: str, out_dir: str) -> str:
    """source re-quantized to qtype by llama-quantize (--pure: every tensor that type where its rows allow)."""
    exe = common.LLAMA_CPP.tool("llama-quantize")
    if not exe:
        raise RuntimeError("llama-quantize not found: run `make bench-setup`")
    stem = os.path.splitext(os.path.basename(source))[0]
    out = os.path.join(out_dir, f"{stem}.pure-{qtype}.gguf")
    if not os.path.exists(out):
        tmp = out + ".tmp"
        res = subprocess.run([exe, "--allow-requantize", "--pure", source, tmp, qtype], capture_output=True,
                             text=True, timeout=3600)
        if res.returncode != 0:
            raise RuntimeError(f"llama-quantize {qtype} failed: {(res.stdout + res.stderr)[-2000:]}")
        os.replace(tmp, out)
    return out


def tensor_types(path: str) -> str:
    """'Q4_K x 30, Q5_0 x 90, ...': what the file holds (weights only, by count)."""
    from collections import Counter

    from pagedllm.model.gguf_loader import type_name
    from pagedllm.model.gguf_reader import read_gguf

    f = read_gguf(path)
    try:
        counts = Counter(type_name(t.ggml_type).split(" ")[0] for t in f.tensors.values() if len(t.shape) == 2)
    finally:
        f.close()
    return ", ".join(f"{k} x {v}" for k, v in counts.most_common())


def measure(model: str, text_path: str, args: argparse.Namespace) -> dict:
    row: dict = {"file": os.path.basename(model), "tensors": tensor_types(model)}
    for system in args.systems.split(","):
        if system in common.LLAMA_PEERS:
            r = llama_perplexity(model, text_path, args.ctx, args.chunks, args.threads, common.LLAMA_PEERS[system])
        else:
            quant = "auto" if system == "pagedllm" else "none"
            r = pagedllm_perplexity(model, text_path, args, quant)
        row[f"{system} ppl"] = f"{r['ppl']:.4f}"  # (a table cell: the ratios below need the digits)
        row[f"{system} detail"] = r
        print(system, r, flush=True)
    ppl = {s: row[f"{s} detail"]["ppl"] for s in args.systems.split(",")}
    for base, col in (("pagedllm-dequant", "stored / dequant"), ("llama.cpp", "stored / llama.cpp"),
                      ("ik_llama.cpp", "stored / ik_llama.cpp")):
        if "pagedllm" in ppl and base in ppl:
            row[col] = f"{ppl['pagedllm'] / ppl[base]:.4f}"
    return row


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf (default: the embedded SmolLM2-135M)")
    p.add_argument("--types", default="", help="re-quantize --model to each of these types first (llama-quantize)")
    p.add_argument("--text", default=DEFAULT_TEXT, help="a UTF-8 text file to score")
    p.add_argument("--ctx", type=int, default=512, help="chunk length (llama-perplexity -c)")
    p.add_argument("--chunks", type=int, default=16, help="chunks scored (0: the whole text)")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                   help="pagedllm's activations, as stored and dequantized alike")
    p.add_argument("--tokenizer", default="llama.cpp", choices=["llama.cpp", "pagedllm"],
                   help="whose tokens pagedllm scores (llama.cpp's: the same ids as llama-perplexity)")
    p.add_argument("--threads", type=int, default=common.DEFAULT_THREADS)
    p.add_argument("--work-dir", default=None, help="where re-quantized files go (default: the bench model cache)")
    p.add_argument("--quick", action="store_true", help="one chunk of 128 tokens (checks the command runs)")


def run(args: argparse.Namespace) -> dict:
    from pagedllm.paths import cache_dir

    if args.quick:
        args.chunks, args.ctx = 1, 128
    args.chunks = args.chunks or None
    source = args.model or common.default_model_path()
    files = [source]
    if args.types:
        work = args.work_dir or str(cache_dir() / "bench-models")
        os.makedirs(work, exist_ok=True)
        files = [requantize(source, t, work) for t in args.types.split(",")]
    rows = [measure(f, args.text, args) for f in files]
    cols = ["file", "tensors"] + [f"{s} ppl" for s in args.systems.split(",")]
    ratio_cols = ("stored / dequant", "stored / llama.cpp", "stored / ik_llama.cpp")
    cols += [c for c in ratio_cols if any(c in r for r in rows)]
    print(common.table(rows, cols, title=f"perplexity, ctx {args.ctx}, {os.path.basename(args.text)} "
                                           f"({common.environment()['cpu']})"))
    payload = {"rows": rows, "text": args.text, "ctx": args.ctx, "env": common.environment(args.threads)}
    common.save("perplexity", payload)
    return payload
