"""Per-head q/k RMSNorm and rotary embedding (rotate_half layout) for q and k in one launch.

Program (token t, head h) over Hq + Hkv heads: heads below Hq are query heads, the rest key
heads. The head's two halves x1, x2 [d/2] are loaded once; with norm weights, x is normalised
over the whole head (fp32, as `freetoken.layers.norm`); then
    out1 = x1 * cos1 - x2 * sin1,  out2 = x2 * cos2 + x1 * sin2
with cos/sin [T, d] fp32 (the two halves of a row hold the same frequencies in HF's tables,
but both are read so any table gives the reference's numbers). Outputs are new contiguous
[T, H, d] tensors in the input dtype. Torch runs about fourteen launches per tensor for this.

Partial rotary (cos/sin [T, r], r < d: qwen3.5's attention rotates the first quarter of each
head): the head's d values are normalised together, its first r rotated in halves of r / 2,
the rest passed through (`_head_partial`); one launch where the model ran a norm, a rotary
and a concatenation per tensor and a separate KV store.

`_rope_rows` gives the same numbers for a tile of heads: decode attention ropes its query heads
with it, and the step's key head (`_store_step_kv`, with the KV store), in its own launch
(`attention.decode(rope=...)`).
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
def _head_partial(x_ptr, w_ptr, cos_ptr, sin_ptr, eps, D: tl.constexpr, RH: tl.constexpr,
                  NORM: tl.constexpr):
    """The head [D] with its first 2 RH values rotated (halves of RH), the rest as they are
    (normalised over all D with NORM), fp32."""
    i = tl.arange(0, D)
    lo = i < RH
    rot = i < 2 * RH
    pj = tl.where(lo, i + RH, tl.where(rot, i - RH, i))  # the rotation's partner of i
    x = tl.load(x_ptr + i).to(tl.float32)
    xp = tl.load(x_ptr + pj).to(tl.float32)
    if NORM:
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        x = x * inv * tl.load(w_ptr + i)
        xp = xp * inv * tl.load(w_ptr + pj)
    c = tl.load(cos_ptr + i, mask=rot, other=1.0)
    s = tl.load(sin_ptr + i, mask=rot, other=0.0)
    return tl.where(lo, x * c - xp * s, tl.where(rot, x * c + xp * s, x))


@triton.jit
def _rope_rows(x_ptr, rows, rmask, stride_r, w_ptr, cos_ptr, sin_ptr, eps, D: tl.constexpr,
               RH: tl.constexpr, NORM: tl.constexpr, PARTIAL: tl.constexpr):
    """Heads [R, D] (head r at x_ptr + rows[r] stride_r, unit stride in d; rows past rmask
    read as 0) normalised and rotated, fp32: per head the numbers of `_head` (full rotary, RH
    = D / 2) or `_head_partial`, the same products and sums in the same order (the decode
    kernel ropes its tile of query heads with it, where this kernel ropes one head a
    program). Each value's rotation partner is read from memory, as `_head_partial` does."""
    i = tl.arange(0, D)
    lo = i < RH
    rot = i < 2 * RH
    pj = tl.where(lo, i + RH, tl.where(rot, i - RH, i))
    base = x_ptr + rows[:, None] * stride_r
    x = tl.load(base + i[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    xp = tl.load(base + pj[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    if NORM:
        sq = x * x
        if PARTIAL:
            ms = tl.sum(sq, axis=1) / D
        else:  # `_head`'s order: each half's sum, then the two
            ms = (tl.sum(tl.where(lo, sq, 0.0), axis=1)
                  + tl.sum(tl.where(lo, 0.0, sq), axis=1)) / D
        inv = (1.0 / tl.sqrt(ms + eps))[:, None]
        x = x * inv * tl.load(w_ptr + i)[None, :]
        xp = xp * inv * tl.load(w_ptr + pj)[None, :]
    c = tl.load(cos_ptr + i, mask=rot, other=1.0)[None, :]
    s = tl.load(sin_ptr + i, mask=rot, other=0.0)[None, :]
    return tl.where(lo, x * c - xp * s, tl.where(rot, x * c + xp * s, x))


@triton.jit
def _store_step_kv(k_row, v_row, kw_ptr, cos, sin, eps, cache_ptr, v_plane, slot_ptr, b, kvh,
                   N_KV: tl.constexpr, D: tl.constexpr, RH: tl.constexpr, NORM: tl.constexpr,
                   PARTIAL: tl.constexpr):
    """Sequence b's new key head kvh (at k_row) normalised and rotated (`_rope_rows`, one
    row), and its value head, into the cache at flat slot slot[b] (< 0: padding, nothing):
    what `_qk_rope_kernel` stores for them."""
    slot = tl.load(slot_ptr + b).to(tl.int64)
    one = tl.arange(0, 1)
    k = _rope_rows(k_row, one, one < 1, 0, kw_ptr, cos, sin, eps, D, RH, NORM, PARTIAL)
    i = tl.arange(0, D)[None, :]
    dst = cache_ptr + (slot * N_KV + kvh) * D + i
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=slot >= 0)
    v = tl.load(v_row + i)
    tl.store(dst + v_plane, v.to(cache_ptr.dtype.element_ty), mask=slot >= 0)


@triton.jit
def _rope_store(x_ptr, w_ptr, cos, sin, eps, o_ptr, o2_ptr, HALF: tl.constexpr,
                RH: tl.constexpr, NORM: tl.constexpr, PARTIAL: tl.constexpr,
                SECOND: tl.constexpr = False, ok2=True):
    """One head normalised and rotated (`_head`, or `_head_partial`) into o_ptr, and with
    SECOND also into o2_ptr where ok2 (the KV cache)."""
    if PARTIAL:
        i = tl.arange(0, 2 * HALF)
        y = _head_partial(x_ptr, w_ptr, cos, sin, eps, 2 * HALF, RH, NORM)
        tl.store(o_ptr + i, y.to(o_ptr.dtype.element_ty))
        if SECOND:
            tl.store(o2_ptr + i, y.to(o2_ptr.dtype.element_ty), mask=ok2)
    else:
        y1, y2 = _head(x_ptr, w_ptr, cos, sin, eps, HALF, NORM)
        _store_halves(o_ptr, y1, y2, HALF)
        if SECOND:
            _store_halves(o2_ptr, y1, y2, HALF, ok2)


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
                    NORM: tl.constexpr, STORE: tl.constexpr, PDL: tl.constexpr = False,
                    RH: tl.constexpr = 0, PARTIAL: tl.constexpr = False):
    """Program (t, h): query heads, then key heads, then (STORE) value heads; with STORE the
    key and value heads also go to the KV cache at flat slot slot[t] (< 0: padding, skipped),
    as `attention._store_kv_kernel` writes them."""
    wait(PDL)  # pdl.py: the kernel before has completed
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cos = cos_ptr + t * s_cos
    sin = sin_ptr + t * s_cos
    if h < HQ:
        _rope_store(q_ptr + t * sq_t + h * sq_h, qw_ptr, cos, sin, eps,
                    qo_ptr + (t * HQ + h) * (2 * HALF), qo_ptr, HALF, RH, NORM, PARTIAL)
    elif h < HQ + HKV:
        hk = h - HQ
        # its own name: Triton types a name across the if / elif / else, and the value branch's
        # slot is int64 where this one is the int32 0 without STORE
        ks = tl.load(slot_ptr + t).to(tl.int64) if STORE else 0
        _rope_store(k_ptr + t * sk_t + hk * sk_h, kw_ptr, cos, sin, eps,
                    ko_ptr + (t * HKV + hk) * (2 * HALF),
                    cache_ptr + (ks * HKV + hk) * (2 * HALF), HALF, RH, NORM, PARTIAL,
                    STORE, ks >= 0)
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
    """q [T, Hq, d], k [T, Hkv, d] (unit stride in d), cos/sin fp32 [T, r] (r = d, or r < d:
    partial rotary of the first r values) with equal strides, norm weights fp32 [d] (both or
    neither) -> (q', k') contiguous. `kv` (v [T, Hkv, d] with
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
        HALF=d // 2, NORM=norm, STORE=kv is not None, RH=cos.shape[1] // 2,
        PARTIAL=cos.shape[1] < d, num_warps=1, **pdl.opts())
    return qo, ko
