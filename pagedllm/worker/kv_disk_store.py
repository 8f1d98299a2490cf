"""The disk tier's store: one file per KV block, written under a temporary name and renamed into place.

Layout: DIR/<fingerprint>/<first 2 hex digits of the key>/<key hex>.kv, temporary files in DIR/<fingerprint>/tmp.
The fingerprint (engine/disk_tier.py) names everything the bytes depend on, so a different model (or KV dtype, block
size, KV-group layout, kernel mode) never reads these entries; `meta.json` beside them says what it stands for.

Why plain files (`pagedllm bench kv-store`, BENCHMARKS.md): for values of a KV block (hundreds of KB), files wrote
several times as fast as SQLite and faster than LMDB, and read as fast as LMDB; deleting an entry gives its space
back (SQLite and LMDB keep their file size); there is no map size to fix up front and no lock between processes:
data-parallel replicas share the directory, a rename is atomic, and a file another process deletes stays readable to
a reader that opened it.

File: a 64-byte header (magic, version, payload length, crc32 of the payload, the key) then the payload. A short,
torn or corrupted file fails the check: one warning, the file is removed, the load reports the block missing (the
request prefills it). Out of disk space: one warning, and no more spills (never a failed request).
Index: key -> size in least-recently-used order (mtime order at the scan of start-up; a load touches the file so
that other processes' scans see it as recent). A key not in the index is looked for on disk (one stat), so a block
another process wrote is a hit. Over `capacity` bytes the least recently used entries are deleted (after a rescan,
at most every RESCAN_SECONDS, that counts the other processes' entries too).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import struct
import threading
import time
import zlib
from collections import OrderedDict
from itertools import count

logger = logging.getLogger(__name__)

MAGIC = b"PKVB"
VERSION = 1
HEADER = struct.Struct("<4sHHQIH")  # magic, version, header bytes, payload bytes, crc32, key length; then the key
HEADER_BYTES = 64
SUFFIX = ".kv"
RESCAN_SECONDS = 10.0
STALE_TMP_SECONDS = 600.0  # a temporary file this old belongs to a writer that died
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def header(key: bytes, payload_bytes: int, crc: int) -> bytes:
    head = HEADER.pack(MAGIC, VERSION, HEADER_BYTES, payload_bytes, crc, len(key)) + key
    if len(head) > HEADER_BYTES:
        raise ValueError(f"key of {len(key)} bytes does not fit the header")
    return head.ljust(HEADER_BYTES, b"\0")


class DiskKVStore:
    """Thread-safe: the writer thread puts, the reader thread reads, the engine thread asks `contains`."""

    def __init__(self, root: str, fingerprint: str, capacity: int, payload_bytes: int,
                 meta: dict | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"kv_disk_cache_size must be >= 1 byte, got {capacity}")
        self.dir = os.path.join(os.path.abspath(root), fingerprint)
        self.capacity = capacity
        self.payload_bytes = payload_bytes
        self.file_bytes = HEADER_BYTES + payload_bytes
        self._tmp = os.path.join(self.dir, "tmp")
        os.makedirs(self._tmp, exist_ok=True)
        if meta is not None:
            self._write_meta(meta)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, least recently used first
        self._bytes = 0
        self._names = count()
        self._last_scan = 0.0
        self.disabled = False  # out of disk space: no more spills
        self._warned: set[str] = set()
        self.num_corrupt = 0
        self.num_evicted = 0
        self.rescan(clean_tmp=True)

    # ---- queries -------------------------------------------------------------------------------------
    @property
    def size_bytes(self) -> int:
        return self._bytes

    @property
    def num_entries(self) -> int:
        return len(self._index)

    def has_local(self, key: bytes) -> bool:
        """In this process's index (no disk access): the spill path's check."""
        return key in self._index

    def contains(self, key: bytes) -> bool:
        """The store holds this block (in the index, or on disk written by another process)."""
        if key in self._index:
            return True
        try:
            st = os.stat(self._path(key))
        except OSError:
            return False
        if st.st_size != self.file_bytes:
            return False  # being replaced, or bad: a load would find out and remove it
        with self._lock:
            if key not in self._index:
                self._index[key] = st.st_size
                self._bytes += st.st_size
        return True

    # ---- writing -------------------------------------------------------------------------------------
    def put(self, key: bytes, payload: bytes) -> bool:
        """Write one block (atomically: a reader sees the whole file or none). False if not written."""
        if self.disabled:
            return False
        if len(payload) != self.payload_bytes:
            raise ValueError(f"payload of {len(payload)} bytes, the store holds {self.payload_bytes}")
        tmp = os.path.join(self._tmp, f"{os.getpid()}-{threading.get_ident()}-{next(self._names)}")
        path = self._path(key)
        try:
            with open(tmp, "xb") as f:
                f.write(header(key, len(payload), zlib.crc32(payload)))
                f.write(payload)
            try:
                os.replace(tmp, path)
            except FileNotFoundError:  # first entry of this key prefix
                os.makedirs(os.path.dirname(path), exist_ok=True)
                os.replace(tmp, path)
        except OSError as e:
            _unlink(tmp)
            if e.errno in _NO_SPACE:
                self.disabled = True
                logger.warning("disk KV cache: no space left in %s (%s): no more blocks are written to it; the "
                               "blocks already there are still read", self.dir, e.strerror)
            else:
                self._warn_once(f"write-{e.errno}", "disk KV cache: writing a block to %s failed: %s", self.dir, e)
            return False
        with self._lock:
            self._bytes += self.file_bytes - self._index.pop(key, 0)
            self._index[key] = self.file_bytes
            over = self._bytes > self.capacity
        if over:
            self._evict()
        return True

    def _evict(self) -> None:
        if time.monotonic() - self._last_scan > RESCAN_SECONDS:
            self.rescan()  # other processes' entries count towards the size too (and may have gone)
        while True:
            with self._lock:
                if self._bytes <= self.capacity or not self._index:
                    return
                key, size = self._index.popitem(last=False)
                self._bytes -= size
            _unlink(self._path(key))
            self.num_evicted += 1

    # ---- reading -------------------------------------------------------------------------------------
    def read_into(self, key: bytes, buffers: list[memoryview]) -> bool:
        """Read a block's payload into `buffers` (writable, payload_bytes in all, in order) and check it. False if
        it is missing (no warning: another process evicted it) or bad (one warning; the file is removed); either
        way the store forgets it."""
        path = self._path(key)
        head = bytearray(HEADER_BYTES)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            self.forget(key)
            return False
        try:
            size = os.fstat(fd).st_size
            got = os.preadv(fd, [head, *buffers], 0)
        except OSError as e:
            os.close(fd)
            return self._bad(key, f"read failed: {e}")
        os.close(fd)
        magic, version, hbytes, nbytes, crc, klen = HEADER.unpack_from(head)
        if size != self.file_bytes or got != self.file_bytes:
            return self._bad(key, f"{size} bytes on disk, {self.file_bytes} expected (torn or truncated)")
        if (magic, version, hbytes, nbytes) != (MAGIC, VERSION, HEADER_BYTES, self.payload_bytes) \
                or bytes(head[HEADER.size:HEADER.size + klen]) != key:
            return self._bad(key, "bad header")
        check = 0
        for b in buffers:
            check = zlib.crc32(b, check)
        if check != crc:
            return self._bad(key, "checksum mismatch")
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        try:
            os.utime(path)  # recently used, for other processes' scans too
        except OSError:
            pass
        return True

    def _bad(self, key: bytes, why: str) -> bool:
        self.num_corrupt += 1
        logger.warning("disk KV cache: entry %s is unusable (%s): removed; the request prefills that block",
                       self._path(key), why)
        self.forget(key)
        _unlink(self._path(key))
        return False

    def forget(self, key: bytes) -> None:
        with self._lock:
            self._bytes -= self._index.pop(key, 0)

    # ---- maintenance ---------------------------------------------------------------------------------
    def rescan(self, clean_tmp: bool = False) -> None:
        """Rebuild the index from the directory (mtime order: the least recently used first)."""
        found: list[tuple[float, bytes, int]] = []
        now = time.time()
        for sub in _listdir(self.dir):
            path = os.path.join(self.dir, sub)
            if sub == "tmp":
                if clean_tmp:
                    for name in _listdir(path):
                        with contextlib.suppress(OSError):
                            if now - os.stat(os.path.join(path, name)).st_mtime > STALE_TMP_SECONDS:
                                _unlink(os.path.join(path, name))
                continue
            if len(sub) != 2:
                continue
            for name in _listdir(path):
                if not name.endswith(SUFFIX):
                    continue
                with contextlib.suppress(OSError):
                    st = os.stat(os.path.join(path, name))
                    found.append((st.st_mtime, bytes.fromhex(name[:-len(SUFFIX)]), st.st_size))
        found.sort()
        with self._lock:
            self._index = OrderedDict((key, size) for _, key, size in found)
            self._bytes = sum(size for _, _, size in found)
            self._last_scan = time.monotonic()

    def clear(self) -> int:
        """Delete every entry of this fingerprint (other processes' indexes then miss: they fall back to prefill).
        Returns the number of entries deleted; spills work again afterwards."""
        self.rescan()
        with self._lock:
            keys = list(self._index)
            self._index.clear()
            self._bytes = 0
        for key in keys:
            _unlink(self._path(key))
        self.disabled = False
        return len(keys)

    def _path(self, key: bytes) -> str:
        h = key.hex()
        return os.path.join(self.dir, h[:2], h + SUFFIX)

    def _write_meta(self, meta: dict) -> None:
        path = os.path.join(self.dir, "meta.json")
        if os.path.exists(path):
            return
        tmp = os.path.join(self._tmp, f"meta-{os.getpid()}")
        with contextlib.suppress(OSError):
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(meta, f, indent=1, sort_keys=True)
            os.replace(tmp, path)

    def _warn_once(self, what: str, msg: str, *args) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(msg, *args)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
