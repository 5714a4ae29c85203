"""GGUFFile against gguf's own GGUFReader and gguf.quants, and its refusals of damaged headers."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_fixtures import kv_str, kv_u32, raw_gguf, s, tinfo, write_small_gguf

from freetoken.formats.dequant import dequantize
from freetoken.formats.errors import FormatError
from freetoken.formats.gguf import GGUFFile

T = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return write_small_gguf(tmp_path_factory.mktemp("gguf") / "small.gguf")


def reader_value(field: gguf.ReaderField) -> object:
    return field.contents()


def test_matches_gguf_reader(small: Path):
    ref = gguf.GGUFReader(small)
    with GGUFFile(small) as g:
        assert g.version == 3 and g.alignment == 32 and g.arch == "llama"
        for key, field in ref.fields.items():
            if key.startswith("GGUF."):
                continue  # the reader's pseudo-fields for the header itself
            want = reader_value(field)
            got = g.metadata[key]
            if isinstance(want, float) or (isinstance(want, list) and want and
                                           isinstance(want[0], float)):
                np.testing.assert_array_equal(np.float32(got), np.float32(want))
            else:
                assert got == want, key
        assert list(g.tensors) == [t.name for t in ref.tensors]
        for t in ref.tensors:
            info = g.tensors[t.name]
            assert info.shape == tuple(int(x) for x in reversed(t.shape)), t.name
            assert info.offset == t.data_offset and info.nbytes == t.n_bytes
            raw = g.raw(t.name)
            assert not raw.flags.writeable and not raw.flags.owndata  # a view of the mapping
            assert raw.tobytes() == t.data.tobytes()


def test_weights_and_dequantize(small: Path):
    ref = gguf.GGUFReader(small)
    with GGUFFile(small) as g:
        for t in ref.tensors:
            if t.name.endswith("scale"):
                continue
            qw = g.weight(t.name)
            want = gguf.quants.dequantize(t.data, t.tensor_type)
            got = dequantize(qw)
            assert got.shape == want.shape, t.name
            assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(want))), t.name
        assert g.weight("token_embd.weight").fmt == "f32"
        assert g.weight("blk.0.attn_v.weight").fmt == "bf16"
        q = g.weight("blk.0.attn_q.weight")
        assert q.fmt == "gguf" and q.ggml_type == T.Q4_0 and tuple(q.data.shape) == (8, 36)
        nv = g.weight("blk.0.ffn_down.weight")
        assert nv.fmt == "nvfp4" and tuple(nv.data.shape) == (8, 64)
        assert nv.scales.dtype == torch.float8_e4m3fn and tuple(nv.scales.shape) == (8, 8)
        assert nv.scale2 is not None and nv.scale2.shape == ()
        assert nv.scale2.item() == np.float32(3e-4)
        scaled = dequantize(nv, apply_scale2=True)
        assert torch.equal(scaled, dequantize(nv) * torch.tensor(3e-4, dtype=torch.float32))


def test_float_weight_is_a_view(small: Path):
    with GGUFFile(small) as g:
        w = g.weight("token_embd.weight").data
        assert w.data_ptr() == g.raw_torch("token_embd.weight").data_ptr()


# -- refusals: each names the file and the tensor or key ----------------------------------------
F32_8 = tinfo("w", (8,), T.F32, 0)


def _load(tmp_path: Path, blob: bytes) -> GGUFFile:
    p = tmp_path / "bad.gguf"
    p.write_bytes(blob)
    return GGUFFile(p)


CASES = {
    "magic": (raw_gguf([], [F32_8], bytes(32), magic=b"GGUG"), "not a GGUF file"),
    "version": (raw_gguf([], [F32_8], bytes(32), version=7), "unsupported GGUF version 7"),
    "big_endian": (raw_gguf([], [F32_8], bytes(32), version=3 << 24), "big-endian"),
    "truncated_data": (raw_gguf([], [F32_8], bytes(16)), "runs past the end"),
    "offset_out_of_range": (raw_gguf([], [tinfo("w", (8,), T.F32, 1 << 40)], bytes(32)),
                            "runs past the end"),
    "misaligned": (raw_gguf([], [tinfo("w", (4,), T.F32, 4)], bytes(64)), "alignment"),
    "unknown_type": (raw_gguf([], [tinfo("w", (8,), 99, 0)], bytes(32)), "unknown ggml"),
    "dup_tensor": (raw_gguf([], [F32_8, tinfo("w", (8,), T.F32, 32)], bytes(64)), "duplicate"),
    "dup_key": (raw_gguf([kv_u32("a.b", 1), kv_u32("a.b", 2)], [F32_8], bytes(32)),
                "duplicate metadata key"),
    "absurd_tensor_count": (raw_gguf([], [F32_8], bytes(32), n_tensors=1 << 62), "cannot fit"),
    "absurd_kv_count": (raw_gguf([], [F32_8], bytes(32), n_kv=1 << 62), "cannot fit"),
    "absurd_string": (raw_gguf([struct.pack("<Q", 1 << 60) + b"x"], [], b""), "exceeds"),
    "block_multiple": (raw_gguf([], [tinfo("w", (48,), T.Q4_0, 0)], bytes(64)), "block size"),
    "overlap": (raw_gguf([], [F32_8, tinfo("v", (8,), T.F32, 0)], bytes(64)), "overlaps"),
    "ndims": (raw_gguf([], [tinfo("w", (1, 1, 1, 1, 8), T.F32, 0)], bytes(32)), "n_dims"),
    "alignment_key": (raw_gguf([kv_u32("general.alignment", 24)], [F32_8], bytes(32)),
                      "power of two"),
    "bad_utf8_key": (raw_gguf([s(b"\xff\xfe") + struct.pack("<I", 4) + bytes(4)], [], b""),
                     "UTF-8"),
    "absurd_array": (raw_gguf([s("k") + struct.pack("<IIQ", 9, 4, 1 << 61)], [], b""),
                     "exceeds"),
    "short": (b"GGUF", "too short"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refusals(tmp_path: Path, case: str):
    blob, msg = CASES[case]
    with pytest.raises(FormatError, match=msg) as e:
        _load(tmp_path, blob)
    assert "bad.gguf" in str(e.value)


def test_refusal_names_the_tensor_and_key(tmp_path: Path):
    with pytest.raises(FormatError, match="tensor 'blk.3.ffn_up.weight'"):
        _load(tmp_path, raw_gguf([], [tinfo("blk.3.ffn_up.weight", (8,), 77, 0)], bytes(32)))
    with pytest.raises(FormatError, match="key 'general.alignment'"):
        _load(tmp_path, raw_gguf([kv_str("general.alignment", "x")], [F32_8], bytes(32)))


def test_real_models_open(tmp_path: Path):
    from freetoken import assets

    with GGUFFile(assets.smollm2_path()) as g:
        ref = gguf.GGUFReader(assets.smollm2_path())
        assert [t.name for t in ref.tensors] == list(g.tensors)
        assert g.metadata["tokenizer.ggml.tokens"] == ref.fields["tokenizer.ggml.tokens"].contents()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
