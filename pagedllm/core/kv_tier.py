"""The second tier of the prefix cache (disk), core side: which blocks go out, which come back. Pure Python.

The bytes and files are the worker's (worker/kv_offload.py, worker/kv_disk_store.py); here only block ids and
hashes. A tier key is the pool's cache key (the chained block hash + the KV group's tag); the store adds the
fingerprint of everything the bytes depend on.

- Spills: a cached block that the pool evicts (its contents stay intact until the next model step writes into it)
  or that becomes free (a finished request's prefix: written at completion) is offered to the tier.
- Loads: at admission, when the tier holds blocks past the pool's prefix hit, the request leaves the waiting queue
  and waits here while its missing blocks are read into blocks taken from the pool. The load holds (pins) those
  blocks and the hit's pool blocks meanwhile: admission of other requests counts them as used, and nothing evicts
  them. When it completes, the blocks read intact are registered in the prefix cache, the pins are released (the
  blocks stay cached, at the LRU tail) and the request goes back to the head of the waiting queue, where its next
  admission finds them as a RAM hit. A block that failed to load is simply not cached: the request prefills it.
Pins never outlive a load, so a running request that needs blocks waits at most for the loads in flight (the
scheduler's liveness argument holds).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import count

from pagedllm.core.block_pool import NULL_BLOCK, KVBlock
from pagedllm.core.prefix_lookup import ON_DISK, lookup_prefix
from pagedllm.core.request import Request

_load_ids = count()


@dataclass(eq=False)
class Load:
    """One request's read from the tier into pool blocks."""

    request: Request | None  # None once the request was aborted (the read still completes, then releases)
    pinned: list[KVBlock]  # pool blocks held until the load completes: the hit's RAM blocks, then the targets
    targets: list[tuple[KVBlock, bytes]]  # (block to fill, tier key to read into it)
    positions: list[int]  # each target's block index in the request
    first: int  # the pool's own hit, in blocks
    hit: int  # the hit once every target is loaded, in blocks
    load_id: int = field(default_factory=lambda: next(_load_ids))


class TierCoordinator:
    """Attached to a KV cache manager (plain or hybrid); `contains(key)` asks the tier whether it holds a block."""

    def __init__(self, kv, contains: Callable[[bytes], bool]) -> None:
        self.kv = kv
        self.pool = kv.block_pool
        self.block_size = kv.block_size
        self.contains = contains
        self._keys = kv.group_keys()
        # the manager that records the pool's peak use (a hybrid manager's groups all see the one pool)
        self._peak = kv.groups[0] if hasattr(kv, "groups") else kv
        self.pool.evicted = []
        self.pool.freed_cached = []
        self.loads: dict[int, Load] = {}  # in flight, by load_id
        self._new_loads: list[Load] = []  # started since the worker last took them
        self._loaded: list[Request] = []  # loads completed, requests to put back at the head of the queue
        self.num_loads = 0
        self.disk_hit_tokens = 0  # prompt tokens whose blocks came back from the tier
        self.num_loaded_blocks = 0
        self.num_failed_blocks = 0

    # ---- admission -----------------------------------------------------------------------------------
    def maybe_load(self, request: Request, num_cached: int, reserve: int) -> bool | None:
        """Called for the waiting head after its pool lookup found num_cached tokens. None: the tier adds nothing
        (admit as usual). True: a load started, the request waits here (take it off the queue). False: the tier
        holds more of the prefix but the pool cannot take it now (wait, as a refused admission does)."""
        B = self.block_size
        first = num_cached // B
        if first >= (request.num_tokens - 1) // B:
            return None
        hashes = self.kv.lookup_hashes(request)
        if len(hashes) > first and not any(self.contains(hashes[first] + k.tag) for k in self._keys):
            return None  # the cheap probe: the block after the pool's hit is not on disk either
        per_group, hit, hashes = lookup_prefix(self.pool, request, B, self._keys, self.contains)
        if hit <= first:
            return None
        ram: list[KVBlock] = []
        wanted: list[tuple[int, bytes]] = []
        for key, blocks in zip(self._keys, per_group, strict=True):
            for i, b in enumerate(blocks):
                if b is ON_DISK:
                    wanted.append((i, hashes[i] + key.tag))
                elif b is not NULL_BLOCK:
                    ram.append(b)
        if not wanted:
            return None
        needed = sum(1 for b in ram if b.ref_cnt == 0) + len(wanted)
        if self.pool.num_free_blocks() - needed < reserve:
            return False
        self.pool.touch(ram)  # before taking new blocks: that could evict them
        new = self.pool.get_new_blocks(len(wanted))
        self._peak._update_peak()
        pins = self.pool.pins
        for b in ram + new:
            pins[b.block_id] = pins.get(b.block_id, 0) + 1
        load = Load(request, ram + new, [(b, key) for b, (_, key) in zip(new, wanted, strict=True)],
                    [i for i, _ in wanted], first, hit)
        self.loads[load.load_id] = load
        self._new_loads.append(load)
        self.num_loads += 1
        return True

    def take_new_loads(self) -> list[Load]:
        """The loads started since the last call, for the worker (after it took the spills: a target block may
        have been evicted to make room, and its old contents must be copied out first)."""
        loads, self._new_loads = self._new_loads, []
        return loads

    def finish_load(self, load_id: int, ok: list[bool]) -> None:
        """The worker read the load's targets (ok[j]: target j arrived intact)."""
        load = self.loads.pop(load_id)
        for (block, key), good in zip(load.targets, ok, strict=True):
            if good:
                self.pool.cache_full_block(block, key)
        pins = self.pool.pins
        for b in load.pinned:
            pins[b.block_id] -= 1
            if not pins[b.block_id]:
                del pins[b.block_id]
        self.pool.free_blocks(reversed(load.pinned))  # the tail of the prefix is evicted first
        good_blocks = sum(ok)
        self.num_loaded_blocks += good_blocks
        self.num_failed_blocks += len(ok) - good_blocks
        failed = {p for p, good in zip(load.positions, ok, strict=True) if not good}
        end = min(failed, default=load.hit)  # the prefix that is whole now
        if load.request is not None:
            self.disk_hit_tokens += max(0, end - load.first) * self.block_size
            self._loaded.append(load.request)

    def take_loaded(self) -> list[Request]:
        """Requests whose load completed, in completion order: the scheduler puts them back at the queue's head."""
        done, self._loaded = self._loaded, []
        return done

    def cancel(self, requests: Iterable[Request]) -> list[Request]:
        """Aborted or finished requests: those loading (or loaded, not yet back in the queue) are dropped here;
        returns them. A cancelled load still completes (its blocks are being written) and then releases them."""
        ids = {id(r) for r in requests}
        found = [r for r in self._loaded if id(r) in ids]
        self._loaded = [r for r in self._loaded if id(r) not in ids]
        for load in self.loads.values():
            if load.request is not None and id(load.request) in ids:
                found.append(load.request)
                load.request = None
        return found

    @property
    def num_loading(self) -> int:
        """Requests waiting for their blocks (aborted loads excluded)."""
        return sum(1 for load in self.loads.values() if load.request is not None) + len(self._loaded)

    # ---- spills --------------------------------------------------------------------------------------
    def take_spills(self) -> list[tuple[int, bytes]]:
        """(block id, key) of the cached blocks to offer the tier now, evicted ones first. Call after scheduling
        and before the model step writes: an evicted block still holds its old contents until then. A block freed
        since the last call is offered only while free and cached: a block in use may have been reused and
        registered under a new hash before its new K/V was written."""
        evicted, self.pool.evicted = self.pool.evicted, []
        freed, self.pool.freed_cached = self.pool.freed_cached, []
        out = list(evicted)
        seen = {key for _, key in out}
        for b in freed:
            key = b.block_hash
            if b.ref_cnt == 0 and key is not None and key not in seen:
                seen.add(key)
                out.append((b.block_id, key))
        return out

    def cached_free_blocks(self) -> list[tuple[int, bytes]]:
        """Every free block still holding a cached prefix (the shutdown flush writes those the tier lacks)."""
        return [(b.block_id, b.block_hash) for b in self.pool.free_block_queue if b.block_hash is not None]

    def stats(self) -> dict:
        return {"kv_disk_loads": self.num_loads, "kv_disk_loading": self.num_loading,
                "prefix_cache_disk_hits": self.disk_hit_tokens, "kv_disk_loaded_blocks": self.num_loaded_blocks,
                "kv_disk_failed_blocks": self.num_failed_blocks}
