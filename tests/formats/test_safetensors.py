"""HFCheckpoint: single-file and sharded directories, dtypes, and what a damaged file gets wrong.

References: tensors written by the `safetensors` package itself (save_file) must read back
bit-identical; each damaged variant is built by editing the header bytes of a valid file and must
raise FormatError naming the file and the tensor or key.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from freetoken.formats.errors import FormatError
from freetoken.formats.safetensors import HFCheckpoint, read_header

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
          "max_position_embeddings": 128}


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)
    return {
        "a.f32": r(3, 5), "b.bf16": r(4, 8).bfloat16(), "c.f16": r(7).half(),
        "d.f8": (r(6, 16) * 50).to(torch.float8_e4m3fn),
        "e.u8": torch.arange(10, dtype=torch.uint8),
        "f.i64": torch.arange(-3, 3), "g.bool": torch.tensor([True, False, True]),
        "h.scalar": torch.tensor(2.5), "i.empty": torch.zeros(0, 4),
        "j.f8e5": r(2, 3).to(torch.float8_e5m2),
    }


def make_dir(d: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(CONFIG))
    if shards == 1:
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        return d
    names = list(tensors)
    wm = {}
    for i in range(shards):
        f = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, d / f)
        wm.update({n: f for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {},
                                                                "weight_map": wm}))
    return d


def split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def join(path: Path, header: dict | bytes, data: bytes, n: int | None = None) -> None:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h) if n is None else n) + h + data)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point and a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


@pytest.mark.parametrize("shards", [1, 3])
def test_reads_back_every_dtype(tmp_path, shards):
    t = sample_tensors()
    ck = HFCheckpoint(make_dir(tmp_path / "m", t, shards))
    assert ck.architecture == "LlamaForCausalLM" and ck.model_type == "llama"
    assert ck.quant is None
    assert ck.tensor_names() == sorted(t)
    for name, ref in t.items():
        assert same(ck.tensor(name), ref), name
    assert ck.dtype_of("d.f8") == "F8_E4M3"
    s = ck.metadata_summary()
    assert s["tensors"] == len(t) and s["vocab_size"] == 64 and s["context_length"] == 128
    assert s["parameters"] == sum(x.numel() for x in t.values())
    assert s["dtypes"]["F8_E4M3"] == 1 and s["chat_template"] is False
    ck.tensor("a.f32").add_(1)  # copy-on-write mapping: the file must not change
    assert same(HFCheckpoint(tmp_path / "m").tensor("a.f32"), t["a.f32"])


def test_float_weight(tmp_path):
    w = torch.randn(8, 16).bfloat16()
    ck = HFCheckpoint(make_dir(tmp_path / "m", {"x.proj.weight": w, "x.norm.weight": w[0].clone()}))
    qw = ck.weight("x.proj")
    assert qw.fmt == "bf16" and qw.shape == (8, 16) and torch.equal(qw.data, w)
    assert ck.weight_tensor_names("x.proj") == ["x.proj.weight"]
    assert ck.weight_prefixes() == ["x.norm", "x.proj"]
    with pytest.raises(FormatError, match="no weight"):
        ck.weight("x.nothing")


# -- damaged single files: (edit of header/data) -> expected words in the message -------------


def _cases():
    def hdr_len_beyond(h, d):
        return json.dumps(h).encode(), d, 10**9

    def bad_json(h, d):
        return b"{" + json.dumps(h).encode()[1:-1] + b",}", d, None

    def not_utf8(h, d):
        return b'{"\xff": 1}', d, None

    def offsets_out_of_range(h, d):
        h["a.f32"]["data_offsets"] = [len(d) - 4, len(d) + 56]
        return h, d, None

    def overlap(h, d):
        b = h["b.bf16"]["data_offsets"]
        h["b.bf16"]["data_offsets"] = [b[0] - 2, b[1] - 2]
        return h, d, None

    def byte_count(h, d):
        h["a.f32"]["shape"] = [3, 6]
        return h, d, None

    def dtype_count(h, d):
        h["a.f32"]["dtype"] = "F64"
        return h, d, None

    def unknown_dtype(h, d):
        h["c.f16"]["dtype"] = "F4"
        return h, d, None

    def neg_shape(h, d):
        h["c.f16"]["shape"] = [-7]
        return h, d, None

    def float_shape(h, d):
        h["c.f16"]["shape"] = [7.0]
        return h, d, None

    def missing_field(h, d):
        del h["c.f16"]["dtype"]
        return h, d, None

    def truncated(h, d):
        return h, d[:-3], None

    def trailing(h, d):
        return h, d + b"\0" * 8, None

    def duplicate(h, d):
        s = json.dumps(h).encode()
        return s[:-1] + b', "c.f16": ' + json.dumps(h["c.f16"]).encode() + b"}", d, None

    def metadata_not_str(h, d):
        h["__metadata__"] = {"format": 1}
        return h, d, None

    def nan(h, d):
        return json.dumps(h).encode()[:-1] + b', "x": NaN}', d, None

    def not_object(h, d):
        return b"[1, 2]", d, None

    return {
        "header length": (hdr_len_beyond, "header length"),
        "bad json": (bad_json, "JSON"),
        "not utf8": (not_utf8, "UTF-8"),
        "offsets out of range": (offsets_out_of_range, "a.f32"),
        "overlap": (overlap, "b.bf16"),
        "byte count": (byte_count, "a.f32"),
        "dtype count": (dtype_count, "a.f32"),
        "unknown dtype": (unknown_dtype, "c.f16"),
        "negative shape": (neg_shape, "c.f16"),
        "float shape": (float_shape, "c.f16"),
        "missing field": (missing_field, "c.f16"),
        "truncated": (truncated, "data region"),
        "trailing bytes": (trailing, "data region"),
        "duplicate": (duplicate, "c.f16"),
        "metadata": (metadata_not_str, "__metadata__"),
        "nan": (nan, "NaN"),
        "not object": (not_object, "header"),
    }


@pytest.mark.parametrize("case", sorted(_cases()))
def test_damaged_file(tmp_path, case):
    edit, words = _cases()[case]
    d = make_dir(tmp_path / "m", sample_tensors())
    f = d / "model.safetensors"
    h, data = split(f)
    h2, d2, n = edit(h, data)
    join(f, h2, d2, n)
    with pytest.raises(FormatError) as ei:
        HFCheckpoint(d)
    msg = str(ei.value)
    assert "model.safetensors" in msg and words in msg, msg


def test_tiny_and_empty_files(tmp_path):
    for raw in (b"", b"\1\0\0", struct.pack("<Q", 0), struct.pack("<Q", 2) + b"{}x"):
        f = tmp_path / "x.safetensors"
        f.write_bytes(raw)
        with pytest.raises(FormatError, match="x.safetensors"):
            read_header(f)
    f.write_bytes(struct.pack("<Q", 2) + b"{}")
    assert read_header(f) == ({}, {})


# -- directories, index and config -------------------------------------------------------------


def test_missing_shard(tmp_path):
    d = make_dir(tmp_path / "m", sample_tensors(), shards=3)
    (d / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FormatError, match="model-00002-of-00003.safetensors is missing"):
        HFCheckpoint(d)


def test_index_names_missing_tensor(tmp_path):
    d = make_dir(tmp_path / "m", sample_tensors(), shards=2)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(FormatError, match="ghost.weight"):
        HFCheckpoint(d)


def test_index_misses_tensor_and_path_escape(tmp_path):
    d = make_dir(tmp_path / "m", sample_tensors(), shards=2)
    path = d / "model.safetensors.index.json"
    idx = json.loads(path.read_text())
    del idx["weight_map"]["a.f32"]
    path.write_text(json.dumps(idx))
    with pytest.raises(FormatError, match="a.f32.*not in the index"):
        HFCheckpoint(d)
    idx["weight_map"]["a.f32"] = "../model-00001-of-00002.safetensors"
    path.write_text(json.dumps(idx))
    with pytest.raises(FormatError, match="plain file name"):
        HFCheckpoint(d)


def test_directory_and_config_errors(tmp_path):
    with pytest.raises(FormatError, match="not a directory"):
        HFCheckpoint(tmp_path / "nope")
    d = make_dir(tmp_path / "m", sample_tensors())
    (d / "config.json").write_text("{")
    with pytest.raises(FormatError, match="config.json"):
        HFCheckpoint(d)
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(FormatError, match="architectures"):
        HFCheckpoint(d)
    (d / "config.json").write_text(json.dumps(CONFIG))
    (d / "model.safetensors").unlink()
    with pytest.raises(FormatError, match="neither model.safetensors"):
        HFCheckpoint(d)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
