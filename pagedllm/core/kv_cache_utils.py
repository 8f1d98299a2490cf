"""Cumulative block hashes for prefix caching.

hash_i = sha256(hash_{i-1} | token ids of block i | extra keys). The chain makes a block's hash depend on
its whole prefix, so equal blocks after different prefixes never collide. The serialisation is fixed
(little-endian int64 tokens, tagged extra keys) so hashes are stable across processes and machines,
unlike Python's salted 64-bit hash().
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from hashlib import sha256

_NO_PARENT = b"\x00"  # distinguishes the first block from any 32-byte parent digest
_HAS_PARENT = b"\x01"
_BIG_ENDIAN = sys.byteorder == "big"


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks of b slots needed for a tokens."""
    return -(-a // b)


def _encode_key(key: object) -> bytes:
    """Tagged, length-prefixed encoding so that distinct keys never serialise alike."""
    if key is None:
        return b"N"
    if isinstance(key, bool):
        return b"T" if key else b"F"
    if isinstance(key, int):
        return b"I" + key.to_bytes(16, "little", signed=True)
    if isinstance(key, str):
        data = key.encode("utf-8")
        return b"S" + len(data).to_bytes(8, "little") + data
    if isinstance(key, bytes | bytearray):
        return b"B" + len(key).to_bytes(8, "little") + bytes(key)
    if isinstance(key, tuple):
        return b"(" + len(key).to_bytes(8, "little") + b"".join(_encode_key(k) for k in key) + b")"
    raise TypeError(f"unsupported extra key type {type(key).__name__}: {key!r}")


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    arr = array("q", token_ids)
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr.tobytes()


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
    """32-byte sha256 digest of one block given its parent's digest (None for the first block)."""
    data = (_NO_PARENT if parent_hash is None else _HAS_PARENT + parent_hash) \
        + len(token_ids).to_bytes(8, "little") + _token_bytes(token_ids)
    if extra_keys:
        data += _encode_key(tuple(extra_keys))
    return sha256(data).digest()


def block_extra_keys(block_index: int, cache_salt: str | None) -> tuple:
    """The salt is an extra key of the first block only; the chain carries it to every later block."""
    return (cache_salt,) if block_index == 0 and cache_salt is not None else ()


def hash_request_blocks(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
                        *, start_hashes: Sequence[bytes] = ()) -> list[bytes]:
    """Cumulative hashes of the full blocks of token_ids. `start_hashes` (the hashes of the first
    len(start_hashes) blocks, already known) lets a caller extend a chain without rehashing it."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes = list(start_hashes)
    parent = hashes[-1] if hashes else None
    if not hashes and cache_salt is not None and len(token_ids) >= block_size:
        parent = hash_block_tokens(None, token_ids[:block_size], (cache_salt,))
        hashes.append(parent)
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes
