"""Triton q/k RMSNorm + rotary (one launch for q and k) against float64 math and the torch
reference `freetoken.kernels.rotary` (norm, then rotate_half).

Without CUDA the kernel runs under Triton's interpreter (TRITON_INTERPRET=1) on small shapes;
with CUDA the same cases run compiled, plus the entry point's dispatch on a strided q/k split
of a fused qkv row. Tolerance against float64 of the same inputs: rel |ref| + 1e-5, with rel
1e-5 for fp32 (summation order, fused products), 2^-8 for bf16 on CUDA (one rounding of the
output) and 2^-7 under the interpreter (it converts to bf16 by truncation).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():  # NOTE: read when the kernels are decorated (first import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from freetoken.kernels.rotary import qk_rope, rotary_reference  # noqa: E402
from freetoken.kernels.triton.rotary import qk_rope_triton  # noqa: E402
from freetoken.layers.rotary import RotaryEmbedding  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
REL = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -8 if CUDA else 2.0 ** -7}


def _ref64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: torch.Tensor | None,
           eps: float) -> torch.Tensor:
    xd = x.double()
    if w is not None:
        xd = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    half = xd.shape[-1] // 2
    rot = torch.cat([-xd[..., half:], xd[..., :half]], dim=-1)
    return xd * cos.double()[:, None] + rot * sin.double()[:, None]


def _close(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    err = (y.double() - ref).abs()
    bound = REL[dtype] * ref.abs() + 1e-5
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"


def _case(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, norm: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=gen) * 2).to(dtype)
    q = qkv[:, :hq * d].view(t, hq, d)  # strided views, as the attention layer splits them
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    cos, sin = RotaryEmbedding(d, 10000.0)(torch.randint(0, 4000, (t,), generator=gen))
    w = (torch.rand(d, generator=gen) + 0.5, torch.rand(d, generator=gen) + 0.5) if norm \
        else (None, None)
    return q, k, cos, sin, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("t,hq,hkv,d", [(3, 4, 2, 32), (2, 2, 1, 128)])
def test_qk_rope(t: int, hq: int, hkv: int, d: int, norm: bool, dtype: torch.dtype) -> None:
    q, k, cos, sin, (wq, wk) = _case(t, hq, hkv, d, dtype, norm, seed=t * 100 + d)

    def dev(x):
        return None if x is None else x.to(DEV)

    qo, ko = qk_rope_triton(dev(q), dev(k), dev(cos), dev(sin), dev(wq), dev(wk), 1e-6)
    assert qo.shape == q.shape and ko.shape == k.shape and qo.dtype == dtype
    _close(qo.cpu(), _ref64(q, cos, sin, wq, 1e-6), dtype)
    _close(ko.cpu(), _ref64(k, cos, sin, wk, 1e-6), dtype)


def test_cpu_entry_is_reference() -> None:
    q, k, cos, sin, (wq, wk) = _case(3, 4, 2, 32, torch.float32, False, seed=1)
    qo, ko = qk_rope(q, k, cos, sin)
    assert torch.equal(qo, rotary_reference(q, cos, sin))
    assert torch.equal(ko, rotary_reference(k, cos, sin))


def test_checks() -> None:
    q, k, cos, sin, (wq, wk) = _case(3, 4, 2, 32, torch.float32, True, seed=2)
    with pytest.raises(ValueError, match="cos/sin must be"):
        qk_rope(q, k, cos[:2], sin[:2])
    with pytest.raises(ValueError, match="both"):
        qk_rope(q, k, cos, sin, wq, None)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entry_cuda(dtype: torch.dtype) -> None:
    q, k, cos, sin, (wq, wk) = _case(16, 32, 4, 128, dtype, True, seed=3)
    qo, ko = qk_rope(q.cuda(), k.cuda(), cos.cuda(), sin.cuda(), wq.cuda(), wk.cuda(), 1e-6)
    _close(qo.cpu(), _ref64(q, cos, sin, wq, 1e-6), dtype)
    _close(ko.cpu(), _ref64(k, cos, sin, wk, 1e-6), dtype)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,r", [(32, None), (64, 16)])
def test_qk_rope_stores_kv(dtype: torch.dtype, d: int, r: int | None) -> None:
    """With the KV cache given, the same launch writes the rotated k and v into it, bit for
    bit what the separate store kernel writes from its outputs; a negative slot (a padded
    row) writes nothing; q' and k' are what the plain call returns. r: partial rotary."""
    from freetoken.kernels.triton.attention import store_kv

    t, hq, hkv, pages, page = 3, 4, 2, 4, 4
    q, k, cos, sin, (wq, wk) = (_case(t, hq, hkv, d, dtype, True, seed=5) if r is None else
                                _partial_case(t, hq, hkv, d, r, dtype, True, seed=9))
    v = (torch.randn(t, hkv, d, generator=torch.Generator().manual_seed(6)) * 2).to(dtype)
    slots = torch.tensor([5, -1, 13])
    args = [x.to(DEV) for x in (q, k, cos, sin, wq, wk)]
    cache = torch.full((2, pages, page, hkv, d), 7.0, dtype=dtype, device=DEV)
    qo, ko = qk_rope_triton(*args, 1e-6, (v.to(DEV), cache, slots.to(DEV)))
    q2, k2 = qk_rope_triton(*args, 1e-6)
    assert torch.equal(qo, q2) and torch.equal(ko, k2)
    want = torch.full_like(cache, 7.0)
    store_kv(want, k2, v.to(DEV), slots.to(DEV))
    assert torch.equal(cache.cpu(), want.cpu())
    assert bool((cache.view(2, -1, hkv, d)[:, [0, 1, 2, 3, 4, 6]] == 7.0).all())


def _ref64_partial(x, cos, sin, w, eps):
    """float64: the whole head normalised, its first r = cos.shape[-1] values rotated."""
    xd = x.double()
    if w is not None:
        xd = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    r = cos.shape[-1]
    return torch.cat([_ref64(xd[..., :r], cos, sin, None, eps), xd[..., r:]], dim=-1)


def _partial_case(t, hq, hkv, d, r, dtype, norm, seed):
    q, k, _, _, w = _case(t, hq, hkv, d, dtype, norm, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    cos, sin = RotaryEmbedding(r, 10000.0)(torch.randint(0, 4000, (t,), generator=gen))
    return q, k, cos, sin, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("t,hq,hkv,d,r", [(3, 4, 2, 64, 16), (2, 2, 1, 128, 32)])
def test_partial_rotary(t, hq, hkv, d, r, norm, dtype):
    """qwen3.5's partial rotary (cos/sin [T, r], r < d): against float64, in the kernel and in
    the torch entry point; the torch path is the model's former composition bit for bit (a
    norm of the head, rotary of its first r values, the rest concatenated)."""
    from freetoken.kernels.norm import rms_norm
    from freetoken.layers.rotary import apply_rotary

    q, k, cos, sin, (wq, wk) = _partial_case(t, hq, hkv, d, r, dtype, norm, seed=t * 7 + r)
    dev = [None if x is None else x.to(DEV) for x in (q, k, cos, sin, wq, wk)]
    qo, ko = qk_rope_triton(*dev, 1e-6)
    _close(qo.cpu(), _ref64_partial(q, cos, sin, wq, 1e-6), dtype)
    _close(ko.cpu(), _ref64_partial(k, cos, sin, wk, 1e-6), dtype)
    qc, kc = qk_rope(q, k, cos, sin, wq, wk, 1e-6)
    for x, w, got in ((q, wq, qc), (k, wk, kc)):
        n = rms_norm(x, w, 1e-6) if norm else x
        want = torch.cat([apply_rotary(n[..., :r], cos, sin), n[..., r:]], dim=-1)
        assert torch.equal(got, want)
