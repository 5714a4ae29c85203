"""Triton MoE router (scores, top-k, renormalisation in one program per token) against float64
math and the torch reference `freetoken.kernels.route.route_reference`.

Without CUDA the kernel runs under Triton's interpreter (TRITON_INTERPRET=1); with CUDA the
same cases run compiled, plus the entry point. Expert ids must equal the float64 top-k in
order (the cases' logits are drawn so that neighbouring scores differ by far more than fp32
rounding: gaps are checked); weights within 1e-5 |ref| + 1e-7 of float64 (fp32 exp, sums).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():  # NOTE: read when the kernels are decorated (first import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from freetoken.kernels.route import route_reference, route_topk  # noqa: E402
from freetoken.kernels.triton.route import route_triton  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _logits(t: int, e: int, seed: int) -> torch.Tensor:
    """Distinct scores: a random permutation of an evenly spaced grid, plus small noise."""
    gen = torch.Generator().manual_seed(seed)
    grid = torch.linspace(-4, 4, e)
    rows = [grid[torch.randperm(e, generator=gen)] for _ in range(t)]
    return torch.stack(rows) + torch.rand(t, e, generator=gen) * 1e-3


def _ref64(logits: torch.Tensor, k: int, scoring: str, renorm: bool,
           bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.double()
    p = torch.softmax(x, -1) if scoring == "softmax" else torch.sigmoid(x)
    choice = p + bias.double() if bias is not None else p
    ids = torch.topk(choice, k, -1).indices
    w = p.gather(1, ids)
    return ids, w / w.sum(-1, keepdim=True) if renorm else w


def _check(ids: torch.Tensor, w: torch.Tensor, ref: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(ids.cpu(), ref[0])
    err = (w.cpu().double() - ref[1]).abs()
    assert bool((err <= 1e-5 * ref[1].abs() + 1e-7).all()), f"max error {err.max():.3g}"


@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("t,e,k", [(3, 128, 8), (2, 60, 4), (1, 256, 8), (4, 8, 2)])
def test_softmax(t: int, e: int, k: int, renorm: bool) -> None:
    logits = _logits(t, e, seed=e + k)
    ids, w = route_triton(logits.to(DEV), k, False, renorm, None)
    _check(ids, w, _ref64(logits, k, "softmax", renorm, None))


@pytest.mark.parametrize("with_bias", [True, False])
def test_sigmoid(with_bias: bool) -> None:
    t, e, k = 3, 64, 6
    logits = _logits(t, e, seed=9)
    # A bias that reorders the choice (multiples of the grid step keep scores distinct).
    bias = (torch.randperm(e, generator=torch.Generator().manual_seed(4)) % 5).float() * 0.05 \
        if with_bias else None
    ids, w = route_triton(logits.to(DEV), k, True, True,
                          bias.to(DEV) if bias is not None else None)
    _check(ids, w, _ref64(logits, k, "sigmoid", True, bias))


def test_bf16_logits() -> None:
    """Logits in the activation dtype are read as they are (upcast inside the kernel)."""
    logits = _logits(2, 128, seed=5).to(torch.bfloat16)
    ids, w = route_triton(logits.to(DEV), 8, False, True, None)
    _check(ids, w, _ref64(logits.float(), 8, "softmax", True, None))


def test_cpu_entry_is_reference() -> None:
    logits = _logits(3, 32, seed=1)
    bias = torch.rand(32)
    for scoring in ("softmax", "sigmoid"):
        got = route_topk(logits, 4, scoring, True, bias)
        want = route_reference(logits, 4, scoring, True, bias if scoring == "sigmoid" else None)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_checks() -> None:
    with pytest.raises(ValueError, match="unknown router scoring"):
        route_topk(torch.zeros(1, 8), 2, "relu")
    with pytest.raises(ValueError, match="top_k"):
        route_topk(torch.zeros(1, 8), 9)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_entry_cuda() -> None:
    logits = _logits(16, 128, seed=12)
    ids, w = route_topk(logits.cuda(), 8, "softmax", True)
    _check(ids, w, _ref64(logits, 8, "softmax", True, None))
    ref_ids, ref_w = route_reference(logits.cuda(), 8, "softmax", True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-7)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
