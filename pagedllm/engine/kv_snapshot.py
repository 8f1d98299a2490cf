"""A picture of the KV block pool for the live map page (GET /kv): who holds each block, which free blocks still
hold a cached prefix (and how soon the LRU evicts them), which are shared. Built in the engine loop thread
between two steps; one pass over the blocks and one over the free queue, no tensors."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (llm_engine imports torch: only the type here)
    from pagedllm.engine.llm_engine import LLMEngine

FREE, CACHED = -1, -2  # cell codes; a code >= 0 is an index into "requests"


def kv_snapshot(engine: LLMEngine) -> dict[str, Any]:
    """JSON-ready: cells[i] = FREE | CACHED | request index; pos[i] = the block's index in that request's table
    (its tokens are pos*block_size ..); age[i] = place in the eviction order (0 = next) for free blocks;
    shared = ids of blocks with ref count > 1; stats = kv_cache_stats() of the same moment.
    The whole engine, not only its KV manager: the stats and the running / waiting counts must be of the same
    moment as the blocks, and AsyncEngine.call runs a function of the engine in the loop thread."""
    t0 = time.perf_counter()
    kv = engine.kv
    pool = kv.block_pool
    n = pool.num_blocks
    cells = [FREE] * n
    pos = [0] * n
    age = [0] * n
    requests: list[dict[str, Any]] = []
    index: dict[str, int] = {}
    for group in getattr(kv, "groups", [kv]):  # a hybrid model's KV groups: every group's blocks in the colour
        for rid, state in group._requests.items():  # of their request, num_blocks summed over the groups
            if rid not in index:
                index[rid] = len(requests)
                requests.append({"id": rid, "num_tokens": state.num_tokens, "num_blocks": 0})
            idx = index[rid]
            requests[idx]["num_blocks"] += len(state.blocks) - state.num_null
            for j in range(state.num_null, len(state.blocks)):  # leading placeholders: blocks out of a window
                b = state.blocks[j]
                if cells[b.block_id] < 0:  # a shared block is drawn in its first holder's colour
                    cells[b.block_id] = idx
                    pos[b.block_id] = j
    for rank, b in enumerate(pool.free_block_queue):
        age[b.block_id] = rank
        if b.block_hash is not None:
            cells[b.block_id] = CACHED
    shared = [b.block_id for b in pool.blocks if b.ref_cnt > 1]
    stats = engine.kv_cache_stats()
    return {"num_blocks": n, "block_size": kv.block_size, "cells": cells, "pos": pos, "age": age,
            "shared": shared, "requests": requests, "stats": stats,
            "num_running": engine.num_running(), "num_waiting": engine.num_waiting(),
            "build_ms": (time.perf_counter() - t0) * 1e3}
