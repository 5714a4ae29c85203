"""RMSNorm on the GPU in one kernel, optionally fused with the residual add before it.

One program per row: y = x / sqrt(mean(x^2) + eps) * w, in fp32, stored in x's dtype. With a
residual, s = x + residual is rounded to x's dtype first (as torch's `x + residual` does), stored
as the new residual, and normalised: the decoder's `residual = x + residual; norm(residual)` in
one launch where torch runs about eight (dtype casts, pow, mean, rsqrt, two products, the add).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton import pdl
from freetoken.kernels.triton.gemv_i8 import quant_store, xq_len
from freetoken.kernels.triton.pdl import wait


@triton.jit
def norm_row(x, r_ptr, w_ptr, y_ptr, s_ptr, q_ptr, cols, ok, D, eps, HAS_RES: tl.constexpr,
             QUANT: tl.constexpr, BLOCK: tl.constexpr):
    """One row: x [BLOCK] in the activation dtype (0 where not `ok`); with HAS_RES s = x + r
    (rounded to x's dtype, as torch's add) stored at s_ptr and normalised; y = rms_norm * w
    stored at y_ptr, and with QUANT its int8 codes at q_ptr (pointers at the row). The
    arithmetic of the RMSNorm kernel, for kernels that produce x and normalise it in the
    same launch (`kernels/norm.py`: folding)."""
    if HAS_RES:
        r = tl.load(r_ptr + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded as torch's add
        tl.store(s_ptr + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    y = (xf * inv * w).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + cols, y, mask=ok)
    if QUANT:  # the int8 GEMVs' activation, quantized once here (gemv_i8.quant_store)
        quant_store(tl.reshape(y.to(tl.float32), (1, BLOCK)), q_ptr, 0,
                    tl.arange(0, 1) < 1, D)


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, q_ptr, D, stride_x, stride_r, stride_y,
                     stride_s, stride_q, eps, HAS_RES: tl.constexpr, QUANT: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)  # pdl.py: the kernel before has completed
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    norm_row(x, r_ptr + row * stride_r, w_ptr, y_ptr + row * stride_y, s_ptr + row * stride_s,
             q_ptr + row * stride_q, cols, ok, D, eps, HAS_RES, QUANT, BLOCK)


def norm_warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None, quantize: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """x [N, D] (unit stride in D), weight fp32 [D], residual [N, D] in x's dtype or None ->
    (y [N, D] in x's dtype, x + residual or None, y quantized for the int8 GEMVs
    [N, xq_len(D)] int32 with `quantize` (D a multiple of 32), else None). Checked by
    `freetoken.kernels.norm`."""
    n, d = x.shape
    y = torch.empty((n, d), dtype=x.dtype, device=x.device)
    s = torch.empty_like(y) if residual is not None else None
    q = torch.empty((n, xq_len(d)), dtype=torch.int32, device=x.device) if quantize else None
    if n == 0:
        return y, s, q
    if quantize and d % 32:
        raise ValueError(f"rms_norm: quantize needs a width that is a multiple of 32, got {d}")
    block = triton.next_power_of_2(d)
    r = residual if residual is not None else x
    s_ = s if s is not None else y
    q_ = q if q is not None else y
    _rms_norm_kernel[(n,)](
        x, r, weight, y, s_, q_, d, x.stride(0), r.stride(0), y.stride(0), s_.stride(0),
        q_.stride(0), float(eps), HAS_RES=residual is not None, QUANT=quantize, BLOCK=block,
        num_warps=norm_warps(block), **pdl.opts(),
        enable_fp_fusion=False)  # x * 127 / amax + 1/2 unfused, as in the GEMVs: the same codes
    return y, s, q
