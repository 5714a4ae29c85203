"""Quantization configs of HF checkpoints, normalised to one small dataclass.

Four methods are understood (the names on the left are `QuantConfig.method`):

- ``modelopt_nvfp4``: NVIDIA ModelOpt NVFP4, either `hf_quant_config.json`
  (``{"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16,
  "exclude_modules": [...]}}``) or config.json ``quantization_config`` with
  ``quant_method: modelopt``, ``quant_algo: NVFP4`` and ``ignore`` / ``exclude_modules``.
- ``compressed_tensors_nvfp4``: config.json ``quant_method: compressed-tensors`` with
  ``format: nvfp4-pack-quantized``; exclusions in ``ignore`` (``re:`` entries are regexes).
- ``fp8_block``: ``quant_method: fp8`` with ``weight_block_size: [128, 128]`` (DeepSeek / Qwen FP8);
  exclusions in ``modules_to_not_convert`` or ``ignored_layers``.
- ``mxfp4``: gpt-oss, ``quant_method: mxfp4``; exclusions in ``modules_to_not_convert``.

Anything else that declares quantization raises FormatError: loading it as float would be wrong.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path

from freetoken.formats.errors import FormatError

METHODS = ("modelopt_nvfp4", "compressed_tensors_nvfp4", "fp8_block", "mxfp4")


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's quantization: method, block geometry and excluded modules.

    `group_size` is the number of weights sharing one block scale along the input dimension
    (16 for NVFP4, 32 for MXFP4, 128 for FP8 block). `block_size` is (rows, cols) for 2-D block
    formats (FP8), else None. `exclude` holds glob patterns (fnmatch) on module names, or
    ``re:<regex>`` entries as compressed-tensors writes them.
    """

    method: str
    group_size: int
    block_size: tuple[int, int] | None = None
    exclude: tuple[str, ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown quantization method {self.method!r}; expected {METHODS}")

    def is_quantized(self, module_name: str) -> bool:
        """False when `module_name` or one of its parent modules matches an exclusion."""
        parts = module_name.split(".")
        names = [".".join(parts[: i + 1]) for i in range(len(parts))]
        return not any(_matches(p, n) for p in self.exclude for n in names)


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern)


def load_quant_config(path_or_dir: str | Path) -> QuantConfig | None:
    """Read the quantization config of an HF directory (or of one config JSON file).

    Looks at `hf_quant_config.json` first (ModelOpt), then config.json's `quantization_config`.
    Returns None for an unquantized checkpoint. Raises FormatError for unreadable or unsupported
    configs, naming the file and the key.
    """
    p = Path(path_or_dir)
    if p.is_dir():
        hq = p / "hf_quant_config.json"
        if hq.is_file():
            return _from_hf_quant_config(read_json_object(hq), hq)
        p = p / "config.json"
        if not p.is_file():
            return None
    doc = read_json_object(p)
    if p.name == "hf_quant_config.json" or "quantization" in doc and "producer" in doc:
        return _from_hf_quant_config(doc, p)
    qc = doc.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise FormatError("expected an object", path=p, key="quantization_config")
    return parse_quantization_config(qc, p)


def read_json_object(path: Path) -> dict:
    """The JSON object in the file at `path`; FormatError naming the file when it cannot be
    read or parsed, or holds something else at the top level."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise FormatError(f"cannot read JSON: {e}", path=path) from e
    if not isinstance(doc, dict):
        raise FormatError("expected a JSON object at the top level", path=path)
    return doc


def _from_hf_quant_config(doc: dict, path: Path) -> QuantConfig:
    q = doc.get("quantization")
    if not isinstance(q, dict):
        raise FormatError("expected an object", path=path, key="quantization")
    algo = q.get("quant_algo")
    if algo != "NVFP4":
        raise FormatError(
            f"unsupported ModelOpt quant_algo {algo!r}; only NVFP4 is supported",
            path=path,
            key="quantization.quant_algo",
        )
    group = _int(q.get("group_size", 16), path, "quantization.group_size")
    if group != 16:
        raise FormatError(f"NVFP4 needs group_size 16, got {group}", path=path,
                          key="quantization.group_size")
    excl = _patterns(q.get("exclude_modules"), path, "quantization.exclude_modules")
    return QuantConfig("modelopt_nvfp4", 16, None, excl, str(path))


def parse_quantization_config(qc: dict, path: str | Path = "config.json") -> QuantConfig:
    """Normalise a config.json `quantization_config` object (see the module docstring)."""
    method = qc.get("quant_method")
    if method == "modelopt":
        return _modelopt(qc, path)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, path)
    if method == "fp8":
        return _fp8_block(qc, path)
    if method == "mxfp4":
        excl = _patterns(qc.get("modules_to_not_convert"), path, "modules_to_not_convert")
        return QuantConfig("mxfp4", 32, None, excl, str(path))
    raise FormatError(
        f"unsupported quant_method {method!r}; expected modelopt (NVFP4), compressed-tensors "
        "(nvfp4-pack-quantized), fp8 (128x128 blocks) or mxfp4",
        path=path,
        key="quantization_config.quant_method",
    )


def _modelopt(qc: dict, path: str | Path) -> QuantConfig:
    algo = qc.get("quant_algo")
    if algo != "NVFP4":
        raise FormatError(f"unsupported ModelOpt quant_algo {algo!r}; only NVFP4 is supported",
                          path=path, key="quantization_config.quant_algo")
    group = qc.get("group_size")
    for g in (qc.get("config_groups") or {}).values():
        if isinstance(g, dict) and isinstance(g.get("weights"), dict):
            group = g["weights"].get("group_size", group)
    group = _int(16 if group is None else group, path, "quantization_config.group_size")
    if group != 16:
        raise FormatError(f"NVFP4 needs group_size 16, got {group}", path=path,
                          key="quantization_config.group_size")
    key = "ignore" if "ignore" in qc else "exclude_modules"
    excl = _patterns(qc.get(key), path, f"quantization_config.{key}")
    return QuantConfig("modelopt_nvfp4", 16, None, excl, str(path))


def _compressed_tensors(qc: dict, path: str | Path) -> QuantConfig:
    fmt = qc.get("format")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise FormatError("expected an object", path=path, key="quantization_config.config_groups")
    formats = [g.get("format", fmt) for g in groups.values() if isinstance(g, dict)] or [fmt]
    if any(f != "nvfp4-pack-quantized" for f in formats):
        raise FormatError(
            f"unsupported compressed-tensors format {formats}; only "
            "nvfp4-pack-quantized is supported",
            path=path,
            key="quantization_config.format",
        )
    for name, g in groups.items():
        w = g.get("weights") if isinstance(g, dict) else None
        if isinstance(w, dict) and w.get("group_size", 16) != 16:
            raise FormatError(f"NVFP4 needs group_size 16, got {w.get('group_size')!r}",
                              path=path, key=f"quantization_config.config_groups.{name}")
    excl = _patterns(qc.get("ignore"), path, "quantization_config.ignore")
    return QuantConfig("compressed_tensors_nvfp4", 16, None, excl, str(path))


def _fp8_block(qc: dict, path: str | Path) -> QuantConfig:
    key = "quantization_config.weight_block_size"
    bs = qc.get("weight_block_size")
    if not (isinstance(bs, list) and len(bs) == 2 and all(type(b) is int and b > 0 for b in bs)):
        raise FormatError(f"expected two positive integers, got {bs!r} (per-tensor FP8 is not "
                          "supported)", path=path, key=key)
    if qc.get("fmt", "e4m3") != "e4m3":
        raise FormatError(f"unsupported FP8 format {qc.get('fmt')!r}; expected e4m3", path=path,
                          key="quantization_config.fmt")
    k = "modules_to_not_convert" if "modules_to_not_convert" in qc else "ignored_layers"
    excl = _patterns(qc.get(k), path, f"quantization_config.{k}")
    return QuantConfig("fp8_block", bs[1], (bs[0], bs[1]), excl, str(path))


def _int(v: object, path: str | Path, key: str) -> int:
    if type(v) is not int:
        raise FormatError(f"expected an integer, got {v!r}", path=path, key=key)
    return v


def _patterns(v: object, path: str | Path, key: str) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise FormatError(f"expected a list of module names, got {v!r}", path=path, key=key)
    for s in v:
        if s.startswith("re:"):
            try:
                re.compile(s[3:])
            except re.error as e:
                raise FormatError(f"bad regex {s!r}: {e}", path=path, key=key) from e
    return tuple(v)
