"""Hypothesis-driven mutations of a small valid GGUF (bit flips, truncation, edits of every header field, renames,
offset games, appended bytes): each variant loads and matches the original (same shapes, bit-identical weights)
or raises InvalidModelError naming the file, within 2 s of CPU time and 200 MB (bench/pagedllm_bench/fuzz_gguf.py;
`pagedllm bench fuzz --minutes N` runs the same oracle for longer)."""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagedllm_bench.fuzz_gguf import MUTATIONS, check_variant, load_summary, mutate, write_tiny_gguf


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fuzz") / "orig.gguf")
    write_tiny_gguf(path, seed=0)
    with open(path, "rb") as f:
        return path, f.read(), load_summary(path)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**63 - 1), kind=st.sampled_from(MUTATIONS))
def test_mutated_gguf_loads_identically_or_fails_cleanly(original, tmp_path, seed, kind):
    path, data, ref = original
    variant, what = mutate(data, random.Random(seed), kind)
    target = tmp_path / f"variant-{seed}.gguf"
    target.write_bytes(variant)
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the bound is this thread's CPU time
    try:
        check_variant(str(target), ref)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from e
    finally:
        torch.set_num_threads(n)
        os.remove(target)


def test_the_original_loads(original):
    path, _, ref = original
    assert check_variant(path, ref).result == "loaded"
