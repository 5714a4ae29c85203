"""RMSNorm entry points: the torch reference (CPU, and the oracle of the kernel tests) and the
Triton kernel (`freetoken.kernels.triton.norm`) on CUDA tensors.

`rms_norm(x, w, eps)`: y = x / sqrt(mean(x^2) + eps) * w over the last dimension, in fp32,
returned in x's dtype. `add_rms_norm(x, residual, w, eps)`: s = x + residual (in x's dtype),
then (rms_norm(s), s): the pre-norm decoder's residual step in one launch on the GPU.

Folding (GPU, decode): a decoder layer's MoE output goes only into the next layer's residual
step. So the layer declares that step (`folding(norm, residual)`), the MoE backend takes it
(`take_fold`) and hands it to the kernel that writes the output last (the down kernel's
last-arriving program, the receive of the CPU's answer), which also computes it, with the
RMSNorm kernel's arithmetic (`triton/norm.py: norm_row`), and tags the output with it
(`fold_done`); `add_rms_norm` of that output with that residual and weight then returns it
without a launch. A backend that cannot fold ignores the request and nothing changes.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from freetoken import env
from freetoken.kernels import xq
from freetoken.kernels.cpu_kernels import cpu_rms_norm


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight).to(x.dtype)


def _cpu_f32(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """fp32 CPU tensors: one call of the C++ executor's RMSNorm (with the residual add), else
    torch's fused rms_norm; the same formula in fp32 (a decode step runs dozens of norms, and
    the reference's seven ops each cost a dispatch)."""
    return not x.is_cuda and x.dtype == torch.float32 and weight.dtype == torch.float32


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"rms_norm: weight must be [{d}] (x's last dimension), got "
                         f"{list(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"add_rms_norm: residual {residual.dtype} {list(residual.shape)} "
                         f"must match x {x.dtype} {list(x.shape)}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [N, D] with unit stride in D (a view where the strides allow, else a copy)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.shape[0] <= 1 or x2.stride(-1) == 1 else x2.contiguous()


def _on_gpu(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.is_cuda and weight.is_cuda and weight.dtype == torch.float32
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, quantize: bool = False
             ) -> torch.Tensor:
    """x [..., D], weight fp32 [D] -> [..., D] in x's dtype. `quantize`: where an int8 GEMV
    may read the result (`freetoken.kernels.xq`), the kernel also quantizes it, once."""
    _check(x, weight, None)
    if _cpu_f32(x, weight):
        r = cpu_rms_norm(x, weight, eps)
        return r[0] if r is not None else torch.rms_norm(x, weight.shape, weight, eps)
    if not _on_gpu(x, weight):
        return rms_norm_reference(x, weight, eps)
    from freetoken.kernels.triton.norm import rms_norm_triton  # lazy: needs triton

    y, _, q = rms_norm_triton(_rows(x), weight, eps, quantize=quantize and xq.wanted(x))
    return xq.attach(y.view(x.shape), q)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 quantize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); the sum is rounded to x's dtype first.
    `quantize` as for `rms_norm`. Where the kernel that wrote x computed this very step
    (folding: the same residual, weight, eps and quantize), its results, with no launch."""
    done = xq.tagged(x, _FOLDED)
    if done is not None:
        fold, y, s = done
        if (fold.residual is residual and fold.weight is weight and fold.eps == eps
                and fold.quantize == quantize):
            return y, s
    _check(x, weight, residual)
    if _cpu_f32(x, weight):
        r = cpu_rms_norm(x, weight, eps, residual)
        if r is not None:
            return r
        s = x + residual
        return torch.rms_norm(s, weight.shape, weight, eps), s
    if not _on_gpu(x, weight):
        s = x + residual
        return rms_norm_reference(s, weight, eps), s
    from freetoken.kernels.triton.norm import rms_norm_triton

    y, s, q = rms_norm_triton(_rows(x), weight, eps, _rows(residual),
                              quantize=quantize and xq.wanted(x))
    return xq.attach(y.view(x.shape), q), s.view(x.shape)


class NormFold(NamedTuple):
    """The residual step that takes a kernel's output next: `add_rms_norm(output, residual,
    weight, eps, quantize)`."""

    residual: torch.Tensor
    weight: torch.Tensor
    eps: float
    quantize: bool


_FOLDED = "_freetoken_norm_folded"
FOLD_ROWS = 64  # decode: the most rows a fold is offered for (the hand-off's token limit)
FOLD_MAX_H = 8192  # the widest row: the kernels that fold hold a token's row in one program
_pending: NormFold | None = None


@contextlib.contextmanager
def folding(weight: torch.Tensor, eps: float, quantize: bool, residual: torch.Tensor):
    """While the block runs, a MoE backend may take (`take_fold`) the residual step that
    takes the block's output next, for its last kernel to compute (GPU decode sizes, unless
    FREETOKEN_GPU_NORM_FOLD=0)."""
    global _pending
    old = _pending
    ok = (_on_gpu(residual, weight) and residual.dim() == 2 and residual.stride(-1) == 1
          and residual.shape[0] <= FOLD_ROWS and residual.shape[-1] <= FOLD_MAX_H
          and weight.shape == (residual.shape[-1],) and env.gpu_norm_fold())
    _pending = NormFold(residual, weight, float(eps), quantize) if ok else None
    try:
        yield
    finally:
        _pending = old


def take_fold(x: torch.Tensor) -> NormFold | None:
    """The pending residual step, for the kernel that writes the output of the MoE whose input
    is x [T, H] (same shape and dtype as the residual), else None. Taken once: the kernels a
    backend runs before its last one do not see it."""
    global _pending
    fold, _pending = _pending, None
    if fold is None or fold.residual.shape != x.shape or fold.residual.dtype != x.dtype:
        return None
    return fold


def fold_buffers(fold: NormFold) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(y, s, y's int8 codes or None) for a kernel that computes `fold`: `rms_norm_triton`'s
    outputs for the residual's shape."""
    from freetoken.kernels.triton.gemv_i8 import xq_len

    r = fold.residual
    y, s = torch.empty_like(r), torch.empty_like(r)
    q = (torch.empty((r.shape[0], xq_len(r.shape[-1])), dtype=torch.int32, device=r.device)
         if fold.quantize and xq.wanted(r) else None)
    return y, s, q


def fold_done(out: torch.Tensor, fold: NormFold, y: torch.Tensor, s: torch.Tensor,
              q: torch.Tensor | None) -> torch.Tensor:
    """out, carrying the residual step `fold` its kernel computed: (y with its codes q, s)."""
    return xq.tag(out, _FOLDED, (fold, xq.attach(y, q), s))
