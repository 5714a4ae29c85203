"""Find and build the HF tokenizer of a model: from an HF directory or from GGUF metadata.

transformers builds a tokenizer from a GGUF file's `tokenizer.ggml.*` metadata
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), which takes 4-20 s on the real models;
the result is saved under `assets.cache_dir()/tokenizers/<key>` and reloaded from there
(about 0.5 s). The key hashes the file's size and its first bytes, where GGUF keeps all
metadata (the vocabulary included), so a different file never reuses another's tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sys
from pathlib import Path

from freetoken import assets
from freetoken.formats.errors import FormatError

_HASH_BYTES = 32 << 20  # GGUF metadata (vocab, merges, template) sits at the start of the file


def gguf_cache_key(path: Path) -> str:
    """A content key for a GGUF file's metadata: blake2b of its size and first 32 MiB."""
    h = hashlib.blake2b(digest_size=12)
    h.update(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        h.update(f.read(_HASH_BYTES))
    return h.hexdigest()


def load_hf_tokenizer(path: str | os.PathLike):
    """A transformers tokenizer for a GGUF file or an HF directory (cached for GGUF)."""
    from transformers import AutoTokenizer

    p = Path(path)
    if p.is_dir():
        if not any((p / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            raise FormatError("no tokenizer.json / tokenizer.model / vocab.json in it", path=p)
        return AutoTokenizer.from_pretrained(str(p))
    cached = assets.cache_dir() / "tokenizers" / gguf_cache_key(p)
    if (cached / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(cached))
    print(f"building the tokenizer from {p.name}'s metadata (once; cached)", file=sys.stderr)
    try:
        tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    except Exception as e:  # transformers raises many types for unsupported vocabularies
        raise FormatError(f"cannot build a tokenizer from its metadata: {e}", path=p) from e
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    tok.save_pretrained(str(tmp))
    if cached.exists():  # another process got there first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, cached)
    return tok


def model_family(path: str | os.PathLike) -> str:
    """The architecture name: GGUF `general.architecture` or HF config.json `model_type`."""
    p = Path(path)
    if p.is_dir():
        cfg = p / "config.json"
        if not cfg.exists():
            return "unknown"
        return str(json.loads(cfg.read_text()).get("model_type", "unknown"))
    return str(gguf_metadata(p, ("general.architecture",)).get("general.architecture", "unknown"))


def gguf_metadata(path: Path, keys: tuple[str, ...]) -> dict:
    """Scalar / string values of a few GGUF metadata keys (missing keys are left out).

    A header scan that skips arrays without decoding them: gguf.GGUFReader decodes every
    vocabulary array and takes ~8 s on a 150k-token vocabulary; this takes milliseconds.
    """
    with open(path, "rb") as f:
        buf = memoryview(f.read(_HASH_BYTES))
    try:
        return _scan_kv(buf, set(keys))
    except (struct.error, IndexError, UnicodeDecodeError) as e:
        raise FormatError(f"cannot read its GGUF metadata ({e})", path=path) from e


# GGUF value types: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool, 8 string, 9 array,
# 10 u64, 11 i64, 12 f64.
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?"}
_SCALAR |= {10: "Q", 11: "q", 12: "d"}


def _scan_kv(buf: memoryview, wanted: set[str]) -> dict:
    if bytes(buf[:4]) != b"GGUF":
        raise struct.error("bad magic")
    (n_kv,) = struct.unpack_from("<Q", buf, 16)  # magic u32, version u32, n_tensors u64, n_kv
    off, out = 24, {}
    for _ in range(n_kv):
        key, off = _read_str(buf, off)
        (vtype,) = struct.unpack_from("<I", buf, off)
        value, off = _read_value(buf, off + 4, vtype)
        if key in wanted:
            out[key] = value
            if len(out) == len(wanted):
                break
    return out


def _read_str(buf: memoryview, off: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, off)
    return bytes(buf[off + 8 : off + 8 + n]).decode("utf-8"), off + 8 + n


def _read_value(buf: memoryview, off: int, vtype: int) -> tuple[object, int]:
    if vtype in _SCALAR:
        fmt = "<" + _SCALAR[vtype]
        return struct.unpack_from(fmt, buf, off)[0], off + struct.calcsize(fmt)
    if vtype == 8:
        return _read_str(buf, off)
    if vtype != 9:
        raise struct.error(f"unknown value type {vtype}")
    etype, n = struct.unpack_from("<IQ", buf, off)
    off += 12
    if etype in _SCALAR:  # skipped, not decoded
        return None, off + n * struct.calcsize("<" + _SCALAR[etype])
    for _ in range(n):
        _, off = _read_value(buf, off, etype)
    return None, off


def generation_eos_ids(path: str | os.PathLike) -> list[int]:
    """Extra end-of-sequence ids the model declares outside its tokenizer.

    HF: generation_config.json `eos_token_id` (an int or a list, as llama 3 has).
    GGUF: `tokenizer.ggml.eos_token_id` and `tokenizer.ggml.eot_token_id`.
    """
    p = Path(path)
    if p.is_dir():
        gen = p / "generation_config.json"
        if not gen.exists():
            return []
        eos = json.loads(gen.read_text()).get("eos_token_id")
        return [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
    return [int(v) for v in gguf_metadata(p, keys).values()]
