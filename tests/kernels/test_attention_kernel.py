"""The C++ paged-attention kernel (backend "cpu") against the reference backend on fresh random inputs."""

from __future__ import annotations

import zlib

import pytest
import torch
from attention_harness import make_batch, poison
from attention_harness import oracle as shared_oracle

from pagedllm import kernels
from pagedllm.attention import get_backend
from pagedllm.attention.kv_quant import is_int8
from pagedllm.kernels import KernelMode

cpu = pytest.importorskip("pagedllm.attention.cpu")

try:
    kernels.load_ops()
except Exception as e:  # pragma: no cover - a machine without a compiler
    pytest.skip(f"cpu kernel does not build here: {e}", allow_module_level=True)


def oracle(q, k, v, k_cache, v_cache, meta, scale, window=None, portable=False, sinks=None):
    """The float64 oracle; over int8 K/V the kernel's VNNI path also rounds q to int8 blocks: the oracle then takes
    the same rounded q."""
    rounded = is_int8(k_cache) and kernels.rounds_int8_queries(q.shape[-1], portable)
    return shared_oracle(q, k, v, k_cache, v_cache, meta, scale, window, sinks, rounded_queries=rounded)


def run_both(backend, q, k, v, k_cache, v_cache, meta, scale, window=None):
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    ref = oracle(q, k, v, kc_ref, vc_ref, meta, scale, window, backend.portable)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, scale, window)
    # the kernel wrote exactly the same K/V as the reference (for int8: the same quantized bytes)
    assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref)
    return out, ref


def tol(dtype: torch.dtype, kv_dtype: torch.dtype | None = None, d: int = 64, portable: bool = False) -> dict:
    """Equal to rounding. Over int8 K/V the VNNI path also rounds each chunk's probabilities to 15 bits (its
    oracle takes the rounded q, not the rounded probabilities): up to ~3e-5 of the chunk's largest one."""
    if dtype != torch.float32:
        return {"atol": 1.5e-2, "rtol": 1e-2}
    if kv_dtype == torch.int8 and kernels.rounds_int8_queries(d, portable):
        return {"atol": 2e-4, "rtol": 1e-4}
    return {"atol": 2e-5, "rtol": 1e-5}


# (num_computed, num_new): decode, prefill, prefix-cached chunks, contexts ending mid-block, empty rows
MIXED = ([0, 37, 100, 5, 64, 0, 250, 17], [9, 1, 1, 20, 33, 1, 70, 0])

CASES = [
    # block_size, hq, hkv, d, num_computed, num_new
    (16, 9, 3, 64, *MIXED),
    (8, 8, 2, 64, *MIXED),
    (32, 4, 4, 64, *MIXED),
    (16, 16, 1, 64, [0, 300, 1], [45, 1, 1]),
    (32, 12, 3, 128, [0, 63, 31], [100, 1, 2]),
    (16, 6, 2, 32, [3, 0, 700], [1, 130, 1]),
    (8, 6, 3, 40, [0, 21], [19, 4]),  # head_dim 40: portable code path
    (16, 4, 1, 256, [0, 600, 31, 2], [40, 1, 1, 17]),  # Gemma 3's head_dim 256, its 4 query heads on one KV head
    # bf16 decode takes all KV heads of a request in one item when tokens x Hq <= 64 (here 1 and 2 tokens), per
    # KV head beyond (3 tokens)
    (16, 32, 8, 128, [500, 37, 0, 90, 3], [1, 2, 3, 1, 2]),
]


# (q dtype, KV dtype): the model runs in the KV dtype, or over an int8 KV cache
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.int8),
          (torch.bfloat16, torch.int8)]
DTYPE_IDS = ["f32", "bf16", "f32-int8kv", "bf16-int8kv"]


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("dtype,kv_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference(case, dtype, kv_dtype, portable, invariant):
    """Every path: dot / lanes / bf16 / int8 / portable, in both kernel modes (the backend takes the forward's)."""
    block_size, hq, hkv, d, computed, new = case
    gen = torch.Generator().manual_seed(zlib.crc32(repr((case, dtype, kv_dtype, portable)).encode()))
    batch = make_batch(gen, computed, new, block_size, hq, hkv, d, dtype, kv_dtype)
    backend = cpu.CpuAttentionBackend(portable=portable)
    with kernels.kernel_mode(invariant=invariant):
        out, ref = run_both(backend, *batch, scale=d ** -0.5)
    assert out.dtype == dtype and out.shape == batch[0].shape
    torch.testing.assert_close(out.double(), ref, **tol(dtype, kv_dtype, d, portable))


WINDOW_CASES = [
    # block_size, hq, hkv, d, window, num_computed, num_new: windows shorter than most contexts, decode steps and
    # chunks that cross the window edge, every path (dot, lanes, bf16 per-request decode, portable head dims)
    (16, 9, 3, 64, 24, *MIXED),
    (16, 16, 1, 64, 100, [0, 300, 1], [45, 1, 1]),
    (32, 12, 3, 128, 40, [0, 63, 31], [100, 1, 2]),
    (8, 6, 3, 40, 7, [0, 21], [19, 4]),
    (16, 32, 8, 128, 33, [500, 37, 0, 90, 3], [1, 2, 3, 1, 2]),
    (16, 4, 1, 256, 50, [0, 120, 60], [70, 1, 3]),  # Gemma 3's head shape
]


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("dtype,kv_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("case", WINDOW_CASES)
def test_sliding_window_matches_reference_and_reads_only_the_window(case, dtype, kv_dtype, portable, invariant):
    block_size, hq, hkv, d, window, computed, new = case
    gen = torch.Generator().manual_seed(zlib.crc32(repr((case, dtype, kv_dtype, portable)).encode()))
    q, k, v, k_cache, v_cache, meta = make_batch(gen, computed, new, block_size, hq, hkv, d, dtype, kv_dtype)
    ref = oracle(q, k, v, k_cache, v_cache, meta, d ** -0.5, window, portable)  # leaves the pool as the kernel finds it
    for r, c in enumerate(computed):
        first = max(0, c - window + 1)  # the first key any query of request r sees
        for b in meta.block_tables[r, :first // block_size].tolist():
            poison(k_cache, b), poison(v_cache, b)  # blocks a sliding-window cache may have freed: never read
    out = kernels.paged_attention(q, k_cache, v_cache, meta, d ** -0.5, mode=KernelMode(invariant, portable),
                                  window=window)
    torch.testing.assert_close(out.double(), ref, **tol(dtype, kv_dtype, d, portable))


SINK_CASES = [
    # block_size, hq, hkv, d, window, num_computed, num_new: gpt-oss's shape (64 query heads of 64 on 8 KV heads,
    # windows of 128 on every other layer) and the other paths' (dot, lanes, portable head dims, long-context split)
    (16, 64, 8, 64, None, [0, 300, 17, 1000], [40, 1, 3, 1]),
    (16, 64, 8, 64, 128, [0, 300, 17, 1000], [200, 1, 3, 1]),
    (16, 9, 3, 64, 24, *MIXED),
    (8, 6, 3, 40, None, [0, 21], [19, 4]),
    (16, 4, 1, 256, None, [0, 2000], [70, 1]),
]


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("dtype,kv_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("case", SINK_CASES)
def test_attention_sinks_match_reference(case, dtype, kv_dtype, portable, invariant):
    """gpt-oss's sinks on every path: a logit per query head joins the softmax's denominator and adds no value,
    against the reference's softmax over [scores, sink]; random sinks, some far above the scores (the sink then
    takes most of the weight), some far below (nearly no effect)."""
    block_size, hq, hkv, d, window, computed, new = case
    gen = torch.Generator().manual_seed(zlib.crc32(repr(("sinks", case, dtype, kv_dtype, portable)).encode()))
    q, k, v, k_cache, v_cache, meta = make_batch(gen, computed, new, block_size, hq, hkv, d, dtype, kv_dtype)
    sinks = torch.randn(hq, generator=gen) * 2
    sinks[0], sinks[-1] = 12.0, -30.0
    ref = oracle(q, k, v, k_cache, v_cache, meta, d ** -0.5, window, portable, sinks)
    out = kernels.paged_attention(q, k_cache, v_cache, meta, d ** -0.5, mode=KernelMode(invariant, portable),
                                  window=window, sinks=sinks)
    torch.testing.assert_close(out.double(), ref, **tol(dtype, kv_dtype, d, portable))
    plain = kernels.paged_attention(q, k_cache, v_cache, meta, d ** -0.5, mode=KernelMode(invariant, portable),
                                    window=window)
    assert (out.float() - plain.float()).abs().max() > 0.1  # the sinks changed the result


@pytest.mark.parametrize("min_items", [1, 64])
@pytest.mark.parametrize("dtype,kv_dtype", DTYPES, ids=DTYPE_IDS)
def test_long_context_split_matches(min_items, dtype, kv_dtype):
    """min_items=64 forces the context split + merge path; 1 disables it."""
    gen = torch.Generator().manual_seed(1234 + min_items)
    q, k, v, k_cache, v_cache, meta = make_batch(gen, [2000, 1500, 700], [1, 3, 40], 16, 9, 3, 64,
                                                 dtype, kv_dtype)
    scale = 0.125
    ref = oracle(q, k, v, k_cache, v_cache, meta, scale)  # also writes the new K/V
    out = kernels.paged_attention(q, k_cache, v_cache, meta, scale, min_items=min_items)
    torch.testing.assert_close(out.double(), ref, **tol(dtype, kv_dtype))


def test_strided_q_and_large_scores():
    """q as a view of a fused QKV projection (token stride > Hq*D) and scores large enough to overflow exp."""
    gen = torch.Generator().manual_seed(7)
    hq, hkv, d = 9, 3, 64
    _, k, v, k_cache, v_cache, meta = make_batch(gen, [10, 0, 40], [1, 24, 9], 16, hq, hkv, d,
                                                 torch.float32, torch.float32)
    qkv = torch.randn(k.shape[0], (hq + 2 * hkv) * d, generator=gen) * 30
    q = qkv[:, :hq * d].view(-1, hq, d)
    assert not q.is_contiguous()
    out, ref = run_both(cpu.CpuAttentionBackend(), q, k, v, k_cache, v_cache, meta, scale=d ** -0.5)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype,kv_dtype", DTYPES, ids=DTYPE_IDS)
def test_a_dominant_key_and_keys_far_below_it(dtype, kv_dtype):
    """An attention sink: one key scores ~200 (base 2) above all others, so whole chunks of keys after it have
    probabilities of ~2^-126 or less (where exp2 bottoms out), which must add nothing rather than garbage."""
    gen = torch.Generator().manual_seed(17)
    hq, hkv, d = 9, 3, 64
    q, k, v, k_cache, v_cache, meta = make_batch(gen, [300, 0, 150], [1, 70, 5], 16, hq, hkv, d, dtype, kv_dtype)
    q, k = q.float(), k.float()
    q[:, :, 0] = 40.0  # every query points along dim 0 ...
    k[:, :, 0] = -2.0  # ... which every new key opposes (scores far below the sink's)
    k[0, :, 0] = 150.0  # except the prefill's first key: the sink of its request
    k_cache[..., 0] = -127 if is_int8(k_cache) else -2.0  # cached keys too (an int8 code, its scale positive)
    q, k = q.to(dtype), k.to(dtype)
    backend = cpu.CpuAttentionBackend()
    with kernels.kernel_mode(invariant=False):
        out, ref = run_both(backend, q, k, v, k_cache, v_cache, meta, scale=d ** -0.5)
    invariant = kernels.paged_attention(q, k_cache, v_cache, meta, d ** -0.5, mode=KernelMode(invariant=True))
    for o in (out, invariant):
        assert torch.isfinite(o).all()
        torch.testing.assert_close(o.double(), ref, **tol(dtype, kv_dtype, d))


def test_registry_auto_prefers_cpu():
    assert get_backend("auto").name == "cpu"
    assert get_backend("cpu").name == "cpu"


def test_bad_block_table_rejected():
    gen = torch.Generator().manual_seed(3)
    q, k, v, k_cache, v_cache, meta = make_batch(gen, [5], [1], 8, 2, 1, 64, torch.float32, torch.float32)
    meta.block_tables[0, 0] = k_cache.shape[0]  # out of range
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.paged_attention(q, k_cache, v_cache, meta, 0.1)


def test_build_variant_flags():
    name, isa = kernels.build_variant({"sse2", "sse4_2"})
    assert name == "portable" and isa == []
    name, isa = kernels.build_variant({"sse2", "avx2", "fma", "f16c"})
    assert name == "avx2" and not any("avx512" in f for f in isa) and "-mf16c" in isa
    name, isa = kernels.build_variant({"avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl"})
    assert name == "avx512" and "-mavx512f" in isa and "-march=native" not in isa
    best = {"avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16", "f16c"}
    assert kernels.build_variant(best)[0] == "avx512bf16vnni"
    assert kernels.build_variant(best, forced="avx2") == ("avx2", ["-mavx2", "-mfma", "-mf16c"])  # $PAGEDLLM_KERNEL_VARIANT
    assert kernels.build_variant(best, forced="portable") == ("portable", [])
    with pytest.raises(RuntimeError, match="lacks avx512f"):
        kernels.build_variant({"avx2", "fma"}, forced="avx512")
    with pytest.raises(ValueError, match="not a build variant"):
        kernels.build_variant(best, forced="native")


def test_auto_falls_back_to_reference_when_build_fails(monkeypatch, caplog):
    def broken():
        raise RuntimeError("simulated compiler failure")

    monkeypatch.setattr(cpu, "load_ops", broken)
    assert get_backend("auto").name == "reference"
    assert "simulated compiler failure" in caplog.text


@pytest.mark.parametrize("seed", range(6))
def test_random_mixed_batches(seed):
    """Fresh random batches: decode, prefill and prefix-cached chunks mixed, random block size and GQA ratio."""
    gen = torch.Generator().manual_seed(1000 + seed)

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    block_size = [8, 16, 32][randint(0, 2)]
    hkv = randint(1, 4)
    hq = hkv * [1, 2, 3, 4, 8][randint(0, 4)]
    d = [32, 64, 128, 256][randint(0, 3)]
    r = randint(1, 10)
    kind = torch.randint(0, 3, (r,), generator=gen).tolist()  # 0 decode, 1 prefill, 2 chunk over a cached prefix
    computed = [randint(1, 300) if k != 1 else 0 for k in kind]
    new = [1 if k == 0 else randint(1, 90) for k in kind]
    dtype = torch.float32 if seed % 2 == 0 else torch.bfloat16
    batch = make_batch(gen, computed, new, block_size, hq, hkv, d, dtype, dtype)
    out, ref = run_both(cpu.CpuAttentionBackend(), *batch, scale=d ** -0.5)
    torch.testing.assert_close(out.double(), ref, **tol(dtype))


def test_kernel_benchmark_smoke(capsys):
    """`pagedllm bench kernel` runs end to end on a tiny shape (its own checks compare every method to SDPA)."""
    from pagedllm_bench import main

    assert main(["kernel", "--num-requests", "2", "--context-len", "40", "--repeats", "1", "--block-size", "8",
                 "--bandwidth-mib", "8"]) == 0
    out = capsys.readouterr().out
    assert "paged kernel" in out and "SDPA causal" in out


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_kernel_device_comparison_smoke():
    """The `--device cuda` comparison's code path, run on the CPU on tiny cases (flex eager, no triton here or
    triton interpreted): every method checked against SDPA, a fastest method and a reason per case."""
    import argparse

    from pagedllm_bench import kernel, kernel_device

    p = argparse.ArgumentParser()
    kernel.add_args(p)
    args = p.parse_args(["--repeats", "1", "--block-size", "8"])
    kernel.resolve_device_defaults(args)
    res = kernel_device.compare(args, decode_cases=[(3, 40)], prefill_cases=[(2, 16, 8)], flex_compile=False)
    assert [c["kind"] for c in res["cases"]] == ["decode", "prefill chunk"]
    for case in res["cases"]:
        assert {"flex", "contiguous SDPA"} <= set(case["ms"])
        best, why = kernel_device.verdict(case)
        assert best in case["ms"] and why


@pytest.mark.parametrize("q_dtype,kv_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_mixed_query_and_cache_dtypes(q_dtype, kv_dtype):
    gen = torch.Generator().manual_seed(99)
    q, k, v, k_cache, v_cache, meta = make_batch(gen, *MIXED, 16, 9, 3, 64, q_dtype, kv_dtype)
    out, ref = run_both(cpu.CpuAttentionBackend(), q, k, v, k_cache, v_cache, meta, scale=0.125)
    assert out.dtype == q_dtype
    torch.testing.assert_close(out.double(), ref, **tol(q_dtype))
