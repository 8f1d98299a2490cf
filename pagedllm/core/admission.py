"""Admission: a request that could never run is refused when it is added (instead of waiting, or stalling the
queue, forever), with what to change."""

from __future__ import annotations

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_cache_utils import cdiv


def check_fits(max_len: int, max_num_batched_tokens: int, kv: KVCacheManager, capacity: int, num_prompt_tokens: int,
               max_tokens: int | None = None, *, prefill_only: bool = False) -> int:
    """Reject at add time what could never run (instead of letting it wait, or stall the queue, forever).
    Returns the number of tokens the request may generate: max_tokens, or with max_tokens None as many as
    the context and the cache can hold (the request then finishes with "length" at capacity). prefill_only
    (pooling): the prompt may fill the whole context, and nothing is generated."""
    if num_prompt_tokens < 1:
        raise ValueError("prompt must contain at least one token")
    if prefill_only and num_prompt_tokens > max_len:
        raise ValueError(f"prompt is {num_prompt_tokens} tokens, more than max_model_len={max_len}; set "
                         f"truncate_prompt_tokens to keep its last tokens")
    if num_prompt_tokens >= max_len and not prefill_only:
        raise ValueError(
            f"prompt is {num_prompt_tokens} tokens, which leaves no room to generate within "
            f"max_model_len={max_len}")
    if kv.kv_layout == "contiguous" and cdiv(max_len, kv.block_size) > kv.num_blocks:
        raise ValueError(
            f"the contiguous layout reserves {cdiv(max_len, kv.block_size)} KV blocks per request but "
            f"the cache has only {kv.num_blocks}; raise kv_cache_memory or num_kv_blocks")
    if prefill_only:
        if num_prompt_tokens > capacity:
            raise ValueError(f"prompt of {num_prompt_tokens} tokens needs more KV slots than the whole cache holds "
                             f"({capacity}); raise kv_cache_memory or num_kv_blocks")
        return 0
    # The last generated token never needs a slot: prompt + max_tokens - 1 slots at most.
    room = min(max_len - num_prompt_tokens, capacity + 1 - num_prompt_tokens)
    if room < 1:
        raise ValueError(
            f"prompt of {num_prompt_tokens} tokens needs "
            f"{kv.request_blocks(num_prompt_tokens, max_num_batched_tokens)} KV blocks but the "
            f"cache has only {kv.num_blocks} of {kv.block_size} tokens; raise kv_cache_memory or "
            f"num_kv_blocks")
    if max_tokens is None:
        return room
    max_tokens = min(max_tokens, max_len - num_prompt_tokens)
    if num_prompt_tokens + max_tokens - 1 > capacity:
        raise ValueError(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) needs "
            f"{num_prompt_tokens + max_tokens - 1} KV slots but the whole cache holds {capacity} "
            f"({kv.num_blocks} blocks of {kv.block_size}); lower max_tokens to at most {room} "
            f"or raise kv_cache_memory / num_kv_blocks")
    return max_tokens
