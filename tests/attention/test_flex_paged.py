"""The "flex" backend (FlexAttention over the paged pool) against the reference backend on fresh random inputs.

Most cases run eager flex on CPU tensors: it evaluates mask_mod at every slot of the pool, so they check that
mask_mod alone is exact. What the compiled kernel reads is the block mask's lists: test_block_lists_* check them
against mask_mod block by block, and the one compiled test proves on NaN-poisoned blocks that nothing else is read.
Eager flex reads every value of the pool (0 x NaN is NaN), so eager cases poison with NaN keys (a masked score is
replaced whatever it is) and huge values, not NaN values.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from pagedllm.attention import available_backends, build_attention_metadata, get_backend
from pagedllm.attention.kv_quant import random_pool
from pagedllm.attention.reference import ReferenceBackend

flex_paged = pytest.importorskip("pagedllm.attention.flex_paged")
FlexAttentionBackend = flex_paged.FlexAttentionBackend

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile",
                                        "ignore:.*return_lse is deprecated")

TOL = dict(atol=1e-5, rtol=1e-5)


def make_batch(gen: torch.Generator, computed: list[int], new: list[int], bs: int, hq: int, hkv: int, d: int,
               dtype: torch.dtype = torch.float32, spare: int = 3, window: int | None = None, freed: str = "null",
               num_blocks: int | None = None):
    """Random pool; every request's blocks a random subset of it, in random order, with spare blocks between.
    With a window, a request's blocks before its first query's window were freed: block 0 in its table (freed
    "null": the engine's NULL_BLOCK) or their old ids, now any block of the pool ("reused"). Block 0 is then
    reserved. Returns q, k, v, k_cache, v_cache, meta, dead (blocks no request owns)."""
    need = [-(-(c + n) // bs) for c, n in zip(computed, new, strict=True)]
    first = [0 if window is None else max(0, c - window + 1) // bs for c in computed]
    live = [nb - f for nb, f in zip(need, first, strict=True)]
    start = 0 if window is None else 1
    num_blocks = num_blocks or start + sum(live) + spare
    perm = (torch.randperm(num_blocks - start, generator=gen) + start).tolist()
    tables, at = [], 0
    for f, n in zip(first, live, strict=True):
        old = [0] * f if freed == "null" else torch.randint(0, num_blocks, (f,), generator=gen).tolist()
        tables.append(old + perm[at:at + n])
        at += n
    dead = sorted(set(range(num_blocks)) - set(perm[:at]))
    meta = build_attention_metadata(tables, computed, new, bs)
    k_cache = random_pool((num_blocks, bs, hkv, d), dtype, gen)
    v_cache = random_pool((num_blocks, bs, hkv, d), dtype, gen)
    t = sum(new)
    q, k, v = (torch.randn(t, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))
    return q, k, v, k_cache, v_cache, meta, dead


def poison(k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: list[int], nan_values: bool) -> None:
    """NaN keys; values NaN too (compiled: never read) or huge (eager: weighed 0, but any leak would show)."""
    k_cache[blocks] = float("nan")
    v_cache[blocks] = float("nan") if nan_values else 1e6


def run_both(backend, q, k, v, k_cache, v_cache, meta, scale, window=None, sinks=None):
    """(flex output, reference output), each on its own copy of the pool."""
    kc, vc = k_cache.clone(), v_cache.clone()
    ref = ReferenceBackend().forward(q, k, v, k_cache, v_cache, meta, scale, window, sinks)
    out = backend.forward(q, k, v, kc, vc, meta, scale, window, sinks)
    # the new K/V landed in the pool
    hkv, d = k.shape[1:]
    assert torch.equal(kc.view(-1, hkv, d)[meta.slot_mapping], k.to(kc.dtype))
    assert torch.equal(vc.view(-1, hkv, d)[meta.slot_mapping], v.to(vc.dtype))
    return out, ref


@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (8, 2, 128), (8, 1, 64), (8, 1, 128)])
def test_decode(hq, hkv, d):
    """One query per request; lengths ending mid-block and on a block boundary (no partial block)."""
    gen = torch.Generator().manual_seed(hq * 100 + hkv * 10 + d)
    batch = make_batch(gen, [19, 31, 4, 47, 0], [1] * 5, 8, hq, hkv, d)
    out, ref = run_both(FlexAttentionBackend(), *batch[:6], scale=d ** -0.5)
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, **TOL)


def test_prefill_several_lengths():
    gen = torch.Generator().manual_seed(1)
    batch = make_batch(gen, [0, 0, 0], [37, 5, 16], 8, 8, 2, 64)
    out, ref = run_both(FlexAttentionBackend(), *batch[:6], scale=0.125)
    torch.testing.assert_close(out, ref, **TOL)


def test_chunked_prefill_against_cached_blocks():
    """Chunks after cached blocks (a prefix-cache hit of whole blocks, and a chunk starting mid-block), and a
    chunk longer than the query tile (two tiles, causal inside each)."""
    gen = torch.Generator().manual_seed(2)
    batch = make_batch(gen, [16, 21, 40], [11, 6, 150], 8, 4, 1, 128)
    out, ref = run_both(FlexAttentionBackend(), *batch[:6], scale=0.09)
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("bucket", [False, True])
def test_mixed_batch(bucket):
    """Decodes, prefills and chunks in one call, and a request with nothing to compute; bucketed: padding
    requests and padding query rows (the compiled path's layout) without the compile."""
    gen = torch.Generator().manual_seed(3)
    batch = make_batch(gen, [30, 0, 12, 25, 9, 0], [1, 14, 5, 1, 0, 3], 4, 8, 2, 64)
    out, ref = run_both(FlexAttentionBackend(bucket=bucket), *batch[:6], scale=0.125)
    torch.testing.assert_close(out, ref, **TOL)


def test_holes_and_unowned_blocks_are_never_seen():
    """Scattered tables with spare blocks between them; the spare blocks hold NaN keys and huge values."""
    gen = torch.Generator().manual_seed(4)
    q, k, v, k_cache, v_cache, meta, dead = make_batch(gen, [13, 0, 20], [1, 9, 4], 4, 4, 2, 64, spare=6)
    poison(k_cache, v_cache, dead, nan_values=False)
    out, ref = run_both(FlexAttentionBackend(), q, k, v, k_cache, v_cache, meta, 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("window,freed", [(5, "null"), (16, "reused"), (37, "null"), (37, "reused")])
def test_sliding_window(window, freed):
    """Windows shorter than a block, one block, several; out-of-window blocks freed (block 0 in the tables, or
    their old ids now held by other requests or free) and the unowned ones poisoned; decode, chunk and prefill
    requests."""
    gen = torch.Generator().manual_seed(5 + window)
    computed, new = [45, 60, 0, 33], [1, 12, 40, 1]
    q, k, v, k_cache, v_cache, meta, dead = make_batch(gen, computed, new, 8, 8, 2, 64, window=window,
                                                       freed=freed)
    poison(k_cache, v_cache, dead, nan_values=False)
    out, ref = run_both(FlexAttentionBackend(), q, k, v, k_cache, v_cache, meta, 0.125, window=window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **TOL)


def test_sinks():
    gen = torch.Generator().manual_seed(6)
    batch = make_batch(gen, [22, 0, 9], [1, 11, 6], 8, 8, 2, 64)
    sinks = torch.randn(8, generator=gen) * 2
    out, ref = run_both(FlexAttentionBackend(), *batch[:6], scale=0.125, sinks=sinks)
    torch.testing.assert_close(out, ref, **TOL)
    out, ref = run_both(FlexAttentionBackend(bucket=True), *batch[:6], scale=0.125, window=7, sinks=sinks)
    torch.testing.assert_close(out, ref, **TOL)


def test_bf16_pool_and_query_dtypes():
    """bf16 pool: q cast to bf16, output back in q's dtype (fp32 here), within bf16's rounding."""
    gen = torch.Generator().manual_seed(7)
    q, k, v, k_cache, v_cache, meta, _ = make_batch(gen, [17, 0], [1, 9], 8, 8, 2, 64, dtype=torch.bfloat16)
    out, ref = run_both(FlexAttentionBackend(), q.float(), k, v, k_cache, v_cache, meta, 0.125)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)


def test_int8_pool_is_refused():
    gen = torch.Generator().manual_seed(8)
    q, k, v, k_cache, v_cache, meta, _ = make_batch(gen, [5], [1], 8, 4, 2, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="triton"):
        FlexAttentionBackend().forward(q.float(), k.float(), v.float(), k_cache, v_cache, meta, 0.125)


@pytest.mark.parametrize("full_blocks", [True, False])
@pytest.mark.parametrize("window", [None, 9])
def test_block_lists_match_mask_mod(full_blocks, window):
    """The lists the compiled kernel visits, block by block against mask_mod over the whole pool: a block is
    listed iff some query of the tile sees one of its keys; a full block's keys are seen by every row of the tile;
    nothing listed twice."""
    gen = torch.Generator().manual_seed(9)
    computed, new = [40, 0, 26, 70, 3], [1, 150, 9, 1, 0]
    *_, k_cache, _, meta, dead = make_batch(gen, computed, new, 8, 4, 2, 16, window=window)
    nb, bs = k_cache.shape[:2]
    rows, qmax = flex_paged.bucket_shape(meta.num_requests, meta.max_query_len)
    pm = flex_paged.build_paged_mask(meta, nb, bs, k_cache.device, window, rows, qmax, full_blocks)
    bm = pm.block_mask
    dense = create_mask(bm.mask_mod, rows, 1, qmax, nb * bs, device="cpu")[:, 0]  # [rows, qmax, slots]
    q_tile = bm.BLOCK_SIZE[0]
    tiles = dense.unflatten(1, (-1, q_tile)) if qmax % q_tile == 0 else dense[:, None]
    tiles = tiles.unflatten(-1, (nb, bs))  # [rows, tiles, q_tile, blocks, bs]
    any_seen = tiles.any(-1).any(2)  # [rows, tiles, blocks]
    all_seen = tiles.all(-1).all(2)
    for r in range(rows):
        for t in range(any_seen.shape[1]):
            part = bm.kv_indices[r, 0, t, :bm.kv_num_blocks[r, 0, t]].tolist()
            full = [] if bm.full_kv_num_blocks is None else \
                bm.full_kv_indices[r, 0, t, :bm.full_kv_num_blocks[r, 0, t]].tolist()
            assert len(set(part + full)) == len(part) + len(full)
            assert sorted(part + full) == torch.nonzero(any_seen[r, t]).flatten().tolist(), (r, t)
            assert all(all_seen[r, t, b] for b in full), (r, t)
            assert not set(part + full) & set(dead)
            if not full_blocks:
                assert not full
    # a decode step lists every block but the partial last one as full (above, its padding rows made the
    # mixed batch's decode rows partial)
    *_, k_cache, _, meta, _ = make_batch(gen, [40, 31], [1, 1], 8, 4, 2, 16)
    bm = flex_paged.build_paged_mask(meta, k_cache.shape[0], 8, k_cache.device, None, 2, 1, full_blocks).block_mask
    assert bm.kv_num_blocks[:, 0, 0].tolist() == ([1, 0] if full_blocks else [6, 4])
    assert full_blocks == (bm.full_kv_num_blocks is not None)
    if full_blocks:
        assert bm.full_kv_num_blocks[:, 0, 0].tolist() == [5, 4]


def test_compiled_on_cpu_reads_only_the_listed_blocks():
    """The compiled kernel (inductor's CPU flex) on a pool whose unowned and out-of-window blocks are NaN, keys
    and values: finite and exact, so it never read them. Two steps with other lengths and request counts in the
    same bucket (4 requests, 16 queries): one compile."""
    from torch._dynamo.utils import counters

    gen = torch.Generator().manual_seed(10)
    backend = FlexAttentionBackend(compile=True)
    window, hq, hkv, d, bs = 10, 8, 2, 64, 8
    graphs = []
    for computed, new in [([40, 0, 25], [1, 12, 7]), ([9, 30, 3, 17], [5, 1, 1, 16])]:
        # the same pool geometry each step: the shapes repeat
        q, k, v, k_cache, v_cache, meta, dead = make_batch(gen, computed, new, bs, hq, hkv, d, window=window,
                                                          freed="reused", num_blocks=16)
        poison(k_cache, v_cache, dead, nan_values=True)
        ref = ReferenceBackend().forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.125, window)
        out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.125, window)
        graphs.append(counters["stats"]["unique_graphs"])
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, ref, **TOL)
    assert graphs[1] == graphs[0], "the second step in the same bucket recompiled"


def test_registry():
    assert "flex" in available_backends("cpu") and "flex" in available_backends("cuda")
    assert get_backend("flex").name == "flex"
    assert get_backend("auto").name != "flex"  # on the CPU only when named


def test_stale_nan_past_a_request_in_its_last_block_is_cleared():
    """A reused last block may hold a failed request's NaN K/V past the new request's length: flex reads listed
    blocks whole (0 x NaN is NaN), so the backend zeroes those slots before attending (eager flex here reads the
    whole pool, so any NaN left anywhere would show)."""
    gen = torch.Generator().manual_seed(21)
    computed, new, bs = [19, 5, 30], [1, 6, 2], 8
    q, k, v, k_cache, v_cache, meta, _ = make_batch(gen, computed, new, bs, 4, 2, 64, spare=0)
    for r, (c, n) in enumerate(zip(computed, new, strict=True)):
        length = c + n
        if length % bs:
            block = int(meta.block_tables[r, (length - 1) // bs])
            k_cache[block, length % bs:] = float("nan")
            v_cache[block, length % bs:] = float("nan")
    kc, vc = k_cache.clone(), v_cache.clone()
    ref = ReferenceBackend().forward(q, k, v, kc, vc, meta, 0.125)
    out = FlexAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **TOL)
