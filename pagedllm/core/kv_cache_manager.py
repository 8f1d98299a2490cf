"""Block tables per request on top of the BlockPool: prefix-cache lookup, allocation, fork with
copy-on-write, free, and the two layouts (paged, and the contiguous baseline).

Slot of token t of a request = table[t // B] * B + t % B (the worker vectorises this).

Bookkeeping kept per request (keyed by request_id):
- blocks: the block table (logical block i -> KVBlock);
- num_full_blocks: leading blocks whose tokens were all known at an allocation ("full"); with prefix
  caching on they have been hashed and offered to the cache (block_hashes holds their hashes);
- num_tokens: token slots the table has been asked to cover so far.

Slot accounting: `used_slots` counts each physical block once, as the slots its holders have filled (a block
shared by k requests holds the same tokens for all of them); `logical_slots` sums what every table covers, so
`logical_slots - used_slots` is what sharing saves.

Sliding window (`window`, one KV group of a hybrid model, see kv_groups.py): at each allocation, the blocks no
future query of the request can read (every token older than num_computed_tokens - window + 1) go back to the pool,
still cached, and the table holds NULL_BLOCK in their place (num_null leading entries).

Blocks are registered in the cache at allocation time: the worker writes all new K/V of a step before any
attention reads, so a block cached in this step is safe to hit in this same step. The caller must therefore
run every allocation it keeps; `free()` drops the hashes of registered blocks beyond
`request.num_computed_tokens` that nobody else holds (call it before resetting num_computed_tokens).
"""

from __future__ import annotations

from collections import OrderedDict

from pagedllm.core import prefix_lookup as lookup
from pagedllm.core.allocation import AllocationPlan, RequestBlocks
from pagedllm.core.block_pool import NULL_BLOCK, BlockPool, KVBlock, PoolUsage
from pagedllm.core.kv_cache_errors import (  # noqa: F401  (re-exported: callers catch them from here)
    ContextTooLongError,
    DoubleFreeError,
    InconsistentRequestError,
    InvalidComputedBlocksError,
    KVCacheManagerError,
    NegativeTokenCountError,
    RequestExistsError,
    UnknownRequestError,
)
from pagedllm.core.kv_cache_utils import cdiv
from pagedllm.core.kv_groups import capacity_tokens, request_blocks
from pagedllm.core.request import Request

_NO_BLOCKS: list[KVBlock] = []  # shared empty table; never mutated


_FREED_MEMORY = 4096  # recently freed ids kept to tell "freed twice" from "never seen"


class KVCacheManager(PoolUsage):
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 kv_layout: str = "paged", max_model_len: int | None = None, window: int | None = None,
                 block_pool: BlockPool | None = None, group_id: int = 0) -> None:
        """window: tokens a sliding-window group's layers attend to (None: full attention). block_pool: a pool
        shared with the other KV groups of a hybrid model (group_id tells their cached blocks apart)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if kv_layout not in ("paged", "contiguous"):
            raise ValueError(f"kv_layout must be 'paged' or 'contiguous', got {kv_layout!r}")
        if kv_layout == "contiguous":
            if max_model_len is None or max_model_len < 1:
                raise ValueError("kv_layout='contiguous' needs max_model_len >= 1")
            enable_prefix_caching = False  # the baseline reserves private contiguous regions
        self.block_size = block_size
        self.kv_layout = kv_layout
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        if window is not None and (window < 1 or kv_layout == "contiguous"):
            raise ValueError(f"a sliding window needs the paged layout and window >= 1, got {window!r}")
        self.window = window
        self.block_pool = block_pool or BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        num_blocks = self.block_pool.num_blocks
        self._key = lookup.GroupKey(lookup.group_tag(group_id), window)
        self.num_held_blocks = 0  # blocks in use by this manager's tables (each counted once)
        self._blocks_per_reservation = cdiv(max_model_len, block_size) if kv_layout == "contiguous" else 0
        self._requests: dict[str, RequestBlocks] = {}
        self._freed: OrderedDict[str, None] = OrderedDict()
        # The hashes computed by the last get_computed_blocks, reused by the allocate_slots that follows.
        self._lookup_memo: tuple[Request, int, list[bytes]] | None = None
        self._fill = [0] * num_blocks  # slots holding tokens, per physical block in use
        self._used_slots = 0  # sum of _fill
        self._logical_slots = 0  # sum of num_tokens over tables
        self.peak_used_blocks = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prefix_cache_block_queries = 0
        self.prefix_cache_block_hits = 0

    def request_blocks(self, num_tokens: int, step_tokens: int) -> int:
        """Blocks a request of num_tokens holds at most (step_tokens new tokens per step)."""
        return request_blocks([self.window], self.block_size, num_tokens, step_tokens)

    def capacity_tokens(self, step_tokens: int, limit: int) -> int:
        """Tokens one request can hold with the whole cache to itself (step_tokens new tokens per step; at most
        limit where a sliding window makes the need bounded)."""
        if self.window is None:
            return self.num_blocks * self.block_size
        return capacity_tokens([self.window], self.block_size, self.num_blocks, step_tokens, limit)

    # ---- lookup ------------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest prefix hit (prefix_lookup.py: cached full blocks from the start; for a sliding window only those
        the next token may read, NULL_BLOCK before), never covering the last token. Changes no ref counts."""
        if not self.enable_prefix_caching:
            return [], 0
        (blocks,), num_hit, hashes = lookup.lookup_prefix(self.block_pool, request, self.block_size, [self._key])
        self.set_lookup_memo(request, hashes)
        return blocks, num_hit * self.block_size

    def group_keys(self) -> list[lookup.GroupKey]:
        """The cache key (tag, window) of each KV group: here the one group."""
        return [self._key]

    def lookup_hashes(self, request: Request) -> list[bytes]:
        """The block hashes the last lookup of this request computed (empty if another lookup came since)."""
        return self._memo_hashes(request)

    def set_lookup_memo(self, request: Request, hashes: list[bytes]) -> None:
        """Remember the hashes a lookup computed, for the allocate_slots of the same request that follows."""
        self._lookup_memo = (request, request.num_tokens, hashes)

    # ---- allocation --------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] | None = None,
                       num_reserved_blocks: int = 0) -> list[tuple[int, int]] | None:
        """Make the table cover num_computed_tokens + len(new_computed_blocks) * B + num_new_tokens tokens.
        Returns the copy-on-write (src_block_id, dst_block_id) pairs the worker must copy before writing,
        or None (and changes nothing but giving back blocks that fell out of a sliding window) if that would
        leave fewer than num_reserved_blocks free blocks."""
        if num_reserved_blocks < 0:
            raise NegativeTokenCountError(f"num_reserved_blocks must be >= 0, got {num_reserved_blocks}")
        plan = self.plan_allocation(request, num_new_tokens, new_computed_blocks)
        self.release_outside_window(request)
        if self.block_pool.free_block_queue.num_free_blocks - plan.needed < num_reserved_blocks:
            return None
        self.take_hits(plan)
        return self.commit_allocation(plan)

    # The three phases of allocate_slots, separate so that a hybrid manager can check the blocks all its groups
    # need together and take every group's prefix hits before any group takes new blocks (which could evict them).
    def plan_allocation(self, request: Request, num_new_tokens: int,
                        new_computed_blocks: list[KVBlock] | None = None) -> AllocationPlan:
        """Validate and count; no change."""
        if num_new_tokens < 0:
            raise NegativeTokenCountError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        B = self.block_size
        rid = request.request_id
        state = self._requests.get(rid)
        cur_blocks = state.blocks if state is not None else _NO_BLOCKS
        num_cur = len(cur_blocks)
        num_computed = request.num_computed_tokens
        if num_computed < 0 or num_computed > num_cur * B:
            raise InconsistentRequestError(
                f"request {rid!r} has num_computed_tokens={num_computed} but its block table holds "
                f"{num_cur * B} token slots")
        known_hashes = state.block_hashes if state is not None else self._memo_hashes(request)
        if new_computed_blocks:
            ncb = list(new_computed_blocks)
            known_hashes = self._check_computed_blocks(request, state, ncb, known_hashes)
            num_revived = sum(1 for b in ncb if b.ref_cnt == 0 and b is not NULL_BLOCK)  # cached free blocks
        else:
            ncb, num_revived = _NO_BLOCKS, 0
        total = num_computed + len(ncb) * B + num_new_tokens
        num_table_blocks = cdiv(total, B)

        # How many blocks this needs from the free queue.
        if self.kv_layout == "contiguous":
            if total > self._blocks_per_reservation * B:
                raise ContextTooLongError(
                    f"request {rid!r} needs {total} token slots, more than max_model_len={self.max_model_len}")
            num_new_blocks = self._blocks_per_reservation if state is None else 0
        else:
            num_new_blocks = max(0, num_table_blocks - num_cur - len(ncb))
        cow_index: list[int] = []
        if num_new_tokens > 0 and num_cur:
            # Blocks the new tokens write into, shared and not yet full: copy first. Full blocks hold the
            # same tokens for every holder, so they are never copied.
            for i in range(max(num_computed // B, state.num_full_blocks), min(num_cur, num_table_blocks)):
                if cur_blocks[i].ref_cnt > 1:
                    cow_index.append(i)
        return AllocationPlan(request, state, num_new_tokens, ncb, known_hashes, total, num_new_blocks, cow_index,
                     num_new_blocks + len(cow_index) + num_revived, state is None)

    def release_outside_window(self, request: Request) -> None:
        """Sliding window: give back the blocks before the first one the next query may read."""
        state = self._requests.get(request.request_id)
        if self.window is None or state is None:
            return
        end = min(lookup.first_needed_block(request.num_computed_tokens, self.window, self.block_size), len(state.blocks))
        if end <= state.num_null:
            return
        blocks = state.blocks
        self._release(blocks[i] for i in range(end - 1, state.num_null - 1, -1))  # tail first, as free()
        for i in range(state.num_null, end):
            blocks[i] = NULL_BLOCK
        self._logical_slots -= (end - state.num_null) * self.block_size
        state.num_null = end

    def take_hits(self, plan: AllocationPlan) -> None:
        """Hold the prefix-cache hits (before any new block is taken: that could evict them)."""
        if plan.state is not None:
            return
        rid = plan.request.request_id
        plan.state = self._requests[rid] = RequestBlocks()
        self._freed.pop(rid, None)
        self._lookup_memo = None
        ncb = plan.hits
        if ncb:
            live = [b for b in ncb if b is not NULL_BLOCK]
            self.block_pool.touch(live)
            table_refs = self.block_pool.table_refs
            self.num_held_blocks += sum(1 for b in live if table_refs(b) == 1)
            plan.state.blocks.extend(ncb)
            plan.state.block_hashes = list(plan.known_hashes[:len(ncb)])
            plan.state.num_full_blocks = plan.state.num_hit_blocks = len(ncb)
            plan.state.num_null = len(ncb) - len(live)
            self._logical_slots -= plan.state.num_null * self.block_size

    def commit_allocation(self, plan: AllocationPlan) -> list[tuple[int, int]]:
        """Take the new blocks and copy-on-write targets (the caller checked that enough are free)."""
        B = self.block_size
        pool = self.block_pool
        request, state = plan.request, plan.state
        self._lookup_memo = None
        copies: list[tuple[int, int]] = []
        if plan.cow_index:
            for i, dst in zip(plan.cow_index, pool.get_new_blocks(len(plan.cow_index)), strict=True):
                src = state.blocks[i]
                self._release((src,))  # ref_cnt > 1: stays in use by the others
                state.blocks[i] = dst
                copies.append((src.block_id, dst.block_id))
        if plan.num_new_blocks:
            state.blocks.extend(pool.get_new_blocks(plan.num_new_blocks))
        self.num_held_blocks += plan.num_new_blocks + len(plan.cow_index)
        total = plan.total
        if total > state.num_tokens:
            self._logical_slots += total - state.num_tokens
            state.num_tokens = total
        self._cover(state, request.num_computed_tokens // B)
        if min(total, len(request.all_token_ids)) // B > state.num_full_blocks:
            self._register_full_blocks(request, state, total, plan.known_hashes)
        if plan.first_allocation and self.enable_prefix_caching and request.num_preemptions == 0:
            num_prompt = request.num_prompt_tokens  # counted once per request, like vLLM: prompt tokens
            ncb = plan.hits
            self.prefix_cache_queries += num_prompt
            self.prefix_cache_hits += min(len(ncb) * B, num_prompt)
            self.prefix_cache_block_queries += max(0, (num_prompt - 1) // B)
            self.prefix_cache_block_hits += min(len(ncb), max(0, (num_prompt - 1) // B))
        if plan.needed:
            self._update_peak()
        return copies

    def _cover(self, state: RequestBlocks, first_block: int) -> None:
        """Raise the fill of the table's blocks from first_block on to what the table now covers."""
        B, fill, blocks = self.block_size, self._fill, state.blocks
        for i in range(max(first_block, state.num_null), min(len(blocks), cdiv(state.num_tokens, B))):
            n = min(B, state.num_tokens - i * B)
            bid = blocks[i].block_id
            if n > fill[bid]:
                self._used_slots += n - fill[bid]
                fill[bid] = n

    def _release(self, blocks) -> None:
        """Ref counts down (in the order given; placeholders skipped); a block nobody holds any more holds no
        used slots."""
        blocks = [b for b in blocks if b is not NULL_BLOCK]
        self.block_pool.free_blocks(blocks)
        fill = self._fill
        table_refs = self.block_pool.table_refs  # (a block the disk tier pins is held by no table)
        for b in blocks:
            if table_refs(b) == 0:
                self.num_held_blocks -= 1
                self._used_slots -= fill[b.block_id]
                fill[b.block_id] = 0

    def _memo_hashes(self, request: Request) -> list[bytes]:
        memo = self._lookup_memo
        if memo is not None and memo[0] is request and memo[1] == request.num_tokens:
            return memo[2]
        return []

    def _check_computed_blocks(self, request: Request, state: RequestBlocks | None, ncb: list[KVBlock],
                               known_hashes: list[bytes]) -> list[bytes]:
        rid = request.request_id
        if not self.enable_prefix_caching:
            raise InvalidComputedBlocksError("new_computed_blocks given but prefix caching is off")
        if state is not None:
            raise InvalidComputedBlocksError(
                f"new_computed_blocks are only accepted at a request's first allocation ({rid!r} has blocks)")
        return lookup.check_hit_blocks(self.block_pool, request, ncb, known_hashes, self.block_size, self._key.tag)

    def _register_full_blocks(self, request: Request, state: RequestBlocks, total: int,
                              known_hashes: list[bytes]) -> None:
        """Blocks whose tokens are now all known become full; with caching they are hashed and cached."""
        B = self.block_size
        n_full = min(total, request.num_tokens) // B
        if n_full <= state.num_full_blocks:
            return
        if self.enable_prefix_caching:
            hashes = state.block_hashes  # one per full block; extended in place (fork copies the list)
            lookup.extend_block_hashes(request, hashes, n_full, B, known_hashes if known_hashes is not hashes else ())
            cache = self.block_pool.cache_full_block
            blocks = state.blocks
            tag = self._key.tag
            for i in range(max(state.num_full_blocks, state.num_null), n_full):
                cache(blocks[i], hashes[i] + tag)
        state.num_full_blocks = n_full

    # ---- sharing and release ----------------------------------------------------------------------
    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent (ref counts up); writes into a shared partly
        filled block are copied on write by the next allocate_slots."""
        ps = self._requests.get(parent.request_id)
        if ps is None:
            raise self._unknown(parent.request_id, "fork from")
        if child.request_id in self._requests:
            raise RequestExistsError(f"cannot fork into {child.request_id!r}: it already holds blocks")
        self.block_pool.touch(ps.blocks[ps.num_null:])  # all in use already: no free block is taken
        self._requests[child.request_id] = RequestBlocks(
            list(ps.blocks), list(ps.block_hashes), ps.num_full_blocks, ps.num_tokens, ps.num_hit_blocks,
            ps.num_null)
        self._freed.pop(child.request_id, None)
        self._logical_slots += ps.num_tokens - ps.num_null * self.block_size

    def free(self, request: Request) -> None:
        """Ref counts down, tail blocks first, so that the LRU queue evicts a request's tail first.
        Cached blocks stay findable until reused."""
        rid = request.request_id
        state = self._requests.get(rid)
        if state is None:
            raise self._unknown(rid, "free")
        self._release(reversed(state.blocks))
        del self._requests[rid]
        self._logical_slots -= state.num_tokens - state.num_null * self.block_size
        self._freed[rid] = None
        if len(self._freed) > _FREED_MEMORY:
            self._freed.popitem(last=False)
        # Full blocks past the computed prefix (and past the prefix-cache hits) were registered by an
        # allocation of this request whose K/V may never have been written: if nobody else holds them,
        # forget their hashes.
        start = max(request.num_computed_tokens // self.block_size, state.num_hit_blocks)
        for b in state.blocks[start:state.num_full_blocks]:
            if self.block_pool.table_refs(b) == 0 and b.block_hash is not None:
                self.block_pool.evict_cached_block(b)

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Roll the table back to cover num_tokens tokens (speculative decoding: drop rejected draft tokens).
        Blocks past the new end go back to the pool; a partly filled last block keeps only its first slots.
        Draft tokens are never in request.all_token_ids at allocation, so no dropped block was hashed."""
        rid = request.request_id
        state = self._requests.get(rid)
        if state is None:
            raise self._unknown(rid, "truncate")
        if num_tokens < 0:
            raise NegativeTokenCountError(f"num_tokens must be >= 0, got {num_tokens}")
        if num_tokens >= state.num_tokens:
            return
        B = self.block_size
        keep = cdiv(num_tokens, B)
        if self.kv_layout == "paged" and keep < len(state.blocks):
            dropped = state.blocks[keep:]
            del state.blocks[keep:]
            if state.num_full_blocks > keep:  # cannot happen for draft tokens; keep the bookkeeping exact
                for b in dropped[:state.num_full_blocks - keep]:
                    if b.ref_cnt == 1:
                        self.block_pool.evict_cached_block(b)
                state.num_full_blocks = keep
                del state.block_hashes[keep:]
            self._release(reversed(dropped))
        self._logical_slots -= state.num_tokens - num_tokens
        state.num_tokens = num_tokens
        if num_tokens % B and keep <= len(state.blocks):
            last = state.blocks[keep - 1]
            if last.ref_cnt == 1 and self._fill[last.block_id] > num_tokens % B:
                self._used_slots -= self._fill[last.block_id] - num_tokens % B
                self._fill[last.block_id] = num_tokens % B
        for b in state.blocks[keep:]:  # contiguous reservations: blocks past the end hold nothing now
            if self._fill[b.block_id]:
                self._used_slots -= self._fill[b.block_id]
                self._fill[b.block_id] = 0

    def _unknown(self, rid: str, action: str) -> UnknownRequestError:
        if rid in self._freed:
            return DoubleFreeError(f"cannot {action} request {rid!r}: it was already freed")
        return UnknownRequestError(f"cannot {action} request {rid!r}: it holds no blocks")

    # ---- queries -----------------------------------------------------------------------------------
    def has_request(self, request: Request) -> bool:
        return request.request_id in self._requests

    def get_group_block_ids(self, request: Request) -> list[list[int]]:
        """One block table per KV group (HybridKVCacheManager's interface): here the one table."""
        return [self.get_block_ids(request)]

    def get_block_ids(self, request: Request) -> list[int]:
        state = self._requests.get(request.request_id)
        if state is None:
            raise self._unknown(request.request_id, "get the blocks of")
        return [b.block_id for b in state.blocks]

    def stats(self) -> dict:
        """used_slots: token slots holding a token (num_computed_tokens + tokens allocated this step) in the
        blocks in use, each physical block counted once (<= allocated_slots = blocks in use x B).
        logical_slots: the same summed over block tables (a block shared by k requests counts k times).
        Prefix stats count each request once, at its first admission (not again after a preemption), in
        prompt tokens: queries = prompt tokens, hits = prompt tokens served from the cache; block queries =
        full prompt blocks a lookup could hit ((num_prompt_tokens - 1) // B), block hits = cached blocks."""
        used_blocks = self.num_used_blocks()
        return {
            "num_blocks": self.block_pool.num_blocks,
            "num_free_blocks": self.block_pool.num_free_blocks(),
            "block_size": self.block_size,
            "used_slots": self._used_slots,
            "logical_slots": self._logical_slots,
            "allocated_slots": used_blocks * self.block_size,
            "peak_used_blocks": self.peak_used_blocks,
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "prefix_cache_block_queries": self.prefix_cache_block_queries,
            "prefix_cache_block_hits": self.prefix_cache_block_hits,
            "num_cached_blocks": len(self.block_pool.cached_block_hash_to_block),
            "num_evictions": self.block_pool.num_evictions,
        }

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; only possible when no block is in use."""
        self._lookup_memo = None
        return self.block_pool.reset_prefix_cache()

    @property
    def used_slots(self) -> int:
        return self._used_slots

    def reset_peak(self) -> None:
        """Start a new peak-blocks measurement from the blocks in use now."""
        self.peak_used_blocks = self.num_used_blocks()

    def _update_peak(self) -> None:
        used = self.num_used_blocks()
        if used > self.peak_used_blocks:
            self.peak_used_blocks = used
