"""Q8_0 split at load on CUDA (`freetoken.kernels.triton.formats.split_q8_0`: int8 codes
[N, K] and f16 d [N, K/32] instead of 34-byte blocks): the split weight decodes bit for bit as
the blocks it came from (codecs and gguf-py's numpy dequantize, every bit pattern of d: NaN and
inf included), and its GEMV / tl.dot paths agree with float64 within the bounds of
test_triton_linear (fp32 activations: 2 K eps sum |x||w| |s2|, the kernel sums in another order;
bf16 on CUDA: 2^-7 sum |x||w| |s2|). CPU weights are never split (the C++ executor reads the
blocks as stored). Without CUDA the kernels run in Triton's interpreter on small shapes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import triton_cases as cases  # noqa: E402

from freetoken.formats.dequant import dequantize  # noqa: E402
from freetoken.formats.qweight import QuantWeight  # noqa: E402
from freetoken.kernels.linear import embedding, linear  # noqa: E402
from freetoken.kernels.triton.formats import (  # noqa: E402
    F_Q8_0_SPLIT,
    device_layout,
    format_id,
    split_q8_0,
)
from freetoken.kernels.triton.linear import (  # noqa: E402
    triton_dequantize,
    triton_linear,
    triton_rows,
)

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
N, K = (300, 4096) if CUDA else (12, 1024)
Q8_0 = int(gguf.GGMLQuantizationType.Q8_0)


def _blocks(seed: int, n: int = N, k: int = K) -> QuantWeight:
    """Random bytes: every f16 d pattern (NaN, inf, subnormals) and every code."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (n, k // 32 * 34), generator=gen, dtype=torch.uint8)
    return QuantWeight(data, "gguf", (n, k), ggml_type=Q8_0)


def _same_bits(got: torch.Tensor, ref: torch.Tensor) -> None:
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(got), nan)
    diff = (got.view(torch.int32) != ref.view(torch.int32)) & ~nan
    assert int(diff.sum()) == 0, f"{int(diff.sum())} values differ"


def test_split_decodes_bit_exact():
    qw = _blocks(1)
    s = split_q8_0(cases.to_device(qw, DEV))
    assert format_id(s) == F_Q8_0_SPLIT and s.nbytes() == qw.nbytes()
    ref = dequantize(qw)
    ref_np = gguf.quants.dequantize(qw.data.numpy(), Q8_0).reshape(qw.shape)
    _same_bits(ref, torch.from_numpy(np.ascontiguousarray(ref_np)))
    rows = torch.arange(N, device=DEV)
    _same_bits(triton_rows(s, rows, torch.float32, apply_scale2=False).cpu(), ref)  # per value
    _same_bits(triton_dequantize(s).cpu(), ref)  # the tl.dot paths' vectorized tiles


def test_split_linear_matches_float64():
    gen = torch.Generator().manual_seed(7)
    qw = cases.random_weight("Q8_0", gen, N, K)  # finite d
    qw.scale2 = torch.rand(N, generator=gen) + 0.5
    w = dequantize(qw).double()
    s = split_q8_0(cases.to_device(qw, DEV))
    s.scale2 = qw.scale2.to(DEV)
    # split_gemv at 1 and 5 tokens; the tl.dot tiles (fast tiles) at 20
    for m, tiles in ((1, None), (5, None), (20, (16, 16, 128, 4))):
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
        y = triton_linear(x.to(DEV), s, tiles).double().cpu()
        ref = (x.double() @ w.T) * qw.scale2.double()
        mag = (x.double().abs() @ w.abs().T) * qw.scale2.double()
        assert bool(((y - ref).abs() <= cases.fp32_bound(K, mag)).all())


def test_cpu_weights_stay_blocks():
    qw = _blocks(2, 4, 64)
    assert device_layout(qw, torch.bfloat16) is qw
    with pytest.raises(ValueError, match="split_q8_0 takes Q8_0 blocks"):
        split_q8_0(split_q8_0(qw))


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_entry_points_on_split_cuda_weight():
    gen = torch.Generator().manual_seed(9)
    qw = cases.random_weight("Q8_0", gen, N, K)
    s = device_layout(cases.to_device(qw, DEV), torch.bfloat16)
    assert format_id(s) == F_Q8_0_SPLIT
    w = dequantize(qw).double()
    for m in (1, 4, 16, 512):
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        y = linear(x.to(DEV), s).double().cpu()
        ref = x.double() @ w.T
        mag = x.double().abs() @ w.abs().T
        assert bool(((y - ref).abs() <= cases.bf16_bound(mag)).all()), m
    ids = torch.tensor([[3, 0], [N - 1, 3]])
    got = embedding(ids.to(DEV), s, torch.float32).cpu()
    assert torch.equal(got, dequantize(qw)[ids])


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
