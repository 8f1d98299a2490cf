"""/metrics of a data-parallel server: every replica's Prometheus text merged, each sample with a `replica`
label, one HELP/TYPE per metric family; plus the router's own replica health gauge."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


class _Merged:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def merge_replica_metrics(texts: Mapping[int, str], healthy: Mapping[int, bool]) -> bytes:
    """texts: replica index -> its exposition text (may be empty for a replica never reached)."""
    merged: dict[str, Metric] = {}
    for index, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text or ""):
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                out.samples.append(Sample(s.name, {**s.labels, "replica": str(index)}, s.value, s.timestamp,
                                          s.exemplar))
    up = Metric("pagedllm_replica_healthy", "1 if the engine replica answers its health check.", "gauge")
    for index, ok in sorted(healthy.items()):
        up.samples.append(Sample("pagedllm_replica_healthy", {"replica": str(index)}, float(ok), None, None))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged([*merged.values(), up]))
    return generate_latest(registry)
