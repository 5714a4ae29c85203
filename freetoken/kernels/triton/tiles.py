"""Whole tiles decoded from contiguous byte runs, in logical k order, bit for bit as the codecs.

`fast_tile(FMT, w_rows, s_rows, k0, n_ok, BK)` returns fp32 [BLOCK_N, BK] for columns
k0 .. k0 + BK - 1 (K a multiple of BK; Q4_K: BK = 256). Where `quant.decode_tile` loads a byte
per value (any k, any mask), these load each row's bytes as one run (vector loads), compute
the values with the codecs' fp32 operations (`e2m1 * s`, `q * d`, `q * d - m`, each rounded
as the codec rounds it) and put them in k order with `tl.interleave` / `tl.join`. The tl.dot
paths (several tokens, prefill) use them; `has_fast_tile` says which formats have one.
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.kernels.triton.quant import _e2m1, _e4m3, _f16, _k4_scale_min

FAST_TILE_FORMATS = (1, 12, 13, 18)  # NVFP4, Q8_0, Q4_K, split Q8_0


def has_fast_tile(fmt: int, k: int, bk: int) -> bool:
    if fmt not in FAST_TILE_FORMATS or k % bk:
        return False
    return bk == 256 if fmt == 13 else bk % 32 == 0


@triton.jit
def _nvfp4_tile(w_rows, s_rows, k0, n_ok, BK: tl.constexpr):
    G: tl.constexpr = BK // 16
    g = tl.arange(0, G)
    q = tl.load(w_rows[:, :, None] + (k0 // 2 + 8 * g)[None, :, None]
                + tl.arange(0, 8)[None, None, :], mask=n_ok[:, None, None], other=0)
    q = q.to(tl.int32)  # [BN, G, 8]: byte i of block g holds k = 16g + 2i (low), + 1 (high)
    s = _e4m3(tl.load(s_rows + k0 // 16 + g[None, :], mask=n_ok[:, None], other=0)
              .to(tl.int32))[:, :, None]
    w = tl.interleave(_e2m1(q & 15) * s, _e2m1(q >> 4) * s)  # [BN, G, 16]
    return tl.reshape(w, (w.shape[0], BK))


@triton.jit
def _q8_0_tile(w_rows, k0, n_ok, BK: tl.constexpr):
    G: tl.constexpr = BK // 32
    blk = w_rows + (k0 // 32 + tl.arange(0, G)[None, :]) * 34  # [BN, G]
    q = tl.load(blk[:, :, None] + 2 + tl.arange(0, 32)[None, None, :],
                mask=n_ok[:, None, None], other=0).to(tl.int8, bitcast=True)
    w = q.to(tl.float32) * _f16(blk, n_ok[:, None])[:, :, None]
    return tl.reshape(w, (w.shape[0], BK))


@triton.jit
def _q8_0_split_tile(w_rows, s_rows, k0, n_ok, BK: tl.constexpr):
    G: tl.constexpr = BK // 32
    q = tl.load(w_rows + k0 + tl.arange(0, BK)[None, :], mask=n_ok[:, None], other=0)
    d = tl.load(s_rows + k0 // 32 + tl.arange(0, G)[None, :], mask=n_ok[:, None], other=0.0)
    w = tl.reshape(q.to(tl.float32), (q.shape[0], G, 32)) * d.to(tl.float32)[:, :, None]
    return tl.reshape(w, (q.shape[0], BK))


@triton.jit
def _q4_k_tile(w_rows, k0, n_ok, BK: tl.constexpr):
    blk = w_rows + (k0 // 256) * 144  # [BN, 1]
    g = tl.arange(0, 4)
    q = tl.load(blk[:, :, None] + 16 + 32 * g[None, :, None] + tl.arange(0, 32)[None, None, :],
                mask=n_ok[:, None, None], other=0).to(tl.int32)  # [BN, 4, 32]
    m2 = n_ok[:, None]
    sc_lo, mn_lo = _k4_scale_min(blk + 4, 2 * g[None, :], m2)
    sc_hi, mn_hi = _k4_scale_min(blk + 4, 2 * g[None, :] + 1, m2)
    d = _f16(blk, m2)
    dmin = _f16(blk + 2, m2)
    lo = (q & 15).to(tl.float32) * (d * sc_lo.to(tl.float32))[:, :, None] \
        - (dmin * mn_lo.to(tl.float32))[:, :, None]
    hi = (q >> 4).to(tl.float32) * (d * sc_hi.to(tl.float32))[:, :, None] \
        - (dmin * mn_hi.to(tl.float32))[:, :, None]
    w = tl.permute(tl.join(lo, hi), (0, 1, 3, 2))  # [BN, 4, 2, 32]: k = 64g + 32h + l
    return tl.reshape(w, (w.shape[0], BK))


@triton.jit
def fast_tile(FMT: tl.constexpr, w_rows, s_rows, k0, n_ok, BK: tl.constexpr):
    """fp32 [BLOCK_N, BK] of columns k0 .. k0 + BK - 1 (see the module docstring)."""
    if FMT == 1:
        w = _nvfp4_tile(w_rows, s_rows, k0, n_ok, BK)
    elif FMT == 12:
        w = _q8_0_tile(w_rows, k0, n_ok, BK)
    elif FMT == 18:
        w = _q8_0_split_tile(w_rows, s_rows, k0, n_ok, BK)
    else:
        w = _q4_k_tile(w_rows, k0, n_ok, BK)
    return w


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, N, stride_wn, stride_sn, stride_on,
                    K: tl.constexpr, FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    s2_ptr=None, SCALE2: tl.constexpr = 0):
    """out[N, K] = the weight's values (fast tiles): tests, and a float copy where one pays.
    SCALE2 1 / 2: times the tensor's scale2 (s2_ptr[0]) / its row's (s2_ptr[n]) in fp32,
    before the one rounding to out's dtype."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    n_ok = rn < N
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    s_rows = s_ptr + rn[:, None].to(tl.int64) * stride_sn
    k0 = tl.program_id(1) * BK
    w = fast_tile(FMT, w_rows, s_rows, k0, n_ok, BK)
    if SCALE2 == 1:
        w = w * tl.load(s2_ptr)
    elif SCALE2 == 2:
        w = w * tl.load(s2_ptr + rn, mask=n_ok, other=0.0)[:, None]
    out = out_ptr + rn[:, None].to(tl.int64) * stride_on + k0 + tl.arange(0, BK)[None, :]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=n_ok[:, None])



