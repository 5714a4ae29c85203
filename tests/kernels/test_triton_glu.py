"""The MLP-tail kernels (kernels/triton/glu.py) against float64 math: the GLU act(g) * u,
the shared expert's gate-and-sum y + sigmoid(x . w) * sh, and qwen3.5's attention output
gate o * sigmoid(g) with its int8 codes.

Without CUDA they run under Triton's interpreter (TRITON_INTERPRET=1). Both compute in fp32
and round once: fp32 outputs within 1e-5 |ref| + 1e-6 (a few fp32 ops; the gate's dot of H
terms ~H 2^-24 relative, inside the bound for H <= 160), bf16 within one rounding, 2^-8 |ref|
(2^-7 under the interpreter, which truncates) + 1e-6 absolute (the fp32 error before it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # NOTE: read when the kernels are decorated (first import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).parent))
import triton_cases as cases  # noqa: E402
import util  # noqa: E402

from freetoken.kernels.attention import sigmoid_gate  # noqa: E402
from freetoken.kernels.triton.glu import (  # noqa: E402
    gated_add_triton,
    glu_triton,
    sigmoid_gate_triton,
)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    rel = 1e-5 if dtype == torch.float32 else (2.0 ** -8 if CUDA else 2.0 ** -7)
    err = (got.cpu().double() - ref).abs()
    bound = rel * ref.abs() + 1e-6
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glu(act: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    inter = 96
    gu = (torch.randn(3, 2 * inter + 5, generator=gen) * 3)[:, :2 * inter].to(dtype)  # strided
    g, u = gu.double().split(inter, dim=-1)
    ref = (F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")) * u
    a = glu_triton(gu.to(DEV), inter, act)
    assert a.dtype == dtype and a.shape == (3, inter)
    _close(a, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 160])
def test_gated_add(dtype: torch.dtype, hidden: int) -> None:
    gen = torch.Generator().manual_seed(hidden)
    y, sh, x = (torch.randn(4, hidden, generator=gen).to(dtype) for _ in range(3))
    w = (torch.randn(hidden, generator=gen) * 0.1).to(dtype)
    ref = y.double() + torch.sigmoid(x.double() @ w.double())[:, None] * sh.double()
    out = gated_add_triton(y.to(DEV), sh.to(DEV), x.to(DEV), w.to(DEV))
    assert out.dtype == dtype and out.shape == y.shape
    _close(out, ref, dtype)


@pytest.mark.parametrize("quantize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,hidden", [(1, 1120), (3, 320), (2, 160)])  # 160: no fold
def test_gated_add_folds_the_next_residual_step(T, hidden, dtype, quantize, monkeypatch):
    """The gated add with a fold (the fused backend's last kernel of a qwen3.5-moe layer)
    gives the plain gated add's sum bit for bit and carries the RMSNorm kernel's (y, s,
    codes) of it, which `add_rms_norm` returns; rows whose norm takes other warps than the
    gate (`gate_folds`) are not folded."""
    from freetoken.kernels import norm, xq
    from freetoken.kernels.triton.glu import gate_folds

    if quantize and DEV == "cpu":
        monkeypatch.setattr(xq, "wanted", lambda x: True)
    gen = torch.Generator().manual_seed(T + hidden)
    y, sh, x, res = ((torch.randn(T, hidden, generator=gen) * 2).to(dtype).to(DEV)
                     for _ in range(4))
    w = (torch.randn(hidden, generator=gen) * 0.1).to(dtype).to(DEV)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(DEV)
    fold = norm.NormFold(res, weight, 1e-6, quantize)
    got = gated_add_triton(y, sh, x, w, fold)
    want = gated_add_triton(y, sh, x, w)
    assert util.check_folded_step(got, want, res, weight, quantize) == gate_folds(hidden)
    assert gate_folds(hidden) == (hidden > 256)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_gate(dtype: torch.dtype) -> None:
    """o * sigmoid(g) from strided views (the gate halves of q's projection), the gate rounded
    to the dtype first as the model computes it: within one rounding of float64 (plus the
    gate's rounding, one bf16 unit of the product); the codes are the quantizer's of the
    stored output, bit for bit; the torch entry point (CPU) is the model's expression."""
    gen = torch.Generator().manual_seed(11)
    t, h, d = 3, 4, 64
    qg = (torch.randn(t, h, 2 * d, generator=gen) * 2).to(dtype)
    o, g = qg[..., :d].contiguous(), qg[..., d:]
    ref = o.double() * torch.sigmoid(g.double())
    y, q = sigmoid_gate_triton(o.to(DEV), g.to(DEV), True)
    assert y.shape == (t, h * d) and y.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else (2.0 ** -7 if CUDA else 2.0 ** -6)
    err = (y.cpu().double().view(t, h, d) - ref).abs()
    assert bool((err <= tol * ref.abs() + 1e-6).all())
    cases.check_codes(q, y)
    y2, none = sigmoid_gate_triton(o.to(DEV), g.to(DEV), False)
    assert none is None and torch.equal(y2.cpu(), y.cpu())
    want = (o * torch.sigmoid(g.float()).to(dtype)).reshape(t, h * d)
    assert torch.equal(sigmoid_gate(o, g), want)
