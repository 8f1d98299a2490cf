"""Which replica serves a request: prefix affinity with bounded load, least-loaded, round-robin.

Pure Python, no Ray: the server's router and the router simulation use the same classes. A policy sees the
prompt's token ids and one ReplicaLoad per replica, and returns the index of the replica to use. Prefix
affinity keeps, per replica, an approximate LRU set of the block hashes it was sent (the same chained hashes
the prefix cache uses, so a hit on block i means the whole prefix up to i was sent there); a request goes to
the healthy replica holding its longest prefix unless that replica is overloaded, then to the next one
holding it (a hot prefix spills to a second replica), and without a useful prefix to the least loaded one.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pagedllm.core.kv_cache_utils import hash_request_blocks


class NoHealthyReplicaError(RuntimeError):
    """Every replica is down (dead or restarting)."""


@dataclass
class ReplicaLoad:
    """What the router knows about one replica when it routes a request."""

    healthy: bool = True
    num_requests: int = 0  # running + waiting
    queued_tokens: int = 0  # tokens still to compute or generate for those requests (estimate)
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0-1 (last report)


def _healthy(replicas: Sequence[ReplicaLoad]) -> list[int]:
    up = [i for i, r in enumerate(replicas) if r.healthy]
    if not up:
        raise NoHealthyReplicaError("no healthy engine replica")
    return up


class RoutingPolicy:
    name = "base"

    def choose(self, token_ids: Sequence[int], replicas: Sequence[ReplicaLoad],
               cache_salt: str | None = None) -> int:
        raise NotImplementedError

    def replica_reset(self, index: int) -> None:
        """The replica restarted (or its prefix cache was reset): it holds nothing any more."""


class RoundRobinPolicy(RoutingPolicy):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, token_ids: Sequence[int], replicas: Sequence[ReplicaLoad],
               cache_salt: str | None = None) -> int:
        up = _healthy(replicas)
        n = len(replicas)
        for k in range(n):  # the next healthy one in ring order
            i = (self._next + k) % n
            if i in up:
                self._next = i + 1
                return i
        raise AssertionError("unreachable")


class LeastLoadedPolicy(RoutingPolicy):
    """Fewest requests, then lowest KV usage, then fewest queued tokens; ties rotate so that equal replicas
    share the work instead of the first one taking it all."""

    name = "least-loaded"

    def __init__(self) -> None:
        self._tie = 0

    def choose(self, token_ids: Sequence[int], replicas: Sequence[ReplicaLoad],
               cache_salt: str | None = None) -> int:
        return self.least_loaded(replicas, _healthy(replicas))

    def least_loaded(self, replicas: Sequence[ReplicaLoad], candidates: list[int]) -> int:
        n = len(replicas)
        self._tie += 1

        def key(i: int) -> tuple:
            r = replicas[i]
            return r.num_requests, round(r.kv_usage, 2), r.queued_tokens, (i - self._tie) % n

        return min(candidates, key=key)


class PrefixAffinityPolicy(LeastLoadedPolicy):
    """Longest known prefix first, under a load bound; least loaded when no replica holds a useful prefix.

    A replica is overloaded when it has more than `load_factor` times its fair share of requests (counting
    this one: consistent hashing with bounded loads) plus `load_slack` (an engine batches a few requests at
    almost no cost, so small absolute differences are not worth a cache miss), or its KV usage is at least
    `kv_high`."""

    name = "prefix"

    def __init__(self, num_replicas: int, block_size: int = 16, *, max_prefix_blocks: int = 128,
                 min_match_blocks: int = 1, load_factor: float = 1.25, load_slack: int = 4,
                 token_slack: int = 2048, kv_high: float = 0.9,
                 table_blocks: int = 65536) -> None:
        super().__init__()
        if block_size < 1 or max_prefix_blocks < 1 or min_match_blocks < 1:
            raise ValueError("block_size, max_prefix_blocks and min_match_blocks must be >= 1")
        if load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1, got {load_factor}")
        self.block_size = block_size
        self.max_prefix_blocks = max_prefix_blocks
        self.min_match_blocks = min_match_blocks
        self.load_factor = load_factor
        self.load_slack = load_slack
        self.token_slack = token_slack
        self.kv_high = kv_high
        self.table_blocks = table_blocks
        self._tables: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_replicas)]

    def choose(self, token_ids: Sequence[int], replicas: Sequence[ReplicaLoad],
               cache_salt: str | None = None) -> int:
        if len(replicas) != len(self._tables):
            raise ValueError(f"policy built for {len(self._tables)} replicas, got {len(replicas)}")
        up = _healthy(replicas)
        # Never hash the last token: the engine recomputes it, so a block ending there cannot be a hit.
        usable = min(len(token_ids) - 1, self.max_prefix_blocks * self.block_size)
        hashes = hash_request_blocks(token_ids[:max(usable, 0)], self.block_size, cache_salt)
        n_up, new_tokens = len(up), len(token_ids)
        capacity = math.ceil(self.load_factor * (sum(replicas[i].num_requests for i in up) + 1) / n_up)
        token_capacity = self.load_factor * (sum(replicas[i].queued_tokens for i in up) + new_tokens) / n_up

        def overloaded(i: int) -> bool:
            r = replicas[i]
            return (r.num_requests + 1 > capacity + self.load_slack or r.kv_usage >= self.kv_high
                    or r.queued_tokens + new_tokens > token_capacity + self.token_slack)

        holders = sorted(((self.matched_blocks(i, hashes), i) for i in up), key=lambda m: -m[0])
        chosen = next((i for m, i in holders if m >= self.min_match_blocks and not overloaded(i)), None)
        if chosen is None:
            relaxed = [i for i in up if not overloaded(i)] or up
            chosen = self.least_loaded(replicas, relaxed)
        self._remember(chosen, hashes)
        return chosen

    def matched_blocks(self, index: int, hashes: Sequence[bytes]) -> int:
        """Leading blocks of the prompt that were sent to this replica (the chain makes it a prefix)."""
        table = self._tables[index]
        n = 0
        for h in hashes:
            if h not in table:
                break
            n += 1
        return n

    def _remember(self, index: int, hashes: Sequence[bytes]) -> None:
        table = self._tables[index]
        for h in hashes:
            table[h] = None
            table.move_to_end(h)
        while len(table) > self.table_blocks:
            table.popitem(last=False)

    def replica_reset(self, index: int) -> None:
        self._tables[index].clear()


POLICIES = ("prefix", "least-loaded", "round-robin")


def make_policy(name: str, num_replicas: int, block_size: int = 16, **kwargs) -> RoutingPolicy:
    if name == "prefix":
        return PrefixAffinityPolicy(num_replicas, block_size, **kwargs)
    if name == "least-loaded":
        return LeastLoadedPolicy()
    if name == "round-robin":
        return RoundRobinPolicy()
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
