"""Reference paged attention vs plain dense SDPA on random inputs; metadata vs a naive per-token computation."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from pagedllm.attention import build_attention_metadata, copy_blocks, get_backend
from pagedllm.attention.metadata import compute_positions


def _naive_slots(tables, computed, new, bs):
    out = []
    for bt, c, n in zip(tables, computed, new, strict=True):
        for t in range(c, c + n):
            out.append(bt[t // bs] * bs + t % bs)
    return out


def _random_batch(rng: random.Random, num_blocks: int, bs: int, nreq: int, min_decodes: int = 0):
    """Scattered block tables drawn from a shuffled pool; a mix of decodes, prefills and chunked prefills
    (the first min_decodes requests are decodes, so the batched-decode path always runs)."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, computed, new = [], [], []
    for i in range(nreq):
        kind = "decode" if i < min_decodes else rng.choice(["decode", "prefill", "chunk"])
        c = 0 if kind == "prefill" else rng.randint(1, 40)
        n = 1 if kind == "decode" else rng.randint(1, 20)
        need = -(-(c + n) // bs)
        tables.append([free.pop() for _ in range(need)])
        computed.append(c)
        new.append(n)
    return tables, computed, new


def test_metadata_matches_naive():
    rng = random.Random(1)
    for _ in range(20):
        bs = rng.choice([1, 4, 16])
        tables, computed, new = _random_batch(rng, 400, bs, rng.randint(1, 8))
        meta = build_attention_metadata(tables, computed, new, bs)
        assert meta.slot_mapping.dtype == torch.int64 and meta.block_tables.dtype == torch.int32
        assert meta.slot_mapping.tolist() == _naive_slots(tables, computed, new, bs)
        assert meta.query_start_loc.tolist() == [sum(new[:i]) for i in range(len(new) + 1)]
        assert meta.seq_lens.tolist() == [c + n for c, n in zip(computed, new, strict=True)]
        assert meta.max_query_len == max(new) and meta.max_seq_len == max(c + n for c, n in zip(computed, new,
                                                                                                  strict=True))
        for r, bt in enumerate(tables):
            assert meta.block_tables[r, :len(bt)].tolist() == bt
        pos = compute_positions(computed, new).tolist()
        assert pos == [t for c, n in zip(computed, new, strict=True) for t in range(c, c + n)]


def test_metadata_rejects_short_block_table():
    with pytest.raises(ValueError, match="block table"):
        build_attention_metadata([[0, 1]], [5], [4], 4)  # 9 tokens need 3 blocks
    with pytest.raises(ValueError):
        build_attention_metadata([[0]], [0, 1], [1], 4)


def _dense_oracle(q, k_full, v_full, scale):
    """q [n, Hq, D] are the last n positions of k_full/v_full [L, Hkv, D]; plain SDPA with repeated KV heads."""
    n, hq, _ = q.shape
    L, hkv, _ = k_full.shape
    rep = hq // hkv
    k = k_full.repeat_interleave(rep, dim=1).transpose(0, 1)
    v = v_full.repeat_interleave(rep, dim=1).transpose(0, 1)
    mask = torch.ones(n, L, dtype=torch.bool).tril(diagonal=L - n)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale)
    return o.transpose(0, 1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("garbage", ["random", "nan"])  # nan: a failed request's freed blocks must not leak in
def test_reference_backend_vs_dense_sdpa(dtype, tol, hq, hkv, seed, garbage):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    bs, nblocks, d = 4, 200, 16
    tables, computed, new = _random_batch(rng, nblocks, bs, nreq=9, min_decodes=3)
    tables.insert(3, [])  # a request with nothing to compute this step
    computed.insert(3, 0)
    new.insert(3, 0)
    k_cache = torch.randn(nblocks, bs, hkv, d).to(dtype)  # garbage outside each request's slots
    v_cache = torch.randn(nblocks, bs, hkv, d).to(dtype)
    if garbage == "nan":
        k_cache.fill_(float("nan")), v_cache.fill_(float("nan"))
    # full K/V of each request: the cached prefix goes into the pool now, the new part through forward()
    full_k = [torch.randn(c + n, hkv, d).to(dtype) for c, n in zip(computed, new, strict=True)]
    full_v = [torch.randn(c + n, hkv, d).to(dtype) for c, n in zip(computed, new, strict=True)]
    for bt, c, fk, fv in zip(tables, computed, full_k, full_v, strict=True):
        slots = torch.tensor(_naive_slots([bt], [0], [c], bs), dtype=torch.long)
        k_cache.view(-1, hkv, d)[slots] = fk[:c]
        v_cache.view(-1, hkv, d)[slots] = fv[:c]
    meta = build_attention_metadata(tables, computed, new, bs)
    q = torch.randn(sum(new), hq, d).to(dtype)
    k = torch.cat([fk[c:] for fk, c in zip(full_k, computed, strict=True)])
    v = torch.cat([fv[c:] for fv, c in zip(full_v, computed, strict=True)])
    scale = d ** -0.5
    backend = get_backend("reference")
    backend.decode_group = 2  # several padded decode groups
    out = backend.forward(q, k, v, k_cache, v_cache, meta, scale)
    assert out.shape == q.shape and out.dtype == dtype
    # new K/V landed in their slots
    assert torch.equal(k_cache.view(-1, hkv, d)[meta.slot_mapping], k)
    assert torch.equal(v_cache.view(-1, hkv, d)[meta.slot_mapping], v)
    starts = meta.query_start_loc.tolist()
    for r, n in enumerate(new):
        if n == 0:
            continue
        ref = _dense_oracle(q[starts[r]:starts[r] + n].float(), full_k[r].float(), full_v[r].float(), scale)
        got = out[starts[r]:starts[r] + n].float()
        assert (got - ref).abs().max().item() < tol, f"request {r} (computed={computed[r]}, new={new[r]})"


def test_copy_blocks():
    torch.manual_seed(0)
    caches = [(torch.randn(10, 4, 2, 8), torch.randn(10, 4, 2, 8)) for _ in range(3)]
    before = [(k.clone(), v.clone()) for k, v in caches]
    pairs = [(1, 5), (2, 7), (9, 0)]
    copy_blocks(caches, pairs)
    get_backend("reference").copy_blocks(caches, [])  # no-op
    for (k, v), (k0, v0) in zip(caches, before, strict=True):
        for s, d in pairs:
            assert torch.equal(k[d], k0[s]) and torch.equal(v[d], v0[s])
        untouched = [i for i in range(10) if i not in {d for _, d in pairs}]
        assert torch.equal(k[untouched], k0[untouched]) and torch.equal(v[untouched], v0[untouched])


def test_copy_blocks_on_one_pool():
    from pagedllm.model import ModelConfig, allocate_kv_caches

    cfg = ModelConfig(architecture="llama", num_layers=3, hidden_size=16, intermediate_size=32, num_heads=2,
                      num_kv_heads=2, head_dim=8, vocab_size=10, max_position_embeddings=64)
    caches = allocate_kv_caches(cfg, 4, torch.float32, num_blocks=10)
    torch.manual_seed(1)
    caches.pool.copy_(torch.randn(caches.pool.shape))
    before = [(k.clone(), v.clone()) for k, v in caches]
    copy_blocks(caches, [(3, 4), (4, 8)])  # 4 is both a destination and a source: sources are read first
    for (k, v), (k0, v0) in zip(caches, before, strict=True):
        assert torch.equal(k[4], k0[3]) and torch.equal(v[4], v0[3])
        assert torch.equal(k[8], k0[4]) and torch.equal(v[8], v0[4])
        assert torch.equal(k[:4], k0[:4]) and torch.equal(v[9], v0[9])


def test_get_backend():
    assert get_backend("reference").name == "reference"
    assert hasattr(get_backend("auto"), "forward")
    with pytest.raises(ValueError, match="reference"):
        get_backend("no-such-backend")
