"""The KV cache manager's plain data: one request's block table and bookkeeping, and an allocation planned (and
validated) before any change is made (kv_cache_manager.py documents the fields' invariants)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.core.block_pool import KVBlock
from pagedllm.core.request import Request


@dataclass
class RequestBlocks:
    blocks: list[KVBlock] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of the first num_full_blocks (caching on)
    num_full_blocks: int = 0
    num_tokens: int = 0
    num_hit_blocks: int = 0  # leading blocks taken from the prefix cache (their K/V existed already)
    num_null: int = 0  # leading NULL_BLOCK entries: blocks that fell out of a sliding window


@dataclass
class AllocationPlan:
    """What one allocate_slots will do, computed (and validated) before any change."""

    request: Request
    state: RequestBlocks | None
    num_new_tokens: int
    hits: list[KVBlock]  # new_computed_blocks
    known_hashes: list[bytes]
    total: int  # tokens the table covers afterwards
    num_new_blocks: int
    cow_index: list[int]
    needed: int  # blocks taken from the free queue
    first_allocation: bool
