"""NVFP4: ModelOpt dequantization against float64 math, and the GGUF -> ModelOpt repack against
gguf.quants' NVFP4 dequantization, bit for bit, on every one of the 256 scale bytes."""

from __future__ import annotations

import sys

import gguf
import numpy as np
import pytest
import torch
from gguf_fixtures import random_nvfp4

from freetoken.formats.errors import FormatError
from freetoken.formats.nvfp4 import (
    E2M1_VALUES,
    dequant_nvfp4,
    gguf_nvfp4_to_modelopt,
    modelopt_to_gguf_nvfp4,
)

NV = gguf.GGMLQuantizationType.NVFP4


def e2m1_f64(code: int) -> float:
    """E2M1 from its bits (sign, 2 exponent bits with bias 1, 1 mantissa bit)."""
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    mag = m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
    return sign * mag


def e4m3_f64(byte: int) -> float:
    """E4M3 (fn: no inf, 0x7F/0xFF NaN) from its bits, bias 7."""
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 0xF, byte & 7
    if e == 15 and m == 7:
        return float("nan")
    return sign * (m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def test_e2m1_table():
    for c in range(16):
        assert E2M1_VALUES[c].item() == e2m1_f64(c) or (c == 8 and E2M1_VALUES[c].item() == 0.0)


def test_dequant_against_float64():
    codes, scales = random_nvfp4((3, 5, 64), seed=1)
    # also negative scales (ModelOpt's E4M3 is signed)
    sb = scales.view(torch.uint8).clone()
    sb[0] |= 0x80
    scales = sb.view(torch.float8_e4m3fn)
    got = dequant_nvfp4(codes, scales)
    c = codes.numpy().astype(np.int64)
    vals = np.stack([c & 15, c >> 4], -1).reshape(3, 5, 64)  # value 2i low, 2i+1 high
    dec = np.vectorize(e2m1_f64)(vals) * np.repeat(np.vectorize(e4m3_f64)(sb.numpy()), 16, -1)
    np.testing.assert_array_equal(got.numpy().astype(np.float64), dec)  # products are exact


def test_repack_bitexact_on_all_scale_bytes():
    """Super-blocks whose 4 scales run through all 256 byte values, with random codes."""
    rng = np.random.default_rng(3)
    scales = np.arange(256, dtype=np.uint8).reshape(64, 4)  # 64 super-blocks
    raw = np.concatenate([scales, rng.integers(0, 256, (64, 32), dtype=np.uint8)], axis=1)
    ok = ~(scales == 0xFF).any(axis=1)  # 0xFF (UE4M3 480) has no E4M3 equivalent
    good = raw[ok].reshape(1, -1)
    ref = torch.from_numpy(gguf.quants.dequantize(good, NV))
    codes, sc = gguf_nvfp4_to_modelopt(torch.from_numpy(good))
    out = dequant_nvfp4(codes, sc)
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))  # -0.0 vs 0.0 too
    bad = torch.from_numpy(raw[~ok].reshape(1, -1))
    with pytest.raises(FormatError, match="0xFF") as e:
        gguf_nvfp4_to_modelopt(bad, name="blk.0.ffn_up.weight")
    assert "blk.0.ffn_up.weight" in str(e.value)


def test_expert_bank_and_roundtrip():
    codes, scales = random_nvfp4((4, 6, 192), seed=5)  # [E, N, K]
    raw = modelopt_to_gguf_nvfp4(codes, scales)
    assert tuple(raw.shape) == (4, 6, 192 // 64 * 36)
    c2, s2 = gguf_nvfp4_to_modelopt(raw)
    assert torch.equal(c2, codes) and torch.equal(s2.view(torch.uint8), scales.view(torch.uint8))
    ref = gguf.quants.dequantize(raw.numpy(), NV)
    assert torch.equal(dequant_nvfp4(c2, s2), torch.from_numpy(ref))


def test_shape_errors():
    with pytest.raises(ValueError, match="shapes disagree"):
        dequant_nvfp4(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(FormatError, match="multiple of 36"):
        gguf_nvfp4_to_modelopt(torch.zeros(2, 40, dtype=torch.uint8))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
