"""Prometheus metrics of the serving engine (names fixed by DESIGN.md).

Each EngineMetrics owns its CollectorRegistry, so several servers can live in one process (tests).
Counters mirrored from the engine's cumulative stats (prefix cache, preemptions) are advanced by deltas.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "EngineMetrics"]

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 10.0)

# engine kv_cache_stats() key -> our counter attribute
_MIRRORED = {"prefix_cache_queries": "prefix_cache_queries", "prefix_cache_hits": "prefix_cache_hits",
             "num_preemptions": "num_preemptions",
             "spec_decode_num_draft_tokens": "spec_decode_num_draft_tokens",
             "spec_decode_num_accepted_tokens": "spec_decode_num_accepted_tokens"}


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        self.kv_cache_usage = gauge("pagedllm_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0-1).")
        self.num_running = gauge("pagedllm_num_requests_running", "Requests running in the engine.")
        self.num_waiting = gauge("pagedllm_num_requests_waiting", "Requests waiting to be scheduled.")
        self.prefix_cache_queries = counter("pagedllm_prefix_cache_queries_total",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("pagedllm_prefix_cache_hits_total",
                                         "Prompt tokens served from the prefix cache.")
        self.num_preemptions = counter("pagedllm_num_preemptions_total", "Requests preempted by the scheduler.")
        self.spec_decode_num_draft_tokens = counter("pagedllm_spec_decode_num_draft_tokens_total",
                                                    "Draft tokens proposed by speculative decoding.")
        self.spec_decode_num_accepted_tokens = counter("pagedllm_spec_decode_num_accepted_tokens_total",
                                                       "Draft tokens accepted by verification.")
        self.prompt_tokens = counter("pagedllm_prompt_tokens_total", "Prompt tokens processed.")
        self.generation_tokens = counter("pagedllm_generation_tokens_total", "Tokens generated.")
        self.ttft = Histogram("pagedllm_time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("pagedllm_inter_token_latency_seconds", "Time between consecutive tokens.",
                             labels, buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self._last: dict[str, float] = {}

    def update_engine_stats(self, stats: dict, num_running: int, num_waiting: int) -> None:
        """Gauges and mirrored counters from one engine snapshot (called by the engine loop thread)."""
        num_blocks = stats.get("num_blocks") or 0
        if num_blocks:
            self.kv_cache_usage.set((num_blocks - stats.get("num_free_blocks", num_blocks)) / num_blocks)
        self.num_running.set(num_running)
        self.num_waiting.set(num_waiting)
        for key, attr in _MIRRORED.items():
            if key not in stats:
                continue
            value = float(stats[key])
            delta = value - self._last.get(key, 0.0)
            if delta > 0:  # engine counters only grow; a reset engine just restarts the baseline
                getattr(self, attr).inc(delta)
            self._last[key] = value

    def render(self) -> bytes:
        return generate_latest(self.registry)
