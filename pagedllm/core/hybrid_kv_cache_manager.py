"""The KV cache manager of a hybrid model: one KVCacheManager per KV group (kv_groups.py), all on ONE block pool.

A request has one block table per group. Full groups keep every block; sliding groups give back the blocks that
fell out of their window (KVCacheManager with a window). The coordinator adds what the groups cannot do alone:
- an allocation is all or nothing: the blocks every group needs are counted together against the free queue,
  and every group's prefix hits are held before any group takes a new block (which could evict them);
- a prefix hit is a length every group can serve (prefix_lookup.py);
- stats are totals over the groups (blocks, slots), plus a per-group breakdown under "kv_groups".
The public methods are KVCacheManager's, so the scheduler and the engine use either one alike.
"""

from __future__ import annotations

from pagedllm.core.block_pool import BlockPool, KVBlock, PoolUsage
from pagedllm.core.kv_cache_errors import NegativeTokenCountError
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_groups import KVGroupLayout, capacity_tokens, request_blocks
from pagedllm.core.prefix_lookup import lookup_prefix
from pagedllm.core.request import Request


class HybridKVCacheManager(PoolUsage):
    kv_layout = "paged"

    def __init__(self, num_blocks: int, block_size: int, layout: KVGroupLayout, *,
                 enable_prefix_caching: bool = True) -> None:
        self.layout = layout
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.groups = [KVCacheManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching,
                                      window=g.window, block_pool=self.block_pool, group_id=i)
                       for i, g in enumerate(layout.groups)]

    def request_blocks(self, num_tokens: int, step_tokens: int) -> int:
        return request_blocks(self.layout.windows, self.block_size, num_tokens, step_tokens)

    def capacity_tokens(self, step_tokens: int, limit: int) -> int:
        return capacity_tokens(self.layout.windows, self.block_size, self.num_blocks, step_tokens, limit)

    # ---- lookup and allocation ---------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVBlock]], int]:
        """Per group its hit blocks (NULL_BLOCK where a window does not need them), and the hit in tokens."""
        if not self.enable_prefix_caching:
            return [[] for _ in self.groups], 0
        per_group, hit, hashes = lookup_prefix(self.block_pool, request, self.block_size,
                                               [g._key for g in self.groups])
        for g in self.groups:
            g.set_lookup_memo(request, hashes)
        return per_group, hit * self.block_size

    def group_keys(self) -> list:
        return [g._key for g in self.groups]

    def lookup_hashes(self, request: Request) -> list[bytes]:
        return self.groups[0].lookup_hashes(request)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[list[KVBlock]] | None = None,
                       num_reserved_blocks: int = 0) -> list[tuple[int, int]] | None:
        """KVCacheManager.allocate_slots over every group at once (new_computed_blocks: one list per group)."""
        if num_reserved_blocks < 0:
            raise NegativeTokenCountError(f"num_reserved_blocks must be >= 0, got {num_reserved_blocks}")
        hits = new_computed_blocks or [None] * len(self.groups)
        if len(hits) != len(self.groups):
            raise ValueError(f"new_computed_blocks has {len(hits)} lists for {len(self.groups)} KV groups")
        plans = [g.plan_allocation(request, num_new_tokens, h) for g, h in zip(self.groups, hits, strict=True)]
        for g in self.groups:
            g.release_outside_window(request)
        if self.block_pool.num_free_blocks() - sum(p.needed for p in plans) < num_reserved_blocks:
            return None
        for g, p in zip(self.groups, plans, strict=True):
            g.take_hits(p)
        copies: list[tuple[int, int]] = []
        for g, p in zip(self.groups, plans, strict=True):
            copies += g.commit_allocation(p)
        return copies

    # ---- sharing and release ----------------------------------------------------------------------
    def fork(self, parent: Request, child: Request) -> None:
        self.groups[0].fork(parent, child)  # raises (unchanged) on an unknown parent or an existing child
        for g in self.groups[1:]:
            g.fork(parent, child)

    def free(self, request: Request) -> None:
        self.groups[0].free(request)  # raises (unchanged) on an unknown or freed request
        for g in self.groups[1:]:
            g.free(request)

    def truncate(self, request: Request, num_tokens: int) -> None:
        self.groups[0].truncate(request, num_tokens)
        for g in self.groups[1:]:
            g.truncate(request, num_tokens)

    # ---- queries -----------------------------------------------------------------------------------
    def has_request(self, request: Request) -> bool:
        return self.groups[0].has_request(request)

    def get_block_ids(self, request: Request) -> list[int]:
        """The first group's table (a full group where the model has one)."""
        return self.groups[0].get_block_ids(request)

    def get_group_block_ids(self, request: Request) -> list[list[int]]:
        return [g.get_block_ids(request) for g in self.groups]

    @property
    def used_slots(self) -> int:
        return sum(g.used_slots for g in self.groups)

    @property
    def peak_used_blocks(self) -> int:
        # each group records the pool-wide use after its allocations: the largest record is the pool's peak
        return max(g.peak_used_blocks for g in self.groups)

    def reset_peak(self) -> None:
        for g in self.groups:
            g.reset_peak()

    def reset_prefix_cache(self) -> bool:
        for g in self.groups:
            g._lookup_memo = None
        return self.block_pool.reset_prefix_cache()

    def stats(self) -> dict:
        """Totals over the groups (a block holds one layer of each position of its group: blocks of different
        groups cost the same memory); prefix stats are per request (the first group's); "kv_groups" breaks the
        blocks in use down by group."""
        stats = self.groups[0].stats()
        stats["used_slots"] = self.used_slots
        stats["logical_slots"] = sum(g.stats()["logical_slots"] for g in self.groups)
        stats["peak_used_blocks"] = self.peak_used_blocks
        stats["kv_groups"] = [{"layers": list(lg.layers), "window": lg.window, "num_used_blocks": g.num_held_blocks}
                              for lg, g in zip(self.layout.groups, self.groups, strict=True)]
        return stats


def make_kv_cache_manager(num_blocks: int, block_size: int, layout: KVGroupLayout, *,
                          enable_prefix_caching: bool = True, kv_layout: str = "paged",
                          max_model_len: int | None = None) -> KVCacheManager | HybridKVCacheManager:
    """One group: the plain manager (with its window, if every layer slides); several: the hybrid one."""
    if layout.num_groups == 1:
        return KVCacheManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching,
                              kv_layout=kv_layout, max_model_len=max_model_len, window=layout.groups[0].window)
    return HybridKVCacheManager(num_blocks, block_size, layout, enable_prefix_caching=enable_prefix_caching)
