"""/metrics of a data-parallel server: replicas' texts merged with a `replica` label (no Ray needed)."""

from __future__ import annotations

import random

from prometheus_client.parser import text_string_to_metric_families
from tiny_models import fresh_seed

from pagedllm.distributed.metrics import merge_replica_metrics
from pagedllm.metrics import EngineMetrics


def test_merge_labels_every_sample_and_keeps_one_family_per_name():
    rng = random.Random(fresh_seed())
    counts = [rng.randint(1, 1000) for _ in range(3)]
    texts = {}
    for i, n in enumerate(counts):
        m = EngineMetrics("smol")
        m.prompt_tokens.inc(n)
        m.ttft.observe(rng.random())
        texts[i] = m.render().decode()
    texts[3] = ""  # a replica never reached
    merged = merge_replica_metrics(texts, {0: True, 1: True, 2: False, 3: False}).decode()
    families = list(text_string_to_metric_families(merged))
    names = [f.name for f in families]
    assert len(names) == len(set(names))  # one HELP/TYPE per family
    prompt = {s.labels["replica"]: s.value for f in families for s in f.samples
              if s.name == "pagedllm_prompt_tokens_total"}
    assert prompt == {str(i): float(n) for i, n in enumerate(counts)}
    ttft_count = [s for f in families for s in f.samples if s.name == "pagedllm_time_to_first_token_seconds_count"]
    assert sorted(s.labels["replica"] for s in ttft_count) == ["0", "1", "2"]
    assert all(s.labels["model_name"] == "smol" for s in ttft_count)
    healthy = {s.labels["replica"]: s.value for f in families for s in f.samples
               if s.name == "pagedllm_replica_healthy"}
    assert healthy == {"0": 1.0, "1": 1.0, "2": 0.0, "3": 0.0}
