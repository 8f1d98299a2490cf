"""KVCacheManager: the seeds' worked examples plus one test per behaviour (allocation, prefix caching,
copy-on-write fork, free, contiguous layout, stats, errors)."""

from __future__ import annotations

import random

import pytest

from pagedllm.core.kv_cache_manager import (
    ContextTooLongError,
    DoubleFreeError,
    InconsistentRequestError,
    InvalidComputedBlocksError,
    KVCacheManager,
    NegativeTokenCountError,
    RequestExistsError,
    UnknownRequestError,
)
from pagedllm.core.request import Request

RNG = random.Random(20261122)


def rand_tokens(n: int) -> list[int]:
    return [RNG.randrange(1, 49152) for _ in range(n)]


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(tokens), cache_salt=salt)


def admit(m: KVCacheManager, r: Request, reserve: int = 0) -> list[tuple[int, int]] | None:
    """What the scheduler does for a waiting request, then 'runs' the step."""
    blocks, n_cached = m.get_computed_blocks(r)
    copies = m.allocate_slots(r, r.num_tokens - n_cached, blocks, num_reserved_blocks=reserve)
    if copies is not None:
        r.num_computed_tokens = r.num_tokens
    return copies


def decode(m: KVCacheManager, r: Request, token: int | None = None) -> list[tuple[int, int]] | None:
    """Sample one token, then allocate its slot and run the step."""
    r.append_output_token(RNG.randrange(1, 49152) if token is None else token)
    copies = m.allocate_slots(r, 1)
    if copies is not None:
        r.num_computed_tokens += 1
    return copies


def refs(m: KVCacheManager, ids) -> list[int]:
    return [m.block_pool.blocks[i].ref_cnt for i in ids]


def snapshot(m: KVCacheManager) -> tuple:
    pool = m.block_pool
    return ([b.block_id for b in pool.free_block_queue], [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            dict(pool.cached_block_hash_to_block), m.stats(),
            {rid: [b.block_id for b in s.blocks] for rid, s in m._requests.items()})


# ---- the seeds' examples ------------------------------------------------------------------------

def test_seed001_slot_example_35_tokens_table_5_12_3():
    m = KVCacheManager(16, 16)
    pool = m.block_pool
    held = pool.get_new_blocks(16)
    pool.free_blocks([held[5], held[12], held[3]])  # the free queue is now 5, 12, 3
    r = req("r", rand_tokens(35))
    assert m.allocate_slots(r, 35) == []
    table = m.get_block_ids(r)
    assert table == [5, 12, 3]  # 3 physical blocks for 35 tokens
    slot = {t: table[t // 16] * 16 + t % 16 for t in range(35)}
    assert (slot[0], slot[15], slot[16], slot[31], slot[32], slot[34]) == (80, 95, 192, 207, 48, 50)
    assert len(set(slot.values())) == 35


def test_seed001_refcount_lifecycle_T0_to_T3():
    B = 4
    m = KVCacheManager(8, B)
    prefix = rand_tokens(3 * B)
    a = req("A", prefix + rand_tokens(2))
    b = req("B", prefix + rand_tokens(2))
    # T0: A allocates 4 blocks.
    assert admit(m, a) == []
    ta = m.get_block_ids(a)
    assert len(ta) == 4 and refs(m, ta) == [1, 1, 1, 1]
    # T1: B shares A's 3 prefix blocks, allocates 1 of its own.
    blocks, n_cached = m.get_computed_blocks(b)
    assert [x.block_id for x in blocks] == ta[:3] and n_cached == 3 * B
    assert m.allocate_slots(b, b.num_tokens - n_cached, blocks) == []
    b.num_computed_tokens = b.num_tokens  # its step ran
    tb = m.get_block_ids(b)
    assert tb[:3] == ta[:3] and tb[3] not in ta
    assert refs(m, ta) == [2, 2, 2, 1] and refs(m, tb[3:]) == [1]
    # T2: A completes: shared blocks go to 1, A's suffix to 0 (free list).
    m.free(a)
    assert refs(m, ta) == [1, 1, 1, 0]
    assert m.num_free_blocks() == 8 - 4
    # T3: B completes: everything free.
    m.free(b)
    assert refs(m, tb) == [0, 0, 0, 0] and m.num_free_blocks() == 8
    # Better than the seed: freed full blocks keep their hash and stay findable until reused.
    c = req("C", prefix + rand_tokens(1))
    blocks, n_cached = m.get_computed_blocks(c)
    assert [x.block_id for x in blocks] == ta[:3] and n_cached == 3 * B


def test_seed000_beam_fork_copy_on_write():
    B = 4
    m = KVCacheManager(10, B)
    parent = req("beam0", rand_tokens(2 * B + 2))  # table [0, 1, 2], block 2 half full
    assert admit(m, parent) == []
    assert m.get_block_ids(parent) == [0, 1, 2]
    other = req("other", rand_tokens(2 * B))  # holds blocks 3 and 4, so the first copy lands in 5
    admit(m, other)
    beams = [parent]
    for k in range(1, 4):
        child = req(f"beam{k}", parent.all_token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        m.fork(parent, child)
        beams.append(child)
    assert all(m.get_block_ids(x) == [0, 1, 2] for x in beams)
    assert refs(m, [0, 1, 2]) == [4, 4, 4]
    # Beam 0 extends: block 2 is shared and partly full -> copy it to a fresh block 5.
    assert decode(m, beams[0]) == [(2, 5)]
    assert m.get_block_ids(beams[0]) == [0, 1, 5]
    assert all(m.get_block_ids(x) == [0, 1, 2] for x in beams[1:])
    assert refs(m, [0, 1, 2, 5]) == [4, 4, 3, 1]
    # Beams 1 and 2 copy too; beam 3 is the last holder of block 2 and writes in place.
    assert decode(m, beams[1]) == [(2, 6)]
    assert decode(m, beams[2]) == [(2, 7)]
    assert decode(m, beams[3]) == []
    assert m.get_block_ids(beams[3]) == [0, 1, 2]
    assert refs(m, [0, 1, 2]) == [4, 4, 1]  # full shared blocks are never copied


# ---- allocation -----------------------------------------------------------------------------------

def test_decode_allocates_a_block_only_at_boundaries():
    B = 4
    m = KVCacheManager(10, B)
    r = req("r", rand_tokens(3))
    admit(m, r)
    assert len(m.get_block_ids(r)) == 1
    decode(m, r)  # token 4 fills block 0
    assert len(m.get_block_ids(r)) == 1
    decode(m, r)  # token 5 needs block 1
    assert len(m.get_block_ids(r)) == 2
    for _ in range(3):
        decode(m, r)
    assert len(m.get_block_ids(r)) == 2 and r.num_tokens == 8
    assert m.allocate_slots(r, 0) == []  # nothing new: nothing changes
    assert len(m.get_block_ids(r)) == 2


def test_allocation_failure_is_atomic_and_watermark():
    B = 4
    m = KVCacheManager(6, B)
    a = req("a", rand_tokens(4 * B))
    admit(m, a)  # 4 blocks, 2 free
    r = req("r", rand_tokens(3 * B))
    before = snapshot(m)
    assert m.allocate_slots(r, 3 * B) is None  # needs 3
    assert snapshot(m) == before and not m.has_request(r)
    assert m.allocate_slots(r, 2 * B, num_reserved_blocks=1) is None  # would leave 0 < 1
    assert snapshot(m) == before
    assert m.allocate_slots(r, 2 * B - 1, num_reserved_blocks=0) == []  # exactly fits
    assert m.num_free_blocks() == 0


def test_revived_cached_blocks_count_against_the_free_pool():
    B = 4
    m = KVCacheManager(4, B)
    prefix = rand_tokens(2 * B)
    a = req("a", prefix + [7])
    admit(m, a)
    m.free(a)  # all 4 blocks free, a's 2 full blocks cached
    hog = req("hog", rand_tokens(B))
    admit(m, hog)  # takes the LRU head (block 3): 3 free, 2 of them cached
    b = req("b", prefix + rand_tokens(2 * B))
    blocks, n = m.get_computed_blocks(b)
    assert n == 2 * B
    before = snapshot(m)
    # Needs the 2 cached (free) blocks + 2 new = 4 from a pool with 3 free.
    assert m.allocate_slots(b, b.num_tokens - n, blocks) is None
    assert snapshot(m) == before


def test_chunked_prefill_registers_only_full_known_blocks():
    B = 4
    m = KVCacheManager(8, B)
    r = req("r", rand_tokens(3 * B + 1))
    m.allocate_slots(r, B + 2)  # chunk 1: 6 tokens -> 1 full block
    assert m.stats()["num_cached_blocks"] == 1
    r.num_computed_tokens = B + 2
    m.allocate_slots(r, 2 * B - 1)  # chunk 2 ends at 13 tokens -> 3 full blocks
    r.num_computed_tokens += 2 * B - 1
    assert m.stats()["num_cached_blocks"] == 3 and len(m.get_block_ids(r)) == 4
    # Another request with the same prompt hits all 3 full blocks (never the last token).
    other = req("o", r.prompt_token_ids)
    blocks, n = m.get_computed_blocks(other)
    assert [b.block_id for b in blocks] == m.get_block_ids(r)[:3] and n == 3 * B


def test_same_step_hit_on_blocks_registered_at_allocation():
    B = 4
    m = KVCacheManager(8, B)
    prompt = rand_tokens(2 * B + 1)
    a, b = req("a", prompt), req("b", prompt)
    blocks, _ = m.get_computed_blocks(a)
    m.allocate_slots(a, a.num_tokens)  # a's step has not run yet
    blocks, n = m.get_computed_blocks(b)
    assert n == 2 * B and [x.block_id for x in blocks] == m.get_block_ids(a)[:2]


def test_prefix_lookup_never_covers_the_last_token():
    B = 4
    m = KVCacheManager(8, B)
    prompt = rand_tokens(2 * B)
    admit(m, req("a", prompt))
    blocks, n = m.get_computed_blocks(req("b", prompt))
    assert n == B and len(blocks) == 1  # 2 full cached blocks, but the last token must be computed
    blocks, n = m.get_computed_blocks(req("c", prompt + [5]))
    assert n == 2 * B


def test_duplicate_full_block_is_allocated_and_freed_cleanly():
    B = 4
    m = KVCacheManager(8, B)
    prompt = rand_tokens(2 * B)
    a, b = req("a", prompt), req("b", prompt)
    admit(m, a)
    admit(m, b)  # recomputes block 1 into a new block with the same hash
    ta, tb = m.get_block_ids(a), m.get_block_ids(b)
    assert ta[0] == tb[0] and ta[1] != tb[1]
    assert m.block_pool.blocks[tb[1]].block_hash is None  # the first copy stays the cached one
    m.free(a)
    m.free(b)
    assert m.num_free_blocks() == 8


def test_cache_salt_separates_tenants():
    B = 4
    m = KVCacheManager(8, B)
    prompt = rand_tokens(2 * B + 1)
    admit(m, req("a", prompt, salt="tenant-a"))
    assert m.get_computed_blocks(req("b", prompt, salt="tenant-b"))[1] == 0
    assert m.get_computed_blocks(req("c", prompt))[1] == 0
    assert m.get_computed_blocks(req("d", prompt, salt="tenant-a"))[1] == 2 * B


def test_eviction_is_lru_and_takes_tails_first():
    B = 4
    m = KVCacheManager(6, B)
    p1, p2 = rand_tokens(3 * B), rand_tokens(3 * B)
    r1, r2 = req("1", p1), req("2", p2)
    admit(m, r1)
    admit(m, r2)
    m.free(r1)  # older: evicted first, tail block first
    m.free(r2)
    admit(m, req("x", rand_tokens(B)))  # takes r1's last block
    assert m.get_computed_blocks(req("q1", p1 + [1]))[1] == 2 * B
    assert m.get_computed_blocks(req("q2", p2 + [1]))[1] == 3 * B
    admit(m, req("y", rand_tokens(2 * B)))  # takes r1's first two blocks
    assert m.get_computed_blocks(req("q1", p1 + [1]))[1] == 0
    assert m.get_computed_blocks(req("q2", p2 + [1]))[1] == 3 * B
    assert m.stats()["num_evictions"] == 3


def test_free_forgets_hashes_of_blocks_whose_step_never_ran():
    B = 4
    m = KVCacheManager(8, B)
    prompt = rand_tokens(2 * B + 1)
    a = req("a", prompt)
    m.allocate_slots(a, a.num_tokens)  # registered at allocation...
    m.free(a)  # ...but freed before its step ran (num_computed_tokens still 0)
    assert m.get_computed_blocks(req("b", prompt))[1] == 0
    assert m.stats()["num_cached_blocks"] == 0
    # Blocks it took from the prefix cache were computed by others: they stay cached.
    c = req("c", prompt)
    admit(m, c)
    m.free(c)
    d = req("d", prompt + rand_tokens(B))
    blocks, n = m.get_computed_blocks(d)
    assert n == 2 * B
    m.allocate_slots(d, d.num_tokens - n, blocks)
    m.free(d)  # num_computed_tokens still 0: only d's own new full blocks are forgotten
    assert m.get_computed_blocks(req("e", prompt + rand_tokens(B)))[1] == 2 * B
    assert m.stats()["num_cached_blocks"] == 2


def test_fork_shares_everything_then_frees_cleanly():
    B = 4
    m = KVCacheManager(8, B)
    p = req("p", rand_tokens(2 * B + 1))
    admit(m, p)
    c = req("c", p.all_token_ids)
    c.num_computed_tokens = p.num_computed_tokens
    m.fork(p, c)
    assert m.get_block_ids(c) == m.get_block_ids(p)
    assert m.num_free_blocks() == 5  # no block taken
    m.free(p)
    assert refs(m, m.get_block_ids(c)) == [1, 1, 1]
    assert decode(m, c) == []  # sole holder now: no copy
    m.free(c)
    assert m.num_free_blocks() == 8


def test_fork_without_prefix_caching_still_copies_on_write():
    B = 4
    m = KVCacheManager(8, B, enable_prefix_caching=False)
    p = req("p", rand_tokens(B + 1))
    admit(m, p)
    c = req("c", p.all_token_ids)
    c.num_computed_tokens = p.num_computed_tokens
    m.fork(p, c)
    copies = decode(m, c)
    assert copies == [(m.get_block_ids(p)[1], m.get_block_ids(c)[1])]
    assert m.get_block_ids(p)[0] == m.get_block_ids(c)[0]


# ---- contiguous layout ----------------------------------------------------------------------------

def test_contiguous_layout_reserves_max_model_len():
    B = 4
    m = KVCacheManager(20, B, kv_layout="contiguous", max_model_len=30)  # ceil(30/4) = 8 blocks
    prompt = rand_tokens(5)
    r = req("r", prompt)
    assert admit(m, r) == []
    assert len(m.get_block_ids(r)) == 8
    for _ in range(10):
        decode(m, r)
    assert len(m.get_block_ids(r)) == 8  # never grows
    s = m.stats()
    assert s["used_slots"] == 15 and s["allocated_slots"] == 32
    # No prefix caching in this layout.
    assert m.get_computed_blocks(req("x", prompt + [1]))[1] == 0
    assert admit(m, req("r2", rand_tokens(3))) == []
    assert admit(m, req("r3", rand_tokens(3))) is None  # 4 free < 8
    before = snapshot(m)
    with pytest.raises(ContextTooLongError):
        m.allocate_slots(r, 30 - r.num_tokens + 3)
    assert snapshot(m) == before


def test_contiguous_needs_max_model_len():
    with pytest.raises(ValueError):
        KVCacheManager(4, 4, kv_layout="contiguous")
    with pytest.raises(ValueError):
        KVCacheManager(4, 4, kv_layout="ring")


# ---- stats ---------------------------------------------------------------------------------------

def test_stats_and_usage():
    B = 4
    m = KVCacheManager(10, B)
    prefix = rand_tokens(2 * B)
    a = req("a", prefix + rand_tokens(3))  # 11 tokens, 3 blocks
    admit(m, a)
    s = m.stats()
    assert s["num_blocks"] == 10 and s["block_size"] == B and s["num_free_blocks"] == 7
    assert s["used_slots"] == 11 and s["allocated_slots"] == 12
    assert s["prefix_cache_queries"] == 11 and s["prefix_cache_hits"] == 0
    assert s["prefix_cache_block_queries"] == 2 and s["prefix_cache_block_hits"] == 0
    b = req("b", prefix + rand_tokens(1))  # 9 tokens, hits 2 blocks
    admit(m, b)
    s = m.stats()
    assert s["prefix_cache_queries"] == 20 and s["prefix_cache_hits"] == 2 * B
    assert s["prefix_cache_block_queries"] == 4 and s["prefix_cache_block_hits"] == 2
    assert s["used_slots"] == 12  # each physical block once: 8 shared + 3 of a + 1 of b
    assert s["logical_slots"] == 20  # per table: the shared blocks count once per request
    assert s["allocated_slots"] == 4 * B and m.usage() == pytest.approx(0.4)
    assert s["peak_used_blocks"] == 4
    m.free(a)
    m.free(b)
    s = m.stats()
    assert s["used_slots"] == 0 and s["logical_slots"] == 0 and s["allocated_slots"] == 0
    assert s["peak_used_blocks"] == 4
    m.reset_peak()
    assert m.stats()["peak_used_blocks"] == 0
    assert m.usage() == 0.0


def test_reset_prefix_cache():
    B = 4
    m = KVCacheManager(8, B)
    prompt = rand_tokens(2 * B + 1)
    a = req("a", prompt)
    admit(m, a)
    assert m.reset_prefix_cache() is False
    m.free(a)
    assert m.reset_prefix_cache() is True
    assert m.get_computed_blocks(req("b", prompt))[1] == 0


# ---- bad input: precise errors, pool unchanged ---------------------------------------------------

def test_bad_input_raises_and_changes_nothing():
    B = 4
    m = KVCacheManager(8, B)
    a = req("a", rand_tokens(B + 2))
    admit(m, a)
    before = snapshot(m)
    ghost = req("ghost", [1, 2, 3])

    with pytest.raises(NegativeTokenCountError):
        m.allocate_slots(a, -1)
    with pytest.raises(NegativeTokenCountError):
        m.allocate_slots(a, 1, num_reserved_blocks=-2)
    with pytest.raises(UnknownRequestError, match="ghost"):
        m.free(ghost)
    with pytest.raises(UnknownRequestError):
        m.get_block_ids(ghost)
    with pytest.raises(UnknownRequestError, match="fork"):
        m.fork(ghost, req("child", [1]))
    with pytest.raises(RequestExistsError):
        m.fork(a, a)
    a.num_computed_tokens = 100
    with pytest.raises(InconsistentRequestError):
        m.allocate_slots(a, 1)
    a.num_computed_tokens = a.num_tokens
    assert snapshot(m) == before

    b = req("b", a.prompt_token_ids)
    blocks, n = m.get_computed_blocks(b)
    assert n == B
    with pytest.raises(InvalidComputedBlocksError):
        m.allocate_slots(a, 1, blocks)  # a already has blocks
    other = req("other", rand_tokens(B + 2))
    with pytest.raises(InvalidComputedBlocksError):
        m.allocate_slots(other, 2, blocks)  # blocks of another prefix
    assert snapshot(m) == before

    m.free(a)
    after_free = snapshot(m)
    with pytest.raises(DoubleFreeError, match="already freed"):
        m.free(a)
    assert isinstance(DoubleFreeError("x"), KeyError)
    assert snapshot(m) == after_free


def test_stale_computed_blocks_are_rejected():
    B = 4
    m = KVCacheManager(3, B)
    prompt = rand_tokens(2 * B + 1)
    a = req("a", prompt)
    admit(m, a)
    m.free(a)
    b = req("b", prompt)
    blocks, n = m.get_computed_blocks(b)
    assert n == 2 * B
    admit(m, req("hog", rand_tokens(3 * B)))  # evicts all three cached blocks
    before = snapshot(m)
    with pytest.raises(InvalidComputedBlocksError, match="evicted"):
        m.allocate_slots(b, 1, blocks)
    assert snapshot(m) == before
