"""Decode-shape dot products: one activation row against BLOCK_N weight rows, BK values.

`gemv_block(FMT, w_rows, s_rows, x_row, k0, n_ok, BK)` returns fp32 [BLOCK_N] partial sums
sum_k W[n, k] x[k] over k0 <= k < k0 + BK. For the formats that carry the decode bar (NVFP4,
Q4_K, Q6_K, Q8_0) it reads the code bytes as contiguous runs (vector loads) and applies the block
scales once per block, as llama.cpp's MMVQ does: NVFP4 `s * sum(e2m1 * x)`, Q8_0 (blocks or
split) `d * sum(q * x)`, Q4_K `d sc * sum(q * x) - dmin m * sum(x)` per 32 values. These are the
codecs' values summed in another association (fp32, within the same K eps bound the tests
state); the other formats multiply `quant.decode_tile` (the codecs' exact values) by x.
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.kernels.triton.quant import _e4m3, _f16, _f16_bits, _k4_scale_min, decode_tile


@triton.jit
def _e2m1_scaled(c):
    """E2M1 code -> its value times 2^-14, via the f16 bit pattern (s, e1 e0 -> exponent low
    bits, m -> mantissa top bit; E2M1's subnormal maps to f16's): one conversion, no selects
    (code 8 gives -0.0, which adds nothing to a sum)."""
    return _f16_bits(((c & 7) << 9) | ((c & 8) << 12))


@triton.jit
def _nvfp4_dot(w_rows, s_rows, x_row, k0, n_ok, BK: tl.constexpr):
    G: tl.constexpr = BK // 16
    g = tl.arange(0, G)
    i = tl.arange(0, 8)
    m3 = n_ok[:, None, None]
    q = tl.load(w_rows[:, :, None] + (k0 // 2 + 8 * g)[None, :, None] + i[None, None, :],
                mask=m3, other=0).to(tl.int32)  # [BN, G, 8]: byte i of group g
    xk = x_row + k0 + 16 * g[:, None] + 2 * i[None, :]  # [G, 8] even k
    x_lo = tl.load(xk).to(tl.float32)
    x_hi = tl.load(xk + 1).to(tl.float32)
    part = tl.sum(_e2m1_scaled(q & 15) * x_lo[None] + _e2m1_scaled(q >> 4) * x_hi[None], axis=2)
    s = _e4m3(tl.load(s_rows + k0 // 16 + g[None, :], mask=n_ok[:, None], other=0).to(tl.int32))
    return tl.sum(part * (s * 16384.0), axis=1)  # 2^14 undoes the decode's 2^-14 (exact)


@triton.jit
def _q8_0_dot(w_rows, x_row, k0, n_ok, BK: tl.constexpr):
    G: tl.constexpr = BK // 32
    g = tl.arange(0, G)
    i = tl.arange(0, 32)
    blk = w_rows + (k0 // 32 + g[None, :]) * 34  # [BN, G]
    q = tl.load(blk[:, :, None] + 2 + i[None, None, :], mask=n_ok[:, None, None], other=0)
    q = q.to(tl.int8, bitcast=True).to(tl.float32)
    x = tl.load(x_row + k0 + 32 * g[:, None] + i[None, :]).to(tl.float32)  # [G, 32]
    part = tl.sum(q * x[None], axis=2)
    return tl.sum(part * _f16(blk, n_ok[:, None]), axis=1)


@triton.jit
def _q8_0_split_dot(w_rows, s_rows, x_row, k0, n_ok, BK: tl.constexpr):
    """Split Q8_0 (`formats.split_q8_0`): each row's BK codes are one aligned run (16-byte
    loads), d one f16 per 32 values."""
    G: tl.constexpr = BK // 32
    q = tl.load(w_rows + k0 + tl.arange(0, BK)[None, :], mask=n_ok[:, None], other=0)
    x = tl.load(x_row + k0 + tl.arange(0, BK)).to(tl.float32)
    part = tl.sum(tl.reshape(q.to(tl.float32) * x[None, :], (q.shape[0], G, 32)), axis=2)
    d = tl.load(s_rows + k0 // 32 + tl.arange(0, G)[None, :], mask=n_ok[:, None], other=0.0)
    return tl.sum(part * d.to(tl.float32), axis=1)


@triton.jit
def _q4_k_dot(w_rows, x_row, k0, n_ok, BK: tl.constexpr):
    """BK = 256: one super-block per row. qs byte 32g + l holds k = 64g + l (low nibble) and
    64g + 32 + l (high); sub-blocks 2g (low) and 2g + 1 (high)."""
    blk = w_rows + (k0 // 256) * 144  # [BN, 1]
    g = tl.arange(0, 4)
    j = tl.arange(0, 32)
    q = tl.load(blk[:, :, None] + 16 + 32 * g[None, :, None] + j[None, None, :],
                mask=n_ok[:, None, None], other=0).to(tl.int32)  # [BN, 4, 32]
    xk = x_row + k0 + 64 * g[:, None] + j[None, :]  # [4, 32]
    x_lo = tl.load(xk).to(tl.float32)
    x_hi = tl.load(xk + 32).to(tl.float32)
    dot_lo = tl.sum((q & 15).to(tl.float32) * x_lo[None], axis=2)  # [BN, 4]
    dot_hi = tl.sum((q >> 4).to(tl.float32) * x_hi[None], axis=2)
    m2 = n_ok[:, None]
    sc_lo, mn_lo = _k4_scale_min(blk + 4, 2 * g[None, :], m2)
    sc_hi, mn_hi = _k4_scale_min(blk + 4, 2 * g[None, :] + 1, m2)
    d = _f16(blk, m2)  # [BN, 1]
    dmin = _f16(blk + 2, m2)
    sums = sc_lo.to(tl.float32) * dot_lo + sc_hi.to(tl.float32) * dot_hi
    mins = mn_lo.to(tl.float32) * tl.sum(x_lo, axis=1)[None] \
        + mn_hi.to(tl.float32) * tl.sum(x_hi, axis=1)[None]
    return tl.sum(d * sums - dmin * mins, axis=1)


@triton.jit
def _q6_k_dot(w_rows, x_row, k0, n_ok, BK: tl.constexpr):
    """BK = 256: one super-block per row. Code byte 32c + l (c = 2h + f1) holds k = 128h +
    32 f1 + l (low nibble) and k + 64 (high); its top bits come from byte 128 + 32h + l (bits
    2 f1 and 2 f1 + 4); one int8 scale per 16 values (k // 16)."""
    blk = w_rows + (k0 // 256) * 210  # [BN, 1]
    c = tl.arange(0, 4)[None, :, None, None]
    lh = tl.arange(0, 2)[None, None, :, None]
    ll = tl.arange(0, 16)[None, None, None, :]
    m4 = n_ok[:, None, None, None]
    b4 = blk[:, :, None, None]
    ql = tl.load(b4 + 32 * c + 16 * lh + ll, mask=m4, other=0).to(tl.int32)  # [BN, 4, 2, 16]
    qh = tl.load(b4 + 128 + 32 * (c // 2) + 16 * lh + ll, mask=m4, other=0).to(tl.int32)
    f1 = c % 2
    q_lo = ((ql & 15) | (((qh >> (2 * f1)) & 3) << 4)) - 32
    q_hi = ((ql >> 4) | (((qh >> (2 * f1 + 4)) & 3) << 4)) - 32
    xk = x_row + k0 + 128 * (c // 2) + 32 * f1 + 16 * lh + ll  # [1, 4, 2, 16]
    dot_lo = tl.sum(q_lo.to(tl.float32) * tl.load(xk).to(tl.float32), axis=3)  # [BN, 4, 2]
    dot_hi = tl.sum(q_hi.to(tl.float32) * tl.load(xk + 64).to(tl.float32), axis=3)
    c3 = tl.arange(0, 4)[None, :, None]
    s_at = blk[:, :, None] + 192 + 8 * (c3 // 2) + 2 * (c3 % 2) + tl.arange(0, 2)[None, None, :]
    m3 = n_ok[:, None, None]
    sc_lo = tl.load(s_at, mask=m3, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    sc_hi = tl.load(s_at + 4, mask=m3, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    part = tl.sum(tl.sum(sc_lo * dot_lo + sc_hi * dot_hi, axis=2), axis=1)
    return _f16(blk + 208, n_ok[:, None]).reshape(part.shape) * part


@triton.jit
def gemv_block(FMT: tl.constexpr, w_rows, s_rows, x_row, k0, n_ok, BK: tl.constexpr):
    """fp32 [BLOCK_N]: sum over k0 <= k < k0 + BK of W[n, k] x[k] (K a multiple of BK)."""
    if FMT == 1:
        acc = _nvfp4_dot(w_rows, s_rows, x_row, k0, n_ok, BK)
    elif FMT == 12:
        acc = _q8_0_dot(w_rows, x_row, k0, n_ok, BK)
    elif FMT == 13:
        acc = _q4_k_dot(w_rows, x_row, k0, n_ok, BK)
    elif FMT == 15:
        acc = _q6_k_dot(w_rows, x_row, k0, n_ok, BK)
    elif FMT == 18:
        acc = _q8_0_split_dot(w_rows, s_rows, x_row, k0, n_ok, BK)
    else:
        k = k0 + tl.arange(0, BK)
        w = decode_tile(FMT, w_rows, s_rows, k[None, :], n_ok[:, None])
        acc = tl.sum(w * tl.load(x_row + k).to(tl.float32)[None, :], axis=1)
    return acc


def gemv_chunk_error(fmt: int, bk: int, what: str) -> str | None:
    """Why chunks of BK values cannot serve this format's fp32 GEMV, or None: a K-quant's dot
    (Q4_K / Q5_K / Q6_K) takes one super-block a chunk (`gemv_bk`). That BK tiles K is the
    launchers' own check."""
    if fmt in (13, 14, 15) and bk != 256:
        return (f"{what}: the GEMV over K-quant (Q4_K / Q5_K / Q6_K) weights takes chunks of "
                f"BK=256, got tiles with BK={bk}")
    return None


def gemv_bk(fmt: int, k: int, want: int = 256) -> int | None:
    """The BK the GEMV path uses for this format and K, or None when K does not split into
    whole BK chunks (the tiled path, masked, takes those)."""
    bk = 256 if fmt in (13, 14, 15) else want
    while bk > 32 and k % bk:
        bk //= 2
    return bk if k % bk == 0 else None

