"""The engine on a GPU (issue 58's check), in one command that writes one JSON: `pagedllm bench gpu [--quick]`.

Made to run inside 8 minutes on the lent H200 (torch, Triton and transformers are installed there; nothing can be
downloaded, so the models are random-weight checkpoints of real shapes written there by transformers); the JSON is
rewritten after each part. In this order:
1. on the Qwen2.5-1.5B shape in bf16: greedy output against transformers on the GPU (8 chats; where they differ,
   transformers' own top-2 log-probability gap at the first difference: a near tie or not; and each engine's bf16
   log-probabilities against transformers' in float32, to tell bf16 noise from a mistake), offline throughput
   on the standard workload (256 requests, prompts U[32,512], outputs U[16,256]) against transformers' paged
   continuous batching (`generate_batch`) on the same GPU and requests, the GPU's peak memory against the KV
   pool; then the same workload over a pool of 40% of the blocks it needs at once (the pool is the limit: its peak
   use, preemption, every request finished, no out-of-memory);
2. on the Llama-3.2-3B shape: batch-1 decode tokens/s next to the HBM roofline (weight bytes over the copy
   bandwidth measured in the same run);
3. the GPU test subset (`PAGEDLLM_TEST_DEVICE=cuda`: the Triton kernels against the reference on the GPU, the
   device path, CUDA graphs included, against the CPU path), a part per file, each with its own time limit.
Each part records its error instead of stopping the others; `--only` runs some of them. `--device cpu` runs the
script here, on the 0.5B and 1B shapes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

from pagedllm_bench import common

PARTS = ("greedy", "offline", "pressure", "decode", "tests")
# the GPU test subset, each file with its time limit (seconds), in order of what a short lease should see first:
# FlexAttention last, since torch.compile compiles each of its shapes on a GPU
GPU_TESTS = {"tests/attention/test_triton_paged.py": 60, "tests/engine/test_device_path.py": 100,
             "tests/worker/test_sampler.py": 30, "tests/attention/test_flex_paged.py": 90}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="2 layers per shape, 32 requests: a smoke run")
    p.add_argument("--out", default=None, help="the JSON's path (default: the bench results folder)")
    p.add_argument("--skip-tests", action="store_true", help="no pytest run")
    p.add_argument("--attention-backend", default="auto", help="the engine's attention backend on the GPU")
    p.add_argument("--device", default="cuda", help="cpu: this script where no GPU is (the 0.5B and 1B shapes, 8 "
                                                    "requests; with --quick, 2 chats)")
    p.add_argument("--head", choices=("trained", "gaussian"), default="trained",
                   help="the random checkpoints' head: a trained model's decisive logits, or transformers' "
                        "initialisation as is")
    p.add_argument("--only", default=None, help=f"comma-separated parts to run, of {','.join(PARTS)}")


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak_gib(device: str) -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.startswith("cuda") else None


def _hf_checkpoint(shape_name: str, layers: int | None, path: str, device: str, head: str = "trained") -> str:
    """A random-weight Hugging Face checkpoint of a real shape (pagedllm.testing.gguf_writer.SHAPES), bf16,
    initialised on the GPU (fast) and saved with its config."""
    import torch
    import transformers

    from pagedllm.testing.gguf_writer import SHAPES

    s = SHAPES[shape_name]
    llama = s.arch == "llama"
    cfg = (transformers.LlamaConfig if llama else transformers.Qwen2Config)(
        vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.ffn, num_hidden_layers=layers or s.layers,
        num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
        max_position_embeddings=4096, rms_norm_eps=s.eps, rope_theta=s.rope_theta, tie_word_embeddings=True,
        initializer_range=0.02)
    torch.manual_seed(0)
    with torch.device(device):  # transformers' own initialisation (normal, std initializer_range)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    if head == "trained":
        _trained_logits(model, device)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _trained_logits(model, device: str, top_logit: float = 30.0) -> None:
    """Logits like a trained model's. Its next token is decisive: the top logits stand apart from the rest. The
    largest of a vocabulary of Gaussian logits do not, and bf16 noise alone, as large in transformers as here,
    flips greedy choices among them (BENCHMARKS.md, On a GPU). Heavy-tailed row norms of the (tied) embedding make
    a few tokens stand out; the final norm's weight then scales the logits so that a position's largest is
    top_logit (the median over a random prompt), as a trained model's are."""
    import torch

    embed = model.get_input_embeddings().weight
    with torch.no_grad():
        embed.mul_(torch.exp(1.5 * torch.randn(embed.shape[0], 1, device=device)).to(embed.dtype))
        prompt = torch.randint(100, embed.shape[0] - 100, (1, 64), device=device)
        top = model(prompt).logits[0].float().amax(-1).median()
        model.model.norm.weight.mul_(top_logit / float(top))


def _part(results: dict, out: str, name: str, fn, *a) -> None:
    """Run one part into results[name] and write the JSON so far (a run stopped by its time limit keeps the parts
    it finished)."""
    t0 = time.perf_counter()
    try:
        results[name] = fn(*a)
    except Exception as e:  # one part's failure is recorded; the others still run
        results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    results[name]["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"{name}: {json.dumps(results[name])[:600]}", flush=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1, default=str)


def _tests(path: str, limit: int) -> dict:
    """One test file of the subset on the GPU; past its limit, what it printed so far."""
    env = dict(os.environ, PAGEDLLM_TEST_DEVICE="cuda", PYTHONUNBUFFERED="1")  # (a timed-out run keeps its output)
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", path],
                              capture_output=True, text=True, env=env, timeout=limit)
    except subprocess.TimeoutExpired as e:
        printed = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        return {"returncode": None, "timed_out_s": limit, "tail": printed[-2500:]}
    return {"returncode": proc.returncode, "tail": proc.stdout[-2500:] + proc.stderr[-1000:]}


def _hf_model(path: str, device: str, attn: str = "sdpa", dtype=None):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.bfloat16,
                                                attn_implementation=attn).to(device).eval()


def _greedy(path: str, llm, device: str, n_chats: int = 8, new_tokens: int = 32) -> dict:
    """pagedllm's greedy tokens against transformers' on the same GPU; at a difference, transformers' top-2 gap."""
    import torch

    from pagedllm import SamplingParams

    hf = _hf_model(path, device)
    rng = np.random.default_rng(1)
    vocab = hf.config.vocab_size
    prompts = [rng.integers(100, vocab - 100, size=int(rng.integers(24, 160))).tolist() for _ in range(n_chats)]
    ours = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)]
    chats = []
    for prompt, mine in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=new_tokens, do_sample=False,
                              min_new_tokens=new_tokens, return_dict_in_generate=True)
        theirs = out.sequences[0, len(prompt):].tolist()
        first = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b), None)
        entry = {"equal": first is None}
        if first is not None:
            # the gap in float32: transformers' final hidden state there times the head in float32 (its bf16
            # logits are rounded to steps of 2^-5 and more, coarser than the 1e-2 a near tie is); and in steps of
            # bf16 at the top logit (below one, both engines' logits may round to the same value)
            with torch.no_grad():
                states = hf(torch.tensor([prompt + theirs[:first]], device=device), output_hidden_states=True)
                head = hf.get_output_embeddings().weight.float()
                logits = states.hidden_states[-1][0, -1].float() @ head.T
            top = logits.topk(2)
            gap = float(top.values[0] - top.values[1])
            bf16_step = 2.0 ** (math.floor(math.log2(max(abs(float(top.values[0])), 1e-30))) - 7)
            entry |= {"first_difference": first, "hf_top2_logprob_gap": gap,
                      "gap_in_bf16_steps": round(gap / bf16_step, 2),
                      "ours_is_hf_second": mine[first] == int(top.indices[1])}
        chats.append(entry)
    noise = _bf16_error(path, hf, llm, prompts, device)
    del hf
    equal = sum(c["equal"] for c in chats)
    near = sum(1 for c in chats if not c["equal"] and c["hf_top2_logprob_gap"] < 1e-2)
    return {"chats": chats, "equal": equal, "differ_after_near_tie": near, "bf16_error_vs_float32": noise,
            "target_met": equal >= len(chats) - len(chats) // 8 and equal + near == len(chats)}  # 7 of 8


def _bf16_error(path: str, hf, llm, prompts: list[list[int]], device: str, k: int = 20) -> dict:
    """How far each bf16 engine's next-token log-probabilities at the prompts' ends are from transformers' in
    float32: the largest error over the float32 top k (each side centred on the tokens both list), the largest
    over the prompts. Two engines equally far off differ by bf16 noise, not by a mistake."""
    import torch

    from pagedllm import SamplingParams

    hf32 = _hf_model(path, device, dtype=torch.float32)
    ours = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, logprobs=k), use_tqdm=False)
    worst = {"transformers": 0.0, "pagedllm": 0.0}
    for prompt, out in zip(prompts, ours, strict=True):
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            ref, bf16 = (m(ids).logits[0, -1].float().log_softmax(-1).cpu() for m in (hf32, hf))
        top = ref.topk(k).indices.tolist()
        mine = out.outputs[0].logprobs[0]
        shared = [t for t in top if t in mine]
        for name, got in (("transformers", bf16[shared]), ("pagedllm", torch.tensor([mine[t].logprob for t in shared]))):
            want = ref[shared]
            worst[name] = max(worst[name], float(((got - got.mean()) - (want - want.mean())).abs().max()))
    del hf32
    return {name: round(v, 4) for name, v in worst.items()}


def _workload(num: int, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(0)
    plens = rng.integers(32, 513, size=num)
    olens = rng.integers(16, 257, size=num)
    return [rng.integers(100, vocab - 100, size=int(n)).tolist() for n in plens], [int(x) for x in olens]


def _offline(path: str, llm, num: int, device: str) -> dict:
    import torch

    from pagedllm import SamplingParams

    vocab = llm.engine.model_config.vocab_size
    prompts, outs = _workload(num, vocab)
    if num < 64:  # a smoke run: short outputs
        outs = [o // 8 for o in outs]
    total_out = sum(outs)
    common.warm_up(llm)
    common.reset_peak(llm)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    reqs = [(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True))
            for i, (p, o) in enumerate(zip(prompts, outs, strict=True))]
    res = common.drive(llm.engine, reqs)
    ours = total_out / res.elapsed
    num_blocks = llm.engine.kv.stats()["num_blocks"]
    peak_blocks = max(s.used_blocks for s in res.samples) if res.samples else 0
    kv_bytes = llm.engine.runner.kv_caches.pool.numel() * llm.engine.runner.kv_caches.pool.element_size()
    row = {"requests": num, "output_tokens": total_out, "pagedllm_tok_s": round(ours, 1),
           "pagedllm_seconds": round(res.elapsed, 2), "kv_blocks": num_blocks, "kv_peak_blocks": peak_blocks,
           "kv_peak_share": round(peak_blocks / num_blocks, 3), "kv_pool_gib": round(kv_bytes / 2**30, 2),
           "peak_gpu_memory_gib": _peak_gib(device)}
    llm.engine.close()
    row |= _transformers_offline(path, prompts, outs, device)
    if "transformers_tok_s" in row:
        row["ratio"] = round(ours / row["transformers_tok_s"], 2)
        # the pool is sized by gpu_memory_utilization, far past this workload on a large GPU: the KV target (90%
        # of the blocks in use at the peak) is judged on kv_pool_under_pressure, where the pool is the limit
        row["target_met"] = row["ratio"] >= 3.0
    return row


def _kv_pressure(path: str, engine: dict, num: int) -> dict:
    """The same workload over a pool of 40% of the blocks it would need at once: paging must fill the pool (peak
    blocks in use near all of them), preempt and resume, and finish every request without running out of memory."""
    from pagedllm import LLM, SamplingParams

    block = 16
    with open(os.path.join(path, "config.json")) as f:
        prompts, outs = _workload(num, json.load(f)["vocab_size"])
    need = sum(-(-(len(p) + o) // block) for p, o in zip(prompts, outs, strict=True))
    blocks = max(int(0.4 * need), -(-(512 + 256) // block) + 1)
    llm = LLM(path, max_num_seqs=256, block_size=block, num_kv_blocks=blocks, **engine)
    reqs = [(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True))
            for i, (p, o) in enumerate(zip(prompts, outs, strict=True))]
    res = common.drive(llm.engine, reqs)
    done = sum(len(o.outputs[0].token_ids) == outs[int(rid[1:])] for rid, o in res.outputs.items())
    peak = max(s.used_blocks for s in res.samples)
    llm.engine.close()
    return {"kv_blocks": blocks, "blocks_the_workload_needs_at_once": need, "kv_peak_blocks": peak,
            "kv_peak_share": round(peak / blocks, 3), "requests_finished_whole": done, "requests": num,
            "tok_s": round(sum(outs) / res.elapsed, 1), "target_met": peak / blocks >= 0.9 and done == num}


def _transformers_offline(path: str, prompts: list[list[int]], outs: list[int], device: str) -> dict:
    """transformers' continuous batching over its paged cache (generate_batch), each request to its own length
    where the API takes one (else the longest, counted as the tokens each asked for)."""
    import torch
    from transformers import GenerationConfig

    try:
        hf = _hf_model(path, device, "paged|sdpa")
    except Exception:  # (the name older transformers gave it)
        hf = _hf_model(path, device, "sdpa_paged")
    cfg = GenerationConfig(max_new_tokens=max(outs), do_sample=False, eos_token_id=-1, pad_token_id=0)
    t0 = time.perf_counter()
    with torch.no_grad():
        hf.generate_batch(inputs=prompts[:4], generation_config=GenerationConfig(max_new_tokens=4, do_sample=False,
                                                                                   eos_token_id=-1, pad_token_id=0))
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    with torch.no_grad():
        # one call over every request: its max_new_tokens is the longest output (transformers takes one value);
        # only the tokens each request asked for are counted, so the ratio does not flatter pagedllm
        hf.generate_batch(inputs=prompts, generation_config=cfg)
    seconds = time.perf_counter() - t0
    del hf
    return {"transformers_tok_s": round(sum(outs) / seconds, 1), "transformers_seconds": round(seconds, 2),
            "transformers_note": "one generate_batch call, max_new_tokens = the longest output; tokens/s counts "
                                 "the tokens each request asked for", "transformers_warmup_s": round(warm, 1)}


def _copy_bandwidth(device: str) -> float:
    import torch

    x = torch.empty((2 << 30) if device.startswith("cuda") else (256 << 20), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    _sync(device)
    return 2 * x.numel() * 10 / (time.perf_counter() - t0)  # read + write


def _decode(llm, device: str, n: int = 256) -> dict:
    from pagedllm import SamplingParams

    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    bandwidth = _copy_bandwidth(device)
    common.warm_up(llm)
    prompt = list(range(100, 228))

    def timed(tokens: int) -> float:  # the same prompt, prefilled afresh each time (no prefix-cache hit)
        llm.engine.kv.reset_prefix_cache()
        t0 = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == tokens
        return time.perf_counter() - t0

    timed(n)  # (captures the bucket's graph, if any)
    tok_s = (n - 8) / (timed(n) - timed(8))  # the decode steps alone: the difference of two runs
    roofline = bandwidth / weight_bytes
    graphs = llm.engine.runner.decode_graphs
    return {"cuda_graphs": graphs is not None and graphs.capture, "decode_tok_s": round(tok_s, 1),
            "weight_gib": round(weight_bytes / 2**30, 2), "copy_bandwidth_gb_s": round(bandwidth / 1e9), "roofline_tok_s": round(roofline, 1),
            "share_of_roofline": round(tok_s / roofline, 3), "target_met": tok_s / roofline >= 0.5}


def run(args: argparse.Namespace) -> dict:
    import torch

    from pagedllm import LLM

    device = args.device
    gpu = device.startswith("cuda")
    if gpu and not torch.cuda.is_available():
        raise SystemExit("bench gpu needs a CUDA GPU (torch sees none here); --device cpu --quick smoke-tests it")
    results: dict = {"gpu": torch.cuda.get_device_name(0) if gpu else None, "torch": torch.__version__,
                     "environment": common.environment()}
    parts = set(args.only.split(",")) if args.only else set(PARTS) - ({"tests"} if args.skip_tests else set())
    if parts - set(PARTS):
        raise SystemExit(f"--only: unknown parts {sorted(parts - set(PARTS))} (of {','.join(PARTS)})")
    layers = 2 if args.quick else None
    num = (32 if args.quick else 256) if gpu else 8
    shapes = ("qwen2.5-1.5b", "llama-3.2-3b") if gpu else ("qwen2.5-0.5b", "llama-3.2-1b")
    engine = dict(device=device, dtype="bfloat16", attention_backend=args.attention_backend)
    if not gpu:
        engine |= dict(quantization="none", kv_cache_memory="512MiB")
    out = args.out or common.out_path("gpu", "json")
    results["head"] = args.head
    with tempfile.TemporaryDirectory() as tmp:
        if parts & {"greedy", "offline", "pressure"}:
            path = _hf_checkpoint(shapes[0], layers, os.path.join(tmp, "qwen"), device, args.head)
        if parts & {"greedy", "offline"}:
            llm = LLM(path, max_num_seqs=256, max_num_batched_tokens=8192, **engine)
            results["backend"] = llm.engine.runner.backend.name
            if "greedy" in parts:
                chats = 2 if args.quick and not gpu else 8
                _part(results, out, "greedy_vs_transformers", _greedy, path, llm, device, chats)
            if "offline" in parts:
                _part(results, out, "offline_throughput", _offline, path, llm, num, device)
            del llm
        if "pressure" in parts:
            _part(results, out, "kv_pool_under_pressure", _kv_pressure, path, engine, num)
        if "decode" in parts:
            path = _hf_checkpoint(shapes[1], layers, os.path.join(tmp, "llama"), device, args.head)
            llm = LLM(path, **engine)
            _part(results, out, "batch1_decode", _decode, llm, device, 256 if gpu else 24)
            del llm
    if "tests" in parts:  # last: the figures first, inside the device's minutes
        for path, limit in GPU_TESTS.items():
            _part(results, out, f"tests {os.path.basename(path)}", _tests, path, limit)
    print(f"wrote {out}")
    return results
