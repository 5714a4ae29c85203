"""The Triton quantized linear against the torch reference (`freetoken.kernels.linear`'s CPU
path: codecs' dequantized weights, fp32 matmul), every format, one token (the GEMV) and several
(tl.dot tiles), scale2 per tensor and per output row.

Tolerance, elementwise: fp32 activations: 2 K eps sum_k |x||w| |s2| (the kernel sums in another
order than torch, both in fp32); bf16 activations (CUDA only): 2^-7 sum_k |x||w| |s2| (weights
rounded to bf16 for the tensor cores, output rounded to bf16). Without CUDA the kernels run in
Triton's interpreter on small shapes; with CUDA also through the `linear` entry point.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import triton_cases as cases  # noqa: E402

from freetoken.formats.dequant import dequantize  # noqa: E402
from freetoken.kernels.linear import _quant_linear, embedding, linear  # noqa: E402
from freetoken.kernels.triton.linear import triton_embedding, triton_linear  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
N, K = (300, 4096) if CUDA else (16, 512)
BATCHES = [1, 7, 200] if CUDA else [1, 5]


def _case(fmt: str, seed: int, per_row: bool):
    gen = torch.Generator().manual_seed(seed)
    qw = cases.random_weight(fmt, gen, N, K)
    qw.scale2 = torch.rand(N, generator=gen) + 0.5 if per_row else torch.tensor(3e-2)
    w = dequantize(qw)  # fp32 [N, K], no scale2
    return qw, w


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, s2: torch.Tensor) -> None:
    ref = (x.double() @ w.double().T) * s2.double()
    mag = (x.double().abs() @ w.double().abs().T) * s2.double().abs()
    bound = cases.fp32_bound(K, mag) if x.dtype == torch.float32 else cases.bf16_bound(mag)
    err = (y.double().cpu() - ref).abs()
    assert bool((err <= bound).all()), f"max error / bound {float((err / bound).max()):.2f}"


@pytest.mark.parametrize("fmt", cases.FORMATS)
def test_triton_linear_matches_reference(fmt):
    qw, w = _case(fmt, len(fmt) * 13, per_row=fmt in ("Q4_K", "nvfp4"))
    qd = cases.to_device(qw, DEV)
    for m in BATCHES:
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
        # the default choice at one token (few programs); wide tiles otherwise on the CPU
        tiles = None if CUDA or m == 1 else (16, 16, 128, 4)
        y = triton_linear(x.to(DEV), qd, tiles)
        _check(y, x, w, qw.scale2)
        # the oracle itself: the torch path agrees with float64 within the same bound
        _check(_quant_linear(x, qw), x, w, qw.scale2)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("fmt", cases.FORMATS)
def test_linear_entry_point_bf16_cuda(fmt, per_row, monkeypatch):
    # the fp32 GEMV at decode sizes (the bound above); the int8 dots have their own test
    # (test_triton_gemv_i8.py); 512 tokens: decoded rows and torch's GEMM where the format
    # has fast tiles (`dequant_gemm`), tl.dot tiles otherwise
    monkeypatch.setenv("FREETOKEN_GPU_INT8_DOT", "0")
    qw, w = _case(fmt, len(fmt) * 17, per_row=per_row)
    qd = cases.to_device(qw, DEV)
    for m in (1, 4, 16, 512):
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        y = linear(x.to(DEV), qd)
        assert y.dtype == torch.bfloat16
        _check(y.float(), x.float(), w, qw.scale2)


@pytest.mark.parametrize("scale2", ["row", "tensor", None])
@pytest.mark.parametrize("fmt", ["nvfp4", "Q8_0", "Q4_K", "Q6_K"])
def test_dequant_gemm_in_row_chunks(fmt, scale2, monkeypatch):
    """`dequant_gemm` (prefill's decoded rows, scale2 folded into them, and torch's GEMM)
    against float64, bf16 x, its rows decoded in chunks (the byte cap lowered to 256 rows a
    chunk: 600 rows, 3 chunks), within the bf16 bound above (each weight times scale2 rounded
    once to bf16, the output once). Formats without fast tiles (Q6_K) are declined, out
    untouched."""
    import freetoken.kernels.triton.linear as tl_linear

    n, k = 600, 512
    monkeypatch.setattr(tl_linear, "DEQUANT_GEMM_BYTES", 256 * 2 * k)
    gen = torch.Generator().manual_seed(len(fmt))
    qw = cases.random_weight(fmt, gen, n, k)
    qw.scale2 = {"row": torch.rand(n, generator=gen) + 0.5, "tensor": torch.tensor(3e-2),
                 None: None}[scale2]
    w = dequantize(qw)
    x = torch.randn(300, k, generator=gen).to(torch.bfloat16)
    out = torch.full((300, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    done = tl_linear.dequant_gemm(x.to(DEV), cases.to_device(qw, DEV), out)
    if fmt == "Q6_K":
        assert not done and bool(out.isnan().all())
        return
    assert done
    s2 = torch.ones(()) if qw.scale2 is None else qw.scale2
    ref = (x.double() @ w.double().T) * s2.double()
    bound = cases.bf16_bound((x.double().abs() @ w.double().abs().T) * s2.double().abs())
    err = (out.double().cpu() - ref).abs()
    assert bool((err <= bound).all()), f"max error / bound {float((err / bound).max()):.2f}"


@pytest.mark.parametrize("fmt", ["Q6_K", "nvfp4", "fp8_block"])
def test_triton_embedding_matches_reference(fmt):
    qw, w = _case(fmt, 5, per_row=False)
    ids = torch.tensor([[3, 0], [N - 1, 3]])
    got = triton_embedding(ids.to(DEV), cases.to_device(qw, DEV), torch.float32).cpu()
    ref = embedding(ids, qw, torch.float32)
    assert torch.equal(got, ref)  # one multiply per value on both paths: identical


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))


def test_nvfp4_gemv_wide_chunks():
    """NVFP4 at one token with K >= 4096 takes 4 rows in 2048-wide chunks (the launcher's
    choice on the GPU, `_blocks`): the same bound against float64 (small N here)."""
    from freetoken.kernels.triton.linear import _blocks

    n, k = 8, 4096
    assert _blocks(1, n, k, 1, 1) == (1, 4, 2048, 4)
    gen = torch.Generator().manual_seed(41)
    qw = cases.random_weight("nvfp4", gen, n, k)
    qw.scale2 = torch.rand(n, generator=gen) + 0.5
    w = dequantize(qw)
    x = torch.randn(1, k, generator=gen)
    y = triton_linear(x.to(DEV), cases.to_device(qw, DEV), (1, 4, 2048, 4))
    ref = (x.double() @ w.double().T) * qw.scale2.double()
    mag = (x.double().abs() @ w.double().abs().T) * qw.scale2.double().abs()
    err = (y.double().cpu() - ref).abs()
    assert bool((err <= cases.fp32_bound(k, mag)).all())


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K"])
def test_k_quant_gemv_refuses_other_chunks(fmt):
    """The fp32 GEMV's K-quant dot reads one super-block a chunk: explicit tiles asking for
    another chunk are refused by name, not computed wrong."""
    gen = torch.Generator().manual_seed(17)
    qw = cases.random_weight(fmt, gen, 8, 1024)
    x = torch.randn(1, 1024, generator=gen)  # fp32: the fp32 GEMV
    with pytest.raises(ValueError, match="K-quant .* BK=256, got tiles with BK=512"):
        triton_linear(x.to(DEV), cases.to_device(qw, DEV), (1, 4, 512, 4))
