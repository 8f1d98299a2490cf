"""A GGUF parser that validates before it trusts: every count, length, dimension and offset read from the file is
checked against the bytes that are really there before anything is sized, allocated or looped over.

Rules (each failure is an InvalidModelError naming the file and the field): version 2 or 3; counts bounded by
the bytes left; strings and arrays bounded; arrays nested at most MAX_NESTING deep; no duplicate metadata keys or
tensor names; `general.alignment` a power of two; every tensor a known ggml type with 1-4 positive dimensions whose
first is a whole number of blocks; tensor data laid out as llama.cpp requires, each tensor starting where the
previous one ends (padded to the alignment), the last ending at the end of the file, so that a tensor relabelled
with another type, an overlap, a gap or a truncation cannot pass. Numeric metadata arrays are numpy views of the
mapping (no per-element Python objects); string arrays are walked once for their offsets and decoded on access.
"""

from __future__ import annotations

import array
import mmap
import os
import stat
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedllm.model.errors import InvalidModelError
from pagedllm.quantization.types import GEOMETRY

# GGUF metadata value types: id -> numpy dtype (scalars and array elements); 8 = string, 9 = array
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
          12: "<f8"}
_BOOL, _STRING, _ARRAY = 7, 8, 9

MAX_KV = 1 << 16  # metadata entries (real files: ~40)
MAX_TENSORS = 1 << 16  # tensor infos (real files: hundreds to a few thousand)
MAX_ARRAY_LEN = 1 << 28  # elements in one metadata array (and never more than the bytes left can hold)
MAX_STRING = 1 << 24  # bytes in one string (chat templates: tens of KB)
MAX_KEY = 1024  # bytes in a metadata key or tensor name
MAX_NESTING = 2  # an array of arrays of values, no deeper
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 48  # elements in one tensor
MAX_ALIGNMENT = 1 << 24
DEFAULT_ALIGNMENT = 32




@dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (rows first)
    ggml_type: int
    offset: int  # absolute, in the file
    nbytes: int


class StringArray:
    """A metadata array of strings, decoded on access (a vocabulary: ~100k strings we rarely need)."""

    def __init__(self, buf: memoryview, first: int, count: int, where: tuple[str, str]) -> None:
        # string i is the bytes after the 8-byte length at ends[i - 1] (at `first` for i = 0), up to ends[i];
        # the ends are found on first access (the parse only walked them: a load never reads a string)
        self._buf, self._first, self._count, self._where = buf, first, count, where
        self._ends: array.array | None = None

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i: int) -> str:
        if self._ends is None:
            self._ends = _string_ends(self._buf, self._first, self._count)
        start, end = (self._ends[i - 1] if i else self._first) + 8, self._ends[i]
        try:
            return bytes(self._buf[start:end]).decode("utf-8")
        except UnicodeDecodeError as e:
            path, key = self._where
            raise InvalidModelError(f"element {i} is not valid UTF-8 ({e.reason})", path=path, field=key) from e

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def tolist(self) -> list[str]:
        return list(self)

    def __repr__(self) -> str:
        return f"StringArray(len={len(self)})"


@dataclass
class GGUFFile:
    path: str
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]  # in the file's order
    blob: np.ndarray  # uint8 view of the read-only mapping of the whole file
    version: int = 3
    kv_spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> its entry's bytes in the file
    _mmap: mmap.mmap | None = field(default=None, repr=False)

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    def field_error(self, key: str, detail: str) -> InvalidModelError:
        return InvalidModelError(detail, path=self.path, field=key)

    def release_pages(self, offset: int, nbytes: int) -> None:
        """MADV_DONTNEED over the whole pages of [offset, offset + nbytes): the bytes were copied elsewhere."""
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if self._mmap is None or self._mmap.closed or advice is None:
            return
        page = mmap.PAGESIZE
        start, end = -(-offset // page) * page, (offset + nbytes) // page * page
        if end > start:
            self._mmap.madvise(advice, start, end - start)

    def write_vocabulary_copy(self, out: str) -> None:
        """A GGUF file holding only this file's general.architecture, its `{arch}.*` values and its `tokenizer.*`
        entries (arrays no longer than the vocabulary or the merges), byte for byte, and no tensors: what a
        tokenizer converter needs, all of it validated here, and nothing a converter would choke on."""
        arch, m = self.architecture, self.metadata
        longest = max(len(m.get("tokenizer.ggml.tokens", ())), len(m.get("tokenizer.ggml.merges", ())))

        def wanted(key: str) -> bool:
            value = m[key]
            if key.startswith("tokenizer."):
                return not isinstance(value, list | np.ndarray | StringArray) or len(value) <= longest
            return key == "general.architecture" or key.startswith(f"{arch}.") and not isinstance(
                value, list | np.ndarray | StringArray)

        keys = [k for k in self.kv_spans if wanted(k)]
        with open(out, "wb") as fh:
            fh.write(b"GGUF" + struct.pack("<IQQ", self.version, 0, len(keys)))
            for k in keys:
                start, end = self.kv_spans[k]
                fh.write(self.blob[start:end].tobytes())

    def close(self) -> None:
        """Drop this object's view of the mapping and unmap it, unless metadata arrays (views too) are still
        referenced elsewhere: then it is unmapped when the last of them goes."""
        self.blob = np.empty(0, np.uint8)
        if self._mmap is not None:
            _close_quietly(self._mmap)


def open_regular_file(path: str) -> int:
    """A read-only descriptor of `path`, refusing (without blocking) anything but a regular, non-empty file: a
    FIFO would block the loader forever, a device could be endless."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as e:
        raise InvalidModelError(f"cannot open: {e.strerror}", path=path) from e
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise InvalidModelError("not a regular file (a FIFO, device, socket or directory)", path=path)
    return fd


class _Cursor:
    """Bounds-checked little-endian reads from the mapping; `where` names what is being read for errors."""

    def __init__(self, buf: memoryview, path: str) -> None:
        self.buf, self.pos, self.size, self.path = buf, 0, len(buf), path

    def fail(self, where: str, detail: str) -> InvalidModelError:
        return InvalidModelError(detail, path=self.path, field=where)

    def need(self, n: int, where: str) -> int:
        start = self.pos
        if n < 0 or start + n > self.size:
            raise self.fail(where, f"truncated or corrupt: needs {n} bytes at offset {start}, the file has "
                                   f"{self.size}")
        self.pos = start + n
        return start

    def scalar(self, fmt: str, where: str) -> Any:
        return struct.unpack_from(fmt, self.buf, self.need(struct.calcsize(fmt), where))[0]

    def count(self, where: str, limit: int, min_bytes_each: int) -> int:
        n = self.scalar("<Q", where)
        left = (self.size - self.pos) // max(min_bytes_each, 1)
        if n > limit or n > left:
            raise self.fail(where, f"count {n} is impossible (at most {min(limit, left)} fit in what is left "
                                   f"of the file)")
        return n

    def raw_string(self, where: str, limit: int = MAX_STRING) -> tuple[int, int]:
        n = self.scalar("<Q", where)
        if n > limit:
            raise self.fail(where, f"string length {n} is over the limit of {limit} bytes")
        return self.need(n, where), n

    def string(self, where: str, limit: int = MAX_STRING) -> str:
        start, n = self.raw_string(where, limit)
        try:
            return bytes(self.buf[start:start + n]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(where, f"not valid UTF-8 ({e.reason})") from e


def _value(cur: _Cursor, vtype: int, key: str, depth: int = 0) -> Any:
    if vtype in _NUMPY:
        v = np.frombuffer(cur.buf, _NUMPY[vtype], 1, cur.need(np.dtype(_NUMPY[vtype]).itemsize, key))[0]
        if vtype == _BOOL:
            if v > 1:
                raise cur.fail(key, f"boolean byte {int(v)} is neither 0 nor 1")
            return bool(v)
        return v.item()
    if vtype == _STRING:
        return cur.string(key)
    if vtype == _ARRAY:
        if depth >= MAX_NESTING:
            raise cur.fail(key, f"arrays nested more than {MAX_NESTING} deep")
        etype = cur.scalar("<I", key)
        if etype in _NUMPY:
            itemsize = np.dtype(_NUMPY[etype]).itemsize
            n = cur.count(key, MAX_ARRAY_LEN, itemsize)
            arr = np.frombuffer(cur.buf, _NUMPY[etype], n, cur.need(n * itemsize, key))
            if etype == _BOOL:
                if n and int(arr.max()) > 1:
                    raise cur.fail(key, "a boolean array holds a byte that is neither 0 nor 1")
                return arr.view(np.bool_)
            return arr
        if etype == _STRING:
            return _string_array(cur, key)
        if etype == _ARRAY:
            n = cur.count(key, MAX_ARRAY_LEN, 12)
            return [_value(cur, _ARRAY, key, depth + 1) for _ in range(n)]
        raise cur.fail(key, f"unknown array element type {etype}")
    raise cur.fail(key, f"unknown metadata value type {vtype}")


def _string_ends(buf: memoryview, pos: int, n: int, keep: bool = True) -> array.array:
    """Walk n length-prefixed strings from pos: where each ends (only the last, unless keep). Each length decides
    where the next string starts; a length prefix past the end raises struct.error or OverflowError."""
    ends = array.array("q")
    unpack = struct.Struct("<Q").unpack_from
    if keep:
        append = ends.append
        for _ in range(n):
            pos += 8 + unpack(buf, pos)[0]
            append(pos)
        return ends
    for _ in range(n):
        pos += 8 + unpack(buf, pos)[0]
    ends.append(pos)
    return ends


def _string_array(cur: _Cursor, key: str) -> StringArray:
    n = cur.count(key, MAX_ARRAY_LEN, 8)
    try:
        end = _string_ends(cur.buf, cur.pos, n, keep=False)[0] if n else cur.pos
    except (struct.error, OverflowError):
        end = cur.size + 1
    if end > cur.size:  # the ends only grow, so the last one bounds them all
        raise cur.fail(key, f"truncated or corrupt: its {n} strings run past the end of the file")
    strings = StringArray(cur.buf, cur.pos, n, (cur.path, key))
    cur.pos = end
    return strings


def _read_metadata(cur: _Cursor, n_kv: int) -> tuple[dict[str, Any], dict[str, tuple[int, int]]]:
    metadata: dict[str, Any] = {}
    spans: dict[str, tuple[int, int]] = {}
    for i in range(n_kv):
        start = cur.pos
        key = cur.string(f"metadata key #{i}", MAX_KEY)
        if not key:
            raise cur.fail(f"metadata key #{i}", "empty key")
        if key in metadata:
            raise cur.fail(key, "duplicate metadata key")
        metadata[key] = _value(cur, cur.scalar("<I", key), key)
        spans[key] = (start, cur.pos)
    return metadata, spans


def _alignment(path: str, metadata: dict[str, Any]) -> int:
    align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(align, bool) or not isinstance(align, int) or not 0 < align <= MAX_ALIGNMENT \
            or align & (align - 1):
        raise InvalidModelError(f"{align!r} is not a power of two in [1, {MAX_ALIGNMENT}]", path=path,
                                field="general.alignment")
    return align


def _tensor_info(cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], int, int, int]:
    name = cur.string(f"tensor #{i} name", MAX_KEY)
    where = f"tensor {name!r}"
    ndim = cur.scalar("<I", where)
    if not 1 <= ndim <= MAX_DIMS:
        raise cur.fail(where, f"{ndim} dimensions (1 to {MAX_DIMS} allowed)")
    dims = struct.unpack_from(f"<{ndim}Q", cur.buf, cur.need(8 * ndim, where))
    ggml_type, offset = struct.unpack_from("<IQ", cur.buf, cur.need(12, where))
    if ggml_type not in GEOMETRY:
        raise cur.fail(where, f"unknown ggml type {ggml_type}")
    type_name, block, type_bytes = GEOMETRY[ggml_type]
    elements = 1
    for d in dims:  # Python integers do not overflow: bound the product as it grows
        if d == 0:
            raise cur.fail(where, f"a zero dimension in {list(dims)}")
        elements *= d
        if elements > MAX_ELEMENTS:
            raise cur.fail(where, f"dimensions {list(dims)} hold more than 2^48 elements")
    if dims[0] % block:
        raise cur.fail(where, f"{type_name} rows of {dims[0]} values are not whole blocks of {block}")
    nbytes = elements // block * type_bytes
    return name, tuple(reversed(dims)), ggml_type, offset, nbytes


def _check_layout(path: str, infos: list[tuple[str, tuple[int, ...], int, int, int]], data_start: int,
                  size: int, align: int) -> None:
    """Each tensor starts where the previous ends, padded to the alignment (llama.cpp's rule), and the data
    ends with the file: no overlap, no gap, nothing past the end, no unaligned offset."""
    expected, prev = 0, None
    for name, _, _, offset, nbytes in infos:
        where = f"tensor {name!r}"
        if offset % align:
            raise InvalidModelError(f"data offset {offset} is not a multiple of general.alignment ({align})",
                                    path=path, field=where)
        if data_start + offset + nbytes > size:
            raise InvalidModelError(f"truncated or corrupt: its {nbytes} bytes at offset {data_start + offset} "
                                    f"end past the end of the file ({size} bytes)", path=path, field=where)
        if offset < expected:
            raise InvalidModelError(f"data offset {offset} overlaps tensor {prev!r} (which ends at "
                                    f"{expected})", path=path, field=where)
        if offset != expected:
            raise InvalidModelError(f"data offset {offset} leaves a gap after tensor {prev!r} (expected "
                                    f"{expected}): offsets or types were altered", path=path, field=where)
        expected, prev = -(-(offset + nbytes) // align) * align, name
    end = data_start + expected
    if infos and size > end:
        raise InvalidModelError(f"{size - end} bytes after the last tensor's data: a tensor's type or shape was "
                                f"altered, or the file was appended to", path=path, field=f"tensor {prev!r}")


def parse_gguf(path: str, buf: memoryview) -> tuple[int, dict[str, Any], dict[str, tuple[int, int]],
                                                    list[tuple[str, tuple[int, ...], int, int, int]], int]:
    """(version, metadata, metadata spans, tensor infos with data offsets relative to the data section, data
    section start) of the GGUF bytes in `buf`, validated."""
    cur = _Cursor(buf, path)
    magic = bytes(buf[:4])
    if magic != b"GGUF":
        raise InvalidModelError(f"not a GGUF file (bad magic {magic!r})", path=path)
    cur.pos = 4
    version = cur.scalar("<I", "header version")
    if version not in (2, 3):
        raise cur.fail("header version", f"unsupported GGUF version {version} (expected 2 or 3)")
    n_tensors = cur.count("header tensor count", MAX_TENSORS, 8 + 4 + 8 + 4 + 8)
    n_kv = cur.count("header metadata count", MAX_KV, 8 + 1 + 4 + 1)
    metadata, spans = _read_metadata(cur, n_kv)
    infos, names = [], set()
    for i in range(n_tensors):
        info = _tensor_info(cur, i)
        if info[0] in names:
            raise cur.fail(f"tensor {info[0]!r}", "duplicate tensor name")
        names.add(info[0])
        infos.append(info)
    align = _alignment(path, metadata)
    data_start = -(-cur.pos // align) * align
    _check_layout(path, infos, data_start, cur.size, align)
    return version, metadata, spans, infos, data_start


def read_gguf(path: str) -> GGUFFile:
    """The file mapped read-only and its header parsed and validated (InvalidModelError otherwise)."""
    fd = open_regular_file(path)
    try:
        size = os.fstat(fd).st_size
        if size < 24:
            raise InvalidModelError(f"truncated or corrupt: {size} bytes is too short for a GGUF header", path=path)
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    blob = np.frombuffer(mm, np.uint8)
    try:
        version, metadata, spans, infos, data_start = parse_gguf(path, memoryview(mm))
    except BaseException:
        del blob
        _close_quietly(mm)
        raise
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        _close_quietly(mm)
        raise InvalidModelError("missing, or not a string", path=path, field="general.architecture")
    tensors = {name: GGUFTensorInfo(name, shape, t, data_start + off, nbytes)
               for name, shape, t, off, nbytes in infos}
    return GGUFFile(path, metadata, tensors, blob, version, spans, mm)


def _close_quietly(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # a view is still referenced (by a traceback frame): the mapping goes with it
        pass
