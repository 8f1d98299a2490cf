"""The disk tier end to end (LLM(kv_disk_cache_dir=...)) on tiny random models: greedy tokens are the same whether a
prefix is prefilled, hit in RAM, loaded from disk or loaded after a restart, for a plain model, int8 KV and a hybrid
(Gemma 3) layout; cached_tokens counts both tiers; a corrupted entry, a full disk and another model's directory
never fail a request; no block leaks."""

from __future__ import annotations

import errno
import logging
import os
import random

import pytest
from tiny_models import make_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.worker import kv_disk_store

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
BS = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """Tiny random checkpoints: a Llama, and a Gemma 3 (hybrid KV: one full and two sliding groups)."""
    return {arch: make_tiny_model(tmp_path_factory.mktemp(arch), arch, seed=3) for arch in ("llama", "gemma3")}


@pytest.fixture(scope="module")
def llama_dir(models):
    return models["llama"]


def make_llm(path, disk, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 48)  # 192 tokens: a few other prompts push a prefix out of RAM
    return LLM(str(path), dtype="float32", block_size=BS, kv_disk_cache_dir=str(disk), seed=0, **kw)


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(length)] for _ in range(n)]


def push_out_of_ram(llm: LLM, seed: int) -> None:
    """Other prompts take every block (the pool evicts, the tier spills); then wait for the writes."""
    for p in prompts(seed, 3, 120):  # one after another: each reuses the least recently used blocks
        llm.generate([p], SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.engine.disk_tier.worker.flush(30)


def disk_hits(llm: LLM) -> int:
    return llm.kv_cache_stats()["prefix_cache_disk_hits"]


def assert_no_leak(llm: LLM) -> None:
    s = llm.kv_cache_stats()
    assert s["num_free_blocks"] == s["num_blocks"] and not llm.engine.kv.block_pool.pins


@pytest.mark.parametrize("arch,kw", [("llama", {}), ("llama", {"kv_cache_dtype": "int8"}), ("gemma3", {})],
                         ids=["plain", "int8-kv", "hybrid"])
def test_same_tokens_from_prefill_ram_disk_and_restart(models, tmp_path, arch, kw):
    path = models[arch]
    if arch == "gemma3":  # 3 KV groups: a request holds a block per group (a window's worth in the sliding ones)
        kw.update(num_kv_blocks=64, max_num_batched_tokens=24)
    (prompt,) = prompts(1, 1, 70)
    llm = make_llm(path, tmp_path, **kw)
    cold = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    ram = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0 and ram.num_cached_tokens == 68 and disk_hits(llm) == 0
    push_out_of_ram(llm, seed=2)
    disk = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert disk.num_cached_tokens == 68 and disk_hits(llm) == 68  # every cached token came from disk
    assert_no_leak(llm)
    llm.engine.close()  # shutdown: what is still only in RAM is written too
    again = make_llm(path, tmp_path, **kw)
    restarted = again.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert restarted.num_cached_tokens == 68 and disk_hits(again) == 68
    tokens = [o.outputs[0].token_ids for o in (cold, ram, disk, restarted)]
    assert all(t == tokens[0] for t in tokens), tokens
    assert_no_leak(again)
    again.engine.close()


def test_a_prefix_computed_before_shutdown_is_a_hit_after_restart(llama_dir, tmp_path):
    (prompt,) = prompts(4, 1, 50)
    llm = make_llm(llama_dir, tmp_path)
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    llm.engine.close()  # the prefix was never evicted: the shutdown writes it
    again = make_llm(llama_dir, tmp_path)
    out = again.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 48 and out.outputs[0].token_ids == first.outputs[0].token_ids
    again.engine.close()


def test_a_corrupted_entry_is_prefilled_instead(llama_dir, tmp_path, caplog):
    (prompt,) = prompts(5, 1, 70)
    llm = make_llm(llama_dir, tmp_path)
    cold = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    push_out_of_ram(llm, seed=6)
    store = llm.engine.disk_tier.store
    from pagedllm.core.kv_cache_utils import hash_request_blocks

    bad_key = hash_request_blocks(prompt, BS)[5]  # the 6th block of the prefix
    victim = store._path(bad_key)
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        f.write(b"\xff" * 8)
    with caplog.at_level(logging.WARNING, logger=kv_disk_store.__name__):
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == cold.outputs[0].token_ids
    assert out.num_cached_tokens == 5 * BS  # the blocks before the bad one came from disk; the rest was prefilled
    assert len([r for r in caplog.records if "unusable" in r.message]) == 1
    assert llm.engine.disk_tier.worker.flush(30)  # the prefilled block was written again at completion, intact
    assert store.read_into(bad_key, [memoryview(bytearray(store.payload_bytes))])
    assert_no_leak(llm)
    llm.engine.close()


def test_a_full_disk_warns_once_and_fails_no_request(llama_dir, tmp_path, caplog, monkeypatch):
    real_open = open

    def full_disk(path, mode="r", *a, **kw):
        if "x" in mode and str(tmp_path) in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *a, **kw)

    llm = make_llm(llama_dir, tmp_path)
    monkeypatch.setattr("builtins.open", full_disk)
    ps = prompts(7, 4, 70)
    with caplog.at_level(logging.WARNING, logger=kv_disk_store.__name__):
        outs = llm.generate(ps, GREEDY, use_tqdm=False)
        push_out_of_ram(llm, seed=8)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)
    assert len([r for r in caplog.records if "no space" in r.message]) == 1
    s = llm.kv_cache_stats()
    assert not s["kv_disk_spills_enabled"] and s["kv_disk_store_blocks"] == 0
    assert_no_leak(llm)
    llm.engine.close()


def test_another_models_entries_are_never_read(llama_dir, tmp_path_factory, tmp_path):
    other_dir = make_tiny_model(tmp_path_factory.mktemp("other"), "llama", seed=1)  # same shape, other weights
    (prompt,) = prompts(9, 1, 70)
    a = make_llm(llama_dir, tmp_path)
    a.generate([prompt], GREEDY, use_tqdm=False)
    a.engine.close()
    b = make_llm(other_dir, tmp_path)
    out = b.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and disk_hits(b) == 0
    assert b.engine.disk_tier.store.dir != a.engine.disk_tier.store.dir
    assert a.engine.disk_tier.store.contains(next(iter(a.engine.disk_tier.store._index)))
    b.engine.close()


def test_two_engines_on_one_directory_share_prefixes(llama_dir, tmp_path):
    """As data-parallel replicas on one machine: a prefix one computed (written at its completion) is the other's
    hit, without a restart."""
    (prompt,) = prompts(10, 1, 70)
    a, b = make_llm(llama_dir, tmp_path), make_llm(llama_dir, tmp_path)
    first = a.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert a.engine.disk_tier.worker.flush(30)
    second = b.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert second.num_cached_tokens == 68 and disk_hits(b) == 68
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    a.engine.close()
    b.engine.close()


def test_beam_search_waits_for_its_prefix_from_disk(llama_dir, tmp_path):
    from pagedllm import BeamSearchParams

    (prompt,) = prompts(11, 1, 70)
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    llm = make_llm(llama_dir, tmp_path)
    cold = llm.beam_search([prompt], params)[0]
    push_out_of_ram(llm, seed=12)
    warm = llm.beam_search([prompt], params)[0]
    assert disk_hits(llm) == 68
    assert [s.tokens for s in warm.sequences] == [s.tokens for s in cold.sequences]
    assert_no_leak(llm)
    llm.engine.close()
