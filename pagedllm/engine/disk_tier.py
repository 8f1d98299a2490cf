"""The disk tier of the prefix cache, wired into one engine (`kv_disk_cache_dir`, `kv_disk_cache_size`).

core/kv_tier.py decides (spills, loads, pins), worker/kv_offload.py moves the bytes, worker/kv_disk_store.py keeps
the files. This module builds them, names the store by a fingerprint of everything a block's bytes depend on, and
gives the engine its three calls: `before_execute` (after scheduling: copy out the blocks the pool evicted, then
start the loads), `after_step` (offer the blocks freed this step: written at completion; collect finished loads)
and `close` (at shutdown: write every cached block the store lacks, so that a restart finds the hot prefixes).
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import weakref
from typing import TYPE_CHECKING

from pagedllm.core.kv_tier import TierCoordinator
from pagedllm.worker.kv_disk_store import VERSION, DiskKVStore
from pagedllm.worker.kv_offload import KVOffloadWorker

if TYPE_CHECKING:
    import torch

    from pagedllm.core.hybrid_kv_cache_manager import HybridKVCacheManager
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.core.kv_groups import KVGroupLayout
    from pagedllm.model.config import ModelConfig
    from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_SIZE = 16 << 30  # bytes on disk when kv_disk_cache_size is not given
QUEUE_BYTES = 256 << 20  # spills waiting for the disk; more are dropped
_SAMPLES, _SAMPLE_BYTES = 16, 1 << 16  # the model files' identity: size + 16 slices of 64 KiB across each file
_MODEL_SUFFIXES = (".gguf", ".safetensors", ".json", ".bin", ".model")


def file_identity(path: str) -> str:
    """Size and a digest of slices spread over the file: two checkpoints with one header differ in their weights;
    reading 1 MiB is cheap next to loading the model."""
    h = hashlib.sha256()
    size = os.path.getsize(path)
    h.update(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        for i in range(_SAMPLES):
            f.seek(max(0, size - _SAMPLE_BYTES) * i // (_SAMPLES - 1))
            h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def model_identity(model_path: str) -> dict[str, str]:
    """file name -> identity of the checkpoint file, or of each checkpoint file of a directory."""
    if os.path.isfile(model_path):
        return {os.path.basename(model_path): file_identity(model_path)}
    names = sorted(n for n in os.listdir(model_path) if n.endswith(_MODEL_SUFFIXES)
                   and os.path.isfile(os.path.join(model_path, n)))
    return {n: file_identity(os.path.join(model_path, n)) for n in names}


def fingerprint_facts(*, model_path: str, config: ModelConfig, dtype: torch.dtype, quantization: str,
                      kv_cache_dtype: str, block_size: int, layout: KVGroupLayout, batch_invariant: bool,
                      attention_backend: str) -> dict:
    """Everything a KV block's bytes depend on: the model (its files, shape), how it computes (dtype, weights as
    stored or not, the kernels and whether batch-invariant), and how the pool stores K/V (dtype, block size, the
    KV-group layout). Two engines share entries exactly when these are equal."""
    from pagedllm.kernels.variants import build_variant

    try:
        variant = build_variant()[0]
    except Exception:  # no compiler: the portable torch paths
        variant = "none"
    return {"format": VERSION, "model": model_identity(str(model_path)), "num_layers": config.num_layers,
            "num_kv_heads": config.num_kv_heads, "head_dim": config.head_dim, "dtype": str(dtype),
            "quantization": quantization, "kv_cache_dtype": kv_cache_dtype,
            "block_size": block_size, "kv_groups": [[list(g.layers), g.window] for g in layout.groups],
            "batch_invariant": batch_invariant, "attention_backend": attention_backend,
            "kernel_variant": variant}


def fingerprint(facts: dict) -> str:
    return hashlib.sha256(repr(sorted(facts.items())).encode()).hexdigest()[:20]


class DiskTier:
    def __init__(self, kv: KVCacheManager | HybridKVCacheManager, pool: torch.Tensor, facts: dict, directory: str,
                 size_bytes: int) -> None:
        """kv: the engine's KV cache manager (the coordinator hooks its block pool); pool: the runner's KV pool
        tensor (the bytes moved); facts: fingerprint_facts of the engine (the store's name and metadata)."""
        block_bytes = pool[:, :, 0].numel() * pool.element_size()
        self.store = DiskKVStore(directory, fingerprint(facts), size_bytes, block_bytes, meta=facts)
        self.worker = KVOffloadWorker(pool, self.store, QUEUE_BYTES)
        self.coordinator = TierCoordinator(kv, self.store.contains)
        self.block_bytes = block_bytes
        self._closed = False
        ref = weakref.ref(self)
        atexit.register(lambda: (t := ref()) is not None and t.close())  # the offline API has no shutdown call
        logger.info("disk KV cache: %s (%d entries, %.1f MiB of at most %.1f MiB; %d bytes per block)",
                    self.store.dir, self.store.num_entries, self.store.size_bytes / 2**20, size_bytes / 2**20,
                    block_bytes)

    def before_execute(self) -> None:
        """After scheduling, before the model step writes: copy out the evicted blocks, then start the loads
        (a load's target may be one of those evicted blocks); collect the loads that completed meanwhile."""
        c = self.coordinator
        self.worker.spill(c.take_spills())
        for load in c.take_new_loads():
            self.worker.start_load(load.load_id, [(b.block_id, key) for b, key in load.targets])
        self._collect_loads()

    def after_step(self, idle: bool = False) -> None:
        """Offer the blocks freed this step (finished requests: written at completion) and collect the loads that
        completed. idle: nothing was scheduled, so wait a little for a load rather than spin."""
        c = self.coordinator
        self.worker.spill(c.take_spills())
        if idle and c.loads:
            self.worker.wait(0.01)
        self._collect_loads()

    def _collect_loads(self) -> None:
        """Completed loads register their blocks; their requests go back to the queue at the next schedule()."""
        for load_id, ok in self.worker.poll():
            self.coordinator.finish_load(load_id, ok)

    def close(self) -> None:
        """Write every cached block the store lacks and wait for the writes (shutdown); then stop the threads."""
        if self._closed:
            return
        self._closed = True
        self.worker.spill(self.coordinator.take_spills())
        self._collect_loads()
        blocks = self.coordinator.cached_free_blocks()
        step = max(1, QUEUE_BYTES // self.block_bytes)  # in slices: the queue holds a bounded number of bytes
        for i in range(0, len(blocks), step):
            self.worker.spill(blocks[i:i + step])
            self.worker.flush()
        self.worker.close()

    def clear(self) -> int:
        """Delete every entry of this model's store (POST /reset_prefix_cache?reset_external=true)."""
        self.worker.flush()
        return self.store.clear()

    def stats(self) -> dict:
        s = self.coordinator.stats()
        s.update(self.worker.stats())
        s.update({"kv_disk_store_bytes": self.store.size_bytes, "kv_disk_store_blocks": self.store.num_entries,
                  "kv_disk_capacity_bytes": self.store.capacity, "kv_disk_block_bytes": self.block_bytes,
                  "kv_disk_corrupt_entries": self.store.num_corrupt, "kv_disk_spills_enabled": not self.store.disabled})
        return s


def make_disk_tier(directory: str | None, size: int | str | None, *, kv: KVCacheManager | HybridKVCacheManager,
                   runner: ModelRunner, model_path: str, config: ModelConfig, dtype: torch.dtype, quantization: str,
                   kv_cache_dtype: str, layout: KVGroupLayout) -> DiskTier | None:
    """The engine's disk tier, or None (off, the default; or not possible with this engine, said once). The
    runner gives the pool and how it computes (block size, attention backend, kernel mode); the rest, what else
    a block's bytes depend on (fingerprint_facts)."""
    if not directory:
        return None
    from pagedllm.engine.args import parse_bytes

    if not kv.enable_prefix_caching or kv.kv_layout != "paged":
        logger.warning("disk KV cache: off, it needs prefix caching and the paged KV layout")
        return None
    facts = fingerprint_facts(model_path=model_path, config=config, dtype=dtype, quantization=quantization,
                              kv_cache_dtype=kv_cache_dtype, block_size=runner.block_size, layout=layout,
                              batch_invariant=runner.kernel_mode.invariant, attention_backend=runner.backend.name)
    size_bytes = DEFAULT_SIZE if size is None else parse_bytes(size, "kv_disk_cache_size")
    return DiskTier(kv, runner.kv_caches.pool, facts, directory, size_bytes)
