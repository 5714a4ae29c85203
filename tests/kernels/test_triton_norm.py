"""Triton RMSNorm (and its fused residual add) against float64 math and the torch reference
`freetoken.kernels.norm.rms_norm_reference`.

Without CUDA the kernel runs under Triton's interpreter (TRITON_INTERPRET=1) on small shapes;
with CUDA the same cases run compiled, plus the entry points' dispatch. Tolerances, against
the float64 norm of the same input values:
- fp32: 1e-5 |ref| + 1e-6 (summation order and rsqrt differ);
- bf16 / fp16: one rounding of the output, 2^-8 |ref| (bf16) or 2^-11 |ref| (fp16), plus 1e-6;
  the residual sum is rounded once as torch's add does: equal to x + residual bit for bit.
  Triton's interpreter converts fp32 to bf16 by truncation (numpy has no bf16), not to nearest:
  there bf16 allows two truncations, 2^-6 |ref|, and the sum is checked within 2^-7 |x + r|.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():  # NOTE: read when the kernels are decorated (first import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from freetoken.kernels.norm import add_rms_norm, rms_norm, rms_norm_reference  # noqa: E402
from freetoken.kernels.triton.norm import rms_norm_triton  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
REL = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -8 if CUDA else 2.0 ** -6,
       torch.float16: 2.0 ** -11}


def _ref64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _same_sum(s: torch.Tensor, x: torch.Tensor, r: torch.Tensor) -> None:
    if CUDA or s.dtype != torch.bfloat16:
        assert torch.equal(s, x + r)  # the add rounds once, as torch's does
    else:  # the interpreter truncates
        ref = x.double() + r.double()
        assert bool(((s.double() - ref).abs() <= 2.0 ** -7 * ref.abs()).all())


def _close(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    err = (y.double() - ref).abs()
    bound = REL[dtype] * ref.abs() + 1e-6
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,d", [(3, 64), (5, 96), (1, 2048)])
def test_rms_norm(n: int, d: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + d)
    x = (torch.randn(n, d, generator=gen) * 3).to(dtype)
    w = torch.rand(d, generator=gen) + 0.5
    y, s, _ = rms_norm_triton(x.to(DEV), w.to(DEV), 1e-6)
    assert s is None and y.dtype == dtype and y.shape == (n, d)
    _close(y.cpu(), _ref64(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    n, d = 4, 160
    x, r = (torch.randn(n, d, generator=gen).to(dtype) for _ in range(2))
    w = torch.rand(d, generator=gen) + 0.5
    y, s, _ = rms_norm_triton(x.to(DEV), w.to(DEV), 1e-5, r.to(DEV))
    _same_sum(s.cpu(), x, r)
    _close(y.cpu(), _ref64(x + r, w, 1e-5), dtype)


def test_strided_rows() -> None:
    """Rows of a wider tensor (a split of a fused projection) are read through their stride."""
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(3, 200, generator=gen)
    w = torch.rand(64, generator=gen)
    y, _, _ = rms_norm_triton(wide[:, 8:72].to(DEV), w.to(DEV), 1e-6)
    _close(y.cpu(), _ref64(wide[:, 8:72], w, 1e-6), torch.float32)


def test_entry_points_check_shapes() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight must be \\[8\\]"):
        rms_norm(x, torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, torch.randn(2, 4), torch.ones(8), 1e-6)


def test_entry_points_cpu_match_float64() -> None:
    """On the CPU (fp32: the executor's one-call RMSNorm) the entry points compute the
    reference's formula: within fp32 rounding of float64 math, (n + 4) * 2^-24 relative (a sum
    of n squares, a division, a square root and two products, each rounded once); the residual
    sum exactly x + r."""
    gen = torch.Generator().manual_seed(5)
    x, r = torch.randn(3, 4, 32, generator=gen), torch.randn(3, 4, 32, generator=gen)
    w = torch.rand(32, generator=gen)

    def f64(v: torch.Tensor) -> torch.Tensor:
        v = v.double()
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()

    def close(y: torch.Tensor, ref: torch.Tensor) -> bool:
        return bool(((y.double() - ref).abs() <= 36 * 2.0**-24 * ref.abs()).all())

    assert close(rms_norm(x, w, 1e-6), f64(x))
    assert close(rms_norm_reference(x, w, 1e-6), f64(x))
    y, s = add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(s, x + r) and close(y, f64(x + r))


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entry_points_cuda(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(16, 8, 128, generator=gen).to(dtype)
    r = torch.randn(16, 8, 128, generator=gen).to(dtype)
    w = torch.rand(128, generator=gen) + 0.5
    y = rms_norm(x.cuda(), w.cuda(), 1e-6)
    assert y.shape == x.shape
    _close(y.cpu(), _ref64(x, w, 1e-6), dtype)
    y, s = add_rms_norm(x.cuda(), r.cuda(), w.cuda(), 1e-6)
    _same_sum(s.cpu(), x, r)
    _close(y.cpu(), _ref64(x + r, w, 1e-6), dtype)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
