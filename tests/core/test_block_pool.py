"""BlockPool and FreeBlockQueue: O(1) linked-list queue, LRU order, hash map, eviction on reuse."""

from __future__ import annotations

import random

import pytest

from pagedllm.core.block_pool import BlockPool, BlockPoolError, FreeBlockQueue, KVBlock, NoFreeBlocksError
from pagedllm.core.kv_cache_utils import hash_block_tokens, hash_request_blocks


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue]


def check_queue_links(q: FreeBlockQueue) -> None:
    """Walk forwards and backwards: both directions agree and the count matches."""
    fwd = list(q)
    back = []
    cur = q._tail.prev_free
    while cur is not q._head:
        back.append(cur)
        cur = cur.prev_free
    assert fwd == back[::-1]
    assert len(fwd) == q.num_free_blocks == len(set(map(id, fwd)))


# ---- FreeBlockQueue ------------------------------------------------------------------------------

def test_queue_against_list_model():
    """Random popleft / append / remove against a Python list oracle."""
    rng = random.Random(1234)
    blocks = [KVBlock(i) for i in range(50)]
    q = FreeBlockQueue(blocks)
    model = list(blocks)
    for _ in range(2000):
        op = rng.random()
        if op < 0.3 and model:
            assert q.popleft() is model.pop(0)
        elif op < 0.5 and model:
            n = rng.randint(0, len(model))
            got = q.popleft_n(n)
            assert got == model[:n]
            del model[:n]
        elif op < 0.75 and model:
            b = rng.choice(model)
            q.remove(b)
            model.remove(b)
        else:
            outside = [b for b in blocks if b not in model]
            if outside:
                b = rng.choice(outside)
                q.append(b)
                model.append(b)
        assert list(q) == model
        check_queue_links(q)


def test_queue_errors():
    blocks = [KVBlock(i) for i in range(2)]
    q = FreeBlockQueue(blocks)
    with pytest.raises(NoFreeBlocksError):
        q.popleft_n(3)
    assert list(q) == blocks  # unchanged
    q.popleft()
    q.popleft()
    with pytest.raises(NoFreeBlocksError):
        q.popleft()
    with pytest.raises(BlockPoolError):
        q.remove(blocks[0])  # not in the queue
    check_queue_links(q)


# ---- BlockPool -----------------------------------------------------------------------------------

def test_get_new_blocks_takes_lru_head_and_sets_ref():
    pool = BlockPool(8)
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.num_free_blocks() == 5
    assert free_ids(pool) == [3, 4, 5, 6, 7]


def test_get_new_blocks_too_many_changes_nothing():
    pool = BlockPool(4)
    pool.get_new_blocks(2)
    before = free_ids(pool)
    with pytest.raises(NoFreeBlocksError):
        pool.get_new_blocks(3)
    assert free_ids(pool) == before and pool.num_free_blocks() == 2
    with pytest.raises(BlockPoolError):
        pool.get_new_blocks(-1)
    assert free_ids(pool) == before


def test_free_order_is_lru():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)  # 0 1 2
    b = pool.get_new_blocks(3)  # 3 4 5
    pool.free_blocks(reversed(b))  # tail first: 5 4 3
    pool.free_blocks(reversed(a))  # 2 1 0
    assert free_ids(pool) == [5, 4, 3, 2, 1, 0]
    assert [x.block_id for x in pool.get_new_blocks(2)] == [5, 4]


def test_double_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.free_blocks(blocks[:1])
    before = (free_ids(pool), [b.ref_cnt for b in pool.blocks])
    with pytest.raises(BlockPoolError, match="already free"):
        pool.free_blocks(blocks)  # blocks[1] is fine but blocks[0] is free: nothing may change
    assert (free_ids(pool), [b.ref_cnt for b in pool.blocks]) == before


def test_cached_block_survives_free_until_reused():
    pool = BlockPool(3)
    (blk,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2, 3, 4])
    pool.cache_full_block(blk, h)
    assert pool.get_cached_block(h) is blk
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0 and pool.get_cached_block(h) is blk  # still findable while free
    # A hit takes it back out of the middle of the free queue.
    pool.touch([blk])
    assert blk.ref_cnt == 1 and blk.block_id not in free_ids(pool)
    pool.free_blocks([blk])
    # Reuse for new data evicts it: the queue is [1, 2, 0], so it takes three allocations.
    assert free_ids(pool) == [1, 2, 0]
    pool.get_new_blocks(2)
    assert pool.get_cached_block(h) is blk
    (again,) = pool.get_new_blocks(1)
    assert again is blk and blk.block_hash is None and pool.get_cached_block(h) is None
    assert pool.num_evictions == 1


def test_touch_shared_in_use_block():
    pool = BlockPool(2)
    (blk,) = pool.get_new_blocks(1)
    pool.touch([blk])
    assert blk.ref_cnt == 2 and pool.num_free_blocks() == 1
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and pool.num_free_blocks() == 1


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [9, 9])
    pool.cache_full_block(a, h)
    pool.cache_full_block(b, h)
    assert pool.get_cached_block(h) is a and b.block_hash is None


def test_caching_disabled_caches_nothing():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1])
    pool.cache_full_block(a, h)
    assert pool.get_cached_block(h) is None and a.block_hash is None


def test_foreign_block_rejected():
    pool = BlockPool(2)
    with pytest.raises(BlockPoolError):
        pool.touch([KVBlock(0)])
    assert pool.blocks[0].ref_cnt == 0 and pool.num_free_blocks() == 2


def test_reset_prefix_cache():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1])
    pool.cache_full_block(a, h)
    assert pool.reset_prefix_cache() is False  # a block is in use
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(h) is None and a.block_hash is None


# ---- hashing -------------------------------------------------------------------------------------

def test_hash_is_stable_and_chained():
    h1 = hash_block_tokens(None, [1, 2, 3])
    assert h1 == hash_block_tokens(None, [1, 2, 3]) and len(h1) == 32
    # Known digest: the serialisation is fixed, so this must never change (caches may persist).
    assert h1.hex() == "7a81b887487acf8119ee507ddb68b5aef9b10d0cd521cc13294cb9b6f514a8a3"
    assert hash_block_tokens(None, (1, 2, 3)) == h1  # any sequence type
    assert hash_block_tokens(h1, [4, 5, 6]) != hash_block_tokens(None, [4, 5, 6])
    assert hash_block_tokens(None, [1, 2, 3], ("salt",)) != h1
    assert hash_block_tokens(None, [1, 2, 3], ("a",)) != hash_block_tokens(None, [1, 2, 3], ("b",))
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1, 2, 0])
    assert hash_block_tokens(None, [2**40]) != hash_block_tokens(None, [0])


def test_hash_request_blocks_full_blocks_only_and_prefix_dependent():
    rng = random.Random(7)
    common = [rng.randrange(50000) for _ in range(8)]
    a = [rng.randrange(50000) for _ in range(8)] + common + [1, 2, 3]
    b = [rng.randrange(50000) for _ in range(8)] + common
    ha, hb = hash_request_blocks(a, 8), hash_request_blocks(b, 8)
    assert len(ha) == 2 and len(hb) == 2  # the 3-token tail of a is not hashed
    assert ha[1] != hb[1]  # same block tokens after different prefixes
    assert hash_request_blocks(a, 8, "tenant-1")[0] != ha[0]
    assert hash_request_blocks(a, 8, "tenant-1") != hash_request_blocks(a, 8, "tenant-2")
    # Extending a chain equals hashing from scratch.
    assert hash_request_blocks(a, 8, start_hashes=ha[:1]) == ha


def test_blocks_benchmark_runs(capsys):
    """`pagedllm bench blocks` stays runnable: a tiny run prints the table with every row."""
    from pagedllm_bench import main

    main(["blocks", "--sizes", "64,256", "--ops", "64", "--repeat", "1"])
    out = capsys.readouterr().out
    for row in ("pool get", "pool touch", "allocate (cache miss)", "cache hit", "free", "decode step"):
        assert f"| {row}" in out
    assert "256 / 64" in out
