"""RMSNorm entry points: the torch reference (CPU, and the oracle of the kernel tests) and the
Triton kernel (`freetoken.kernels.triton.norm`) on CUDA tensors.

`rms_norm(x, w, eps)`: y = x / sqrt(mean(x^2) + eps) * w over the last dimension, in fp32,
returned in x's dtype. `add_rms_norm(x, residual, w, eps)`: s = x + residual (in x's dtype),
then (rms_norm(s), s): the pre-norm decoder's residual step in one launch on the GPU.
"""

from __future__ import annotations

import torch

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
    `quantize` as for `rms_norm`."""
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
