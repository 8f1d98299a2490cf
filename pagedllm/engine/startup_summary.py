"""The one line `pagedllm serve` logs at start: what it runs and how much fits."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (llm_engine imports torch and the model code: only the type here)
    from pagedllm.engine.llm_engine import LLMEngine


def _tensors(x: object):
    if hasattr(x, "element_size"):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def startup_summary(engine: LLMEngine) -> str:
    """One line on what `pagedllm serve` runs: model, dtype, quantization, KV blocks, KV dtype and bytes per token
    (of the pool actually allocated), and how many requests of the full context length fit at once."""
    if not hasattr(engine, "kv"):  # an encoder (engine/encoder_engine.py): no KV cache to describe
        return engine.describe()
    kv, args = engine.kv, engine.args
    caches = engine.runner.kv_caches
    pool = getattr(caches, "pool", None)  # (hybrid KV groups: layers share the pool's position views)
    pool_bytes = pool.numel() * pool.element_size() if pool is not None else sum(
        t.numel() * t.element_size() for t in _tensors(caches))
    max_len = engine.max_model_len
    kv_dtype = str(caches[0][0].dtype).removeprefix("torch.")
    # requests of the full context that fit at once (a sliding-window group holds about a window of each)
    if kv.kv_layout == "contiguous":
        per_request = -(-max_len // kv.block_size)
    else:
        per_request = kv.request_blocks(max_len, 1)  # decoding (a prefill chunk holds more for a while)
    groups = engine.kv_groups
    layout = f", {groups.num_groups} KV groups of {groups.group_size} layers" if groups.is_hybrid else ""
    return (f"model {engine.model_name}, dtype {str(engine.dtype).removeprefix('torch.')}, "
            f"quantization {args.quantization}, "
            f"KV cache {kv.num_blocks} blocks x {kv.block_size} tokens ({pool_bytes / 2**20:.0f} MiB, KV dtype "
            f"{kv_dtype}, {engine.kv_bytes_per_token()} bytes per token{layout}), max model len {max_len}, "
            f"max concurrency at full length {kv.num_blocks / per_request:.2f}x, prefix caching "
            f"{'on' if kv.enable_prefix_caching else 'off'}")
