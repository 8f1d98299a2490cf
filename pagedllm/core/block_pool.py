"""Physical KV blocks: ref counts, an O(1) LRU free queue and the prefix-cache hash map.

Pure Python (no torch): a block is an id plus bookkeeping; the tensors live in the worker.

A block with ref_cnt 0 sits in the free queue. If it also carries a block hash, its contents are still valid
and it stays findable through the hash map until it is taken for new data (eviction drops the hash then).
The queue head is the least recently freed block, so eviction is LRU.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass


class NoFreeBlocksError(RuntimeError):
    """More blocks were asked for than are free. Nothing was changed."""


class BlockPoolError(ValueError):
    """Bad input to the block pool (negative count, foreign block, freeing a free block). Nothing changed."""


@dataclass(eq=False, slots=True)
class KVBlock:
    """One physical block. `eq=False`: blocks compare (and hash) by identity."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once full and cached
    prev_free: KVBlock | None = None  # free-queue links (doubly linked list)
    next_free: KVBlock | None = None

    def __repr__(self) -> str:  # the links would recurse through the whole queue
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


# The placeholder a sliding-window group's block table holds where a block fell out of the window and went back to
# the pool. Not a pool block (touching or freeing it raises); its id 0 is a valid index that no kernel reads (the
# window starts past it), so block tables stay rectangular int32 arrays.
NULL_BLOCK = KVBlock(0)


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks themselves: O(1) popleft, append and remove
    from the middle (a cache hit on a free block takes it out wherever it is). Two sentinels avoid
    special cases at the ends. Head = least recently freed = next to be evicted."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self.num_free_blocks = len(blocks)
        prev = self._head
        for b in blocks:
            prev.next_free = b
            b.prev_free = prev
            prev = b
        prev.next_free = self._tail
        self._tail.prev_free = prev

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVBlock:
        first = self._head.next_free
        if first is self._tail:
            raise NoFreeBlocksError("no free blocks left")
        nxt = first.next_free
        self._head.next_free = nxt
        nxt.prev_free = self._head
        first.prev_free = first.next_free = None
        self.num_free_blocks -= 1
        return first

    def popleft_n(self, n: int) -> list[KVBlock]:
        """Detach the first n blocks in one splice."""
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out: list[KVBlock] = []
        if n <= 0:
            return out
        cur = self._head.next_free
        for _ in range(n):
            out.append(cur)
            nxt = cur.next_free
            cur.prev_free = cur.next_free = None
            cur = nxt
        self._head.next_free = cur
        cur.prev_free = self._head
        self.num_free_blocks -= n
        return out

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise BlockPoolError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def __iter__(self) -> Iterator[KVBlock]:
        cur = self._head.next_free
        while cur is not self._tail:
            yield cur
            cur = cur.next_free


class BlockPool:
    """Physical block ids 0..num_blocks-1 with ref counts, the LRU free queue and block_hash -> block."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise BlockPoolError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVBlock] = [KVBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        # One block per hash: a block whose hash is already cached elsewhere stays uncached (a duplicate).
        self.cached_block_hash_to_block: dict[bytes, KVBlock] = {}
        self.num_evictions = 0
        # A second tier of the prefix cache (core/kv_tier.py) sets these lists to hear of cached blocks that are
        # evicted (block_id, hash: the contents are still intact until the next model step writes) and of cached
        # blocks that became free (spill candidates). None: nobody listens.
        self.evicted: list[tuple[int, bytes]] | None = None
        self.freed_cached: list[KVBlock] | None = None
        # block_id -> references held outside any block table (the tier's loads pin blocks): a manager counts a
        # block as held by its tables while ref_cnt - pins > 0
        self.pins: dict[int, int] = {}

    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0, cached or not."""
        return self.free_block_queue.num_free_blocks

    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (evictable, reusable on a hit)."""
        return sum(1 for b in self.cached_block_hash_to_block.values() if b.ref_cnt == 0)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take n blocks from the LRU head for new data (dropping their cached hashes); ref_cnt = 1."""
        if n < 0:
            raise BlockPoolError(f"cannot allocate a negative number of blocks ({n})")
        blocks = self.free_block_queue.popleft_n(n)  # raises NoFreeBlocksError before any change
        cache = self.cached_block_hash_to_block
        evicted = self.evicted
        for b in blocks:
            if b.block_hash is not None:  # eviction: the old contents are about to be overwritten
                if evicted is not None:
                    evicted.append((b.block_id, b.block_hash))
                del cache[b.block_hash]
                b.block_hash = None
                self.num_evictions += 1
            b.ref_cnt = 1
        return blocks

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """ref_cnt += 1 for each block; a free (cached) block leaves the free queue."""
        blocks = list(blocks)
        self._check_own(blocks)
        queue = self.free_block_queue
        for b in blocks:
            if b.ref_cnt == 0:
                queue.remove(b)
            b.ref_cnt += 1

    def cache_full_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Make a full block findable by its hash. No-op if caching is off, the block is already cached,
        or another block already holds this hash (the first one stays the cached copy)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_block_hash_to_block:
            return
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block

    def evict_cached_block(self, block: KVBlock) -> None:
        """Forget a block's hash (its contents are no longer trusted); it stays where it is."""
        if block.block_hash is not None:
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """ref_cnt -= 1; blocks reaching 0 go to the free-queue tail in the order given (cached ones
        keep their hash). Pass a request's blocks in reverse so that its tail is evicted first."""
        blocks = list(blocks)
        for b in blocks:  # validate first: an error leaves the pool unchanged
            if b.ref_cnt <= 0:
                raise BlockPoolError(f"block {b.block_id} is already free (ref_cnt={b.ref_cnt})")
        append = self.free_block_queue.append
        freed = self.freed_cached
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                append(b)
                if freed is not None and b.block_hash is not None:
                    freed.append(b)

    def table_refs(self, block: KVBlock) -> int:
        """References to the block from block tables (its ref count less the pins)."""
        pins = self.pins
        return block.ref_cnt - pins.get(block.block_id, 0) if pins else block.ref_cnt

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only when no block is in use (returns False otherwise)."""
        if self.num_free_blocks() != self.num_blocks:
            return False
        for b in self.cached_block_hash_to_block.values():
            b.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def _check_own(self, blocks: list[KVBlock]) -> None:
        own = self.blocks
        for b in blocks:
            if not (0 <= b.block_id < self.num_blocks and own[b.block_id] is b):
                raise BlockPoolError(f"{b!r} does not belong to this pool")


class PoolUsage:
    """What a KV cache manager (plain or hybrid) answers from its block pool alone."""

    block_pool: BlockPool

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks()

    def num_used_blocks(self) -> int:
        return self.block_pool.num_blocks - self.block_pool.num_free_blocks()

    def usage(self) -> float:
        """Fraction of blocks in use (ref_cnt > 0); free cached blocks count as free."""
        return self.num_used_blocks() / self.block_pool.num_blocks
