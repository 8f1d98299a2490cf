"""The serving sweep's offline reference (benchmarks/offline_stream.py): every request alone through the step loop,
its first token and each later token timed, and exactly the requested number of tokens."""

from __future__ import annotations

from pagedllm_bench import common, offline_stream
from tiny_models import random_prompts


def test_each_request_alone_with_its_token_times(tiny_dir):
    prompts = random_prompts(3, seed=5, lo=5, hi=40)
    wl = common.Workload("t", prompts, [4, 7, 1], 0, {})
    res = offline_stream.stream(str(tiny_dir), wl, "float32", "none", "off", num_kv_blocks=64, block_size=8,
                             attention_backend="reference")
    assert [r["output_tokens"] for r in res["records"]] == [4, 7, 1]
    for r in res["records"]:
        times = r["chunk_times"]
        assert len(times) == r["output_tokens"] and r["ttft"] == times[0] > 0
        assert times == sorted(times)
    assert res["elapsed_s"] >= sum(r["chunk_times"][-1] for r in res["records"])
