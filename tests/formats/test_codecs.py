"""Torch GGUF codecs against gguf-py's numpy reference (`gguf.quants.dequantize`), bit for bit.

Random bytes make random scales too: f16 / E8M0 / UE4M3 scale bytes hit NaN, inf, subnormals and
zeros, so special values are covered. "Bit for bit" means: NaN in the same places, and every other
value with the same fp32 bit pattern (so -0.0 and +0.0 are told apart).
"""

from __future__ import annotations

import sys

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from freetoken.formats.codecs import SUPPORTED_TYPES, dequantize_gguf

T = GGMLQuantizationType


def reference_types() -> list[GGMLQuantizationType]:
    """Every type gguf.quants can dequantize: F32 and F16 (special-cased) plus its codec classes."""
    return [T.F32, T.F16, *sorted(gq._type_traits, key=int)]


def assert_bitexact(out: torch.Tensor, ref: np.ndarray, what: str) -> None:
    ref_t = torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32))
    assert out.dtype == torch.float32 and out.shape == ref_t.shape, what
    nan_o, nan_r = torch.isnan(out), torch.isnan(ref_t)
    assert torch.equal(nan_o, nan_r), f"{what}: NaN positions differ"
    same = out.view(torch.int32)[~nan_o] == ref_t.view(torch.int32)[~nan_r]
    if not bool(same.all()):
        i = int((~same).nonzero()[0])
        raise AssertionError(f"{what}: {int((~same).sum())} values differ, first at {i}: "
                             f"{out[~nan_o][i].item()!r} vs {ref_t[~nan_r][i].item()!r}")


def test_covers_every_reference_type():
    assert set(reference_types()) <= set(SUPPORTED_TYPES)


@pytest.mark.parametrize("qtype", reference_types(), ids=lambda t: t.name)
def test_random_blocks_bitexact(qtype: GGMLQuantizationType):
    block, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype) + 1000)
    rows, blocks_per_row = 48, 3
    ncols = blocks_per_row * block if block > 1 else 96
    raw = rng.integers(0, 256, size=(rows, ncols // block * type_size), dtype=np.uint8)
    with np.errstate(all="ignore"):  # NaN / inf scales are part of the test
        ref = gguf.quants.dequantize(raw.copy(), qtype)
    out = dequantize_gguf(torch.from_numpy(raw), int(qtype), (rows, ncols))
    assert_bitexact(out, ref, qtype.name)


QUANTIZABLE = [T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.TQ1_0, T.TQ2_0, T.MXFP4]


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_roundtrip_of_real_values(qtype: GGMLQuantizationType):
    """Well-formed blocks too: weights quantized by gguf's own quantizers (the types it has)."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((8, 512)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    ref = gguf.quants.dequantize(raw, qtype)
    assert_bitexact(dequantize_gguf(torch.from_numpy(raw), int(qtype), (8, 512)), ref, qtype.name)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="Q4_0"):
        dequantize_gguf(torch.zeros(17, dtype=torch.uint8), int(T.Q4_0), (32,))
    with pytest.raises(NotImplementedError, match="Q8_1"):
        dequantize_gguf(torch.zeros(40, dtype=torch.uint8), int(T.Q8_1), (32,))


def test_dequantize_dispatch_and_scale2():
    """dequantize(): float formats, NVFP4 with scale2 per matrix / expert / row, FP8 block."""
    from freetoken.formats.dequant import dequantize
    from freetoken.formats.nvfp4 import dequant_nvfp4
    from freetoken.formats.qweight import QuantWeight

    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 8, generator=g)
    assert torch.equal(dequantize(QuantWeight(w.bfloat16(), "bf16", (4, 8))), w.bfloat16().float())
    codes = torch.randint(0, 256, (3, 4, 16), dtype=torch.uint8, generator=g)
    sc = torch.randint(0, 0x7F, (3, 4, 2), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    base = dequant_nvfp4(codes, sc)
    for s2, bcast in [(torch.tensor(0.5), 0.5), (torch.tensor([1.0, 2.0, 4.0]),
                                                 torch.tensor([1.0, 2.0, 4.0]).reshape(3, 1, 1))]:
        qw = QuantWeight(codes, "nvfp4", (3, 4, 32), scales=sc, scale2=s2)
        assert torch.equal(dequantize(qw), base)  # scale2 multiplies results, not weights
        assert torch.equal(dequantize(qw, apply_scale2=True), base * bcast)
    row = QuantWeight(codes[0], "nvfp4", (4, 32), scales=sc[0], scale2=torch.arange(4.0))
    assert torch.equal(dequantize(row, apply_scale2=True), base[0] * torch.arange(4.0)[:, None])
    with pytest.raises(ValueError, match="scale2"):
        dequantize(QuantWeight(codes[0], "nvfp4", (4, 32), scales=sc[0],
                               scale2=torch.ones(5)), apply_scale2=True)
    f8 = torch.randn(130, 256, generator=g).to(torch.float8_e4m3fn)
    inv = torch.rand(2, 2, generator=g)
    ref = f8.double() * inv.double().repeat_interleave(128, 0)[:130].repeat_interleave(128, 1)
    got = dequantize(QuantWeight(f8, "fp8_block", (130, 256), scales=inv))
    # One fp32 rounding of an exact fp64 product: relative error at most 2**-24.
    torch.testing.assert_close(got.double(), ref, rtol=2.0**-24, atol=0)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
