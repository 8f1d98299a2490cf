"""The Triton paged-attention backend against the reference backend, on fresh random inputs. Without CUDA the
kernels run in Triton's interpreter on CPU tensors (the module sets TRITON_INTERPRET=1): small shapes, each case
combining several features rather than a full cross product."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import zlib

import pytest
import torch
from attention_harness import DEVICE, make_batch, oracle, poison

from pagedllm.attention import available_backends, build_attention_metadata, get_backend
from pagedllm.attention.reference import copy_blocks

triton_paged = pytest.importorskip("pagedllm.attention.triton_paged")  # skipped where triton is absent

F32, BF16, F16, I8 = torch.float32, torch.bfloat16, torch.float16, torch.int8


def tol(dtype: torch.dtype) -> dict:
    """fp32 (also over int8 K/V: dequantized values are exact in fp32): equal to rounding; 16-bit outputs: to
    their rounding."""
    return {"atol": 2e-5, "rtol": 1e-5} if dtype == F32 else {"atol": 1.5e-2, "rtol": 1e-2}


def backend(split_tokens: int = 32):
    """A backend whose decode splits every 32 keys (a few blocks), so that short contexts take several splits."""
    b = get_backend("triton")
    b.split_tokens = split_tokens
    return b


CASES = [
    # dtype, kv_dtype, block_size, hq, hkv, head_dim, window, sinks, num_computed, num_new
    # GQA 1, a mixed batch: prefill, decodes (split, in the batch's decode launch), chunks over cached prefixes
    # ending mid-block, a request of no queries
    (F32, F32, 16, 4, 4, 64, None, False, [0, 37, 100, 5, 64, 0], [9, 1, 1, 20, 33, 0]),
    # GQA 8, head dim 256, int8 K/V, sinks; a long decode over several splits next to a short one
    (F32, I8, 8, 8, 1, 256, None, True, [0, 150, 41], [20, 1, 1]),
    # GQA 4, head dim 128, bf16 decodes only, a sliding window over long contexts (several splits of it), sinks
    (BF16, BF16, 16, 8, 2, 128, 40, True, [200, 63, 17, 120], [1, 1, 1, 1]),
    # GQA 3 (a padded group), fp16 (the 16-bit q.k dot), window crossing chunks and decodes
    (F16, F16, 8, 6, 2, 64, 24, False, [0, 37, 60, 5], [30, 1, 12, 20]),
    # head dim 80 (padded to 128), int8 K/V under bf16 queries, window and sinks, Gemma-like long prefill
    (BF16, I8, 16, 8, 2, 80, 50, True, [0, 120, 60], [70, 1, 3]),
    # GQA 8, block size 32, a prefill and a chunk of several tiles against a cached prefix
    (F32, F32, 32, 16, 2, 128, None, False, [0, 64], [100, 40]),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-bs{c[2]}-{c[3]}q{c[4]}kv-d{c[5]}-w{c[6]}"
                         f"{'-sinks' if c[7] else ''}".replace("torch.", ""))
def test_matches_reference(case):
    """Scattered block tables (a random subset of the pool per request); with a window, the blocks before the
    first key a request's queries see are poisoned (NaN), as is what their table entries point at: never read."""
    dtype, kv_dtype, bs, hq, hkv, d, window, with_sinks, computed, new = case
    gen = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    q, k, v, k_cache, v_cache, meta = make_batch(gen, computed, new, bs, hq, hkv, d, dtype, kv_dtype, device=DEVICE)
    sinks = None
    if with_sinks:
        sinks = torch.randn(hq, generator=gen) * 2
        sinks[0], sinks[-1] = 12.0, -30.0  # the sink takes most of the weight / nearly none
        sinks = sinks.to(DEVICE)
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    ref = oracle(q, k, v, kc_ref, vc_ref, meta, d ** -0.5, window, sinks)
    if window is not None:
        # a freed block's table entry may be anything: half of them point at a spare block, poisoned too (an entry
        # out of the pool's range would crash the interpreter rather than fail a test)
        spare = sorted(set(range(k_cache.shape[0])) - set(meta.block_tables.flatten().tolist()))[0]
        poison(k_cache, spare), poison(v_cache, spare)
        poisoned = 0
        for r, c in enumerate(computed):
            for i in range(max(0, c - window + 1) // bs):  # whole blocks before the request's first visible key
                b = int(meta.block_tables[r, i])
                poison(k_cache, b), poison(v_cache, b)
                if i % 2:
                    meta.block_tables[r, i] = spare
                poisoned += 1
        assert poisoned
    out = backend().forward(q, k, v, k_cache, v_cache, meta, d ** -0.5, window, sinks)
    assert out.dtype == dtype and out.shape == q.shape
    # the new K/V landed where the reference put them (int8: the same quantized bytes)
    for cache, cache_ref in ((k_cache, kc_ref), (v_cache, vc_ref)):
        rows = cache.flatten(0, 1)[meta.slot_mapping]
        assert torch.equal(rows, cache_ref.flatten(0, 1)[meta.slot_mapping])
    torch.testing.assert_close(out.double(), ref, **tol(dtype))


def test_batch_invariance():
    """A request's output is bitwise the same alone, among decodes only and in a mixed batch: decodes always take
    the decode kernel, whose splits have a fixed length below max_splits * split_tokens keys (the short decode
    alone has one split and no merge: the same bits as its one live split merged), and prefill tiles depend on
    their own request only. (A decode and the same query as a prefill's last row go through different kernels:
    equal to rounding only.)"""
    gen = torch.Generator().manual_seed(5)
    computed, new = [150, 20, 10, 70, 0], [1, 40, 1, 1, 17]
    bs, hq, hkv, d = 8, 8, 2, 64
    q, k, v, k_cache, v_cache, meta = make_batch(gen, computed, new, bs, hq, hkv, d, F32, F32, device=DEVICE)
    b = backend()
    batch = b.forward(q, k, v, k_cache, v_cache, meta, 0.125)  # writes the new K/V: the runs below rewrite them
    tables = [meta.block_tables[r, :-(-(computed[r] + new[r]) // bs)].tolist() for r in range(len(new))]
    starts = meta.query_start_loc.tolist()

    def run(reqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        sub = build_attention_metadata([tables[r] for r in reqs], [computed[r] for r in reqs],
                                       [new[r] for r in reqs], bs)
        rows = torch.cat([torch.arange(starts[r], starts[r + 1]) for r in reqs])
        sub = dataclasses.replace(sub, **{f: getattr(sub, f).to(DEVICE) for f in
                                          ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")})
        return b.forward(q[rows], k[rows], v[rows], k_cache, v_cache, sub, 0.125), rows

    decodes = [0, 2, 3]
    out, rows = run(decodes)
    assert torch.equal(out, batch[rows])
    for r in range(len(computed)):
        out, rows = run([r])
        assert torch.equal(out, batch[rows]), f"request {r}"
    assert b.split_rule(meta.block_tables.shape[1], bs, None)[1] > 1  # the batch's decodes were split ...
    assert b.split_rule(-(-11 // bs), bs, None)[1] == 1  # ... the short one alone was not


def test_strided_q_and_large_scores():
    """q as a view of a fused QKV projection (token stride > Hq * D) and scores large enough to overflow exp."""
    gen = torch.Generator().manual_seed(7)
    hq, hkv, d = 4, 2, 64
    _, k, v, k_cache, v_cache, meta = make_batch(gen, [10, 0, 40], [1, 24, 9], 16, hq, hkv, d, F32, F32, device=DEVICE)
    qkv = (torch.randn(k.shape[0], (hq + 2 * hkv) * d, generator=gen) * 30).to(DEVICE)
    q = qkv[:, :hq * d].view(-1, hq, d)
    assert not q.is_contiguous()
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    ref = oracle(q, k, v, kc_ref, vc_ref, meta, d ** -0.5)
    out = backend().forward(q, k, v, k_cache, v_cache, meta, d ** -0.5)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


def test_split_rule_from_shapes():
    b = triton_paged.TritonAttentionBackend()
    assert (b.split_tokens, b.max_splits) == (256, 64)
    assert b.split_rule(1, 16, None) == (256, 1)
    assert b.split_rule(100, 16, None) == (256, 7)  # 1600 keys
    assert b.split_rule(1000, 16, None) == (256, 63)  # 16000 keys: still the fixed split length
    assert b.split_rule(4096, 16, None) == (1024, 64)  # 65536 keys: at most 64 splits, longer ones
    assert b.split_rule(4096, 16, 128) == (256, 1)  # a window bounds the keys any decode sees
    assert b.split_rule(10, 8, None) == (256, 1)


def test_registry_and_empty_batch():
    assert triton_paged.INTERPRETED or torch.cuda.is_available()
    assert "triton" in available_backends("cpu")
    assert get_backend("auto").name != "triton"  # a negative cpu priority: named only
    b = get_backend("triton")
    assert b.name == "triton" and b.copy_blocks is copy_blocks
    gen = torch.Generator().manual_seed(3)
    q, k, v, k_cache, v_cache, meta = make_batch(gen, [5], [0], 8, 2, 1, 64, F32, F32, device=DEVICE)
    assert b.forward(q, k, v, k_cache, v_cache, meta, 0.1).shape == (0, 2, 64)
    # decodes and requests of no queries: the decode launch alone, through its request index
    q, k, v, k_cache, v_cache, meta = make_batch(gen, [5, 3, 9], [0, 1, 1], 8, 2, 1, 64, F32, F32, device=DEVICE)
    ref = oracle(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.1)
    torch.testing.assert_close(b.forward(q, k, v, k_cache, v_cache, meta, 0.1).double(), ref, **tol(F32))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen only without CUDA")
def test_interpreter_is_chosen_before_triton_is_imported():
    """TRITON_INTERPRET is read as each jit function is decorated, triton.language's own on its first import: the
    module sets it when it imports triton first (then its kernels run); after someone else imported triton, the
    backend refuses to build, saying why (the tests' conftest sets the variable before any test module)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    first = ("import os\nfrom pagedllm.attention import get_backend, triton_paged\n"
             "assert triton_paged.INTERPRETED and os.environ['TRITON_INTERPRET'] == '1'\n"
             "get_backend('triton')\n")
    subprocess.run([sys.executable, "-c", first], env=env, check=True, timeout=120)
    late = ("import triton.language\nfrom pagedllm.attention import get_backend\n"
            "try:\n    get_backend('triton')\nexcept RuntimeError as e:\n    print(e)\n")
    run = subprocess.run([sys.executable, "-c", late], env=env, check=True, timeout=120, capture_output=True,
                         text=True)
    assert "imported before TRITON_INTERPRET=1 was set" in run.stdout
