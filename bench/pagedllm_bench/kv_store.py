"""Which embedded store for the disk tier of the prefix cache: plain files (atomic rename), SQLite, LMDB.

`pagedllm bench kv-store [--block-bytes 360448] [--blocks 512] [--run 256]`. The access pattern of the tier
(worker/kv_disk_store.py): values of one KV block (a 1B-class model, bf16, 16 tokens: ~360 KB), written one by
one from a background thread, read back in runs of up to 256 (a 4k-token prefix), deleted oldest first when the
store is over its size, several processes (data-parallel replicas) writing and reading the same directory.
Measures per store: write MB/s, read MB/s of a run from the page cache and after the pages were dropped
(posix_fadvise DONTNEED: a read from the device, as after a restart), delete of half the entries, and the bytes
on disk after that delete (does the store give space back?). LMDB is measured only if the `lmdb` package is
installed (it is not a dependency).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

from pagedllm_bench import common


def add_args(p: argparse.ArgumentParser) -> None:
    common.add_common_args(p, "64 blocks, runs of 32")
    p.add_argument("--block-bytes", type=int, default=2 * 22 * 16 * 4 * 64 * 2,
                   help="bytes of one value (default: one 16-token bf16 block of a TinyLlama-1.1B-shaped model)")
    p.add_argument("--blocks", type=int, default=None, help="entries written (default 512; --quick 64)")
    p.add_argument("--run", type=int, default=None, help="entries read back in one run (default 256; --quick 32)")
    p.add_argument("--dir", default=None, help="where the stores live (default: a temporary directory)")


def drop_page_cache(root: str) -> None:
    """Evict the store's file pages from the page cache (a device read next, as after a reboot)."""
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _du(root: str) -> int:
    return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(root) for f in fs)


class _Files:
    name = "files (atomic rename)"

    def __init__(self, root: str) -> None:
        self.root = root
        os.makedirs(os.path.join(root, "tmp"), exist_ok=True)

    def _path(self, key: bytes) -> str:
        h = key.hex()
        return os.path.join(self.root, h[:2], h)

    def put(self, key: bytes, value: bytes) -> None:
        tmp = os.path.join(self.root, "tmp", key.hex())
        with open(tmp, "wb") as f:
            f.write(value)
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.replace(tmp, path)

    def get(self, key: bytes) -> bytes:
        with open(self._path(key), "rb") as f:
            return f.read()

    def delete(self, key: bytes) -> None:
        os.unlink(self._path(key))

    def close(self) -> None:
        pass


class _SQLite:
    name = "SQLite (WAL)"

    def __init__(self, root: str) -> None:
        os.makedirs(root, exist_ok=True)
        self.db = sqlite3.connect(os.path.join(root, "kv.sqlite"), isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("CREATE TABLE IF NOT EXISTS kv (k BLOB PRIMARY KEY, v BLOB) WITHOUT ROWID")

    def put(self, key: bytes, value: bytes) -> None:
        self.db.execute("INSERT OR REPLACE INTO kv VALUES (?, ?)", (key, value))

    def get(self, key: bytes) -> bytes:
        return self.db.execute("SELECT v FROM kv WHERE k = ?", (key,)).fetchone()[0]

    def delete(self, key: bytes) -> None:
        self.db.execute("DELETE FROM kv WHERE k = ?", (key,))

    def close(self) -> None:
        self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self.db.close()


class _LMDB:
    name = "LMDB"

    def __init__(self, root: str, map_size: int) -> None:
        import lmdb

        self.env = lmdb.open(root, map_size=map_size, max_dbs=1)

    def put(self, key: bytes, value: bytes) -> None:
        with self.env.begin(write=True) as txn:
            txn.put(key, value)

    def get(self, key: bytes) -> bytes:
        with self.env.begin(buffers=True) as txn:
            return bytes(txn.get(key))

    def delete(self, key: bytes) -> None:
        with self.env.begin(write=True) as txn:
            txn.delete(key)

    def close(self) -> None:
        self.env.close()


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _measure(make: Callable[[str], object], root: str, keys: list[bytes], values: list[bytes], run: int) -> dict:
    store = make(root)
    mb = len(values[0]) / 1e6
    write_s = _timed(lambda: [store.put(k, v) for k, v in zip(keys, values, strict=True)])
    run_keys = keys[-run:]
    warm_s = _timed(lambda: [store.get(k) for k in run_keys])
    store.close()
    drop_page_cache(root)
    store = make(root)  # reopened, as after a restart
    cold_s = _timed(lambda: [store.get(k) for k in run_keys])
    assert store.get(keys[0]) == values[0]
    before = _du(root)
    delete_s = _timed(lambda: [store.delete(k) for k in keys[: len(keys) // 2]])
    store.close()
    return {"write_MBps": len(keys) * mb / write_s, "read_warm_MBps": run * mb / warm_s,
            "read_cold_MBps": run * mb / cold_s, "delete_per_s": (len(keys) // 2) / delete_s,
            "disk_MB_before_delete": before / 1e6, "disk_MB_after_delete": _du(root) / 1e6}


def measure(args: argparse.Namespace) -> dict:
    n = args.blocks or (64 if args.quick else 512)
    run = min(n, args.run or (32 if args.quick else 256))
    rng = np.random.default_rng(args.seed)
    keys = [rng.bytes(34) for _ in range(n)]
    values = [rng.bytes(args.block_bytes) for _ in range(n)]
    stores: list[tuple[str, Callable[[str], object]]] = [(_Files.name, _Files), (_SQLite.name, _SQLite)]
    try:
        import lmdb  # noqa: F401

        stores.append((_LMDB.name, lambda root: _LMDB(root, 4 * n * args.block_bytes)))
    except ImportError:
        print("lmdb not installed: LMDB skipped (pip install lmdb to measure it)", file=sys.stderr)
    base = tempfile.mkdtemp(prefix="kv-store-", dir=args.dir)
    rows = []
    try:
        for name, make in stores:
            reps = []
            for rep in range(max(1, args.repeats)):
                root = os.path.join(base, f"{len(rows)}-{rep}")
                reps.append(_measure(make, root, keys, values, run))
                shutil.rmtree(root)
            row = {k: common.median([r[k] for r in reps]) for k in reps[0]}
            row["store"] = name
            rows.append(row)
            print(f"{name}: done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    cols = ["store", "write_MBps", "read_warm_MBps", "read_cold_MBps", "delete_per_s", "disk_MB_before_delete",
            "disk_MB_after_delete"]
    print(common.table(rows, cols, title=f"KV block store: {n} values of {args.block_bytes} bytes, reads of {run}"))
    payload = {"bench": "kv-store", "env": common.environment(args.threads), "results": rows,
               "workload": {"blocks": n, "run": run, "block_bytes": args.block_bytes}}
    jp, _ = common.save("kv_store" + args.tag, payload, None, args.out_dir)
    print(f"wrote {jp}")
    return payload


run = measure
