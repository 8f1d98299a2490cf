"""Prometheus metrics of the serving engine (names fixed by DESIGN.md).

Each EngineMetrics owns its CollectorRegistry, so several servers can live in one process (tests).
Counters mirrored from the engine's cumulative stats (prefix cache, preemptions) are advanced by deltas.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pagedllm.kv_tier_metrics import DiskTierMetrics, stats_clause
from pagedllm.outputs import EmbeddingRequestOutput, RequestOutput, completions_of

__all__ = ["CONTENT_TYPE_LATEST", "EngineMetrics", "StatsLogger"]

logger = logging.getLogger("pagedllm.stats")

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 10.0)

_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

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

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.e2e = histogram("pagedllm_e2e_request_latency_seconds", "Arrival to last token.", _LATENCY_BUCKETS)
        self.queue_time = histogram("pagedllm_request_queue_time_seconds", "Arrival to first scheduled.",
                                    _LATENCY_BUCKETS)
        self.prefill_time = histogram("pagedllm_request_prefill_time_seconds", "First scheduled to first token.",
                                      _LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("pagedllm_request_prompt_tokens", "Prompt tokens per request.",
                                               _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("pagedllm_request_generation_tokens",
                                                   "Generated tokens per request (all n samples).", _TOKEN_BUCKETS)
        self._success = Counter("pagedllm_request_success_total", "Requests finished, by finish reason.",
                                [*labels, "finished_reason"], registry=r)
        self._kv_blocks = Gauge("pagedllm_kv_cache_blocks", "KV cache blocks: used by running requests, cached "
                                "and evictable (free, holding a prefix), or free and empty.", [*labels, "state"],
                                registry=r)
        self.model_name = model_name
        self._last: dict[str, float] = {}
        self.disk_tier: DiskTierMetrics | None = None  # made when the engine's stats first show a disk tier

    def observe_finished(self, out: RequestOutput | EmbeddingRequestOutput) -> None:
        """The per-request histograms and the finish-reason counter, once a request has finished."""
        m = out.metrics
        if m is not None and m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
            if m.first_scheduled_time is not None:
                self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
                if m.first_token_time is not None:
                    self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))
        completions = completions_of(out)
        self.request_generation_tokens.observe(sum(len(c.token_ids) for c in completions))
        for reason in [c.finish_reason or "abort" for c in completions] if completions else ["stop"]:
            self._success.labels(self.model_name, reason).inc()  # (an embedding: one "stop")

    def update_engine_stats(self, stats: dict, num_running: int, num_waiting: int) -> None:
        """Gauges and mirrored counters from one engine snapshot (called by the engine loop thread)."""
        num_blocks = stats.get("num_blocks") or 0
        if num_blocks:
            free = stats.get("num_free_blocks", num_blocks)
            self.kv_cache_usage.set((num_blocks - free) / num_blocks)
            cached = stats.get("num_cached_free_blocks", 0)
            for state, value in (("used", num_blocks - free), ("cached", cached), ("free", free - cached)):
                self._kv_blocks.labels(self.model_name, state).set(value)
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
        if "kv_disk_store_bytes" in stats:
            if self.disk_tier is None:
                self.disk_tier = DiskTierMetrics(self.registry, self.model_name)
            self.disk_tier.update(stats)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StatsLogger:
    """`pagedllm serve`'s periodic INFO line, as vLLM's: throughput since the last line, queue, KV, prefix hits."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._last_time = time.monotonic()
        self._last: dict[str, float] = {}
        self._last_disk: dict[str, float] = {}  # the disk tier's clause counts since the last line

    def maybe_log(self, stats: dict, prompt_tokens: int, generation_tokens: int, now: float | None = None) -> bool:
        """Log one line if `interval` has passed and something ran since the last line; True if logged."""
        now = time.monotonic() if now is None else now
        elapsed = now - self._last_time
        if elapsed < self.interval:
            return False
        last = self._last or {"prompt": prompt_tokens, "gen": generation_tokens}
        busy = stats.get("num_running", 0) or stats.get("num_waiting", 0)
        moved = prompt_tokens != last["prompt"] or generation_tokens != last["gen"]
        self._last_time = now
        self._last = {"prompt": prompt_tokens, "gen": generation_tokens}
        if not (busy or moved):
            return False
        num_blocks = stats.get("num_blocks") or 1
        queries = stats.get("prefix_cache_queries", 0)
        disk = ", " + stats_clause(stats, self._last_disk) if "kv_disk_store_bytes" in stats else ""
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
            "Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%, Preemptions: %d%s",
            (prompt_tokens - last["prompt"]) / elapsed, (generation_tokens - last["gen"]) / elapsed,
            stats.get("num_running", 0), stats.get("num_waiting", 0),
            100.0 * (num_blocks - stats.get("num_free_blocks", num_blocks)) / num_blocks,
            100.0 * stats.get("prefix_cache_hits", 0) / queries if queries else 0.0,
            stats.get("num_preemptions", 0), disk)
        return True

