"""INT8 KV cache (kv_cache_dtype="int8"): the row format, the C++ write against the torch one, block copies keep
the scales, the engine with n>1, beams, prefix hits and preemption leaks nothing, the memory budget counts the
scales; with the real embedded model, perplexity and greedy chat answers against the compute-dtype KV.
(The kernel against the reference in int8 mode: tests/kernels/test_attention_kernel.py; batch invariance with
int8 KV: tests/engine/test_batch_invariance.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedllm import LLM, BeamSearchParams, SamplingParams, kernels
from pagedllm.attention import build_attention_metadata, copy_blocks
from pagedllm.attention.kv_quant import SCALE_BYTES, dequantize, quantize, round_queries
from pagedllm.attention.reference import ReferenceBackend, write_kv
from pagedllm.model.kv_cache import allocate_kv_caches, kv_bytes_per_block, num_blocks_for_budget

SMOLLM2 = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64)  # the embedded model's KV shape


def test_quantize_round_trip_error_is_half_a_step():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200, 3, 64, generator=g) * torch.rand(200, 3, 1, generator=g) * 10
    rows = quantize(x)
    assert rows.dtype == torch.int8 and rows.shape == (200, 3, 64 + SCALE_BYTES)
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float16).float()
    assert torch.allclose(scale[..., 0], x.abs().amax(-1) / 127, rtol=1e-3)  # one f16 rounding
    assert ((dequantize(rows) - x).abs() <= scale * 0.5 * (1 + 1e-3)).all()
    assert rows[..., :64].abs().max() == 127
    assert torch.equal(dequantize(quantize(torch.zeros(2, 64))), torch.zeros(2, 64))  # scale 0: no NaN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_write_equals_torch_quantize(dtype):
    """The fused C++ quantize-and-scatter writes the bytes of kv_quant.quantize, at every magnitude (f16 scales
    subnormal at 1e-6, clamped at 1e7), for zero rows and for strided inputs (k, v as views of a QKV buffer)."""
    g = torch.Generator().manual_seed(2)
    for mag in (1e-9, 1e-6, 1e-3, 1.0, 300.0, 1e7):
        qkv = torch.randn(300, 4 * 3 * 40, generator=g) * mag
        qkv[7] = 0
        k = qkv[:, :120].view(300, 3, 40).to(dtype)
        v = qkv[:, 120:240].view(300, 3, 40).to(dtype)
        slots = torch.randperm(40 * 8, generator=g)[:300]
        a = [torch.zeros(40, 8, 3, 42, dtype=torch.int8) for _ in range(4)]
        kernels.write_kv_int8(k, v, a[0], a[1], slots)
        write_kv(k, v, a[2], a[3], slots)
        assert torch.equal(a[0], a[2]) and torch.equal(a[1], a[3]), mag


def test_budget_counts_scales_and_holds_1_9x_bf16_blocks():
    gib = 1 << 30
    bf16 = num_blocks_for_budget(SMOLLM2, 16, torch.bfloat16, gib)
    int8 = num_blocks_for_budget(SMOLLM2, 16, torch.int8, gib)
    assert int8 >= 1.9 * bf16, (int8, bf16)
    assert kv_bytes_per_block(SMOLLM2, 16, torch.int8) == 2 * 30 * 16 * 3 * (64 + 2)  # values + f16 scales
    pool = allocate_kv_caches(SMOLLM2, 16, torch.int8, num_blocks=4)
    assert pool.pool.numel() * pool.pool.element_size() == 4 * kv_bytes_per_block(SMOLLM2, 16, torch.int8)


def test_copy_blocks_moves_scales_and_attention_reads_the_copy():
    """Copy-on-write of int8 blocks copies values and scales: a request reading the copies attends to exactly
    what it read from the originals (the kernel and the reference backend)."""
    cfg = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=64)
    caches = allocate_kv_caches(cfg, 16, torch.int8, num_blocks=12)
    g = torch.Generator().manual_seed(3)
    src, dst = [1, 4, 6], [9, 2, 11]
    meta = build_attention_metadata([src], [0], [40], 16)
    q = torch.randn(40, 6, 64, generator=g)
    for k_cache, v_cache in caches:
        write_kv(torch.randn(40, 2, 64, generator=g) * 5, torch.randn(40, 2, 64, generator=g), k_cache, v_cache,
                 meta.slot_mapping)
    copy_blocks(caches, list(zip(src, dst, strict=True)))
    meta_copy = build_attention_metadata([dst], [39], [1], 16)
    meta_orig = build_attention_metadata([src], [39], [1], 16)
    for k_cache, v_cache in caches:
        assert torch.equal(k_cache[dst], k_cache[src]) and torch.equal(v_cache[dst], v_cache[src])
        assert (k_cache[dst][..., -SCALE_BYTES:] != 0).any()  # the scale bytes are there
        a = kernels.paged_attention(q[-1:], k_cache, v_cache, meta_copy, 0.125)
        b = kernels.paged_attention(q[-1:], k_cache, v_cache, meta_orig, 0.125)
        assert torch.equal(a, b)
        qr = round_queries(q[-1:], 0.125) if kernels.rounds_int8_queries(64) else q[-1:].double()  # the kernel's q
        ref = ReferenceBackend()._attend_one(qr, k_cache, v_cache, meta_copy.block_tables[0], 40, 0.125, None)
        torch.testing.assert_close(a.double(), ref, atol=2e-4, rtol=1e-4)  # VNNI: probabilities rounded to 15 bits


# ---- engine (a tiny random model: seconds) ------------------------------------------------------------------------


def _llm(path, **kw) -> LLM:
    kw = {"dtype": "float32", "block_size": 8, "num_kv_blocks": 128, "kv_cache_dtype": "int8", **kw}
    return LLM(str(path), **kw)


def _assert_no_leaks(llm: LLM) -> None:
    stats = llm.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"], stats
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (n, length), generator=g).tolist()


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_engine_int8_n_beams_prefix_preemption_no_leaks(tiny_dir, backend):
    llm = _llm(tiny_dir, attention_backend=backend)
    stats = llm.kv_cache_stats()
    assert stats["kv_cache_dtype"] == "int8" and stats["kv_bytes_per_token"] == 2 * 2 * 2 * (16 + 2)
    shared = _prompts(1, 30, seed=1)[0]
    prompts = [shared + p for p in _prompts(4, 9, seed=2)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    cold = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    warm = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], greedy, use_tqdm=False)][::-1]
    assert warm == cold and llm.kv_cache_stats()["prefix_cache_hits"] > 0  # cached int8 blocks read the same
    out = llm.generate(prompts[:1], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    beams = llm.beam_search(prompts[:2], BeamSearchParams(beam_width=3, max_tokens=8))
    assert all(len(b.sequences) == 3 for b in beams)
    _assert_no_leaks(llm)
    small = _llm(tiny_dir, attention_backend=backend, num_kv_blocks=14, max_num_batched_tokens=32,
                 enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in small.generate(prompts, greedy, use_tqdm=False)] == cold
    assert small.kv_cache_stats()["num_preemptions"] > 0
    _assert_no_leaks(small)


def test_kernel_and_reference_backends_agree_on_int8_greedy(tiny_dir):
    prompts = _prompts(5, 25, seed=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got = {b: [o.outputs[0].token_ids for o in _llm(tiny_dir, attention_backend=b).generate(prompts, greedy,
                                                                                              use_tqdm=False)]
           for b in ("cpu", "reference")}
    assert got["cpu"] == got["reference"]


def test_flag_and_bad_value():
    import argparse

    from pagedllm.engine.args import EngineArgs

    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    assert EngineArgs.from_cli_args(p.parse_args([])).kv_cache_dtype == "auto"
    assert EngineArgs.from_cli_args(p.parse_args(["--kv-cache-dtype", "int8"])).kv_cache_dtype == "int8"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="fp8")


# ---- the real embedded model: quality of int8 KV against the compute-dtype KV ---------------------------------------
CHAT = ["What is the capital of France?", "Write a haiku about the sea.",
        "Explain in two sentences what a hash table is.", "Name three primary colors.",
        "Give me a tip for sleeping better.", "What is 17 times 3?", "Translate 'good morning' into French.",
        "Why do leaves change colour in autumn?"]


@pytest.fixture(scope="module")
def smollm2():
    from pagedllm.model import load_model

    # the engine's default dtype and the C++ attention kernel, on the dequantized weights these figures were taken on
    return load_model(None, "bfloat16", quantization="none")


@pytest.mark.slow
def test_perplexity_int8_kv_within_1pct(smollm2):
    from smollm2_harness import TEXT, perplexity

    # the first 768 tokens keep it near ten seconds here (the whole text, 2890 tokens: bf16 KV 26.893, int8 KV
    # 26.899, +0.02%)
    ids = smollm2.tokenizer(open(TEXT, encoding="utf-8").read())["input_ids"][:768]
    ppl = {kv_dtype: perplexity(smollm2, ids, kv_dtype) for kv_dtype in (torch.bfloat16, torch.int8)}
    print(f"\nperplexity over {len(ids)} tokens: bf16 KV {ppl[torch.bfloat16]:.4f}, "
          f"int8 KV {ppl[torch.int8]:.4f}")
    assert abs(ppl[torch.int8] - ppl[torch.bfloat16]) / ppl[torch.bfloat16] < 0.01


@pytest.mark.slow
def test_greedy_chat_changes_are_near_ties(smollm2):
    """Greedy answers (48 tokens) with bf16 and int8 KV; where an answer changes, the bf16 run's top-2 logits at
    the first differing token are a near tie (gap < 0.5, i.e. the two tokens were within a factor 1.65 in
    probability), not a different answer forced by garbage."""
    from smollm2_harness import Greedy, chat_ids

    tok, eos = smollm2.tokenizer, set(smollm2.eos_token_ids)
    runs = {}
    for kv_dtype in (torch.bfloat16, torch.int8):
        seqs = [{"tokens": chat_ids(tok, p), "table": [], "done": 0, "out": [], "gaps": []} for p in CHAT]
        runner, live = Greedy(smollm2, kv_dtype=kv_dtype), list(seqs)
        counts = [len(s["tokens"]) for s in live]
        for _ in range(48):
            logits, _ = runner.step(live, counts)
            top = logits.float().topk(2, dim=-1)
            for s, ids, vals in zip(live, top.indices.tolist(), top.values.tolist(), strict=True):
                s["tokens"].append(ids[0])
                s["out"].append(ids[0])
                s["gaps"].append(vals[0] - vals[1])
            live = [s for s in live if s["out"][-1] not in eos]
            if not live:
                break
            counts = [1] * len(live)
        runs[kv_dtype] = seqs
    changed = []
    for p, a, b in zip(CHAT, runs[torch.bfloat16], runs[torch.int8], strict=True):
        if a["out"] != b["out"]:
            i = next(i for i, (x, y) in enumerate(zip(a["out"], b["out"], strict=False)) if x != y)
            changed.append((p, i, a["gaps"][i]))
    print(f"\n{len(changed)} of {len(CHAT)} greedy answers change with int8 KV: "
          + ", ".join(f"{p!r} at token {i} (bf16 top-2 gap {gap:.3f})" for p, i, gap in changed))
    # The bf16 model's logits are bf16 (spacing 0.125 between 16 and 32): exact ties are common and any KV
    # perturbation flips them, so the count is reported, not bounded; every flip must be at a near tie.
    assert len(changed) < len(CHAT)
    for p, i, gap in changed:
        assert gap < 0.5, (p, i, gap)
