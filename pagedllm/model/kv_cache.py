"""Per-layer paged KV pools, sized once at start-up from a byte budget or an explicit block count."""

from __future__ import annotations

import logging
import math
import mmap

import torch

from pagedllm.attention.kv_quant import row_elems
from pagedllm.core.kv_groups import KVGroupLayout
from pagedllm.model.config import ModelConfig

logger = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]
KV_CACHE_DTYPES = ("auto", "int8")


def resolve_kv_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype: "auto" = the compute dtype, "int8" = int8 rows with their scales (attention/kv_quant.py)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
                         f"got {kv_cache_dtype!r}")
    return torch.int8 if kv_cache_dtype == "int8" else dtype


class KVCacheList(list):
    """The per-layer (k_cache, v_cache) pairs, remembering the single pool tensor
    [layers_per_block, 2, num_blocks, block_size, num_kv_heads, row] they are views of (row = head_dim, or
    head_dim + 2 for int8 rows with their scale), so that block copies can touch every layer in one indexed copy.
    With KV groups (core/kv_groups.py) layers_per_block is the group size: layer l uses pool[its position in its
    group] through its group's block tables (layer_group[l] = its group; pool_rows[l] = its row of the pool, int64,
    which DecoderStack.forward takes with the pool instead of a list of caches)."""

    pool: torch.Tensor
    layer_group: list[int]
    pool_rows: torch.Tensor


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, layers: int | None = None) -> int:
    """2 (K and V) x layers x block_size x kv_heads x row elements (scales included) x element size
    (layers: those one block id holds, all of them by default, a KV group's with a hybrid layout)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * (layers or cfg.num_layers) * block_size * cfg.num_kv_heads * row_elems(cfg.head_dim, dtype) * elem


def num_blocks_for_budget(cfg: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int,
                          layers: int | None = None) -> int:
    per_block = kv_bytes_per_block(cfg, block_size, dtype, layers)
    n = budget_bytes // per_block
    if n < 1:
        raise ValueError(f"kv_cache_memory of {budget_bytes} bytes is smaller than one KV block "
                         f"({per_block} bytes); raise it")
    return int(n)


def allocate_kv_caches(cfg: ModelConfig, block_size: int, dtype: torch.dtype, *,
                       num_blocks: int | None = None, budget_bytes: int | None = None,
                       layout: KVGroupLayout | None = None, device: torch.device | str = "cpu") -> KVCacheList:
    """One (k_cache, v_cache) pair per layer, each [num_blocks, block_size, num_kv_heads, head_dim] of dtype (the
    KV dtype: the compute dtype, or torch.int8 for int8 rows of head_dim + 2 bytes, see resolve_kv_dtype).

    layout: the KV groups (None: one group of every layer). All pools are views of one allocation. Zero-filled:
    padded reads of never-written slots must be finite (masked attention weights are 0, but 0 * NaN is NaN). The
    allocation is an anonymous mapping, so the OS zero-fills each page when it is first touched: the pool is
    resident only for the blocks requests have used. On another device (a GPU) it is allocated there, zeroed.
    """
    if num_blocks is None:
        if budget_bytes is None:
            raise ValueError("give num_blocks or budget_bytes")
        num_blocks = num_blocks_for_budget(cfg, block_size, dtype, budget_bytes, layout and layout.group_size)
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    where = [layout.position(i) if layout else (0, i) for i in range(cfg.num_layers)]
    shape = (layout.group_size if layout else cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads,
             row_elems(cfg.head_dim, dtype))
    device = torch.device(device)
    pool = _zeroed_on_touch(shape, dtype) if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)
    per_block = kv_bytes_per_block(cfg, block_size, dtype, pool.shape[0])
    logger.info("KV cache: %d blocks of %d tokens = %d tokens of capacity (%d KV groups of %d layers; %.1f MiB, %s, "
                "%d bytes per token of a group)", num_blocks, block_size, num_blocks * block_size,
                layout.num_groups if layout else 1, pool.shape[0], num_blocks * per_block / 2**20,
                str(dtype).replace("torch.", ""), per_block // block_size)
    caches = KVCacheList((pool[p, 0], pool[p, 1]) for _, p in where)
    caches.pool = pool
    caches.layer_group = [g for g, _ in where]
    caches.pool_rows = torch.tensor([p for _, p in where], dtype=torch.int64, device=device)
    return caches


def _zeroed_on_touch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor over an anonymous memory mapping (pages mapped, zeroed, on first touch; the tensor keeps the
    mapping alive)."""
    numel = math.prod(shape)
    buf = mmap.mmap(-1, max(1, numel * torch.empty((), dtype=dtype).element_size()))
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)
