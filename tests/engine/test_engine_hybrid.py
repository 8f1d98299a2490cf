"""The hybrid KV cache end to end (core/kv_groups.py): tiny random Gemma 3 (4 local + 2 global layers -> 1 full and
2 sliding KV groups) and Mistral with a window (1 sliding group), window 16 = 4 blocks of 4, with contexts several
windows long. Greedy tokens equal transformers' (teacher-forced: its argmax at every generated position) and the
"all global" layout (hybrid_kv_cache=False) through chunked prefill across the window edge, prefix hits,
preemption, forks, int8 KV and the C++ kernel; the sliding groups' blocks out of the window are back in the pool
while a request runs; no block leaks."""

from __future__ import annotations

import random

import pytest
import tiny_models
import torch
from tiny_models import assert_no_leaks, make_tiny_model, tokens

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.core.kv_groups import window_blocks
from pagedllm.engine.kv_snapshot import kv_snapshot

BS = 4
WINDOW = 16
LONG = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module", params=["gemma3", "mistral_window"])
def arch_dir(request, tmp_path_factory):
    return request.param, make_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=3)


@pytest.fixture(scope="module")
def hf_model(arch_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(arch_dir[1], dtype=torch.float32).eval()


def make_llm(path, **kw) -> LLM:
    """tiny_models.make_llm with this file's defaults: blocks of 4, a larger cache, and prompts longer than the
    window prefilled in chunks."""
    kw.setdefault("block_size", BS)
    kw.setdefault("num_kv_blocks", 600)
    kw.setdefault("max_num_batched_tokens", 24)
    return tiny_models.make_llm(path, **kw)


def prompts_of(n: int, seed: int, lo: int = 10, hi: int = 70) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def hf_teacher_forced(hf_model, prompt: list[int], generated: list[int]) -> list[int]:
    """transformers' greedy choice at every generated position, given the same preceding tokens."""
    full = prompt + generated
    with torch.no_grad():
        logits = hf_model(torch.tensor([full])).logits[0]
    return logits[len(prompt) - 1:len(full) - 1].argmax(-1).tolist()


def test_layout_and_greedy_tokens_match_transformers(arch_dir, hf_model):
    arch, path = arch_dir
    prompts = prompts_of(5, seed=1)
    llm = make_llm(path)
    assert llm.engine.kv_groups.windows == ([None, WINDOW, WINDOW] if arch == "gemma3" else [WINDOW])
    outs = llm.generate(prompts, LONG, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_teacher_forced(hf_model, prompt, out.outputs[0].token_ids)
    assert_no_leaks(llm)
    assert tokens(make_llm(path, hybrid_kv_cache=False).generate(prompts, LONG, use_tqdm=False)) == tokens(outs)


def test_sliding_blocks_go_back_to_the_pool_during_generation(arch_dir):
    arch, path = arch_dir
    llm = make_llm(path)
    engine = llm.engine
    engine.add_request("long", prompts_of(1, seed=2, lo=40, hi=40)[0], LONG)
    num_groups = engine.kv_groups.num_groups
    cap = window_blocks(WINDOW, BS, 24)
    seen_decode = False
    while engine.has_unfinished_requests():
        engine.step()
        req = engine.scheduler.running[0] if engine.scheduler.running else None
        if req is None:
            continue
        table_blocks = -(-req.num_computed_tokens // BS)
        used = engine.kv.num_used_blocks()
        if req.num_computed_tokens > 3 * WINDOW:  # long past the window: sliding groups hold only about it
            seen_decode = True
            full = table_blocks + 1
            num_full = 1 if arch == "gemma3" else 0
            assert used <= num_full * full + (num_groups - num_full) * window_blocks(WINDOW, BS, 1)
            assert used < num_groups * table_blocks
        if arch == "gemma3":
            per_group = engine.kv_cache_stats()["kv_groups"]
            assert [g["window"] for g in per_group] == [None, WINDOW, WINDOW]
            assert all(g["num_used_blocks"] <= cap for g in per_group[1:])
            assert sum(g["num_used_blocks"] for g in per_group) == used
    assert seen_decode
    assert_no_leaks(llm)


def test_prefix_hits_across_the_window(arch_dir, hf_model):
    _, path = arch_dir
    shared = prompts_of(1, seed=3, lo=50, hi=50)[0]
    prompts = [shared + p for p in prompts_of(4, seed=4, lo=1, hi=12)]
    reference = tokens(make_llm(path, enable_prefix_caching=False).generate(prompts, LONG, use_tqdm=False))
    llm = make_llm(path)
    first = llm.generate(prompts[:1], LONG, use_tqdm=False)
    rest = llm.generate(prompts[1:], LONG, use_tqdm=False)
    assert tokens(first + rest) == reference
    assert all(o.num_cached_tokens >= 48 for o in rest)  # 12 full blocks of the shared 50 tokens
    again = llm.generate(prompts[:1], LONG, use_tqdm=False)[0]  # its own generated tokens hit too
    assert again.num_cached_tokens >= 48 and again.outputs[0].token_ids == reference[0]
    assert_no_leaks(llm)


def test_prefix_hit_after_early_sliding_blocks_were_evicted(arch_dir):
    """A long request's first sliding blocks went back to the pool first (LRU) and were taken by others: a later
    hit still serves what every group needs (full group: every block; sliding groups: the window before the
    hit's end), and the outputs do not change."""
    _, path = arch_dir
    long_prompt = prompts_of(1, seed=5, lo=64, hi=64)[0]
    reference = tokens(make_llm(path, enable_prefix_caching=False).generate([long_prompt], LONG, use_tqdm=False))
    llm = make_llm(path, num_kv_blocks=160)
    llm.generate([long_prompt], LONG, use_tqdm=False)
    llm.generate(prompts_of(6, seed=6, lo=30, hi=40), LONG, use_tqdm=False)  # evicts the LRU head
    out = llm.generate([long_prompt], LONG, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference[0]
    assert_no_leaks(llm)


def test_preemption_gives_identical_outputs(arch_dir):
    arch, path = arch_dir
    prompts = prompts_of(8, seed=7, lo=20, hi=50)
    reference = tokens(make_llm(path).generate(prompts, LONG, use_tqdm=False))
    # (whether a budget preempts depends on the schedule: budgets are tried until one does)
    for num_blocks in (90, 80, 100, 70, 110) if arch == "gemma3" else (30, 24, 20, 27, 18, 34):
        small = make_llm(path, num_kv_blocks=num_blocks)
        assert tokens(small.generate(prompts, LONG, use_tqdm=False)) == reference, num_blocks
        assert_no_leaks(small)
        if small.kv_cache_stats()["num_preemptions"] > 0:
            return
    pytest.fail("no budget preempted")


def test_forks_beams_int8_and_the_cpu_kernel_match_all_global(arch_dir):
    _, path = arch_dir
    prompts = prompts_of(3, seed=8, lo=20, hi=40)
    sampled = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=40, ignore_eos=True)
    beams = BeamSearchParams(beam_width=3, max_tokens=24, ignore_eos=True)
    for kw in ({}, {"kv_cache_dtype": "int8"}, {"attention_backend": "cpu"}):
        hybrid, flat = make_llm(path, **kw), make_llm(path, hybrid_kv_cache=False, **kw)
        for llm in (hybrid, flat):
            llm.samples = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, sampled, use_tqdm=False)]
            llm.beams = [[b.tokens for b in o.sequences] for o in llm.beam_search(prompts[:2], beams)]
            assert_no_leaks(llm)
        assert hybrid.samples == flat.samples, kw
        assert hybrid.beams == flat.beams, kw


def test_admission_counts_a_window_per_sliding_group(arch_dir):
    """A request too long for the cache as all-global layers fits once the sliding groups only hold their
    window; one that does not fit even so is rejected at once."""
    arch, path = arch_dir
    prompt = prompts_of(1, seed=9, lo=100, hi=100)[0]
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)  # 149 slots: 38 blocks
    wb = window_blocks(WINDOW, BS, 24)  # what a sliding group holds at most (prefill chunks of 24 tokens)
    blocks = 38 + 2 * wb if arch == "gemma3" else wb  # gemma3: the full group + 2 sliding groups
    per_block = 2 * 2 * BS * 2 * 16 * 4  # K and V x 2 layers per group x block x 2 KV heads x head_dim 16 x fp32
    with pytest.raises(ValueError, match="KV"):  # all global: a third of the blocks (of 6 layers) for gemma3
        make_llm(path, num_kv_blocks=None, kv_cache_memory=blocks * per_block,
                 hybrid_kv_cache=False).generate([prompt], params, use_tqdm=False)
    llm = make_llm(path, num_kv_blocks=None, kv_cache_memory=blocks * per_block)
    assert llm.kv_cache_stats()["num_blocks"] == blocks
    assert len(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids) == 50
    assert_no_leaks(llm)
    with pytest.raises(ValueError, match="KV"):
        make_llm(path, num_kv_blocks=blocks - 1).generate([prompt], params, use_tqdm=False)


def test_kv_map_snapshot_paints_every_group(arch_dir):
    _, path = arch_dir
    llm = make_llm(path)
    engine = llm.engine
    engine.add_request("a", prompts_of(1, seed=10, lo=60, hi=60)[0], LONG)
    for _ in range(6):
        engine.step()
    snap = kv_snapshot(engine)
    (req,) = snap["requests"]
    assert req["num_blocks"] == engine.kv.num_used_blocks() == sum(c == 0 for c in snap["cells"])
    llm.engine.abort_request("a")
    assert_no_leaks(llm)


def test_speculative_decoding_rolls_back_every_group(arch_dir):
    """ngram drafts are written into every group's blocks and the rejected ones rolled back (truncate per group);
    greedy tokens stay those of plain decoding."""
    _, path = arch_dir
    prompts = prompts_of(4, seed=12, lo=20, hi=40)
    reference = tokens(make_llm(path).generate(prompts, LONG, use_tqdm=False))
    llm = make_llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert tokens(llm.generate(prompts, LONG, use_tqdm=False)) == reference
    assert llm.engine.spec_decode_stats()["num_draft_tokens"] > 0
    assert_no_leaks(llm)


def test_fused_layers_batched_chunked_and_cached_equal_alone(arch_dir):
    """bf16 on the C++ kernel: the layers run fused (Gemma's layer style, each layer's window, one stack call per
    run of layers sharing a KV group), in the default batch-invariant mode. Every request's greedy tokens are
    those it gets alone, batched with the others, its prompt chunked across the window edge, and again from the
    prefix cache."""
    from pagedllm.kernels import dispatch
    from pagedllm.model.fused_layer import fuses_layers

    if dispatch.kernel_class("DecoderStack") is None or not dispatch.has(dispatch.AVX512_BF16):
        pytest.skip("no bf16 fused layer on this build")
    _, path = arch_dir
    kw = {"dtype": "bfloat16", "attention_backend": "cpu"}
    prompts = prompts_of(6, seed=13, lo=10, hi=60)
    alone = [tokens(make_llm(path, enable_prefix_caching=False, max_num_batched_tokens=256, **kw).generate(
        [p], LONG, use_tqdm=False))[0] for p in prompts]
    llm = make_llm(path, **kw)  # prompts chunked by 24 tokens
    runner = llm.engine.runner
    h = torch.empty(1, runner.model.config.hidden_size, dtype=torch.bfloat16)
    assert fuses_layers(runner.model, h, runner.kv_caches)
    assert tokens(llm.generate(prompts, LONG, use_tqdm=False)) == alone
    assert tokens(llm.generate(prompts[::-1], LONG, use_tqdm=False))[::-1] == alone
    assert llm.kv_cache_stats()["prefix_cache_hits"] > 0
    assert_no_leaks(llm)
