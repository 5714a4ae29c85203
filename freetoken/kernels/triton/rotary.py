"""Per-head q/k RMSNorm and rotary embedding (rotate_half layout) for q and k in one launch.

Program (token t, head h) over Hq + Hkv heads: heads below Hq are query heads, the rest key
heads. The head's two halves x1, x2 [d/2] are loaded once; with norm weights, x is normalised
over the whole head (fp32, as `freetoken.layers.norm`); then
    out1 = x1 * cos1 - x2 * sin1,  out2 = x2 * cos2 + x1 * sin2
with cos/sin [T, d] fp32 (the two halves of a row hold the same frequencies in HF's tables,
but both are read so any table gives the reference's numbers). Outputs are new contiguous
[T, H, d] tensors in the input dtype. Torch runs about fourteen launches per tensor for this.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _head(x_ptr, w_ptr, o_ptr, cos_ptr, sin_ptr, eps, HALF: tl.constexpr,
          NORM: tl.constexpr):
    i = tl.arange(0, HALF)
    x1 = tl.load(x_ptr + i).to(tl.float32)
    x2 = tl.load(x_ptr + HALF + i).to(tl.float32)
    if NORM:
        ms = (tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF)
        inv = 1.0 / tl.sqrt(ms + eps)
        x1 = x1 * inv * tl.load(w_ptr + i)
        x2 = x2 * inv * tl.load(w_ptr + HALF + i)
    c1 = tl.load(cos_ptr + i)
    c2 = tl.load(cos_ptr + HALF + i)
    s1 = tl.load(sin_ptr + i)
    s2 = tl.load(sin_ptr + HALF + i)
    dt = o_ptr.dtype.element_ty
    tl.store(o_ptr + i, (x1 * c1 - x2 * s1).to(dt))
    tl.store(o_ptr + HALF + i, (x2 * c2 + x1 * s2).to(dt))


@triton.jit
def _qk_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr,
                    sq_t, sq_h, sk_t, sk_h, s_cos, eps, HQ: tl.constexpr, HKV: tl.constexpr,
                    HALF: tl.constexpr, NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cos = cos_ptr + t * s_cos
    sin = sin_ptr + t * s_cos
    if h < HQ:
        _head(q_ptr + t * sq_t + h * sq_h, qw_ptr, qo_ptr + (t * HQ + h) * (2 * HALF), cos, sin,
              eps, HALF, NORM)
    else:
        hk = h - HQ
        _head(k_ptr + t * sk_t + hk * sk_h, kw_ptr, ko_ptr + (t * HKV + hk) * (2 * HALF), cos,
              sin, eps, HALF, NORM)


def qk_rope_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, d], k [T, Hkv, d] (unit stride in d), cos/sin fp32 [T, d] with equal strides,
    norm weights fp32 [d] (both or neither) -> (q', k') contiguous. Checked by
    `freetoken.kernels.rotary`."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    qo, ko = torch.empty((t, hq, d), dtype=q.dtype, device=q.device), torch.empty(
        (t, hkv, d), dtype=k.dtype, device=k.device)
    if t == 0:
        return qo, ko
    norm = q_weight is not None
    _qk_rope_kernel[(t, hq + hkv)](
        q, k, q_weight if norm else cos, k_weight if norm else cos, qo, ko, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), float(eps),
        HQ=hq, HKV=hkv, HALF=d // 2, NORM=norm, num_warps=1)
    return qo, ko
