"""The routing policies of data-parallel serving (pure Python, no Ray)."""

from __future__ import annotations

import random

import pytest

from pagedllm.distributed.routing import (
    LeastLoadedPolicy,
    NoHealthyReplicaError,
    PrefixAffinityPolicy,
    ReplicaLoad,
    RoundRobinPolicy,
    make_policy,
)

B = 16


def family(rng: random.Random, shared: list[int], n_suffix: int = 20) -> list[int]:
    return shared + [rng.randrange(1000, 50000) for _ in range(n_suffix)]


def loads(n: int, **kw) -> list[ReplicaLoad]:
    return [ReplicaLoad(**kw) for _ in range(n)]


def test_round_robin_cycles_and_skips_unhealthy():
    p = RoundRobinPolicy()
    r = loads(3)
    assert [p.choose([1, 2], r) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    r[1].healthy = False
    assert [p.choose([1, 2], r) for _ in range(4)] == [0, 2, 0, 2]


def test_no_healthy_replica_raises():
    for p in (RoundRobinPolicy(), LeastLoadedPolicy(), PrefixAffinityPolicy(2, B)):
        with pytest.raises(NoHealthyReplicaError):
            p.choose(list(range(100)), loads(2, healthy=False))


def test_least_loaded_prefers_fewer_requests_then_kv_and_rotates_ties():
    p = LeastLoadedPolicy()
    r = [ReplicaLoad(num_requests=3), ReplicaLoad(num_requests=1), ReplicaLoad(num_requests=2)]
    assert p.choose([1], r) == 1
    r = [ReplicaLoad(num_requests=1, kv_usage=0.8), ReplicaLoad(num_requests=1, kv_usage=0.1)]
    assert p.choose([1], r) == 1
    equal = loads(4)
    assert {p.choose([1], equal) for _ in range(8)} == {0, 1, 2, 3}


def test_prefix_family_sticks_to_one_replica_and_families_spread():
    rng = random.Random(0)
    p = PrefixAffinityPolicy(4, B)
    r = loads(4)
    shared = [[rng.randrange(1000, 50000) for _ in range(5 * B)] for _ in range(4)]
    homes = []
    for fam in shared:
        first = p.choose(family(rng, fam), r)
        r[first].num_requests += 1  # in flight: the next family's first request goes elsewhere
        homes.append(first)
        for _ in range(10):
            assert p.choose(family(rng, fam), r) == first
    assert sorted(homes) == [0, 1, 2, 3]
    assert p.matched_blocks(homes[0], [b"x"]) == 0


def test_prefix_hot_family_spills_under_bounded_load():
    rng = random.Random(1)
    p = PrefixAffinityPolicy(4, B, load_factor=1.25, load_slack=2)
    r = loads(4)
    hot = [rng.randrange(1000, 50000) for _ in range(4 * B)]
    chosen = []
    for _ in range(40):  # none finishes: the hot family's home fills up to its bound, then others share
        i = p.choose(family(rng, hot), r)
        r[i].num_requests += 1
        chosen.append(i)
    counts = [r[i].num_requests for i in range(4)]
    assert max(counts) <= 1.25 * 40 / 4 + 2 + 1, counts
    # the first spill goes to a second replica, which then holds the prefix too
    assert len(set(chosen)) > 1 and chosen[0] == chosen[1]


def test_prefix_spills_on_high_kv_usage_and_avoids_dead_holder():
    rng = random.Random(2)
    p = PrefixAffinityPolicy(3, B)
    r = loads(3)
    fam = [rng.randrange(1000, 50000) for _ in range(3 * B)]
    home = p.choose(family(rng, fam), r)
    r[home].kv_usage = 0.95
    assert p.choose(family(rng, fam), r) != home
    r[home].kv_usage = 0.1
    assert p.choose(family(rng, fam), r) == home
    r[home].healthy = False
    other = p.choose(family(rng, fam), r)
    assert other != home
    r[home].healthy = True
    p.replica_reset(home)  # restarted: its cache is gone, the family stays where it went meanwhile
    assert p.choose(family(rng, fam), r) == other


def test_prefix_without_useful_prefix_goes_least_loaded_and_salt_separates():
    p = PrefixAffinityPolicy(2, B)
    r = [ReplicaLoad(num_requests=5), ReplicaLoad(num_requests=0)]
    assert p.choose([7] * (B - 1), r) == 1  # shorter than a block: nothing to match
    fam = list(range(100, 100 + 4 * B))
    r = loads(2)
    home = p.choose(fam + [1], r, cache_salt="a")
    r[home].num_requests += 1
    assert p.choose(fam + [2], r, cache_salt="a") == home
    assert p.choose(fam + [3], r, cache_salt="b") != home  # other salt: no match, the idle replica


def test_make_policy():
    assert isinstance(make_policy("prefix", 2, B), PrefixAffinityPolicy)
    assert isinstance(make_policy("least-loaded", 2), LeastLoadedPolicy)
    assert isinstance(make_policy("round-robin", 2), RoundRobinPolicy)
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random", 2)
    with pytest.raises(ValueError, match="built for 2 replicas"):
        PrefixAffinityPolicy(2, B).choose([1] * 40, loads(3))


def test_single_process_server_does_not_import_ray():
    import subprocess
    import sys

    code = ("import sys, pagedllm.cli, pagedllm.entrypoints.openai.server as s, pagedllm_bench.router_sim; "
            "pagedllm.cli.build_parser().parse_args(['serve']); "
            "assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
