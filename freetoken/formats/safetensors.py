"""HF checkpoint directories: config.json + safetensors (one file or sharded by an index).

Every header is validated by our own code before any tensor is touched, so a damaged or hostile
file raises FormatError naming the file and the tensor or key, never a panic or another exception
type. The rules mirror the safetensors format (and its library's checks): an 8-byte little-endian
header length, a JSON object `{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__":
{str: str}}`, and tensor bytes that tile the data region exactly, without holes or overlaps.
Tensors are then zero-copy views of one copy-on-write mmap per file (the `safetensors` package's
`safe_open(...).get_tensor` copies each tensor it returns, measured with 0.8: eight reads of a
25 MB tensor cost 200 MB); the package is used to write checkpoints.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from freetoken.formats.errors import FormatError
from freetoken.formats.quant_config import QuantConfig, load_quant_config, read_json_object
from freetoken.formats.qweight import QuantWeight

# safetensors dtype string -> torch dtype; exactly the set the torch binding can read.
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "U16": torch.uint16, "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64,
    "U64": torch.uint64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
MAX_HEADER = 100_000_000  # the safetensors library's own limit
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a validated header; begin/end are relative to the data region, which starts
    at byte `data_start` of the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    data_start: int = 0


def read_header(path: str | Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Validate a .safetensors file's header; return its tensors and its `__metadata__`."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise FormatError(f"file is {size} bytes, too short for a header", path=path)
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, MAX_HEADER):
                raise FormatError(f"header length {n} exceeds the file ({size} bytes)", path=path)
            raw = f.read(n)
    except OSError as e:
        raise FormatError(f"cannot read: {e}", path=path) from e
    doc = _parse_header_json(raw, path)
    meta = doc.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise FormatError("expected an object of strings", path=path, key="__metadata__")
    entries = {name: _entry(name, info, path, 8 + n) for name, info in doc.items()}
    _check_tiling(entries, size - 8 - n, path)
    return entries, meta


def _parse_header_json(raw: bytes, path: Path) -> dict:
    if not raw.startswith(b"{"):
        raise FormatError("header does not start with '{'", path=path)

    def no_dupes(pairs: list) -> dict:
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            dup = next(k for k, c in Counter(keys).items() if c > 1)
            raise FormatError("duplicate key in header", path=path, key=dup)
        return dict(pairs)

    def no_constants(s: str) -> None:
        raise FormatError(f"non-standard JSON constant {s}", path=path)

    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=no_dupes,
                         parse_constant=no_constants)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise FormatError(f"header is not valid UTF-8 JSON: {e}", path=path) from e
    if not isinstance(doc, dict):
        raise FormatError("header is not a JSON object", path=path)
    return doc


def _entry(name: str, info: object, path: Path, data_start: int) -> TensorEntry:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as e:
        raise FormatError("tensor name is not valid UTF-8", path=path) from e
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise FormatError("expected exactly dtype, shape, data_offsets", path=path, tensor=name)
    dtype, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise FormatError(f"unsupported dtype {dtype!r}; expected one of {sorted(DTYPES)}",
                          path=path, tensor=name)
    if not isinstance(shape, list) or not all(_uint(d) for d in shape):
        raise FormatError(f"shape {shape!r} is not a list of non-negative integers",
                          path=path, tensor=name)
    if not (isinstance(offs, list) and len(offs) == 2 and all(_uint(o) for o in offs)):
        raise FormatError(f"data_offsets {offs!r} are not two non-negative integers",
                          path=path, tensor=name)
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    if offs[1] < offs[0] or offs[1] - offs[0] != nbytes:
        raise FormatError(f"data_offsets {offs} hold {offs[1] - offs[0]} bytes but {dtype} "
                          f"{shape} needs {nbytes}", path=path, tensor=name)
    return TensorEntry(name, dtype, tuple(shape), offs[0], offs[1], data_start)


def _uint(v: object) -> bool:
    return type(v) is int and 0 <= v < 2**63


def _check_tiling(entries: dict[str, TensorEntry], data_len: int, path: Path) -> None:
    """Tensor bytes must cover [0, data_len) exactly once, as the format requires."""
    for e in entries.values():
        if e.end > data_len:
            raise FormatError(f"data_offsets [{e.begin}, {e.end}] run past the {data_len}-byte "
                              "data region", path=path, tensor=e.name)
    pos = 0
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if e.begin != pos:
            what = "overlaps the previous tensor" if e.begin < pos else "leaves a gap before it"
            raise FormatError(f"data_offsets [{e.begin}, {e.end}] {what} (expected to start at "
                              f"{pos})", path=path, tensor=e.name)
        pos = e.end
    if pos != data_len:
        raise FormatError(f"tensors end at byte {pos} of a {data_len}-byte data region",
                          path=path)


class HFCheckpoint:
    """An HF model directory: config.json, its quantization config and its safetensors files.

    Headers, the shard index and the quantization config are validated when it is opened;
    tensors are memory-mapped and read on demand.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise FormatError("not a directory (expected an HF model directory)", path=self.path)
        self.config = _read_config(self.path / "config.json")
        arch = self.config.get("architectures")
        if not (isinstance(arch, list) and arch and isinstance(arch[0], str)):
            raise FormatError(f"expected a non-empty list of names, got {arch!r}",
                              path=self.path / "config.json", key="architectures")
        self.architecture: str = arch[0]
        mt = self.config.get("model_type")
        self.model_type: str = mt if isinstance(mt, str) else ""
        self.quant: QuantConfig | None = load_quant_config(self.path)
        self._where: dict[str, tuple[Path, TensorEntry]] = {}
        for file in self._files():
            entries, _ = read_header(file)
            for name, e in entries.items():
                if name in self._where:
                    raise FormatError(f"tensor also in {self._where[name][0].name}", path=file,
                                      tensor=name)
                self._where[name] = (file, e)
        self._check_index()
        self._maps: dict[Path, mmap.mmap] = {}

    # -- files and index -----------------------------------------------------------------------

    def _files(self) -> list[Path]:
        idx = self.path / INDEX
        if idx.is_file():
            self._index = _read_index(idx)
            return [self.path / f for f in sorted(set(self._index.values()))]
        self._index = None
        single = self.path / SINGLE
        if not single.is_file():
            raise FormatError(f"neither {SINGLE} nor {INDEX} found", path=self.path)
        return [single]

    def _check_index(self) -> None:
        if self._index is None:
            return
        idx = self.path / INDEX
        for name, file in self._index.items():
            if name not in self._where or self._where[name][0].name != file:
                raise FormatError(f"index puts it in {file}, which does not contain it",
                                  path=idx, tensor=name)
        for name, (file, _) in self._where.items():
            if name not in self._index:
                raise FormatError(f"in {file.name} but not in the index's weight_map", path=idx,
                                  tensor=name)

    # -- tensors -------------------------------------------------------------------------------

    def tensor_names(self) -> list[str]:
        """All tensor names, sorted."""
        return sorted(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def dtype_of(self, name: str) -> str:
        """The safetensors dtype string (e.g. "F8_E4M3") of a tensor."""
        return self._entry(name)[1].dtype

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1].shape

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor as a zero-copy view of the memory-mapped file (copy-on-write mapping, so
        a stray in-place write never reaches the file). Copied only if misaligned for its dtype."""
        file, e = self._entry(name)
        dtype = DTYPES[e.dtype]
        if e.end == e.begin:
            return torch.empty(e.shape, dtype=dtype)
        mm = self._maps.get(file)
        try:
            if mm is None:
                with open(file, "rb") as f:
                    mm = self._maps[file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.frombuffer(mm, dtype=torch.uint8, count=e.end - e.begin,
                                       offset=e.data_start + e.begin)
        except (OSError, ValueError) as err:  # file changed or vanished since validation
            raise FormatError(f"cannot map: {err}", path=file, tensor=name) from err
        if (e.data_start + e.begin) % dtype.itemsize:
            raw = raw.clone()
        return raw.view(dtype).reshape(e.shape)

    def _entry(self, name: str) -> tuple[Path, TensorEntry]:
        try:
            return self._where[name]
        except KeyError:
            raise FormatError("no such tensor in the checkpoint", path=self.path,
                              tensor=name) from None

    # -- weights -------------------------------------------------------------------------------

    def weight(self, prefix: str) -> QuantWeight:
        """The weight of module `prefix` (e.g. "model.layers.0.mlp.down_proj") in its format."""
        from freetoken.formats.hf_quant import assemble_weight

        return assemble_weight(self, prefix)[0]

    def weight_tensor_names(self, prefix: str) -> list[str]:
        """The file tensors `weight(prefix)` consumes (weight, block and second-level scales)."""
        from freetoken.formats.hf_quant import weight_names

        return weight_names(self, prefix)

    def weight_prefixes(self) -> list[str]:
        """Module prefixes that own a weight in any supported format, sorted."""
        from freetoken.formats.hf_quant import weight_prefix

        return sorted({p for n in self._where if (p := weight_prefix(n)) is not None})

    def metadata_summary(self) -> dict:
        """What `ft inspect` shows for an HF directory (see hf_quant.summarize)."""
        from freetoken.formats.hf_quant import summarize

        return summarize(self)

    def close(self) -> None:
        self._maps.clear()  # tensors still alive keep their mapping open

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_config(path: Path) -> dict:
    if not path.is_file():
        raise FormatError("config.json missing", path=path)
    return read_json_object(path)


def _read_index(path: Path) -> dict[str, str]:
    wm = read_json_object(path).get("weight_map")
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise FormatError("expected an object of tensor name -> shard file", path=path,
                          key="weight_map")
    for name, file in wm.items():
        if Path(file).name != file or file in (".", ".."):
            raise FormatError(f"shard {file!r} is not a plain file name", path=path, tensor=name)
        if not (path.parent / file).is_file():
            raise FormatError(f"shard file {file} is missing", path=path, tensor=name)
    return wm
