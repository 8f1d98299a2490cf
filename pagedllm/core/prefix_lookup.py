"""Prefix-cache lookup over one or more KV groups sharing a block pool.

Every group caches the same chain of block hashes (kv_cache_utils), each under its own key (the hash + the group's
tag), so that group A's block is never returned for group B. A hit of L blocks is a length every group can serve:
- a full-attention group needs blocks 0..L-1 cached;
- a sliding-window group (window W) needs only the blocks holding keys the next token may read, from position
  L*B - W + 1 on; the blocks before are placeholders (NULL_BLOCK) in its table.
The longest such L never covers the request's last token (the model must produce its logits).
With a second tier (`on_disk`, core/kv_tier.py) a block missing from the pool but held by the tier counts as
available: the lookup then says which blocks of the hit must be loaded (ON_DISK in place of a pool block).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedllm.core.block_pool import NULL_BLOCK, BlockPool, KVBlock
from pagedllm.core.kv_cache_errors import InvalidComputedBlocksError
from pagedllm.core.kv_cache_utils import block_extra_keys, hash_block_tokens, hash_request_blocks
from pagedllm.core.request import Request

# Stands, in a lookup's result, for a block the second tier holds (to be loaded into a pool block). Not a pool block.
ON_DISK = KVBlock(-2)


@dataclass(frozen=True)
class GroupKey:
    tag: bytes  # appended to a block hash to make this group's cache key (b"" for group 0)
    window: int | None


def group_tag(group_id: int) -> bytes:
    return b"" if group_id == 0 else group_id.to_bytes(2, "little")


def first_needed_block(num_tokens: int, window: int | None, block_size: int) -> int:
    """The first block the token at position num_tokens (and every later one) may read; earlier ones are dead."""
    return 0 if window is None else max(0, num_tokens - window + 1) // block_size


def lookup_prefix(pool: BlockPool, request: Request, block_size: int, groups: list[GroupKey],
                  on_disk: Callable[[bytes], bool] | None = None) -> tuple[list[list[KVBlock]], int, list[bytes]]:
    """-> (per group: its hit blocks, NULL_BLOCK where not needed, ON_DISK where on_disk(key) holds a block the
    pool lacks; the hit length in blocks; the block hashes computed on the way, for the allocation that follows).
    Changes no ref counts."""
    B = block_size
    tokens = request.all_token_ids
    max_blocks = max(0, (len(tokens) - 1) // B)
    full = [gi for gi, g in enumerate(groups) if g.window is None]
    hashes: list[bytes] = []
    found: list[list[KVBlock | None]] = [[] for _ in groups]
    parent: bytes | None = None
    for i in range(max_blocks):
        parent = hash_block_tokens(parent, tokens[i * B:(i + 1) * B], block_extra_keys(i, request.cache_salt))
        hashes.append(parent)
        for gi, g in enumerate(groups):
            b = pool.get_cached_block(parent + g.tag)
            if b is None and on_disk is not None and on_disk(parent + g.tag):
                b = ON_DISK
            found[gi].append(b)
        if any(found[gi][i] is None for gi in full):  # no hit can reach past a full group's first miss
            break
    # run[gi][i]: cached blocks of group gi ending at block i (inclusive), back to its last miss
    runs = []
    for col in found:
        run, n = [], 0
        for b in col:
            n = n + 1 if b is not None else 0
            run.append(n)
        runs.append(run)

    def serves(gi: int, num: int) -> bool:
        need = num - first_needed_block(num * B, groups[gi].window, B)
        return need == 0 or runs[gi][num - 1] >= need

    hit = len(hashes)
    while hit > 0 and not all(serves(gi, hit) for gi in range(len(groups))):
        hit -= 1
    out = []
    for gi, g in enumerate(groups):
        first = first_needed_block(hit * B, g.window, B)
        out.append([NULL_BLOCK] * first + found[gi][first:hit])
    return out, hit, hashes


def check_hit_blocks(pool: BlockPool, request: Request, hits: list[KVBlock], known_hashes: list[bytes],
                     block_size: int, tag: bytes) -> list[bytes]:
    """The hashes of the hit blocks' prefix, after checking that every hit block (placeholders aside) is this
    pool's and still holds that prefix (InvalidComputedBlocksError otherwise)."""
    rid = request.request_id
    if len(hits) * block_size > request.num_tokens:
        raise InvalidComputedBlocksError(
            f"{len(hits)} computed blocks cover more than the {request.num_tokens} tokens of {rid!r}")
    hashes = hash_request_blocks(request.all_token_ids[:len(hits) * block_size], block_size, request.cache_salt,
                                 start_hashes=known_hashes[:len(hits)])
    for i, b in enumerate(hits):
        if b is NULL_BLOCK:  # a sliding window's placeholder
            continue
        if not (0 <= b.block_id < pool.num_blocks and pool.blocks[b.block_id] is b):
            raise InvalidComputedBlocksError(f"{b!r} does not belong to this pool")
        if b.block_hash != hashes[i] + tag:
            raise InvalidComputedBlocksError(
                f"computed block {i} of {rid!r} ({b!r}) no longer holds this prefix (evicted since lookup?)")
    return hashes


def extend_block_hashes(request: Request, hashes: list[bytes], num_full: int, block_size: int,
                        known: list[bytes] | tuple = ()) -> None:
    """Append the chain hashes of blocks len(hashes)..num_full-1 (taken from `known`, hashed by a lookup, where
    it has them): only the new blocks, no O(sequence) work per step."""
    B, tokens, salt = block_size, request.all_token_ids, request.cache_salt
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full):
        parent = known[i] if i < len(known) else hash_block_tokens(
            parent, tokens[i * B:(i + 1) * B], block_extra_keys(i, salt))
        hashes.append(parent)
