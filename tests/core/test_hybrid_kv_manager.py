"""The hybrid KV cache manager alone (pure Python): KV groups on one pool, sliding groups giving back the blocks
out of their window, all-or-nothing allocation over the groups, prefix hits every group can serve, capacity."""

from __future__ import annotations

import pytest

from pagedllm.core.block_pool import NULL_BLOCK
from pagedllm.core.hybrid_kv_cache_manager import HybridKVCacheManager
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_groups import capacity_tokens, plan_kv_groups, request_blocks, window_blocks
from pagedllm.core.request import Request

B, W = 4, 8


def decode(m, r: Request, steps: int, token: int = 7) -> None:
    """Allocate and 'compute' one token per step, the way the scheduler drives a decoding request."""
    for _ in range(steps):
        assert m.allocate_slots(r, r.num_tokens - r.num_computed_tokens) is not None
        r.num_computed_tokens = r.num_tokens
        r.append_output_token(token)


def test_sliding_group_gives_back_blocks_out_of_the_window_and_keeps_them_cached():
    m = HybridKVCacheManager(64, B, plan_kv_groups([None, W, W]))
    r = Request("a", list(range(10)))
    decode(m, r, 30)  # 39 tokens computed, 40 known
    full, slide1, slide2 = m.groups
    assert len(full.get_block_ids(r)) == 10 and full.num_held_blocks == 10
    for g in (slide1, slide2):
        state = g._requests["a"]
        assert state.num_null == (39 - 1 - W + 1) // B  # dead before the last allocation's first query
        assert all(b is NULL_BLOCK for b in state.blocks[:state.num_null])
        assert g.num_held_blocks == len(state.blocks) - state.num_null <= window_blocks(W, B, 1)
    assert m.num_used_blocks() == sum(g.num_held_blocks for g in m.groups) < 3 * 10
    assert m.stats()["num_cached_blocks"] == 3 * 9  # full blocks of every group stay cached, freed or not
    # a request with the same 36-token prefix hits: full group all 9 blocks, sliding groups their window only
    r2 = Request("b", list(range(10)) + [7] * 30)
    hits, n = m.get_computed_blocks(r2)
    assert n == 36 and [len(h) for h in hits] == [9, 9, 9]
    first = (36 - W + 1) // B
    assert all(b is NULL_BLOCK for h in hits[1:] for b in h[:first])
    assert m.allocate_slots(r2, 4, hits) is not None
    m.free(r)
    m.free(r2)
    assert m.num_free_blocks() == 64 and all(g.num_held_blocks == 0 for g in m.groups)


def test_allocation_is_all_or_nothing_over_the_groups():
    m = HybridKVCacheManager(7, B, plan_kv_groups([None, W]))
    r = Request("a", list(range(13)))  # 4 blocks per group: 8 > 7
    before = [b.ref_cnt for b in m.block_pool.blocks]
    assert m.allocate_slots(r, 13) is None
    assert [b.ref_cnt for b in m.block_pool.blocks] == before and not m.has_request(r)
    assert m.allocate_slots(r, 12) is not None  # 3 + 3 blocks
    assert m.num_free_blocks() == 1


def test_a_hit_is_a_length_every_group_serves():
    """The full group's prefix is all cached but the sliding group lost blocks 0 and 4: a 20-token hit would need
    its blocks 3 and 4 (the window before token 20), so the hit shrinks to 16 tokens, where the sliding group needs
    only blocks 2 and 3 (placeholders before)."""
    m = HybridKVCacheManager(40, B, plan_kv_groups([None, W]))
    r = Request("a", list(range(24)))
    assert m.allocate_slots(r, 24) is not None
    r.num_computed_tokens = 24
    sliding_table = m.groups[1].get_block_ids(r)
    m.free(r)
    for i in (0, 4):  # block 0 is not needed by any hit of more than 2 blocks: it does not matter
        m.block_pool.evict_cached_block(m.block_pool.blocks[sliding_table[i]])
    hits, n = m.get_computed_blocks(Request("b", list(range(24))))
    assert n == 16
    assert len(hits[0]) == 4 and NULL_BLOCK not in hits[0]
    assert hits[1][:2] == [NULL_BLOCK, NULL_BLOCK] and [b.block_id for b in hits[1][2:]] == sliding_table[2:4]


def test_one_sliding_group_is_a_plain_manager_with_a_window():
    m = KVCacheManager(20, B, window=W)
    r = Request("a", list(range(6)))
    decode(m, r, 40)
    assert m.num_used_blocks() <= window_blocks(W, B, 1)
    m.free(r)
    assert m.num_free_blocks() == 20


@pytest.mark.parametrize("windows", [[None], [None, 8, 8], [8], [None, 512, 512, 512, 512, 512]])
def test_capacity_is_the_longest_request_that_fits(windows):
    for num_blocks in (3, 10, 57, 400):
        for step in (1, 16, 100):
            cap = capacity_tokens(windows, 16, num_blocks, step, 5000)
            assert cap == max((t for t in range(5001) if request_blocks(windows, 16, t, step) <= num_blocks),
                              default=0)
