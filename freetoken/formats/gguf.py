"""GGUF files as data: a memory-mapped, zero-copy reader that validates the whole header up front.

`GGUFFile(path)` parses the header strictly (gguf_header.py), checks every tensor's type, shape,
byte size, alignment and extent against the file, and then hands out raw views: `raw(name)` is a
uint8 numpy view of the tensor's bytes, `weight(name)` a QuantWeight (float tensors as torch views
of their logical shape, quantized ones as their blocks, NVFP4 repacked into the ModelOpt layout).
Nothing is dequantized on read.

NOTE: the mapping is read-only; the torch views it hands out must never be written in place.
"""

from __future__ import annotations

import math
import mmap
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType

from freetoken.formats.codecs import SUPPORTED_TYPES
from freetoken.formats.errors import FormatError
from freetoken.formats.gguf_header import GGUFValueType, RawTensorInfo, parse_header
from freetoken.formats.nvfp4 import gguf_nvfp4_to_modelopt
from freetoken.formats.qweight import QuantWeight

T = GGMLQuantizationType
FLOAT_TYPES = {T.F32: ("f32", torch.float32), T.F16: ("f16", torch.float16),
               T.BF16: ("bf16", torch.bfloat16)}
# Plain integer / f64 tensors: readable raw, not weights.
PLAIN_TYPES = (T.I8, T.I16, T.I32, T.I64, T.F64)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: `shape` is the logical torch order (ggml's ne reversed); `offset` is absolute."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _alignment(meta: dict[str, object], vtypes: dict[str, int], path: str) -> int:
    key = "general.alignment"
    if key not in meta:
        return GGUF_DEFAULT_ALIGNMENT
    a = meta[key]
    if vtypes[key] != GGUFValueType.UINT32 or a == 0 or a & (a - 1):  # type: ignore[operator]
        raise FormatError(f"alignment must be a non-zero power of two (uint32), got {a!r}",
                          path=path, key=key)
    return int(a)  # type: ignore[arg-type]


def _tensor_nbytes(t: RawTensorInfo, path: str) -> int:
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)]
    name = GGMLQuantizationType(t.ggml_type).name
    if any(n == 0 for n in t.ne):
        raise FormatError(f"empty dimension in shape {t.ne}", path=path, tensor=t.name)
    if t.ne[0] % block:
        raise FormatError(f"row length {t.ne[0]} is not a multiple of the {name} block size "
                          f"{block}", path=path, tensor=t.name)
    return math.prod(t.ne[1:]) * (t.ne[0] // block) * type_size


def _check_extents(infos: list[TensorInfo], size: int, path: str) -> None:
    """Each tensor inside the file, none overlapping another."""
    prev: TensorInfo | None = None
    for ti in sorted(infos, key=lambda t: t.offset):
        if ti.offset + ti.nbytes > size:
            raise FormatError(f"data [{ti.offset}, {ti.offset + ti.nbytes}) runs past the end of "
                              f"the file ({size} bytes): truncated?", path=path, tensor=ti.name)
        if prev is not None and prev.offset + prev.nbytes > ti.offset:
            raise FormatError(f"data overlaps tensor {prev.name!r}", path=path, tensor=ti.name)
        prev = ti


class GGUFFile:
    """A validated, memory-mapped GGUF file. Use as a context manager or call close()."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._map: mmap.mmap | None = None
        spath = os.fspath(self.path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise FormatError(f"file of {size} bytes is too short to be GGUF", path=spath)
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._parse(spath, size)
        except BaseException:
            self.close()
            raise

    def _parse(self, spath: str, size: int) -> None:
        assert self._map is not None
        self._buf = np.frombuffer(self._map, dtype=np.uint8)  # read-only, no copy
        h = parse_header(memoryview(self._map), spath)
        self.version = h.version
        self.metadata: dict[str, object] = h.metadata
        self.value_types = h.value_types
        self.alignment = _alignment(h.metadata, h.value_types, spath)
        data_start = -(-h.end // self.alignment) * self.alignment
        self.data_offset = data_start
        self.tensors: dict[str, TensorInfo] = {}
        for t in h.tensors:
            if t.rel_offset % self.alignment:
                raise FormatError(f"offset {t.rel_offset} is not a multiple of the alignment "
                                  f"{self.alignment}", path=spath, tensor=t.name)
            nbytes = _tensor_nbytes(t, spath)
            self.tensors[t.name] = TensorInfo(
                t.name, t.ggml_type, tuple(reversed(t.ne)), data_start + t.rel_offset, nbytes)
        _check_extents(list(self.tensors.values()), size, spath)
        arch = self.metadata.get("general.architecture")
        self.arch: str = arch if isinstance(arch, str) else ""

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Drop the mapping. Views handed out keep the pages alive until they are freed."""
        self._buf = None
        m, self._map = self._map, None
        if m is not None:
            try:
                m.close()
            except BufferError:
                pass  # views still exported: the OS unmaps when the last one goes

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        n = len(self.tensors)
        return f"GGUFFile({os.fspath(self.path)!r}, arch={self.arch!r}, {n} tensors)"

    # -- access ------------------------------------------------------------------------------
    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise FormatError("no such tensor", path=self.path, tensor=name) from None

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view (no copy)."""
        ti = self.info(name)
        if self._buf is None:
            raise ValueError(f"{self.path}: file is closed")
        return self._buf[ti.offset : ti.offset + ti.nbytes]

    def raw_torch(self, name: str) -> torch.Tensor:
        """The tensor's bytes as a uint8 torch view (no copy; never write to it)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffer, by design
            return torch.from_numpy(self.raw(name))

    def weight(self, name: str) -> QuantWeight:
        """The tensor as a QuantWeight in its stored format (see qweight.py)."""
        ti = self.info(name)
        src = f"{self.path}:{name}"
        data = self.raw_torch(name)
        t = GGMLQuantizationType(ti.ggml_type)
        if t in FLOAT_TYPES:
            fmt, dtype = FLOAT_TYPES[t]
            return QuantWeight(_float_view(data, dtype, ti.shape), fmt, ti.shape, source=src)
        if t in PLAIN_TYPES:
            raise FormatError(f"{t.name} tensor is not a weight", path=self.path, tensor=name)
        if t not in SUPPORTED_TYPES:
            raise FormatError(f"GGUF type {t.name} is not supported for weights",
                              path=self.path, tensor=name)
        row_bytes = ti.nbytes // max(1, math.prod(ti.shape[:-1]))
        rows = data.reshape(*ti.shape[:-1], row_bytes)
        if t == T.NVFP4:
            try:
                codes, scales = gguf_nvfp4_to_modelopt(rows, name=name)
            except FormatError as e:
                raise FormatError(str(e), path=self.path, tensor=name) from None
            return QuantWeight(codes, "nvfp4", ti.shape, scales=scales,
                               scale2=self.scale2(name), source=src)
        return QuantWeight(rows, "gguf", ti.shape, ggml_type=int(t), source=src)

    def scale2(self, name: str) -> torch.Tensor | None:
        """The sibling `<name minus .weight>.scale` fp32 tensor (scalar or [E]), if present."""
        sname = (name[: -len(".weight")] if name.endswith(".weight") else name) + ".scale"
        ti = self.tensors.get(sname)
        if ti is None:
            return None
        if ti.ggml_type != T.F32:
            raise FormatError(f"second-level scale must be F32, got {ti.type_name}",
                              path=self.path, tensor=sname)
        s = _float_view(self.raw_torch(sname), torch.float32, ti.shape).clone()
        return s.reshape(()) if s.numel() == 1 else s.reshape(-1)


def _float_view(data: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Reinterpret bytes as `dtype` of `shape`; copies only if the bytes are misaligned."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if data.data_ptr() % itemsize:
        data = data.clone()
    return data.view(dtype).reshape(shape)
