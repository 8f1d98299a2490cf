"""KV cache groups for hybrid models (vLLM's hybrid KV cache manager, small): layers grouped by attention type.

Full-attention layers keep every block of a request; sliding-window layers only ever read the last `window` tokens,
so their blocks that fell out of the window can go back to the pool. To serve both kinds from ONE block pool with
ONE block size, the layers are cut into groups of equal size (the gcd of the two counts): a block id then holds
memory for one layer of each position in a group, and each request has one block table per group. Gemma 3 270M
(3 global + 15 local layers) -> 6 groups of 3 layers: 1 full group and 5 sliding groups.

A model whose layers are all alike is one group (today's layout and cost). If the smaller count does not divide
the larger one, the layout falls back to one full group (correct, no saving), as vLLM does not pad groups either.
Pure Python: the worker maps layer -> (group, position) onto its tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroup:
    layers: tuple[int, ...]  # model layer indices, in order (position p in the group = layers[p])
    window: int | None  # sliding window in tokens (itself included), None = full attention


@dataclass(frozen=True)
class KVGroupLayout:
    groups: tuple[KVGroup, ...]  # full groups first

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def group_size(self) -> int:
        """Layers per group = the layers one block id holds memory for."""
        return len(self.groups[0].layers)

    @property
    def windows(self) -> list[int | None]:
        return [g.window for g in self.groups]

    def position(self, layer: int) -> tuple[int, int]:
        """(group index, position in the group) of a model layer."""
        for gi, g in enumerate(self.groups):
            if layer in g.layers:
                return gi, g.layers.index(layer)
        raise ValueError(f"layer {layer} is in no KV group")

    @property
    def is_hybrid(self) -> bool:
        return self.num_groups > 1


def plan_kv_groups(layer_windows: list[int | None], max_model_len: int | None = None,
                   hybrid: bool = True) -> KVGroupLayout:
    """Group layers by their window. A window no context can exceed (>= max_model_len) is full attention.
    hybrid=False: one full group (every block kept: the "all global" baseline)."""
    if not layer_windows:
        raise ValueError("a model needs at least one layer")
    windows = [None if w is None or (max_model_len is not None and w >= max_model_len) else int(w)
               for w in layer_windows]
    everything = tuple(range(len(windows)))
    if not hybrid:
        return KVGroupLayout((KVGroup(everything, None),))
    kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))
    if len(kinds) == 1:  # all alike: one group (a sliding one still gives back its old blocks)
        return KVGroupLayout((KVGroup(everything, kinds[0]),))
    by_kind = {k: [i for i, w in enumerate(windows) if w == k] for k in kinds}
    size = math.gcd(*(len(v) for v in by_kind.values()))
    if size < min(len(v) for v in by_kind.values()):  # counts do not divide: keep everything (one full group)
        return KVGroupLayout((KVGroup(everything, None),))
    groups = [KVGroup(tuple(layers[i:i + size]), k) for k, layers in by_kind.items()
              for i in range(0, len(layers), size)]
    return KVGroupLayout(tuple(groups))


def window_blocks(window: int, block_size: int, step_tokens: int) -> int:
    """Most blocks a sliding group holds for one request after an allocation of step_tokens new tokens: the new
    tokens plus the window - 1 keys before the first of them, misaligned by at most one block."""
    return -(-(window - 1 + step_tokens) // block_size) + 1


def request_blocks(layout_windows: list[int | None], block_size: int, num_tokens: int, step_tokens: int) -> int:
    """Blocks a request of num_tokens tokens holds at most over all groups (step_tokens new tokens per step)."""
    nb = -(-num_tokens // block_size)
    return sum(nb if w is None else min(nb, window_blocks(w, block_size, step_tokens)) for w in layout_windows)


def capacity_tokens(layout_windows: list[int | None], block_size: int, num_blocks: int, step_tokens: int,
                    limit: int) -> int:
    """Longest request (in tokens, at most limit) that fits alone in num_blocks blocks."""
    if request_blocks(layout_windows, block_size, limit, step_tokens) <= num_blocks:
        return limit
    lo, hi = 0, limit  # request_blocks grows with num_tokens: bisect the last length that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if request_blocks(layout_windows, block_size, mid, step_tokens) <= num_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo
