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


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
