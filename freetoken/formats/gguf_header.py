"""A strict parser for the GGUF header (metadata and tensor infos), on the `gguf` package's tables.

Why not `gguf.GGUFReader`: it trusts counts and lengths (a corrupt tensor count makes it loop for
ever or allocate without bound) and fails with whatever exception numpy raises. This parser bounds
every count and length by the bytes left in the file, so a damaged header costs at most one pass
over the file, and every problem is a FormatError naming the file and the key or tensor.

Layout (little-endian): magic "GGUF", u32 version (2 or 3), u64 n_tensors, u64 n_kv, then n_kv
(string key, u32 type, value), then n_tensors (string name, u32 n_dims, u64 ne[n_dims], u32 type,
u64 offset), padding to `general.alignment`, then the data section. Strings are u64 length + UTF-8.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from freetoken.formats.errors import FormatError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 4  # arrays of arrays are legal; a deeper nest is an attack, not a model
MIN_TENSOR_INFO = 8 + 4 + 8 + 4 + 8  # empty name, 1 dim, type, offset
MIN_KV = 8 + 4 + 1  # empty key, type, a 1-byte value

_SCALARS: dict[int, tuple[str, type]] = {
    GGUFValueType.UINT8: ("<u1", int),
    GGUFValueType.INT8: ("<i1", int),
    GGUFValueType.UINT16: ("<u2", int),
    GGUFValueType.INT16: ("<i2", int),
    GGUFValueType.UINT32: ("<u4", int),
    GGUFValueType.INT32: ("<i4", int),
    GGUFValueType.FLOAT32: ("<f4", float),
    GGUFValueType.BOOL: ("<u1", bool),
    GGUFValueType.UINT64: ("<u8", int),
    GGUFValueType.INT64: ("<i8", int),
    GGUFValueType.FLOAT64: ("<f8", float),
}


@dataclass
class RawTensorInfo:
    name: str
    ne: tuple[int, ...]  # ggml order: ne[0] is the row length
    ggml_type: int
    rel_offset: int  # from the start of the data section


@dataclass
class Header:
    version: int
    metadata: dict[str, object]
    value_types: dict[str, int]  # key -> GGUFValueType (ARRAY for lists)
    tensors: list[RawTensorInfo]
    end: int  # first byte after the tensor infos


class _Cursor:
    """Reads little-endian fields from a byte buffer, refusing to run past its end."""

    def __init__(self, buf: memoryview | bytes, path: str) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path
        self.where: dict[str, str] = {}  # the key or tensor being read, for messages

    def fail(self, msg: str) -> FormatError:
        return FormatError(msg, path=self.path, **self.where)

    def left(self) -> int:
        return len(self.buf) - self.pos

    def take(self, n: int, what: str) -> memoryview | bytes:
        if n < 0 or n > self.left():
            raise self.fail(f"truncated: {what} needs {n} bytes at offset {self.pos}, "
                            f"{self.left()} left in the file")
        b = self.buf[self.pos : self.pos + n]
        self.pos += n
        return b

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack("<Q", self.take(8, what))[0]

    def string(self, what: str, *, strict: bool = True) -> str:
        n = self.u64(f"{what} length")
        if n > self.left():
            raise self.fail(f"{what} length {n} exceeds the {self.left()} bytes left in the file")
        raw = bytes(self.take(n, what))
        try:
            return raw.decode("utf-8", errors="strict" if strict else "surrogateescape")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})") from None


def _value_type(cur: _Cursor, what: str) -> int:
    t = cur.u32(what)
    try:
        return GGUFValueType(t)
    except ValueError:
        raise cur.fail(f"unknown metadata value type {t} in {what}") from None


def _read_array(cur: _Cursor, depth: int) -> list:
    if depth > MAX_ARRAY_DEPTH:
        raise cur.fail(f"arrays nested deeper than {MAX_ARRAY_DEPTH}")
    etype = _value_type(cur, "array element type")
    count = cur.u64("array length")
    if etype in _SCALARS:
        fmt, kind = _SCALARS[etype]
        size = np.dtype(fmt).itemsize
        if count > cur.left() // size:
            raise cur.fail(f"array of {count} x {size} bytes exceeds the {cur.left()} bytes left")
        arr = np.frombuffer(cur.take(count * size, "array"), dtype=fmt)
        return [bool(v) for v in arr] if kind is bool else arr.tolist()
    # Strings take >= 8 bytes each, nested arrays >= 12: bound the count before looping.
    if count > cur.left() // 8:
        raise cur.fail(f"array of {count} elements exceeds the {cur.left()} bytes left")
    return [_read_value(cur, etype, depth + 1) for _ in range(count)]


def _read_value(cur: _Cursor, vtype: int, depth: int = 0) -> object:
    if vtype in _SCALARS:
        fmt, kind = _SCALARS[vtype]
        v = np.frombuffer(cur.take(np.dtype(fmt).itemsize, "value"), dtype=fmt)[0]
        return kind(v)
    if vtype == GGUFValueType.STRING:
        return cur.string("string value", strict=False)
    return _read_array(cur, depth)


def _read_kv(cur: _Cursor, h: Header) -> None:
    cur.where = {}
    key = cur.string("metadata key")
    cur.where = {"key": key}
    if key in h.metadata:
        raise cur.fail("duplicate metadata key")
    vtype = _value_type(cur, "value type")
    h.value_types[key] = vtype
    h.metadata[key] = _read_value(cur, vtype)


def _read_tensor_info(cur: _Cursor, seen: set[str]) -> RawTensorInfo:
    cur.where = {}
    name = cur.string("tensor name")
    cur.where = {"tensor": name}
    if name in seen:
        raise cur.fail("duplicate tensor name")
    seen.add(name)
    n_dims = cur.u32("n_dims")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.fail(f"n_dims {n_dims} is outside 1..{MAX_DIMS}")
    ne = tuple(cur.u64("dimension") for _ in range(n_dims))
    t = cur.u32("tensor type")
    try:
        t = GGMLQuantizationType(t)
    except ValueError:
        raise cur.fail(f"unknown ggml tensor type {t}") from None
    return RawTensorInfo(name, ne, int(t), cur.u64("tensor offset"))


def parse_header(buf: memoryview | bytes, path: str) -> Header:
    """Parse and bound-check the header; tensor sizes and offsets are checked by the caller."""
    cur = _Cursor(buf, path)
    magic = bytes(cur.take(4, "magic"))
    if magic != GGUF_MAGIC:
        raise cur.fail(f"not a GGUF file: magic {magic!r}, expected {GGUF_MAGIC!r}")
    version = cur.u32("version")
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0 and version >> 16:
            raise cur.fail("big-endian GGUF files are not supported")
        raise cur.fail(f"unsupported GGUF version {version}, expected one of {SUPPORTED_VERSIONS}")
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("metadata count")
    if n_tensors > cur.left() // MIN_TENSOR_INFO:
        raise cur.fail(f"tensor count {n_tensors} cannot fit in the {cur.left()} bytes left")
    if n_kv > cur.left() // MIN_KV:
        raise cur.fail(f"metadata count {n_kv} cannot fit in the {cur.left()} bytes left")
    h = Header(version, {}, {}, [], 0)
    for _ in range(n_kv):
        _read_kv(cur, h)
    seen: set[str] = set()
    h.tensors = [_read_tensor_info(cur, seen) for _ in range(n_tensors)]
    h.end = cur.pos
    return h
