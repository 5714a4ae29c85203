"""Triton MoE router (scores, top-k, renormalisation in one program per token) against float64
math and the torch reference `freetoken.kernels.route.route_reference`; the fused router GEMV
+ route (`gate_route_triton`, `gate_topk`) likewise, from hidden states whose logits are the
same well-separated grids (fp32: the logits' sums differ from float64 by ~H eps, far below the
grid's gaps).

Without CUDA the kernel runs under Triton's interpreter (TRITON_INTERPRET=1); with CUDA the
same cases run compiled, plus the entry point. Expert ids must equal the float64 top-k in
order (the cases' logits are drawn so that neighbouring scores differ by far more than fp32
rounding: gaps are checked); weights within 1e-5 |ref| + 1e-7 of float64 (fp32 exp, sums).
The tie cases draw logits from a coarse grid instead: ids must equal a stable sort's (ties to
the lower id), and tied experts' weights must be bitwise equal.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # NOTE: read when the kernels are decorated (first import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).parent))
import triton_cases as cases  # noqa: E402

from freetoken.formats.qweight import QuantWeight  # noqa: E402
from freetoken.kernels import add_rms_norm  # noqa: E402
from freetoken.kernels.route import (  # noqa: E402
    Router,
    add_rms_norm_route,
    gate_topk,
    route_reference,
    route_topk,
    routes_of,
)
from freetoken.kernels.triton.route import (  # noqa: E402
    gate_route_triton,
    norm_gate_route_triton,
    route_triton,
)

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


def _gate_case(t: int, e: int, h: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [t, h], gate [e, h] with x @ gate^T = _logits(t, e) up to ~1e-5: token i is mostly
    the unit vector i, and gate's column i holds token i's logits."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.eye(t, h) + torch.randn(t, h, generator=gen) * 1e-3
    gate = torch.randn(e, h, generator=gen) * 1e-3
    gate[:, :t] = _logits(t, e, seed).T
    return x, gate


@pytest.mark.parametrize("scoring,with_bias", [("softmax", False), ("sigmoid", True)])
def test_gate_route(scoring: str, with_bias: bool) -> None:
    t, e, h, k = 3, 60, 96, 4  # 60 experts: a partial last block of 8
    x, gate = _gate_case(t, e, h, seed=21)
    bias = torch.rand(e, generator=torch.Generator().manual_seed(2)) * 0.01 if with_bias \
        else None
    logits = x.double() @ gate.double().T
    want = _ref64(logits, k, scoring, True, bias)
    dbias = bias.to(DEV) if bias is not None else None
    for _ in range(2):  # the arrival counters are back at zero after a call
        ids, w = gate_route_triton(x.to(DEV), gate.to(DEV), k, scoring == "sigmoid", True,
                                   dbias)
        _check(ids, w, want)
    # the entry point: fused on CUDA, the reference GEMV + route elsewhere
    ids, w = gate_topk(x.to(DEV), QuantWeight(gate.to(DEV), "f32", (e, h)), k, scoring, True,
                       dbias)
    _check(ids, w, want)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gate_topk_bf16_cuda() -> None:
    """bf16 as the models run it: ids equal to the unfused path (cuBLAS GEMM, cast, route);
    weights within 4%: a logit rounded to bf16 (spacing 2^-6 below 4) may land one unit apart
    after another summation order, e^(2^-6) - 1 = 1.6% per weight, doubled by the sum."""
    x, gate = _gate_case(16, 128, 2048, seed=3)
    x, gate = x.cuda().bfloat16(), gate.cuda().bfloat16()
    ids, w = gate_topk(x, QuantWeight(gate, "bf16", tuple(gate.shape)), 8)
    ref_ids, ref_w = route_topk((x @ gate.T).float(), 8)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=0.04, atol=0)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_entry_cuda() -> None:
    logits = _logits(16, 128, seed=12)
    ids, w = route_topk(logits.cuda(), 8, "softmax", True)
    _check(ids, w, _ref64(logits, 8, "softmax", True, None))
    ref_ids, ref_w = route_reference(logits.cuda(), 8, "softmax", True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-7)


# -- the post-attention residual step and the router in one launch -----------------------------
def _norm_case(t: int, e: int, h: int, seed: int):
    """x, residual [t, h], norm weight [h], gate [e, h]: s = x + residual is mostly the unit
    vector i for token i, so y = rms_norm(s) ~ sqrt(h) w_i e_i; w_i = (1 + u_i) / sqrt(h) with
    a small u_i, so y ~ (1 + u_i) e_i and token i's logits are _logits' row i scaled by
    1 + u_i: the same order and gaps."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen) * 1e-3
    r = torch.eye(t, h) + torch.randn(t, h, generator=gen) * 1e-3
    nw = (1 + 0.05 * torch.rand(h, generator=gen)) / h ** 0.5
    gate = torch.randn(e, h, generator=gen) * 1e-3
    gate[:, :t] = _logits(t, e, seed).T
    return x, r, nw, gate


def _norm64(x, r, nw, eps):
    s = x.double() + r.double()
    return s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + eps) * nw.double()


@pytest.mark.parametrize("scoring,with_bias,switch,value", [
    ("softmax", False, None, None), ("sigmoid", True, None, None),
    ("softmax", False, "SPLIT", "0"), ("softmax", False, "TILES", "8x4"),
    ("sigmoid", True, "TILES", "1x2"), ("softmax", False, "SPLIT", "32x4"),
    ("sigmoid", True, "SPLIT", "64x2")])
def test_norm_gate_route_fp32(scoring: str, with_bias: bool, switch: str | None,
                              value: str | None, monkeypatch) -> None:
    """fp32: s = x + residual exactly as torch adds, y within 1e-6 of float64 (a 96-term sum
    of squares in fp32), routes of y as `_check` bounds them (61 experts: a partial last block
    of two, or of five with 8 a program; 96 wide: a masked row tail): by default split by
    hidden slices (two, of 64 and a partial one of 32), and the same with other slices
    (FREETOKEN_GPU_NORM_ROUTE_SPLIT: three of 32) and with the expert split (=0) and its
    experts and warps per program (FREETOKEN_GPU_NORM_ROUTE_TILES)."""
    if switch is not None:  # the expert split's tiles apply with the hidden split off
        monkeypatch.setenv(f"FREETOKEN_GPU_NORM_ROUTE_{switch}", value)
        if switch == "TILES":
            monkeypatch.setenv("FREETOKEN_GPU_NORM_ROUTE_SPLIT", "0")
    t, e, h, k, eps = 3, 61, 96, 4, 1e-6
    x, r, nw, gate = _norm_case(t, e, h, seed=31)
    bias = torch.rand(e, generator=torch.Generator().manual_seed(2)) * 0.01 if with_bias \
        else None
    y64 = _norm64(x, r, nw, eps)
    want = _ref64(y64 @ gate.double().T, k, scoring, True, bias)
    for _ in range(2):  # the arrival counters are back at zero after a call
        y, s, q, ids, w = norm_gate_route_triton(
            x.to(DEV), r.to(DEV), nw.to(DEV), eps, False, gate.to(DEV), k, scoring == "sigmoid",
            True, bias.to(DEV) if bias is not None else None)
        assert q is None
        assert torch.equal(s.cpu(), x + r)
        torch.testing.assert_close(y.cpu().double(), y64, rtol=1e-6, atol=1e-9)
        _check(ids, w, want)


@pytest.mark.parametrize("split", [None, "0"])
def test_norm_gate_route_bf16_codes(split: str | None, monkeypatch) -> None:
    """bf16 as the models run it: s = x + residual rounded as torch rounds it, y within one
    bf16 unit of the float64 norm of that s (under the interpreter, which truncates to bf16,
    as test_triton_norm.py allows), y's int8 codes exactly the quantizer's of y
    (`triton_cases.check_codes`), and the routes those of y's own logits in float64: ids
    equal (neighbouring logits are 4 or more bf16 units apart), weights within 4% (a logit
    summed in fp32 may round to the bf16 neighbour of the float64 one: 1.6% per weight, see
    test_gate_topk_bf16_cuda)."""
    if split is not None:  # the expert split (default: by hidden slices, codes by slice)
        monkeypatch.setenv("FREETOKEN_GPU_NORM_ROUTE_SPLIT", split)
    t, e, h, k, eps = 4, 128, 256, 8, 1e-6
    x, r, nw, gate = _norm_case(t, e, h, seed=7)
    x, r, gate = x.bfloat16(), r.bfloat16(), gate.bfloat16()
    y, s, q, ids, w = norm_gate_route_triton(x.to(DEV), r.to(DEV), nw.to(DEV), eps, True,
                                             gate.to(DEV), k, False, True, None)
    s_want = x + r
    if CUDA:
        assert torch.equal(s.cpu(), s_want)
    else:  # the interpreter converts fp32 to bf16 by truncation (test_triton_norm.py)
        assert bool(((s.cpu() - s_want).abs() <= 2 ** -7 * s_want.abs()).all())
    y64 = _norm64(s.cpu(), torch.zeros_like(s_want), nw, eps)
    torch.testing.assert_close(y.cpu().double(), y64, rtol=2 ** -8 if CUDA else 2 ** -6,
                               atol=1e-6)
    cases.check_codes(q, y)
    logits = (y.cpu().double() @ gate.double().T).to(torch.bfloat16).double()
    want_ids, _ = _ref64(logits, k, "softmax", True, None)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(w.cpu(), route_reference(logits.float(), k, "softmax", True)[1],
                               rtol=0.04, atol=0)


def test_norm_gate_route_split_partial_slice_codes() -> None:
    """The default split by hidden slices on a row that ends in a partial slice (96 = 64 +
    32) with codes: s, y and the codes of both slices stored, nothing past the row (the codes
    exactly the quantizer's of y, `triton_cases.check_codes`), routes as the float64 ones of
    y's logits bound them (`_check`)."""
    t, e, h, k, eps = 2, 16, 96, 2, 1e-6
    x, r, nw, gate = _norm_case(t, e, h, seed=13)
    y, s, q, ids, w = norm_gate_route_triton(x.to(DEV), r.to(DEV), nw.to(DEV), eps, True,
                                             gate.to(DEV), k, False, True, None)
    assert torch.equal(s.cpu(), x + r)
    torch.testing.assert_close(y.cpu().double(), _norm64(x, r, nw, eps), rtol=1e-6, atol=1e-9)
    cases.check_codes(q, y)
    _check(ids, w, _ref64(y.cpu().double() @ gate.double().T, k, "softmax", True, None))


def test_add_rms_norm_route_entry(monkeypatch) -> None:
    """The entry point: on CUDA at bf16 the routes come with y (`routes_of`) and equal the
    router's own on y (`gate_topk`), y and s those of `add_rms_norm`, and
    FREETOKEN_GPU_NORM_ROUTE=0 leaves them out; elsewhere (CPU, fp32) it is `add_rms_norm` and
    y carries no routes (the MoE routes for itself)."""
    t, e, h, k = 2, 64, 128, 4
    x, r, nw, gate = _norm_case(t, e, h, seed=5)
    dt = torch.bfloat16 if CUDA else torch.float32
    x, r, gate = x.to(DEV, dt), r.to(DEV, dt), gate.to(DEV, dt)
    router = Router(QuantWeight(gate, "bf16" if CUDA else "f32", (e, h)), k)
    y, s = add_rms_norm_route(x, r, nw.to(DEV), 1e-6, True, router)
    y_ref, s_ref = add_rms_norm(x, r, nw.to(DEV), 1e-6)
    assert torch.equal(s, s_ref)
    torch.testing.assert_close(y, y_ref, rtol=2 ** -8 if CUDA else 0, atol=0)
    routed = routes_of(y)
    if not CUDA:
        assert routed is None
        return
    assert routed is not None and routes_of(y.clone()) is None
    ids, w = gate_topk(y, *router)
    assert torch.equal(routed[0], ids)
    torch.testing.assert_close(routed[1], w, rtol=1e-5, atol=1e-7)
    monkeypatch.setenv("FREETOKEN_GPU_NORM_ROUTE", "0")
    y2, s2 = add_rms_norm_route(x, r, nw.to(DEV), 1e-6, True, router)
    assert routes_of(y2) is None and torch.equal(s2, s_ref)


# -- ties: many experts share a score ------------------------------------------------------------
def _tie_logits(t: int, e: int, seed: int) -> torch.Tensor:
    """Logits on a coarse grid (steps of 1/2, e // 16 levels or 4): every level is shared by
    several experts, so the top-k holds ties and the k-th choice is often tied with the next."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, max(4, e // 16), (t, e), generator=gen).float() * 0.5 - 2


def _tie_bias(e: int, seed: int) -> torch.Tensor:
    """A bias of 0 (about 1 expert in 8), -1 or -2: choices p + bias in disjoint bands, the
    negative ones reached by the top-k of 60 experts; ties where logit and bias are shared."""
    level = torch.randint(0, 8, (e,), generator=torch.Generator().manual_seed(seed))
    return torch.where(level == 0, 0.0, torch.where(level < 3, -1.0, -2.0))


def _tie_ref(logits: torch.Tensor, k: int, scoring: str, renorm: bool,
             bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, float64 weights, float64 choice) of the top-k ordered by (-choice, id): a stable
    sort of -choice, so equal choices keep the lower id first. Equal (logit, bias) give equal
    choices in float64 as in fp32; distinct choices are checked to differ by far more than fp32
    rounding, so fp32 orders them as float64 does."""
    x = logits.double()
    p = torch.softmax(x, -1) if scoring == "softmax" else torch.sigmoid(x)
    choice = p + bias.double() if bias is not None else p
    for row in choice:
        u = torch.unique(row)  # ascending
        assert bool(((u[1:] - u[:-1]) > 1e-4 * torch.maximum(u[1:].abs(), u[:-1].abs())).all())
    ids = torch.sort(-choice, dim=-1, stable=True).indices[:, :k]
    w = p.gather(1, ids)
    return ids, w / w.sum(-1, keepdim=True) if renorm else w, choice


def _check_ties(ids: torch.Tensor, w: torch.Tensor,
                ref: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """Ids equal to the stable sort's (ties to the lower id, in order), weights as `_check`
    bounds them, and the weights of tied experts bitwise equal (the same p, the same sum)."""
    ids, w = ids.cpu(), w.cpu()
    _check(ids, w, ref[:2])
    choice = ref[2].gather(1, ids)
    tied = choice[:, :, None] == choice[:, None, :]
    assert bool((w[:, :, None] == w[:, None, :])[tied].all())


@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("e", [128, 256, 60])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_ties(scoring: str, e: int, renorm: bool) -> None:
    """route_triton on tied scores, top 8 and top 2 (sigmoid with a bias that reorders the
    experts and reaches negative choices): exactly the stable sort's ids; without
    renormalisation the top 2's weights are bitwise the top 8's first two."""
    t = 4
    logits = _tie_logits(t, e, seed=e)
    bias = _tie_bias(e, seed=e + 1) if scoring == "sigmoid" else None
    dbias = bias.to(DEV) if bias is not None else None
    got = {}
    for k in (8, 2):
        ref = _tie_ref(logits, k, scoring, renorm, bias)
        choice = ref[2].gather(1, torch.sort(-ref[2], dim=-1, stable=True).indices[:, :k + 1])
        assert bool((choice[:, 1:] == choice[:, :-1]).any())  # the case holds ties
        got[k] = route_triton(logits.to(DEV), k, scoring == "sigmoid", renorm, dbias)
        _check_ties(*got[k], ref)
    if not renorm:
        assert torch.equal(got[2][0], got[8][0][:, :2])
        assert torch.equal(got[2][1], got[8][1][:, :2])


@pytest.mark.parametrize("e", [256, 60])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_ties_fused(scoring: str, e: int) -> None:
    """gate_route_triton and norm_gate_route_triton on tied scores: token i is exactly the unit
    vector i (x + residual for the norm), so its logits are exactly gate's column i (times y_i
    after the norm), the tie grid."""
    t, h, k, eps = 3, 64, 8, 1e-6
    gen = torch.Generator().manual_seed(e)
    gate = torch.randn(e, h, generator=gen) * 1e-3
    gate[:, :t] = _tie_logits(t, e, seed=e + 2).T
    bias = _tie_bias(e, seed=e + 3) if scoring == "sigmoid" else None
    dbias = bias.to(DEV) if bias is not None else None
    x = torch.eye(t, h)
    ids, w = gate_route_triton(x.to(DEV), gate.to(DEV), k, scoring == "sigmoid", True, dbias)
    _check_ties(ids, w, _tie_ref(x.double() @ gate.double().T, k, scoring, True, bias))
    nw = (1 + 0.05 * torch.rand(h, generator=gen)) / h ** 0.5
    y, _, _, ids, w = norm_gate_route_triton(
        torch.zeros(t, h).to(DEV), x.to(DEV), nw.to(DEV), eps, False, gate.to(DEV), k,
        scoring == "sigmoid", True, dbias)
    logits = y.cpu().double() @ gate.double().T  # y is exactly y_i e_i: ties as in the gate
    _check_ties(ids, w, _tie_ref(logits, k, scoring, True, bias))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
