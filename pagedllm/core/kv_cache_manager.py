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

Blocks are registered in the cache at allocation time: the worker writes all new K/V of a step before any
attention reads, so a block cached in this step is safe to hit in this same step. The caller must therefore
run every allocation it keeps; `free()` drops the hashes of registered blocks beyond
`request.num_computed_tokens` that nobody else holds (call it before resetting num_computed_tokens).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from pagedllm.core.block_pool import BlockPool, KVBlock
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
from pagedllm.core.kv_cache_utils import block_extra_keys, cdiv, hash_block_tokens, hash_request_blocks
from pagedllm.core.request import Request

_NO_BLOCKS: list[KVBlock] = []  # shared empty table; never mutated


@dataclass
class _RequestBlocks:
    blocks: list[KVBlock] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of the first num_full_blocks (caching on)
    num_full_blocks: int = 0
    num_tokens: int = 0
    num_hit_blocks: int = 0  # leading blocks taken from the prefix cache (their K/V existed already)


_FREED_MEMORY = 4096  # recently freed ids kept to tell "freed twice" from "never seen"


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 kv_layout: str = "paged", max_model_len: int | None = None) -> None:
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
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._blocks_per_reservation = cdiv(max_model_len, block_size) if kv_layout == "contiguous" else 0
        self._requests: dict[str, _RequestBlocks] = {}
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

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    # ---- lookup ------------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks from the start of request.all_token_ids, never covering the
        last token (the model must produce its logits). Changes no ref counts."""
        if not self.enable_prefix_caching:
            return [], 0
        B = self.block_size
        tokens = request.all_token_ids
        max_blocks = max(0, (len(tokens) - 1) // B)
        pool = self.block_pool
        hashes: list[bytes] = []
        blocks: list[KVBlock] = []
        parent: bytes | None = None
        for i in range(max_blocks):  # hash only until the first miss
            parent = hash_block_tokens(parent, tokens[i * B:(i + 1) * B], block_extra_keys(i, request.cache_salt))
            hashes.append(parent)
            block = pool.get_cached_block(parent)
            if block is None:
                break
            blocks.append(block)
        self._lookup_memo = (request, len(tokens), hashes)
        return blocks, len(blocks) * B

    # ---- allocation --------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] | None = None,
                       num_reserved_blocks: int = 0) -> list[tuple[int, int]] | None:
        """Make the table cover num_computed_tokens + len(new_computed_blocks) * B + num_new_tokens tokens.
        Returns the copy-on-write (src_block_id, dst_block_id) pairs the worker must copy before writing,
        or None (and changes nothing) if that would leave fewer than num_reserved_blocks free blocks."""
        if num_new_tokens < 0:
            raise NegativeTokenCountError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if num_reserved_blocks < 0:
            raise NegativeTokenCountError(f"num_reserved_blocks must be >= 0, got {num_reserved_blocks}")
        B = self.block_size
        pool = self.block_pool
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
            num_revived = sum(1 for b in ncb if b.ref_cnt == 0)  # cached free blocks leave the free queue
        else:
            ncb, num_revived = _NO_BLOCKS, 0
        total = num_computed + len(ncb) * B + num_new_tokens
        num_table_blocks = cdiv(total, B)

        # How many blocks this needs from the free queue (all checks before any change).
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
        needed = num_new_blocks + len(cow_index) + num_revived
        if pool.free_block_queue.num_free_blocks - needed < num_reserved_blocks:
            return None

        # Commit.
        first_allocation = state is None
        if state is None:
            state = self._requests[rid] = _RequestBlocks()
            self._freed.pop(rid, None)
        self._lookup_memo = None
        if ncb:
            pool.touch(ncb)  # before get_new_blocks, so that they cannot be evicted by it
            state.blocks.extend(ncb)
            state.block_hashes = list(known_hashes[:len(ncb)])
            state.num_full_blocks = state.num_hit_blocks = len(ncb)
        copies: list[tuple[int, int]] = []
        if cow_index:
            for i, dst in zip(cow_index, pool.get_new_blocks(len(cow_index)), strict=True):
                src = state.blocks[i]
                self._release((src,))  # ref_cnt > 1: stays in use by the others
                state.blocks[i] = dst
                copies.append((src.block_id, dst.block_id))
        if num_new_blocks:
            state.blocks.extend(pool.get_new_blocks(num_new_blocks))
        if total > state.num_tokens:
            self._logical_slots += total - state.num_tokens
            state.num_tokens = total
        self._cover(state, num_computed // B)
        if min(total, len(request.all_token_ids)) // B > state.num_full_blocks:
            self._register_full_blocks(request, state, total, known_hashes)
        if first_allocation and self.enable_prefix_caching and request.num_preemptions == 0:
            num_prompt = request.num_prompt_tokens  # counted once per request, like vLLM: prompt tokens
            self.prefix_cache_queries += num_prompt
            self.prefix_cache_hits += min(len(ncb) * B, num_prompt)
            self.prefix_cache_block_queries += max(0, (num_prompt - 1) // B)
            self.prefix_cache_block_hits += min(len(ncb), max(0, (num_prompt - 1) // B))
        if needed:
            self._update_peak()
        return copies

    def _cover(self, state: _RequestBlocks, first_block: int) -> None:
        """Raise the fill of the table's blocks from first_block on to what the table now covers."""
        B, fill, blocks = self.block_size, self._fill, state.blocks
        for i in range(first_block, min(len(blocks), cdiv(state.num_tokens, B))):
            n = min(B, state.num_tokens - i * B)
            bid = blocks[i].block_id
            if n > fill[bid]:
                self._used_slots += n - fill[bid]
                fill[bid] = n

    def _release(self, blocks) -> None:
        """Ref counts down (in the order given); a block nobody holds any more holds no used slots."""
        blocks = list(blocks)
        self.block_pool.free_blocks(blocks)
        fill = self._fill
        for b in blocks:
            if b.ref_cnt == 0:
                self._used_slots -= fill[b.block_id]
                fill[b.block_id] = 0

    def _memo_hashes(self, request: Request) -> list[bytes]:
        memo = self._lookup_memo
        if memo is not None and memo[0] is request and memo[1] == request.num_tokens:
            return memo[2]
        return []

    def _check_computed_blocks(self, request: Request, state: _RequestBlocks | None, ncb: list[KVBlock],
                               known_hashes: list[bytes]) -> list[bytes]:
        rid = request.request_id
        if not self.enable_prefix_caching:
            raise InvalidComputedBlocksError("new_computed_blocks given but prefix caching is off")
        if state is not None:
            raise InvalidComputedBlocksError(
                f"new_computed_blocks are only accepted at a request's first allocation ({rid!r} has blocks)")
        B = self.block_size
        if len(ncb) * B > request.num_tokens:
            raise InvalidComputedBlocksError(
                f"{len(ncb)} computed blocks cover more than the {request.num_tokens} tokens of {rid!r}")
        hashes = hash_request_blocks(request.all_token_ids[:len(ncb) * B], B, request.cache_salt,
                                     start_hashes=known_hashes[:len(ncb)])
        pool_blocks = self.block_pool.blocks
        for i, b in enumerate(ncb):
            if not (0 <= b.block_id < len(pool_blocks) and pool_blocks[b.block_id] is b):
                raise InvalidComputedBlocksError(f"{b!r} does not belong to this pool")
            if b.block_hash != hashes[i]:
                raise InvalidComputedBlocksError(
                    f"computed block {i} of {rid!r} ({b!r}) no longer holds this prefix (evicted since lookup?)")
        return hashes

    def _register_full_blocks(self, request: Request, state: _RequestBlocks, total: int,
                              known_hashes: list[bytes]) -> None:
        """Blocks whose tokens are now all known become full; with caching they are hashed and cached."""
        B = self.block_size
        n_full = min(total, request.num_tokens) // B
        if n_full <= state.num_full_blocks:
            return
        if self.enable_prefix_caching:
            hashes = state.block_hashes  # one per full block; extended in place (fork copies the list)
            reuse = known_hashes if known_hashes is not hashes else ()  # hashed by the lookup already
            tokens, salt = request.all_token_ids, request.cache_salt
            parent = hashes[-1] if hashes else None
            for i in range(len(hashes), n_full):  # only the new blocks: no O(sequence) work per step
                parent = reuse[i] if i < len(reuse) else hash_block_tokens(
                    parent, tokens[i * B:(i + 1) * B], block_extra_keys(i, salt))
                hashes.append(parent)
            cache = self.block_pool.cache_full_block
            blocks = state.blocks
            for i in range(state.num_full_blocks, n_full):
                cache(blocks[i], hashes[i])
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
        self.block_pool.touch(ps.blocks)  # all in use already: no free block is taken
        self._requests[child.request_id] = _RequestBlocks(
            list(ps.blocks), list(ps.block_hashes), ps.num_full_blocks, ps.num_tokens, ps.num_hit_blocks)
        self._freed.pop(child.request_id, None)
        self._logical_slots += ps.num_tokens

    def free(self, request: Request) -> None:
        """Ref counts down, tail blocks first, so that the LRU queue evicts a request's tail first.
        Cached blocks stay findable until reused."""
        rid = request.request_id
        state = self._requests.get(rid)
        if state is None:
            raise self._unknown(rid, "free")
        self._release(reversed(state.blocks))
        del self._requests[rid]
        self._logical_slots -= state.num_tokens
        self._freed[rid] = None
        if len(self._freed) > _FREED_MEMORY:
            self._freed.popitem(last=False)
        # Full blocks past the computed prefix (and past the prefix-cache hits) were registered by an
        # allocation of this request whose K/V may never have been written: if nobody else holds them,
        # forget their hashes.
        start = max(request.num_computed_tokens // self.block_size, state.num_hit_blocks)
        for b in state.blocks[start:state.num_full_blocks]:
            if b.ref_cnt == 0 and b.block_hash is not None:
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

    def get_block_ids(self, request: Request) -> list[int]:
        state = self._requests.get(request.request_id)
        if state is None:
            raise self._unknown(request.request_id, "get the blocks of")
        return [b.block_id for b in state.blocks]

    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks()

    def num_used_blocks(self) -> int:
        return self.block_pool.num_blocks - self.block_pool.num_free_blocks()

    def usage(self) -> float:
        """Fraction of blocks in use (ref_cnt > 0); free cached blocks count as free."""
        return self.num_used_blocks() / self.block_pool.num_blocks

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
