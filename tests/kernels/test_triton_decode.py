"""Every format's Triton decode (`freetoken.kernels.triton.quant.decode_tile`, and the
vectorized tiles of `freetoken.kernels.triton.tiles`) reproduces the codecs bit for bit: tiny
kernels write the decoded rows (`triton_rows`, `triton_dequantize`), compared with
`freetoken.formats.dequant.dequantize` as int32 bit patterns (signed zeros included; NaN where
and only where the codec has NaN), and for GGUF types also with gguf-py's numpy dequantize.

Weights are random bytes (every bit pattern of codes and scales, NaN / inf scales included).
Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported) on small shapes; with CUDA on the device at larger shapes.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from freetoken.formats.dequant import dequantize  # noqa: E402
from freetoken.formats.qweight import QuantWeight  # noqa: E402
from freetoken.kernels.linear import dequantize_at_load  # noqa: E402
from freetoken.kernels.triton.linear import triton_dequantize, triton_rows  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
N, K = (96, 4096) if CUDA else (3, 512)
GGUF_TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "NVFP4"]


def _bytes(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)


def _weights(name: str, gen: torch.Generator) -> QuantWeight:
    if name == "nvfp4":
        scales = _bytes(gen, N, K // 16).view(torch.float8_e4m3fn)
        return QuantWeight(_bytes(gen, N, K // 2), "nvfp4", (N, K), scales=scales)
    if name == "mxfp4":
        return QuantWeight(_bytes(gen, N, K // 2), "mxfp4", (N, K), scales=_bytes(gen, N, K // 32))
    if name == "fp8_block":
        n = N + 70  # a partial 128-row block of scales
        scales = torch.randn(-(-n // 128), K // 128, generator=gen)
        return QuantWeight(_bytes(gen, n, K).view(torch.float8_e4m3fn), "fp8_block", (n, K),
                           scales=scales)
    t = gguf.GGMLQuantizationType[name]
    block, size = gguf.GGML_QUANT_SIZES[t]
    return QuantWeight(_bytes(gen, N, K // block * size), "gguf", (N, K), ggml_type=int(t))


def _on(qw: QuantWeight, dev: torch.device) -> QuantWeight:
    return QuantWeight(qw.data.to(dev), qw.fmt, qw.shape,
                       scales=None if qw.scales is None else qw.scales.to(dev),
                       ggml_type=qw.ggml_type)


def _assert_same_bits(got: torch.Tensor, ref: torch.Tensor) -> None:
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(got), nan)
    diff = (got.view(torch.int32) != ref.view(torch.int32)) & ~nan
    assert int(diff.sum()) == 0, f"{int(diff.sum())} values differ, first at " \
        f"{torch.nonzero(diff)[0].tolist()}"


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "fp8_block", *GGUF_TYPES])
def test_decode_is_bit_exact(name):
    qw = _weights(name, torch.Generator().manual_seed(len(name) * 7 + 1))
    ref = dequantize(qw)
    rows = torch.arange(qw.out_features, device=DEV)
    got = triton_rows(_on(qw, DEV), rows, torch.float32, apply_scale2=False).cpu()
    _assert_same_bits(got, ref)
    if qw.fmt == "gguf":  # the independent numpy reference, for the GGUF types
        ref_np = gguf.quants.dequantize(qw.data.numpy(), qw.ggml_type).reshape(qw.shape)
        _assert_same_bits(got, torch.from_numpy(np.ascontiguousarray(ref_np)))


@pytest.mark.parametrize("name", ["nvfp4", "Q8_0", "Q4_K"])
def test_fast_tiles_are_bit_exact(name):
    """The tl.dot paths' vectorized tiles (freetoken.kernels.triton.tiles) equal the codecs."""
    qw = _weights(name, torch.Generator().manual_seed(len(name) * 5 + 2))
    got = triton_dequantize(_on(qw, DEV)).cpu()
    _assert_same_bits(got, dequantize(qw))


def test_rows_apply_a_scalar_scale2():
    qw = _weights("Q8_0", torch.Generator().manual_seed(3))
    qw.data = qw.data.clone()
    qw.data.view(-1, 34)[:, 1] &= 0x3F  # finite f16 block scales
    qw.scale2 = torch.tensor(3e-3)
    ids = torch.tensor([2, 0, 2], device=DEV)
    qw_dev = _on(qw, DEV)
    qw_dev.scale2 = qw.scale2.to(DEV)
    got = triton_rows(qw_dev, ids, torch.float32).cpu()
    ref = dequantize(qw)[ids.cpu()] * torch.tensor(3e-3)
    _assert_same_bits(got, ref)


def test_dequantize_at_load_keeps_supported_and_decodes_the_rest():
    qw = _weights("Q4_K", torch.Generator().manual_seed(5))
    assert dequantize_at_load(qw) is qw
    t = gguf.GGMLQuantizationType.Q3_K
    block, size = gguf.GGML_QUANT_SIZES[t]
    q3 = QuantWeight(_bytes(torch.Generator().manual_seed(6), 2, 256 // block * size), "gguf",
                     (2, 256), ggml_type=int(t), scale2=torch.tensor(2.0), source="blk.0.w")
    f = dequantize_at_load(q3, torch.float32)
    assert f.fmt == "f32" and f.scale2 is q3.scale2
    _assert_same_bits(f.data, dequantize(q3))


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
