"""Batch invariance: a row's result does not depend on what else is in the batch.

Kernel level: a row's output bytes are identical computed alone or inside batches of 2..300 rows, for the GEMM,
paged attention (decode, prefill, a prompt tail after a prefix-cache hit, long contexts split across threads) and
the sampler. Engine level (the real embedded model, bf16): a request's tokens equal the same request run alone,
whatever it is batched with, how its prompt is chunked, whether its prefix is cached, whether it was preempted.

Every test runs over PATHS, the execution paths the engine has: a new one (int8 KV, quantized weights,
speculative decoding, a mixture of experts) is covered by adding one line there.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from pagedllm import kernels
from pagedllm.attention import build_attention_metadata
from pagedllm.attention.kv_quant import random_pool


@dataclass(frozen=True)
class ExecPath:
    name: str
    dtype: torch.dtype      # activations (and dense weights)
    kv_dtype: torch.dtype   # the KV cache
    weights: str = "dense"  # or a GGUF block type the linears run as stored (the quantized GEMM kernel)
    engine: dict[str, Any] = field(default_factory=dict)  # what else LLM(...) is given for this path


PATHS = [
    ExecPath("fp32", torch.float32, torch.float32),
    ExecPath("bf16", torch.bfloat16, torch.bfloat16),
    ExecPath("bf16-int8kv", torch.bfloat16, torch.int8, engine={"kv_cache_dtype": "int8"}),
    # the embedded model stores Q4_1; 1B-class GGUFs mostly Q4_K (its blocks are read by another kernel loop)
    ExecPath("q4_1-weights", torch.bfloat16, torch.bfloat16, weights="Q4_1", engine={"quantization": "auto"}),
    ExecPath("q4_k-weights", torch.bfloat16, torch.bfloat16, weights="Q4_K", engine={"quantization": "auto"}),
    # the other types of real files, each on its packed 16-row form (a 37-row matrix stays unpacked)
    *(ExecPath(f"{t.lower()}-weights", torch.bfloat16, torch.bfloat16, weights=t, engine={"quantization": "auto"})
      for t in ("Q4_0", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")),
    # fp32 activations on quantized weights: the default ("auto") where the CPU lacks bf16 arithmetic. Their
    # engine path is "fp32" above (the embedded Q4_1 model runs as stored by default)
    *(ExecPath(f"{t.lower()}-weights-fp32", torch.float32, torch.float32, weights=t)
      for t in ("Q4_1", "Q4_K", "Q5_0", "Q6_K", "Q8_0")),
    ExecPath("spec-ngram", torch.bfloat16, torch.bfloat16,
             engine={"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}),
    # a mixture of experts (a tiny random Qwen3-MoE shape, Q4_K_M, the experts as stored): routing and the
    # per-expert GEMMs of a token depend on its own row alone (tests/model/test_moe.py holds the block's rows
    # bitwise equal alone and batched in both dtypes' kernels)
    ExecPath("moe-q4_k_m", torch.float32, torch.float32, engine={"model": "tiny-moe", "quantization": "gguf"}),
    # gpt-oss (a tiny random checkpoint): attention sinks in the C++ kernel, windowed layers beside full ones in
    # the hybrid KV manager, router and expert biases
    ExecPath("gpt-oss", torch.float32, torch.float32, engine={"model": "tiny-gpt-oss"}),
    ExecPath("gpt-oss-bf16", torch.bfloat16, torch.bfloat16, engine={"model": "tiny-gpt-oss"}),
    # ... and as llama.cpp's gpt-oss files are (MXFP4 experts, Q8_0 elsewhere), run as stored
    ExecPath("gpt-oss-mxfp4", torch.float32, torch.float32,
             engine={"model": "tiny-gpt-oss-gguf", "quantization": "gguf"}),
]


def _distinct(key) -> list[ExecPath]:
    """The paths that differ in what a kernel test exercises (the others would repeat a test)."""
    seen: dict[Any, ExecPath] = {}
    for p in PATHS:
        seen.setdefault(key(p), p)
    return list(seen.values())


LINEAR_PATHS = _distinct(lambda p: (p.dtype, p.weights))
KERNEL_PATHS = _distinct(lambda p: (p.dtype, p.kv_dtype))  # attention and sampler
ENGINE_PATHS = _distinct(lambda p: (p.dtype, repr(sorted(p.engine.items()))))  # what LLM(...) is given
BATCH_SIZES = [2, 3, 4, 5, 7, 16, 17, 64, 129, 300]

try:
    kernels.load_ops()
except Exception as e:  # pragma: no cover - a machine without a compiler
    pytest.skip(f"C++ kernels do not build here: {e}", allow_module_level=True)


pytestmark = pytest.mark.usefixtures("batch_invariant_kernels")


# ---- GEMM ------------------------------------------------------------------------------------------------------
def _path_linear(path: ExecPath, n: int, k: int, gen: torch.Generator):
    """This path's linear (random weights [n, k]) as a function of x, and the weight it multiplies by."""
    import numpy as np

    from pagedllm.model.layers import linear
    from pagedllm.quantization.tensor import QuantTensor, type_id
    from pagedllm.testing.gguf_writer import quantized

    if path.weights != "dense":
        raw = quantized(np.random.default_rng(k + n), n, k, path.weights, 0.05)
        q = QuantTensor(torch.from_numpy(np.ascontiguousarray(raw)), type_id(path.weights), k).packed()
        return q.matmul, q.dequantize()
    if kernels.kernel_op("gemm_invariant") is None:
        pytest.skip("no invariant GEMM in this build")
    w = torch.randn(n, k, generator=gen).to(path.dtype)
    return (lambda x: linear(x, w)), w


@pytest.mark.parametrize("path", LINEAR_PATHS, ids=[p.name for p in LINEAR_PATHS])
@pytest.mark.parametrize("k,n", [(768, 64), (256, 37)])  # K: whole 256-element K-quant blocks; N off the tiles
def test_linear_row_alone_equals_row_in_batch(path, k, n):
    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(300, k, generator=g).to(path.dtype)
    linear, w = _path_linear(path, n, k, g)
    rows = [0, 1, 150, 299]
    alone = {r: linear(x[r:r + 1]) for r in rows}
    ref = torch.nn.functional.linear(x.double(), w.double())
    # bf16 rounding of x and the output; the quantized GEMM also rounds x to int8 per block of 32
    tol = 5e-2 if path.weights != "dense" else 1e-4 if path.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(torch.cat([alone[r] for r in rows]).double(), ref[rows], rtol=tol, atol=tol * k ** 0.5)
    for m in BATCH_SIZES:
        start = random.Random(m).randrange(0, 300 - m + 1)
        out = linear(x[start:start + m])
        for r in rows:
            if start <= r < start + m:
                assert torch.equal(out[r - start], alone[r][0]), (m, r)
        assert torch.equal(out[0], linear(x[start:start + 1])[0]), m


# ---- attention -------------------------------------------------------------------------------------------------
HQ, HKV, D, BS = 6, 2, 64, 16


def _pool(gen, lens: list[int], kv_dtype, hkv: int = HKV):
    need = [-(-n // BS) for n in lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for nb in need:
        tables.append(perm[at:at + nb])
        at += nb
    k_cache = random_pool((num_blocks, BS, hkv, D), kv_dtype, gen)
    v_cache = random_pool((num_blocks, BS, hkv, D), kv_dtype, gen)
    return tables, k_cache, v_cache


def _attend(q_rows, tables, lens, new, k_cache, v_cache):
    """q_rows[r]: [new[r], HQ, D] queries of request r (its last new[r] positions) -> per-request outputs."""
    meta = build_attention_metadata(tables, [n - t for n, t in zip(lens, new, strict=True)], new, BS)
    out = kernels.paged_attention(torch.cat(q_rows), k_cache, v_cache, meta, 0.125)
    return list(out.split(new))


@pytest.mark.parametrize("path", KERNEL_PATHS, ids=[p.name for p in KERNEL_PATHS])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("hkv", [HKV, 1], ids=["kv_heads_2", "kv_head_1"])
def test_attention_row_alone_equals_row_in_batch(path, threads, hkv):
    """One request (decode, a verification of 4 drafts, a prefill of 40 tokens, a long context split into slices)
    alone and among 1..299 others of random lengths and query counts (alone, a request's few query tokens are cut
    into one tile per thread, a lone token's KV heads into one item each, and with one KV head its query heads
    into parts)."""
    gen = torch.Generator().manual_seed(threads)
    rnd = random.Random(threads)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for target_len, target_new in [(300, 1), (300, 5), (900, 1), (1500, 40), (37, 37)]:
            for m in [1, *BATCH_SIZES]:
                lens = [target_len] + [rnd.randrange(1, 300) for _ in range(m - 1)]
                new = [target_new] + [rnd.choice([1, 1, 1, min(n, rnd.randrange(1, 50))]) for n in lens[1:]]
                tables, k_cache, v_cache = _pool(gen, lens, path.kv_dtype, hkv)
                q = [torch.randn(t, HQ, D, generator=gen).to(path.dtype) for t in new]
                alone = _attend(q[:1], tables[:1], lens[:1], new[:1], k_cache, v_cache)[0]
                batched = _attend(q, tables, lens, new, k_cache, v_cache)[0]
                assert torch.equal(alone, batched), (target_len, target_new, m)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("path", KERNEL_PATHS, ids=[p.name for p in KERNEL_PATHS])
@pytest.mark.parametrize("prompt_len", [5, 40, 700])
def test_attention_row_same_for_any_prompt_split(path, prompt_len):
    """A prompt's rows computed in one cold prefill, as the tail after a prefix-cache hit of any length, in
    chunks, or one at a time (decode) are the same bytes."""
    gen = torch.Generator().manual_seed(prompt_len)
    tables, k_cache, v_cache = _pool(gen, [prompt_len], path.kv_dtype)
    q = torch.randn(prompt_len, HQ, D, generator=gen).to(path.dtype)
    cold = _attend([q], tables, [prompt_len], [prompt_len], k_cache, v_cache)[0]
    for cached in sorted({0, 1, prompt_len // 3, prompt_len - 17, prompt_len - 2, prompt_len - 1} - {-1}):
        if not 0 <= cached < prompt_len:
            continue
        rows = []
        for start in range(cached, prompt_len, 16):  # the rest in chunks of 16 tokens
            end = min(prompt_len, start + 16)
            rows.append(_attend([q[start:end]], tables, [end], [end - start], k_cache, v_cache)[0])
        assert torch.equal(torch.cat(rows), cold[cached:]), cached


# ---- sampler ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", KERNEL_PATHS, ids=[p.name for p in KERNEL_PATHS])
def test_sampler_row_alone_equals_row_in_batch(path):
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.worker.sampler import Sampler, SamplingRow

    gen = torch.Generator().manual_seed(3)
    vocab = 5000
    logits = (torch.randn(300, vocab, generator=gen) * 3).to(path.dtype).float()
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.8, top_p=0.9, seed=5,
                                                                          logprobs=1),
              SamplingParams(temperature=1.2, top_k=20, min_p=0.05, seed=6)]

    def run(rows_idx):
        rows = [SamplingRow(params[i % len(params)], [1, 2, 3], [], params[i % len(params)].seed)
                for i in rows_idx]
        return Sampler(seed=0)(logits[rows_idx], rows)

    for target in (0, 1, 2):
        alone = run([target])
        for m in BATCH_SIZES:
            idx = [target] + [3 + (target + 7 * j) % 297 for j in range(m - 1)]
            out = run(idx)
            assert out.token_ids[0] == alone.token_ids[0], (target, m)
            if alone.logprobs is not None:  # (a batch reports max(logprobs asked) alternatives for every row)
                k = params[target].logprobs
                assert out.logprobs[0] == alone.logprobs[0] and out.ranks[0] == alone.ranks[0]
                assert out.top_ids[0][:k] == alone.top_ids[0][:k]
                assert out.top_logprobs[0][:k] == alone.top_logprobs[0][:k]


# ---- engine ----------------------------------------------------------------------------------------------------
# The real embedded model. Prompts share prefixes (so that batched runs hit the prefix cache mid-prompt), the
# requests mix greedy, seeded n=2 samples and stop strings.
PREFIX = ("You are a careful assistant. Answer briefly and precisely, in plain words, without lists. "
          "The user asks about everyday things. ")
QUESTIONS = ["What is the capital of France?", "Name a colour of the sky.", "What is 12 plus 7?",
             "Say hello in Spanish.", "Why is the sea salty?", "What do bees make?", "Count to three."]


def _requests(seed: int):
    from pagedllm import SamplingParams

    rnd = random.Random(seed)
    reqs = []
    for i, q in enumerate(rnd.sample(QUESTIONS, 6)):
        prompt = (PREFIX * rnd.choice([1, 1, 3]) if rnd.random() < 0.7 else "") + q
        kind = i % 3
        if kind == 0:
            params = SamplingParams(temperature=0.0, max_tokens=rnd.randrange(4, 9))
        elif kind == 1:
            params = SamplingParams(temperature=0.9, top_p=0.95, n=2, seed=rnd.randrange(1000), max_tokens=6)
        else:
            params = SamplingParams(temperature=0.0, max_tokens=8, stop=[".", "!"])
        reqs.append((prompt, params))
    return reqs


def _tokens(outs):
    return [[(c.token_ids, c.text) for c in o.outputs] for o in outs]


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory) -> str:
    """A random Qwen3-MoE-shaped GGUF (8 experts, 2 per token, 3 layers) with the embedded model's tokenizer."""
    from pagedllm.testing.gguf_writer import tiny_shape, write_random_gguf

    path = str(tmp_path_factory.mktemp("moe") / "tiny-moe.gguf")
    shape = tiny_shape("qwen3moe", experts=8, experts_used=2, expert_ffn=256, qk_norm=True, layers=3, vocab=49152)
    write_random_gguf(path, shape, "Q4_K_M", seed=7, std=0.1)
    return path


@pytest.fixture(scope="session")
def tiny_gpt_oss(tmp_path_factory) -> str:
    """A random tiny gpt-oss (windows of 16 on every other layer: the prompts here are longer) with the embedded
    model's tokenizer (the prompts' lengths, which the KV budgets here are chosen for)."""
    import os

    import transformers
    from tiny_models import make_tiny_model

    from pagedllm.model.loader import default_model_path

    gguf = default_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    return str(make_tiny_model(tmp_path_factory.mktemp("gpt-oss"), "gpt_oss", seed=3, tokenizer=tokenizer))


@pytest.fixture(scope="session")
def tiny_gpt_oss_gguf(tmp_path_factory) -> str:
    """A random gpt-oss-shaped GGUF (MXFP4_MOE: 4 experts of which 2 per token, windows of 16, YaRN)."""
    from pagedllm.testing.gguf_writer import tiny_shape, write_random_gguf

    path = str(tmp_path_factory.mktemp("gpt-oss-gguf") / "tiny-gpt-oss.gguf")
    shape = tiny_shape("gpt-oss", experts=4, experts_used=2, expert_ffn=256, sliding_window=16, yarn=(4.0, 256),
                       layers=2, vocab=49152)
    write_random_gguf(path, shape, "MXFP4_MOE", seed=5, std=0.1)
    return path


@pytest.fixture(scope="module", params=ENGINE_PATHS, ids=[p.name for p in ENGINE_PATHS])
def alone(request):
    """(the path's LLM arguments, the requests, each one's outputs run alone on a fresh engine without a prefix
    cache)."""
    from pagedllm import LLM

    path = request.param
    dtype = "float32" if path.dtype == torch.float32 else "bfloat16"
    engine = dict(path.engine)
    if engine.get("model") in ("tiny-moe", "tiny-gpt-oss", "tiny-gpt-oss-gguf"):
        engine["model"] = request.getfixturevalue(engine["model"].replace("-", "_"))
    reqs = _requests(seed=4)  # the same requests on every path (this mix preempts in test_engine_preempted_...)
    outs = []
    for prompt, params in reqs:
        llm = LLM(dtype=dtype, enable_prefix_caching=False, num_kv_blocks=64, **engine)
        outs.append(_tokens(llm.generate([prompt], params, use_tqdm=False))[0])
        del llm
    return {"dtype": dtype, **engine}, reqs, outs


@pytest.mark.slow  # the real embedded model
@pytest.mark.parametrize("budget", [16, 64, 2048])
def test_engine_batched_equals_alone(alone, budget):
    """All requests in one batch, prompts chunked by the token budget, cold then warm prefix cache: every
    request's tokens are those it gets alone."""
    from pagedllm import LLM

    engine, reqs, expected = alone
    llm = LLM(max_num_batched_tokens=budget, num_kv_blocks=256, **engine)
    prompts, params = [p for p, _ in reqs], [s for _, s in reqs]
    cold = _tokens(llm.generate(prompts, params, use_tqdm=False))
    assert cold == expected
    warm = _tokens(llm.generate(prompts[::-1], params[::-1], use_tqdm=False))[::-1]
    assert warm == expected
    assert llm.kv_cache_stats()["prefix_cache_hits"] > 0


@pytest.mark.slow  # the real embedded model
def test_engine_preempted_equals_alone(alone):
    """KV budgets too small for the batch: requests are preempted and recomputed, tokens unchanged. (Whether a
    budget preempts depends on the exact lengths, so budgets are tried until one does.)"""
    from pagedllm import LLM

    engine, reqs, expected = alone
    for num_blocks in (12, 10, 14, 9, 16, 8, 11, 13, 7, 15):
        llm = LLM(num_kv_blocks=num_blocks, max_num_batched_tokens=64, enable_prefix_caching=False, **engine)
        got = _tokens(llm.generate([p for p, _ in reqs], [s for _, s in reqs], use_tqdm=False))
        assert got == expected, num_blocks
        if llm.kv_cache_stats()["num_preemptions"] > 0:
            return
    pytest.fail("no budget preempted")


def test_opt_out_flag():
    """On by default; --no-batch-invariant / LLM(batch_invariant=False) turn it off."""
    import argparse

    from pagedllm.engine.args import EngineArgs

    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    assert EngineArgs.from_cli_args(p.parse_args([])).batch_invariant is True
    assert EngineArgs.from_cli_args(p.parse_args(["--no-batch-invariant"])).batch_invariant is False
    assert EngineArgs.from_cli_args(p.parse_args(["--batch-invariant"])).batch_invariant is True
