"""The disk tier's core side (core/kv_tier.py) on its own, with a dict for a disk: what is spilled when, how a load
pins and releases its blocks, and the scheduler's admission with a request that waits for its blocks."""

from __future__ import annotations

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_tier import TierCoordinator
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler, SchedulerConfig

B = 4


def setup(num_blocks: int = 8) -> tuple[KVCacheManager, TierCoordinator, set[bytes]]:
    m = KVCacheManager(num_blocks, B)
    disk: set[bytes] = set()
    return m, TierCoordinator(m, disk.__contains__), disk


def run(m: KVCacheManager, r: Request) -> None:
    """Admit and compute the whole request, as one scheduler step would."""
    hits, n = m.get_computed_blocks(r)
    assert m.allocate_slots(r, r.num_tokens - n, hits) is not None
    r.num_computed_tokens = r.num_tokens


def test_freed_blocks_are_offered_only_while_free_and_evicted_ones_with_their_old_hash():
    m, tier, _ = setup(num_blocks=3)
    a = Request("a", list(range(9)))  # 2 full blocks + 1 token
    run(m, a)
    m.free(a)
    freed = tier.take_spills()
    assert sorted(b for b, _ in freed) == [0, 1] and all(k is not None for _, k in freed)
    old = dict(freed)
    # b reuses a's blocks (evicting them) and registers its own full blocks before its K/V is written:
    b = Request("b", list(range(100, 109)))
    run(m, b)
    spills = tier.take_spills()
    assert {(bid, key) for bid, key in spills} == {(bid, old[bid]) for bid in (0, 1)}  # old contents, old keys


def test_load_pins_blocks_then_the_request_hits_them_in_ram():
    m, tier, disk = setup(num_blocks=8)
    a = Request("a", list(range(13)))
    run(m, a)
    m.free(a)
    for _, k in tier.take_spills():
        disk.add(k)
    m.reset_prefix_cache()  # the pool forgets: only the disk has the prefix now
    r = Request("r", list(range(13)) + [99])
    _, n = m.get_computed_blocks(r)
    assert n == 0
    assert tier.maybe_load(r, n, reserve=0) is True
    (load,) = tier.take_new_loads()
    assert [p for p in load.positions] == [0, 1, 2] and load.hit == 3
    assert m.num_free_blocks() == 5 and tier.num_loading == 1
    assert sorted(m.block_pool.pins) == sorted(b.block_id for b in load.pinned)
    tier.finish_load(load.load_id, [True, True, False])  # the third block's file was bad
    assert m.num_free_blocks() == 8 and not m.block_pool.pins
    assert tier.take_loaded() == [r] and tier.disk_hit_tokens == 2 * B
    hits, n = m.get_computed_blocks(r)
    assert n == 2 * B and [b.block_id for b in hits] == [b.block_id for b, _ in load.targets[:2]]


def test_no_room_means_wait_and_nothing_on_disk_means_admit_as_usual():
    m, tier, disk = setup(num_blocks=4)
    r = Request("r", list(range(13)))
    assert tier.maybe_load(r, m.get_computed_blocks(r)[1], reserve=0) is None  # the disk is empty
    disk.update(k for k in _chain(r))
    assert tier.maybe_load(r, m.get_computed_blocks(r)[1], reserve=2) is False  # 3 blocks + 2 reserved > 4
    assert m.num_free_blocks() == 4 and not tier.loads


def test_an_aborted_load_releases_its_blocks_when_the_read_completes():
    m, tier, disk = setup()
    r = Request("r", list(range(13)))
    disk.update(_chain(r))
    assert tier.maybe_load(r, m.get_computed_blocks(r)[1], reserve=0)
    (load,) = tier.take_new_loads()
    assert tier.cancel([r]) == [r] and tier.num_loading == 0
    assert m.num_free_blocks() == 8 - 3  # the reader may still be writing into them
    tier.finish_load(load.load_id, [True] * 3)
    assert m.num_free_blocks() == 8 and tier.take_loaded() == []


def test_scheduler_takes_a_loading_request_off_the_queue_and_back_first():
    m, tier, disk = setup(num_blocks=16)
    s = Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=64), m)
    s.kv_tier = tier
    r, other = Request("r", list(range(13))), Request("o", [7] * 5)
    disk.update(_chain(r))
    s.add_request(r)
    s.add_request(other)
    out = s.schedule()
    assert [x.request for x in out.scheduled] == [other] and not s.waiting and tier.num_loading == 1
    other.num_computed_tokens = other.num_tokens  # the step ran: other has nothing to run until it samples
    (load,) = tier.take_new_loads()
    tier.finish_load(load.load_id, [True] * 3)
    out = s.schedule()
    assert [x.request for x in out.scheduled] == [r] and out.scheduled[0].num_new_tokens == 1
    assert r.num_cached_tokens == 12  # usage.prompt_tokens_details.cached_tokens: the disk's blocks count
    s.finish_requests([r, other], RequestStatus.FINISHED_ABORTED)
    assert m.num_free_blocks() == 16


def test_finishing_a_loading_request_sets_its_status():
    m, tier, disk = setup(num_blocks=16)
    s = Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=64), m)
    s.kv_tier = tier
    r = Request("r", list(range(13)))
    disk.update(_chain(r))
    s.add_request(r)
    s.schedule()
    s.finish_requests([r], RequestStatus.FINISHED_ABORTED)
    assert r.status == RequestStatus.FINISHED_ABORTED


def _chain(r: Request) -> list[bytes]:
    from pagedllm.core.kv_cache_utils import hash_request_blocks

    return hash_request_blocks(r.all_token_ids, B, r.cache_salt)
