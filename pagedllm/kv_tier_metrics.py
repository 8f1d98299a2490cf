"""The disk tier's Prometheus metrics and its clause of the 10 s stats line (engine/disk_tier.py stats() keys).

Counters advance by the deltas of the engine's cumulative stats (as metrics.py's); the two latency histograms are
accumulated by the worker (worker/kv_offload.LatencyHistogram) and exported as they are by a custom collector.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import HistogramMetricFamily

# stats key -> (metric name, help)
_COUNTERS = {
    "kv_disk_spilled_blocks": ("pagedllm_kv_disk_spilled_blocks_total", "KV blocks written to the disk tier."),
    "kv_disk_spilled_bytes": ("pagedllm_kv_disk_spilled_bytes_total", "Bytes of KV blocks written to the disk tier."),
    "kv_disk_dropped_spills": ("pagedllm_kv_disk_dropped_spills_total",
                               "Spills dropped because the write queue was full (the disk was behind)."),
    "kv_disk_loaded_bytes": ("pagedllm_kv_disk_loaded_bytes_total", "Bytes of KV blocks read from the disk tier."),
    "kv_disk_load_errors": ("pagedllm_kv_disk_load_errors_total",
                            "Blocks that could not be loaded (missing, torn or corrupt): prefilled instead."),
}
_GAUGES = {
    "kv_disk_store_bytes": ("pagedllm_kv_disk_store_bytes", "Bytes the disk tier holds."),
    "kv_disk_store_blocks": ("pagedllm_kv_disk_store_blocks", "KV blocks the disk tier holds."),
}
_HISTOGRAMS = {
    "kv_disk_spill_seconds": ("pagedllm_kv_disk_spill_latency_seconds",
                              "Time from a block's spill (copied out of the pool) to its file in place."),
    "kv_disk_load_seconds": ("pagedllm_kv_disk_load_latency_seconds",
                             "Time to read one request's blocks from the disk tier."),
}


def tier_hit_tokens(stats: dict) -> dict[str, int]:
    """Prompt tokens served from each tier: disk = loaded from disk, ram = the other prefix-cache hits."""
    disk = int(stats.get("prefix_cache_disk_hits", 0))
    return {"ram": max(0, int(stats.get("prefix_cache_hits", 0)) - disk), "disk": disk}


class _Histograms:
    """Exports the latest snapshots of the worker's histograms."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshots: dict[str, dict] = {}

    def describe(self) -> list:
        return []

    def collect(self):
        for key, (name, doc) in _HISTOGRAMS.items():
            snap = self.snapshots.get(key)
            if not snap:
                continue
            family = HistogramMetricFamily(name, doc, labels=["model_name"])
            cumulative, buckets = 0, []
            for le, n in zip(snap["buckets"], snap["counts"], strict=False):
                cumulative += n
                buckets.append((repr(float(le)), cumulative))
            buckets.append(("+Inf", snap["count"]))
            family.add_metric([self.model_name], buckets, sum_value=snap["sum"])
            yield family


class DiskTierMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]
        self.model_name = model_name
        self._counters = {k: Counter(n, d, labels, registry=registry).labels(model_name)
                          for k, (n, d) in _COUNTERS.items()}
        self._gauges = {k: Gauge(n, d, labels, registry=registry).labels(model_name) for k, (n, d) in _GAUGES.items()}
        self._hits = Counter("pagedllm_prefix_cache_hits_by_tier_total",
                             "Prompt tokens served from the prefix cache, by tier (ram, disk).", [*labels, "tier"],
                             registry=registry)
        self._hit_bytes = Counter("pagedllm_prefix_cache_hit_bytes_total",
                                  "Bytes of KV served from the prefix cache, by tier (ram, disk).", [*labels, "tier"],
                                  registry=registry)
        self._histograms = _Histograms(model_name)
        registry.register(self._histograms)
        self._last: dict[str, float] = {}

    def update(self, stats: dict) -> None:
        for key, counter in self._counters.items():
            self._advance(counter, key, stats.get(key, 0))
        for key, gauge in self._gauges.items():
            gauge.set(stats.get(key, 0))
        per_token = stats.get("kv_bytes_per_token", 0)
        for tier, tokens in tier_hit_tokens(stats).items():
            self._advance(self._hits.labels(self.model_name, tier), f"hits-{tier}", tokens)
            self._advance(self._hit_bytes.labels(self.model_name, tier), f"bytes-{tier}", tokens * per_token)
        for key in _HISTOGRAMS:
            if key in stats:
                self._histograms.snapshots[key] = stats[key]

    def _advance(self, counter, key: str, value: float) -> None:
        delta = float(value) - self._last.get(key, 0.0)
        if delta > 0:  # cumulative engine counters: only ever forward
            counter.inc(delta)
        self._last[key] = float(value)


def stats_clause(stats: dict, last: dict) -> str:
    """The disk tier's part of the 10 s stats line: hit rate by tier, bytes read and written since the last line
    with their mean latencies, and the store's size. `last` is updated to this snapshot."""
    hits = tier_hit_tokens(stats)
    queries = stats.get("prefix_cache_queries", 0) or 1
    load, spill = stats.get("kv_disk_load_seconds") or {}, stats.get("kv_disk_spill_seconds") or {}

    def since(key: str, value: float) -> float:
        return value - last.get(key, 0.0)

    loads, load_s = since("loads", load.get("count", 0)), since("load_s", load.get("sum", 0.0))
    spills, spill_s = since("spills", spill.get("count", 0)), since("spill_s", spill.get("sum", 0.0))
    read = since("read", stats.get("kv_disk_loaded_bytes", 0))
    written = since("written", stats.get("kv_disk_spilled_bytes", 0))
    last.update(loads=load.get("count", 0), load_s=load.get("sum", 0.0), spills=spill.get("count", 0),
                spill_s=spill.get("sum", 0.0), read=stats.get("kv_disk_loaded_bytes", 0),
                written=stats.get("kv_disk_spilled_bytes", 0))
    return (f"Prefix hits by tier: RAM {100.0 * hits['ram'] / queries:.1f}%, disk {100.0 * hits['disk'] / queries:.1f}%"
            f"; Disk KV: read {read / 2**20:.1f} MiB in {loads:.0f} loads"
            f"{f' ({1e3 * load_s / loads:.0f} ms each)' if loads else ''}, wrote {written / 2**20:.1f} MiB"
            f"{f' ({1e3 * spill_s / spills:.1f} ms per block)' if spills else ''}"
            f", {stats.get('kv_disk_dropped_spills', 0)} spills dropped, store "
            f"{stats.get('kv_disk_store_bytes', 0) / 2**20:.1f} MiB")
