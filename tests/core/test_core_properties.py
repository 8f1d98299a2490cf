"""Property-based tests of the paged KV core: random interleavings of admissions (with prefix-cache hits and
chunked prefill), decode steps, forks (copy-on-write), frees, evictions and cache resets, against a
simulated KV memory. After every step:
- each block's ref count equals the number of block tables holding it;
- the free queue holds exactly the blocks with ref count 0, each once;
- every hash in the map points at a block carrying that hash (and every hashed block is in the map);
- tables are exactly as long as needed (paged) or the full reservation (contiguous);
- after each simulated model step, every request reads back its own tokens through its block table
  (this catches a missed copy-on-write, a wrong cache hit or a block handed out while still in use);
- speculative append + rollback keeps all of the above (rejected drafts' blocks return, no block of rejected
  tokens stays hashed);
- when all requests are freed, every block is free.
With a sliding window (a KVCacheManager with `window`, or a HybridKVCacheManager of a full and two sliding
groups on one pool): after every allocation each sliding table holds NULL_BLOCK exactly for the blocks no later
query reads (those blocks are back in the pool), and the tokens the next query may read still read back right.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedllm.core.block_pool import NULL_BLOCK
from pagedllm.core.hybrid_kv_cache_manager import HybridKVCacheManager
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_cache_utils import hash_request_blocks
from pagedllm.core.kv_groups import plan_kv_groups
from pagedllm.core.kv_tier import TierCoordinator
from pagedllm.core.prefix_lookup import first_needed_block
from pagedllm.core.request import Request

# Few distinct tokens and shared "system prompts" so that prefix-cache hits and hash duplicates happen.
TOKENS = st.integers(min_value=0, max_value=3)
PREFIXES = [[1, 2, 3, 0, 1, 2, 3, 0, 2, 2], [3, 3, 1, 0, 2, 1], []]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCoreMachine(RuleBasedStateMachine):
    FORCE_DISK = False  # KVTierMachine: every run has the disk tier
    @initialize(block_size=st.sampled_from([1, 2, 4, 4]), num_blocks=st.integers(6, 32),
                layout=st.sampled_from([("paged", True), ("paged", True), ("paged", False), ("contiguous", False)]),
                groups=st.sampled_from(["one", "one", "window", "hybrid"]), window=st.integers(1, 7),
                disk=st.sampled_from([False, True, True]))
    def setup(self, block_size: int, num_blocks: int, layout: tuple[str, bool], groups: str, window: int,
              disk: bool) -> None:
        contiguous, caching = layout[0] == "contiguous", layout[1]
        if self.FORCE_DISK:
            contiguous, caching, disk = False, True, True
        self.B = block_size
        self.max_len = 12
        self.contiguous = contiguous and cdiv(self.max_len, block_size) <= num_blocks
        if groups == "hybrid" and not self.contiguous:  # one full and two sliding groups on one pool
            self.m = HybridKVCacheManager(num_blocks, block_size, plan_kv_groups([None, window, window]),
                                          enable_prefix_caching=caching)
        else:
            self.m = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching,
                                    kv_layout="contiguous" if self.contiguous else "paged",
                                    max_model_len=self.max_len,
                                    window=window if groups == "window" and not self.contiguous else None)
        self.groups = getattr(self.m, "groups", [self.m])
        self.windowed = any(g.window is not None for g in self.groups)
        event("KV groups: " + ("hybrid" if len(self.groups) > 1 else "window" if self.windowed else "one"))
        self.live: list[Request] = []
        self.pending: dict[str, tuple[int, int, list[tuple[int, int]]]] = {}  # rid -> (start, n, copies)
        self.memory: dict[int, list[int | None]] = {i: [None] * block_size for i in range(num_blocks)}
        self.next_id = 0
        self.disk: dict[bytes, list[int | None]] = {}  # the second tier: key -> the spilled block's tokens
        self.tier = TierCoordinator(self.m, self.disk.__contains__) if disk and caching and not self.contiguous \
            else None
        event("disk tier" if self.tier else "no disk tier")

    # ---- helpers -----------------------------------------------------------------------------------
    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _snapshot(self) -> tuple:
        pool = self.m.block_pool
        return ([b.block_id for b in pool.free_block_queue], [(b.ref_cnt, b.block_hash) for b in pool.blocks],
                dict(pool.cached_block_hash_to_block), self.m.stats(),
                {r.request_id: self.m.get_group_block_ids(r) for r in self.live})

    def _tables(self, r: Request) -> list[list[int | None]]:
        """Per group the request's block ids, None where a sliding window left a placeholder."""
        return [[None if b is NULL_BLOCK else b.block_id for b in g._requests[r.request_id].blocks]
                for g in self.groups]

    def _num_hits(self, hits) -> int:
        """Blocks of a lookup's hit (a hybrid manager gives one list per group, all as long)."""
        if hits and isinstance(self.m, HybridKVCacheManager):
            assert len({len(h) for h in hits}) == 1
            return len(hits[0])
        return len(hits or ())

    def _write(self, r: Request, t: int, token: int) -> None:
        for table in self._tables(r):  # the worker writes every layer, i.e. every group's block
            self.memory[table[t // self.B]][t % self.B] = token

    def _idle(self) -> list[Request]:
        return [r for r in self.live if r.request_id not in self.pending]

    def _spill(self) -> None:
        """The worker, before the step's writes: copy out what the pool evicted or freed since the last call."""
        if self.tier is not None:
            for bid, key in self.tier.take_spills():
                if key not in self.disk:  # as the store: a key it holds is not written again
                    self.disk[key] = list(self.memory[bid])
                    event("spilled")

    def _allocate(self, r: Request, n: int, hits=None, reserve: int = 0) -> bool:
        before = self._snapshot()
        start = r.num_computed_tokens + self._num_hits(hits) * self.B
        copies = self.m.allocate_slots(r, n, hits, num_reserved_blocks=reserve)
        self._spill()
        if copies is None:  # (a sliding window gives back its dead blocks even then)
            assert self.windowed or self._snapshot() == before, "a failed allocation changed the pool"
            event("allocation refused")
            return False
        if copies:
            event("copy-on-write")
        if hits:
            event("prefix-cache hit")
        self.pending[r.request_id] = (start, n, copies)
        for g in self.groups:  # exactly the blocks no query from `start` on reads are placeholders, back in the pool
            state = g._requests[r.request_id]
            dead = first_needed_block(start, g.window, self.B)
            assert state.num_null == dead and all(b is NULL_BLOCK for b in state.blocks[:dead])
            if dead:
                event("blocks out of a window went back")
            assert all(b is not NULL_BLOCK and b.ref_cnt > 0 for b in state.blocks[dead:])
        return True

    # ---- rules -------------------------------------------------------------------------------------
    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(TOKENS, min_size=1, max_size=6),
          chunk=st.integers(1, 12), reserve=st.integers(0, 3), salt=st.sampled_from([None, None, "t"]))
    def admit(self, prefix, tail, chunk, reserve, salt) -> None:
        self._admit(Request(self._new_id(), (prefix + tail)[: self.max_len - 1], cache_salt=salt), chunk, reserve)

    def _admit(self, r: Request, chunk: int, reserve: int) -> None:
        """The scheduler's admission: pool lookup, then the disk tier (which may take the request to load)."""
        hits, n_cached = self.m.get_computed_blocks(r)
        assert n_cached == self._num_hits(hits) * self.B < r.num_tokens
        if self.tier is not None:
            loading = self.tier.maybe_load(r, n_cached, reserve)
            self._spill()  # its target blocks may have evicted cached ones
            if loading is not None:
                event("load started" if loading else "load refused")
                return
        if self._allocate(r, min(chunk, r.num_tokens - n_cached), hits, reserve):
            r.num_computed_tokens = n_cached  # what the scheduler does after a successful admission
            self.live.append(r)

    @precondition(lambda self: self.tier is not None and bool(self.tier.loads))
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def finish_load(self, data, chunk) -> None:
        """The worker reads a load's blocks (a read may fail: a corrupt or vanished file, which the store then
        forgets); the request is admitted again and must now find the loaded blocks in the pool."""
        load = data.draw(st.sampled_from(list(self.tier.loads.values())))
        ok = []
        for block, key in load.targets:
            good = key in self.disk and data.draw(st.integers(0, 4)) > 0
            if good:
                self.memory[block.block_id] = list(self.disk[key])
            else:
                self.disk.pop(key, None)
                event("load failed")
            ok.append(good)
        r = load.request
        if r is not None:  # a loaded block holds exactly the tokens of its block of the prefix
            for (block, _), pos, good in zip(load.targets, load.positions, ok, strict=True):
                if good:
                    assert self.memory[block.block_id] == r.all_token_ids[pos * self.B:(pos + 1) * self.B]
        self.tier.finish_load(load.load_id, ok)
        for req in self.tier.take_loaded():
            event("admitted after a load")
            self._admit(req, chunk, 0)

    @precondition(lambda self: self.tier is not None and bool(self.tier.loads))
    @rule(data=st.data())
    def abort_loading(self, data) -> None:
        load = data.draw(st.sampled_from(list(self.tier.loads.values())))
        r = load.request
        if r is not None:
            assert self.tier.cancel([r]) == [r] and load.request is None
            assert self.tier.cancel([r]) == []

    @precondition(lambda self: any(r.num_computed_tokens < r.num_tokens for r in self._idle()))
    @rule(data=st.data())
    def schedule(self, data) -> None:
        """Prefill chunk or decode: allocate slots for (some of) the uncomputed tokens."""
        r = data.draw(st.sampled_from([r for r in self._idle() if r.num_computed_tokens < r.num_tokens]))
        n = data.draw(st.integers(1, r.num_tokens - r.num_computed_tokens))
        self._allocate(r, n)

    @precondition(lambda self: any(r.num_computed_tokens == r.num_tokens < self.max_len for r in self._idle()))
    @rule(data=st.data(), token=TOKENS)
    def sample(self, data, token) -> None:
        r = data.draw(st.sampled_from([r for r in self._idle()
                                       if r.num_computed_tokens == r.num_tokens < self.max_len]))
        r.append_output_token(token)

    @precondition(lambda self: bool(self._idle()))
    @rule(data=st.data(), token=TOKENS)
    def fork(self, data, token) -> None:
        """A beam candidate: the parent's computed tokens plus its own sampled (uncomputed) token."""
        p = data.draw(st.sampled_from(self._idle()))
        tokens = p.all_token_ids[: p.num_computed_tokens] + [token]
        c = Request(self._new_id(), tokens[: self.max_len], cache_salt=p.cache_salt)
        c.num_computed_tokens = p.num_computed_tokens
        self.m.fork(p, c)
        self.live.append(c)

    @precondition(lambda self: any(0 < r.num_computed_tokens < self.max_len for r in self._idle()))
    @rule(data=st.data(), tokens=st.tuples(TOKENS, TOKENS))
    def beam_step(self, data, tokens) -> None:
        """Fork a request and extend both beams in the same step (copy-on-write territory)."""
        event("beam step")
        p = data.draw(st.sampled_from([r for r in self._idle() if 0 < r.num_computed_tokens < self.max_len]))
        c = Request(self._new_id(), p.all_token_ids[: p.num_computed_tokens] + [tokens[1]],
                    cache_salt=p.cache_salt)
        c.num_computed_tokens = p.num_computed_tokens
        self.m.fork(p, c)
        self.live.append(c)
        if p.num_computed_tokens == p.num_tokens:
            p.append_output_token(tokens[0])
        self._allocate(p, p.num_tokens - p.num_computed_tokens)
        self._allocate(c, 1)

    @precondition(lambda self: not self.pending and any(
        r.num_computed_tokens == r.num_tokens - 1 and r.num_tokens < self.max_len for r in self.live))
    @rule(data=st.data(), drafts=st.lists(TOKENS, min_size=1, max_size=5), bonus=TOKENS)
    def speculate(self, data, drafts, bonus) -> None:
        """Speculative decoding: the last token and k drafts are computed in one step, the first m drafts and
        one bonus token are accepted, the table rolls back over the rejected drafts' slots."""
        r = data.draw(st.sampled_from([r for r in self.live
                                       if r.num_computed_tokens == r.num_tokens - 1 and r.num_tokens < self.max_len]))
        drafts = drafts[: self.max_len - r.num_tokens - 1]  # room for the bonus token too
        start = r.num_computed_tokens
        copies = self.m.allocate_slots(r, 1 + len(drafts))
        self._spill()
        if copies is None:
            return
        for src, dst in copies:
            self.memory[dst] = list(self.memory[src])
        for t, tok in enumerate(r.all_token_ids[start:] + drafts, start=start):  # the worker's K/V writes
            self._write(r, t, tok)
        m = data.draw(st.integers(0, len(drafts)))
        event(f"speculation: {m} of {len(drafts)} accepted")
        for tok in drafts[:m] + [bonus]:
            r.append_output_token(tok)
        r.num_computed_tokens = start + 1 + m
        self.m.truncate(r, r.num_computed_tokens)

    @precondition(lambda self: bool(self._idle()))
    @rule(data=st.data())
    def free(self, data) -> None:
        r = data.draw(st.sampled_from(self._idle()))
        self.m.free(r)
        self.live.remove(r)

    @rule()
    def step(self) -> None:
        """The worker: all copy-on-write copies of the step, then all new K/V writes; then read back."""
        for _, _, copies in self.pending.values():
            for src, dst in copies:
                self.memory[dst] = list(self.memory[src])
        by_id = {r.request_id: r for r in self.live}
        for rid, (start, n, _) in self.pending.items():
            r = by_id[rid]
            for t in range(start, start + n):
                self._write(r, t, r.all_token_ids[t])
            r.num_computed_tokens = start + n
        self.pending.clear()
        for r in self.live:  # every token the next query may read (in a sliding group: its window)
            for g, table in zip(self.groups, self._tables(r), strict=True):
                first = 0 if g.window is None else max(0, r.num_computed_tokens - g.window + 1)
                seen = [self.memory[table[t // self.B]][t % self.B] for t in range(first, r.num_computed_tokens)]
                assert seen == r.all_token_ids[first:r.num_computed_tokens], f"{r.request_id} reads wrong K/V"

    @precondition(lambda self: not self.pending and not (self.tier and self.tier.loads))
    @rule()
    def free_all(self) -> None:
        for r in self.live:
            self.m.free(r)
        self.live.clear()
        assert self.m.num_free_blocks() == self.m.num_blocks
        assert self.m.stats()["used_slots"] == 0

    @rule()
    def reset_prefix_cache(self) -> None:
        in_use = self.m.num_free_blocks() < self.m.num_blocks
        assert self.m.reset_prefix_cache() is (not in_use)

    # ---- invariants --------------------------------------------------------------------------------
    @invariant()
    def ref_counts_match_tables(self) -> None:
        if not hasattr(self, "m"):
            return
        holders = Counter(b for r in self.live for table in self._tables(r) for b in table if b is not None)
        for load in self.tier.loads.values() if self.tier else ():  # a load pins its blocks until it completes
            holders.update(b.block_id for b in load.pinned)
        for b in self.m.block_pool.blocks:
            assert b.ref_cnt == holders[b.block_id], f"block {b.block_id}: ref {b.ref_cnt} != {holders[b.block_id]}"

    @invariant()
    def free_queue_is_exactly_the_free_blocks(self) -> None:
        if not hasattr(self, "m"):
            return
        pool = self.m.block_pool
        queued = [b.block_id for b in pool.free_block_queue]
        assert len(queued) == len(set(queued)) == pool.num_free_blocks()
        assert set(queued) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}

    @invariant()
    def hash_map_is_consistent(self) -> None:
        if not hasattr(self, "m"):
            return
        pool = self.m.block_pool
        for h, b in pool.cached_block_hash_to_block.items():
            assert b.block_hash == h
        assert sum(b.block_hash is not None for b in pool.blocks) == len(pool.cached_block_hash_to_block)
        for r in self.live:  # a cached block in a table stands for exactly that request's prefix (and group)
            for g, table in zip(self.groups, self._tables(r), strict=True):
                full = g._requests[r.request_id].num_full_blocks
                expected = hash_request_blocks(r.all_token_ids[: full * self.B], self.B, r.cache_salt)
                for i in range(full):
                    h = None if table[i] is None else pool.blocks[table[i]].block_hash
                    assert h is None or h == expected[i] + g._key.tag

    @invariant()
    def tables_have_the_right_length_and_stats_add_up(self) -> None:
        if not hasattr(self, "m"):
            return
        covered = 0
        fill: dict[int, int] = {}  # physical block -> slots holding tokens (the fullest holder's view)
        for r in self.live:
            for g, table in zip(self.groups, self._tables(r), strict=True):
                state = g._requests[r.request_id]
                n_blocks = len(table)
                if self.contiguous:
                    assert n_blocks == cdiv(self.max_len, self.B)
                else:
                    assert n_blocks == cdiv(state.num_tokens, self.B)
                assert r.num_computed_tokens <= state.num_tokens <= n_blocks * self.B
                covered += state.num_tokens - state.num_null * self.B  # placeholders hold no slots
                for i, bid in enumerate(table):
                    if bid is not None:
                        fill[bid] = max(fill.get(bid, 0), min(self.B, max(0, state.num_tokens - i * self.B)))
        s = self.m.stats()
        assert s["logical_slots"] == covered
        assert s["used_slots"] == sum(fill.values()) <= s["allocated_slots"]
        assert s["allocated_slots"] == (s["num_blocks"] - s["num_free_blocks"]) * self.B
        assert s["prefix_cache_hits"] <= s["prefix_cache_queries"]
        assert s["peak_used_blocks"] >= s["num_blocks"] - s["num_free_blocks"]

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        self.step()
        if self.tier is not None:
            for load in list(self.tier.loads.values()):
                self.tier.finish_load(load.load_id, [False] * len(load.targets))
        for r in self.live:
            self.m.free(r)
        assert self.m.num_free_blocks() == self.m.num_blocks
        assert all(b.ref_cnt == 0 for b in self.m.block_pool.blocks)


KVCoreMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestKVCore = KVCoreMachine.TestCase


class KVTierMachine(KVCoreMachine):
    FORCE_DISK = True


KVTierMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestKVTier = KVTierMachine.TestCase
