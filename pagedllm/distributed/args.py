"""Command-line options of data-parallel serving (no Ray import: `pagedllm serve --help` works without it)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from pagedllm.distributed.routing import POLICIES


@dataclass
class DataParallelArgs:
    data_parallel_size: int = 1
    ray_address: str | None = None  # None: start a local Ray (or use the one this process already runs)
    threads: int | None = None  # per replica; None: this machine's cores / data_parallel_size
    routing_policy: str = "prefix"
    max_restarts: int = 4  # Ray restarts a dead replica this many times
    object_store_memory: int = 256 << 20  # of a local Ray we start: our objects are small outputs
    startup_timeout: float = 600.0  # seconds for every replica to load its model
    health_interval: float = 0.5

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.routing_policy not in POLICIES:
            raise ValueError(f"routing_policy must be one of {POLICIES}, got {self.routing_policy!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")

    @property
    def enabled(self) -> bool:
        """Serve through Ray replicas (else the single-process server)."""
        return self.data_parallel_size > 1 or self.ray_address is not None

    @property
    def threads_per_replica(self) -> int:
        return self.threads or max(1, (os.cpu_count() or 1) // self.data_parallel_size)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("data parallel (Ray; pip install pagedllm[ray])")
        g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                       help="engine replicas, each a Ray actor with its own KV cache (--kv-cache-memory each)")
        g.add_argument("--ray-address", default=None,
                       help="an existing Ray cluster ('auto' or ray://host:port); default: start a local one")
        g.add_argument("--threads", type=int, default=None,
                       help="torch threads per replica (default: cores / data-parallel-size)")
        g.add_argument("--routing-policy", default="prefix", choices=POLICIES,
                       help="which replica takes a request: the one holding its prefix, the least loaded, or in turn")
        g.add_argument("--max-replica-restarts", dest="max_restarts", type=int, default=4,
                       help="times Ray restarts a replica that died")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> DataParallelArgs:
        return cls(data_parallel_size=getattr(ns, "data_parallel_size", 1),
                   ray_address=getattr(ns, "ray_address", None), threads=getattr(ns, "threads", None),
                   routing_policy=getattr(ns, "routing_policy", "prefix"),
                   max_restarts=getattr(ns, "max_restarts", 4))
