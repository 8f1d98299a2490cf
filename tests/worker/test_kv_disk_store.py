"""The disk tier's store and offload worker: file format, checks, LRU by size, out of space, several processes (two
stores on one directory), and blocks that come back from disk byte-equal to the ones spilled (every KV dtype)."""

from __future__ import annotations

import errno
import logging
import os
import random

import pytest
import torch

from pagedllm.worker import kv_disk_store
from pagedllm.worker.kv_disk_store import HEADER_BYTES, DiskKVStore
from pagedllm.worker.kv_offload import KVOffloadWorker

PAYLOAD = 256


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8  # 32 bytes, like a block hash


def payload(seed: int) -> bytes:
    return random.Random(seed).randbytes(PAYLOAD)


def read(store: DiskKVStore, k: bytes) -> bytes | None:
    buf = bytearray(PAYLOAD)
    halves = [memoryview(buf)[:100], memoryview(buf)[100:]]  # a scatter read, as into a block's segments
    return bytes(buf) if store.read_into(k, halves) else None


def test_round_trip_and_reopen(tmp_path):
    s = DiskKVStore(str(tmp_path), "fp", 1 << 20, PAYLOAD, meta={"model": "x"})
    assert not s.contains(key(1))
    assert s.put(key(1), payload(1))
    assert s.contains(key(1)) and read(s, key(1)) == payload(1)
    assert s.size_bytes == HEADER_BYTES + PAYLOAD and s.num_entries == 1
    again = DiskKVStore(str(tmp_path), "fp", 1 << 20, PAYLOAD)  # a restart: the scan finds the entry
    assert again.num_entries == 1 and read(again, key(1)) == payload(1)
    assert os.path.exists(tmp_path / "fp" / "meta.json")


def test_another_process_sees_new_entries_and_fingerprints_are_apart(tmp_path):
    a = DiskKVStore(str(tmp_path), "fp", 1 << 20, PAYLOAD)
    b = DiskKVStore(str(tmp_path), "fp", 1 << 20, PAYLOAD)  # a second replica on the same directory
    other_model = DiskKVStore(str(tmp_path), "other", 1 << 20, PAYLOAD)
    assert a.put(key(7), payload(7))
    assert not b.has_local(key(7)) and b.contains(key(7)) and read(b, key(7)) == payload(7)
    assert not other_model.contains(key(7))
    a.clear()  # b's index is stale now: its read misses quietly and it forgets the key
    assert read(b, key(7)) is None and not b.contains(key(7))


@pytest.mark.parametrize("damage", ["truncate", "flip", "header", "empty"])
def test_a_damaged_entry_is_skipped_with_one_warning_and_removed(tmp_path, caplog, damage):
    s = DiskKVStore(str(tmp_path), "fp", 1 << 20, PAYLOAD)
    s.put(key(3), payload(3))
    path = s._path(key(3))
    data = bytearray(open(path, "rb").read())
    if damage == "truncate":
        data = data[:-10]
    elif damage == "flip":
        data[HEADER_BYTES + 17] ^= 0x40
    elif damage == "header":
        data[0:4] = b"XXXX"
    else:
        data = bytearray()
    open(path, "wb").write(data)
    with caplog.at_level(logging.WARNING, logger=kv_disk_store.__name__):
        assert read(s, key(3)) is None
    assert len([r for r in caplog.records if "unusable" in r.message]) == 1
    assert not os.path.exists(path) and not s.contains(key(3)) and s.num_corrupt == 1
    assert read(s, key(3)) is None  # gone: no second warning
    assert len([r for r in caplog.records if "unusable" in r.message]) == 1


def test_lru_by_size_keeps_the_recently_used(tmp_path):
    per = HEADER_BYTES + PAYLOAD
    s = DiskKVStore(str(tmp_path), "fp", 3 * per, PAYLOAD)
    for i in range(3):
        s.put(key(i), payload(i))
    assert read(s, key(0)) == payload(0)  # a hit: 0 is now the most recent
    s.put(key(3), payload(3))
    assert s.num_entries == 3 and s.size_bytes == 3 * per
    assert not os.path.exists(s._path(key(1))) and s.contains(key(0)) and s.contains(key(3))


def test_out_of_disk_space_is_one_warning_and_no_more_spills(tmp_path, caplog, monkeypatch):
    s = DiskKVStore(str(tmp_path), "fp", 1 << 20, PAYLOAD)
    real_open = open

    def full_disk(path, mode="r", *a, **kw):
        if "x" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr("builtins.open", full_disk)
    with caplog.at_level(logging.WARNING, logger=kv_disk_store.__name__):
        assert not s.put(key(1), payload(1))
        assert not s.put(key(2), payload(2))
    assert s.disabled and len([r for r in caplog.records if "no space" in r.message]) == 1
    assert os.listdir(tmp_path / "fp" / "tmp") == []  # no temporary file left behind


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_blocks_come_back_byte_equal(tmp_path, dtype):
    """Spill blocks of a pool [positions, 2, blocks, B, H, row], load them into other blocks: same bytes."""
    torch.manual_seed(0)
    shape = (3, 2, 8, 4, 2, 6)
    pool = (torch.randn(shape) * 50).to(dtype)
    block_bytes = pool[:, :, 0].numel() * pool.element_size()
    store = DiskKVStore(str(tmp_path), "fp", 1 << 20, block_bytes)
    w = KVOffloadWorker(pool, store, max_queue_bytes=1 << 20)
    spilled = {b: pool[:, :, b].clone() for b in (1, 4, 6)}
    w.spill([(b, key(b)) for b in spilled])
    assert w.flush(10)
    pool[:, :, 1:].zero_()
    w.start_load(5, [(7, key(1)), (2, key(4)), (3, key(6)), (5, key(99))])  # key 99: never written
    assert w.wait(10)
    assert w.poll() == [(5, [True, True, True, False])]
    for dst, src in ((7, 1), (2, 4), (3, 6)):
        assert torch.equal(pool[:, :, dst].view(torch.uint8), spilled[src].view(torch.uint8))
    assert w.stats()["kv_disk_spilled_blocks"] == 3 and w.stats()["kv_disk_load_errors"] == 1
    w.close()


def test_a_full_queue_drops_spills_instead_of_waiting(tmp_path):
    pool = torch.zeros(1, 2, 8, 2, 1, 4)
    block_bytes = pool[:, :, 0].numel() * 4
    store = DiskKVStore(str(tmp_path), "fp", 1 << 20, block_bytes)
    w = KVOffloadWorker(pool, store, max_queue_bytes=2 * block_bytes)
    with w._cond:  # hold the writer so that the queue cannot drain meanwhile
        w.spill([(b, key(b)) for b in range(5)])
    assert w.num_dropped == 3
    assert w.flush(10) and w.num_spilled == 2
    w.spill([(0, key(0))])  # already on disk: not written again
    assert w.flush(10) and w.num_spilled == 2
    w.close()
