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

from freetoken.kernels.triton import pdl
from freetoken.kernels.triton.pdl import wait


@triton.jit
def _head(x_ptr, w_ptr, cos_ptr, sin_ptr, eps, HALF: tl.constexpr, NORM: tl.constexpr):
    """The head's two rotated halves, fp32 [HALF] each."""
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
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2


@triton.jit
def _store_halves(o_ptr, y1, y2, HALF: tl.constexpr, ok=True):
    i = tl.arange(0, HALF)
    dt = o_ptr.dtype.element_ty
    tl.store(o_ptr + i, y1.to(dt), mask=ok)
    tl.store(o_ptr + HALF + i, y2.to(dt), mask=ok)


@triton.jit
def _qk_rope_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr,
                    cache_ptr, slot_ptr, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, s_cos, v_plane,
                    eps, HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
                    NORM: tl.constexpr, STORE: tl.constexpr, PDL: tl.constexpr = False):
    """Program (t, h): query heads, then key heads, then (STORE) value heads; with STORE the
    key and value heads also go to the KV cache at flat slot slot[t] (< 0: padding, skipped),
    as `attention._store_kv_kernel` writes them."""
    wait(PDL)  # pdl.py: the kernel before has completed
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cos = cos_ptr + t * s_cos
    sin = sin_ptr + t * s_cos
    if h < HQ:
        y1, y2 = _head(q_ptr + t * sq_t + h * sq_h, qw_ptr, cos, sin, eps, HALF, NORM)
        _store_halves(qo_ptr + (t * HQ + h) * (2 * HALF), y1, y2, HALF)
    elif h < HQ + HKV:
        hk = h - HQ
        y1, y2 = _head(k_ptr + t * sk_t + hk * sk_h, kw_ptr, cos, sin, eps, HALF, NORM)
        _store_halves(ko_ptr + (t * HKV + hk) * (2 * HALF), y1, y2, HALF)
        if STORE:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            _store_halves(cache_ptr + (slot * HKV + hk) * (2 * HALF), y1, y2, HALF, slot >= 0)
    else:
        hv = h - HQ - HKV
        slot = tl.load(slot_ptr + t).to(tl.int64)
        i = tl.arange(0, 2 * HALF)
        v = tl.load(v_ptr + t * sv_t + hv * sv_h + i)
        dst = cache_ptr + v_plane + (slot * HKV + hv) * (2 * HALF) + i
        tl.store(dst, v.to(cache_ptr.dtype.element_ty), mask=slot >= 0)


def qk_rope_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                   kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, d], k [T, Hkv, d] (unit stride in d), cos/sin fp32 [T, d] with equal strides,
    norm weights fp32 [d] (both or neither) -> (q', k') contiguous. `kv` (v [T, Hkv, d] with
    unit stride in d, a contiguous cache [2, pages, page_size, Hkv, d], flat slots [T]): k'
    and v are also written into the cache, in the same launch. Checked by
    `freetoken.kernels.rotary`."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    qo, ko = torch.empty((t, hq, d), dtype=q.dtype, device=q.device), torch.empty(
        (t, hkv, d), dtype=k.dtype, device=k.device)
    if t == 0:
        return qo, ko
    norm = q_weight is not None
    v, cache, slots = kv if kv is not None else (k, ko, cos)
    _qk_rope_kernel[(t, hq + hkv + (hkv if kv is not None else 0))](
        q, k, v, q_weight if norm else cos, k_weight if norm else cos, qo, ko, cos, sin, cache,
        slots, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), cache[1].numel() if kv is not None else 0, float(eps), HQ=hq, HKV=hkv,
        HALF=d // 2, NORM=norm, STORE=kv is not None, num_warps=1, **pdl.opts())
    return qo, ko
