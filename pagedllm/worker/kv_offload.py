"""Moves KV blocks between the pool and the disk store (worker/kv_disk_store.py), off the engine step's path.

A block's bytes are pool[:, :, block_id] of the pool tensor [layers per block, 2, num_blocks, B, Hkv, row] (every
layer of a KV group, K and V, scales included for int8 KV): as raw bytes, whatever the dtype.
- Spill: the engine thread copies the block out (one memcpy of the block, before the next model step may write
  into it) and queues it; a writer thread checksums and writes it. When the queue holds max_queue_bytes, further
  spills are dropped (counted), never waited for.
- Load: a reader thread reads each file straight into the target block's memory (one scatter read per block) and
  checks it there; the block is pinned by the load (core/kv_tier.py), so nothing else reads or writes it meanwhile.
  The engine polls for completed loads.
Only numpy copies and file I/O run on the threads (they release the GIL; no torch op, so no second OpenMP team).
"""

from __future__ import annotations

import bisect
import logging
import queue
import threading
import time
from collections import deque

import torch

from pagedllm.worker.kv_disk_store import DiskKVStore

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LatencyHistogram:
    """Cumulative counts per bucket, sum and count (exported as a Prometheus histogram by kv_tier_metrics.py)."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one: above every bucket
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def snapshot(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum, "count": self.count}


class KVOffloadWorker:
    def __init__(self, pool: torch.Tensor, store: DiskKVStore, max_queue_bytes: int) -> None:
        self._pool = pool.view(torch.uint8).numpy()  # shares the pool's memory
        self.block_bytes = self._pool[:, :, 0].nbytes
        if store.payload_bytes != self.block_bytes:
            raise ValueError(f"store holds {store.payload_bytes}-byte blocks, the pool's are {self.block_bytes}")
        self.store = store
        self.max_queue_bytes = max_queue_bytes
        self._cond = threading.Condition()
        self._writes: deque[tuple[bytes, bytes, float]] = deque()  # (key, payload, queued at), guarded by _cond
        self._queued: set[bytes] = set()  # keys queued or being written
        self._queued_bytes = 0
        self._loads: queue.SimpleQueue[tuple[int, list[tuple[int, bytes]], float] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[int, list[bool]]] = queue.SimpleQueue()
        self._done_event = threading.Event()
        self._closed = False
        self.num_spilled = self.num_dropped = self.num_loaded = self.num_load_failed = 0
        self.spilled_bytes = self.loaded_bytes = 0
        self.writer_cpu_seconds = 0.0  # CPU time the writer thread spent writing (it competes with the model's)
        self.spill_latency = LatencyHistogram()
        self.load_latency = LatencyHistogram()
        self._writer = threading.Thread(target=self._write_loop, name="pagedllm-kv-spill", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="pagedllm-kv-load", daemon=True)
        self._writer.start()
        self._reader.start()

    # ---- engine thread -------------------------------------------------------------------------------
    def spill(self, blocks: list[tuple[int, bytes]]) -> None:
        """Copy these (block id, key) out of the pool and queue them for writing (skipping keys the store has or
        has queued). Call before the model step that may overwrite them."""
        store = self.store
        for block_id, key in blocks:
            if store.disabled or self._closed:
                return
            if key in self._queued or store.has_local(key):
                continue
            if self._queued_bytes + self.block_bytes > self.max_queue_bytes:
                self.num_dropped += 1  # the disk is behind: never stall a step for it
                continue
            payload = self._pool[:, :, block_id].tobytes()
            with self._cond:
                self._writes.append((key, payload, time.perf_counter()))
                self._queued.add(key)
                self._queued_bytes += len(payload)
                self._cond.notify_all()

    def start_load(self, load_id: int, targets: list[tuple[int, bytes]]) -> None:
        """Read each (block id, key) into its block; poll() reports (load_id, ok per target) when done."""
        self._loads.put((load_id, list(targets), time.perf_counter()))

    def poll(self) -> list[tuple[int, list[bool]]]:
        done = []
        while True:
            try:
                done.append(self._done.get_nowait())
            except queue.Empty:
                self._done_event.clear()
                if not self._done.empty():  # completed between get_nowait and clear
                    self._done_event.set()
                return done

    def wait(self, timeout: float) -> bool:
        """Block until a load completes (or timeout); True if one is ready to poll."""
        return self._done_event.wait(timeout)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued spill is on disk (or dropped: out of space); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queued, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued writes, then stop both threads."""
        if self._closed:
            return
        self.flush(timeout)
        self._closed = True
        with self._cond:
            self._cond.notify_all()
        self._loads.put(None)
        self._writer.join(timeout)
        self._reader.join(timeout)

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    # ---- threads -------------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._writes or self._closed)
                if not self._writes:
                    return
                key, payload, t0 = self._writes.popleft()
            ok = False
            cpu = time.thread_time()
            try:
                ok = self.store.put(key, payload)
            except Exception:  # a spill must never take the engine down
                logger.exception("disk KV cache: spill failed")
            self.writer_cpu_seconds += time.thread_time() - cpu
            with self._cond:
                self._queued.discard(key)
                self._queued_bytes -= len(payload)
                if ok:
                    self.num_spilled += 1
                    self.spilled_bytes += len(payload)
                    self.spill_latency.observe(time.perf_counter() - t0)
                self._cond.notify_all()

    def _read_loop(self) -> None:
        while True:
            item = self._loads.get()
            if item is None:
                return
            load_id, targets, t0 = item
            ok = []
            for block_id, key in targets:
                try:
                    ok.append(self.store.read_into(key, self._segments(block_id)))
                except Exception:
                    logger.exception("disk KV cache: load failed")
                    ok.append(False)
            good = sum(ok)
            self.num_loaded += good
            self.num_load_failed += len(ok) - good
            self.loaded_bytes += good * self.block_bytes
            self.load_latency.observe(time.perf_counter() - t0)
            self._done.put((load_id, ok))
            self._done_event.set()

    def _segments(self, block_id: int) -> list[memoryview]:
        """The block's memory as writable byte views, in the order of its bytes in a file."""
        pool = self._pool
        return [memoryview(pool[p, kv, block_id]).cast("B") for p in range(pool.shape[0]) for kv in range(2)]

    def stats(self) -> dict:
        return {"kv_disk_spilled_blocks": self.num_spilled, "kv_disk_spilled_bytes": self.spilled_bytes,
                "kv_disk_dropped_spills": self.num_dropped, "kv_disk_loaded_bytes": self.loaded_bytes,
                "kv_disk_load_errors": self.num_load_failed, "kv_disk_queued_bytes": self._queued_bytes,
                "kv_disk_spill_seconds": self.spill_latency.snapshot(),
                "kv_disk_load_seconds": self.load_latency.snapshot()}
