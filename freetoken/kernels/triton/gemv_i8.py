"""Decode-shape dot products in int8, as llama.cpp's MMVQ computes them: the activation chunk is
quantized to int8 per 32 values (q = floor(x * 127 / amax + 1/2), d = amax / 127, llama.cpp's
q8_1 up to the rounding of ties), the weight codes are expanded to int8 in registers and
multiplied four at a time by `dp4a` (int32 sums, exact); the block scales multiply the integer
sums once per block in fp32. A program quantizes its chunk itself (`quant_x`) or reads codes
that the kernel producing the activation wrote once for all programs (`quant_store`, read by
`load_xq`; `freetoken/kernels/xq.py`), the same arithmetic bit for bit.

Why: the fp32 GEMV (`gemv.py`) spends some ten integer and float operations per weight value
(nibble, bit pattern, conversion, FMA) and tops out at 500-765 GB/s on the H200, a sixth of HBM
(bench_gpu_kernels.py --sweep). Here a 32-bit word of codes costs one to eleven operations for
four to eight values:
- NVFP4: the E2M1 codes of a word's low 16 bits are four prmt byte-selectors as they are stored
  (k order: byte i holds k = 2i low, 2i + 1 high): one prmt gives the positive codes' int8
  magnitudes (E2M1 doubled: 0, 1, 2, 3, 4, 6, 8, 12; the 1/2 goes into the fp32 epilogue), one
  on the sign-flipped codes the negative codes', each multiplied by x or -x in a dp4a (five
  operations for four values);
- Q4_K: `w & 0x0F0F0F0F` and `(w >> 4) & 0x0F0F0F0F` are four codes of sub-blocks 2g and
  2g + 1; the mins use the activation block's integer sum;
- split Q8_0: the codes are the int8 values.

The numbers differ from the fp32 path by the activation's quantization: each x_k moves by at
most d_b / 2 (d_b = its block's amax / 127), so a dot moves by at most
sum_b d_b / 2 * sum_{k in b} |w_k|, plus fp32 rounding of the block sums (tests state it).
Activations in fp32 keep the fp32 path (`use_i8`): float32 runs are the exact reference.

The PTX (`dp4a`, `prmt`) goes through `tl.inline_asm_elementwise`; Triton's interpreter cannot
run inline assembly, so under `TRITON_INTERPRET=1` (`ASM` false) the same kernels compute each
step with integer arithmetic instead (tests in CI), with the same results bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.kernels import xq
from freetoken.kernels.triton import interpreting
from freetoken.kernels.triton.quant import _e2m1x2_int, _f16_bits

I8_FORMATS = (1, 13, 18)  # NVFP4, Q4_K, split Q8_0


def asm() -> bool:
    """Whether kernels may use inline PTX (not under Triton's interpreter)."""
    return not interpreting()


def use_i8(fmt: int, x_dtype) -> bool:
    """The int8 path for a decode launch: a format with int8 dots and an activation they take
    (`kernels.xq.int8_dots`: 16-bit, the switch on, not ROCm)."""
    return fmt in I8_FORMATS and xq.int8_dots(x_dtype)


def i8_chunk_ok(fmt: int, k: int, bk: int) -> bool:
    """Whether chunks of BK values tile K for this format's int8 dot (Q4_K: whole
    super-blocks)."""
    return k % bk == 0 and bk % (256 if fmt == 13 else 32) == 0


def i8_chunk(fmt: int, k: int, want: int) -> int | None:
    """The widest power-of-two chunk up to `want` that tiles K, or None. The kernels unroll
    their chunk loop (`tl.static_range`): every chunk's loads go out before the first chunk's
    products wait on them, the memory parallelism a one-token GEMV lives on (measured on the
    H200, bench_gpu_kernels.py --sweep)."""
    bk = want
    while bk >= 32 and not i8_chunk_ok(fmt, k, bk):
        bk //= 2
    return bk if bk >= 32 else None


# -- integer helpers ------------------------------------------------------------------------------
@triton.jit
def _sbyte(v, i: tl.constexpr):
    """Signed byte i of each int32."""
    return (v << (24 - 8 * i)) >> 24


@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr):
    """c + sum_i a.byte_i * b.byte_i, bytes signed, int32 (PTX dp4a.s32.s32)."""
    if ASM:
        r = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                      dtype=tl.int32, is_pure=True, pack=1)
    else:
        r = c + _sbyte(a, 0) * _sbyte(b, 0) + _sbyte(a, 1) * _sbyte(b, 1) \
            + _sbyte(a, 2) * _sbyte(b, 2) + _sbyte(a, 3) * _sbyte(b, 3)
    return r


@triton.jit
def _e2m1_dot(w, xa, xb, na, nb, ASM: tl.constexpr):
    """sum over the word's 8 E2M1 codes (k order) of 2 * value * x, x's int8 codes packed four
    to a word (xa: k 0-3, xb: k 4-7; na, nb: the same negated), int32."""
    if ASM:
        # prmt's selector nibbles are the codes as stored: bits 0-2 pick a byte of the
        # magnitudes {0, 1, 2, 3 | 4, 6, 8, 12}, bit 3 (the sign) replaces it by its sign
        # byte, 0. So prmt(codes) holds the positive codes' magnitudes (0 where negative) and
        # prmt(codes ^ 0x8888) the negative codes' (0 where positive): two dp4a, the second
        # against -x, give the signed sum.
        r = tl.inline_asm_elementwise(
            """{
            .reg .b32 t0, t1, s, p, q, h;
            mov.b32 t0, 0x03020100;
            mov.b32 t1, 0x0C080604;
            prmt.b32 p, t0, t1, $1;
            xor.b32 s, $1, 0x8888;
            prmt.b32 q, t0, t1, s;
            dp4a.s32.s32 $0, p, $2, 0;
            dp4a.s32.s32 $0, q, $4, $0;
            shr.u32 h, $1, 16;
            prmt.b32 p, t0, t1, h;
            xor.b32 s, h, 0x8888;
            prmt.b32 q, t0, t1, s;
            dp4a.s32.s32 $0, p, $3, $0;
            dp4a.s32.s32 $0, q, $5, $0;
            }""",
            "=r,r,r,r,r,r", [w, xa, xb, na, nb], dtype=tl.int32, is_pure=True, pack=1)
    else:
        r = _e2m1x2_int(w & 15) * _sbyte(xa, 0) + _e2m1x2_int((w >> 4) & 15) * _sbyte(xa, 1) \
            + _e2m1x2_int((w >> 8) & 15) * _sbyte(xa, 2) \
            + _e2m1x2_int((w >> 12) & 15) * _sbyte(xa, 3) \
            + _e2m1x2_int((w >> 16) & 15) * _sbyte(xb, 0) \
            + _e2m1x2_int((w >> 20) & 15) * _sbyte(xb, 1) \
            + _e2m1x2_int((w >> 24) & 15) * _sbyte(xb, 2) \
            + _e2m1x2_int((w >> 28) & 15) * _sbyte(xb, 3)
    return r


@triton.jit
def _e2m1_expand(w, ASM: tl.constexpr):
    """The word's 8 E2M1 codes as `_e2m1_dot` expands them, kept for several dots: four words
    of int8 magnitudes (E2M1 doubled), k 0-3's positive codes (0 where negative), k 0-3's
    negative codes (0 where positive), k 4-7's alike; `_e2m1_dot`'s sum is dp4a of them
    against x, -x, x, -x."""
    if ASM:  # the prmt of `_e2m1_dot`, its results kept
        p0, q0, p1, q1 = tl.inline_asm_elementwise(
            """{
            .reg .b32 t0, t1, s, h;
            mov.b32 t0, 0x03020100;
            mov.b32 t1, 0x0C080604;
            prmt.b32 $0, t0, t1, $4;
            xor.b32 s, $4, 0x8888;
            prmt.b32 $1, t0, t1, s;
            shr.u32 h, $4, 16;
            prmt.b32 $2, t0, t1, h;
            xor.b32 s, h, 0x8888;
            prmt.b32 $3, t0, t1, s;
            }""",
            "=r,=r,=r,=r,r", [w], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=True, pack=1)
    else:
        p0 = _e2m1_mags(w, False)
        q0 = _e2m1_mags(w, True)
        p1 = _e2m1_mags(w >> 16, False)
        q1 = _e2m1_mags(w >> 16, True)
    return p0, q0, p1, q1


@triton.jit
def _e2m1_mags(w, NEG: tl.constexpr):
    """Bytes 0-3: the magnitude (doubled) of E2M1 code i in bits 4i .. 4i + 3 of w where its
    sign is NEG, else 0 (prmt's selection, in integer arithmetic)."""
    r = _e2m1_mag(w, 0, NEG) | _e2m1_mag(w, 1, NEG)
    return r | _e2m1_mag(w, 2, NEG) | _e2m1_mag(w, 3, NEG)


@triton.jit
def _e2m1_mag(w, i: tl.constexpr, NEG: tl.constexpr):
    c = (w >> (4 * i)) & 15
    return tl.where((c >= 8) == NEG, _e2m1x2_int(c & 7), 0) << (8 * i)


@triton.jit
def _e4m3_div256(b):
    """E4M3 (fn) byte -> its value times 2^-8, through the f16 bit pattern (the exponent field
    moves as it is: biases 7 and 15 differ by 8; subnormals map to subnormals); NaN for
    0x7F / 0xFF as torch decodes them."""
    v = _f16_bits(((b & 127) << 7) | ((b & 128) << 8))
    return tl.where((b & 127) == 127, float("nan"), v)


# -- the activation chunk -------------------------------------------------------------------------
def xq_len(k: int) -> int:
    """int32 words of one activation row quantized ahead (`quant_store`): K / 4 code words,
    K / 4 negated code words, K / 32 block scales (fp32 bits), K / 32 block sums."""
    return k // 2 + k // 16


@triton.jit
def _quant(xf, BK: tl.constexpr, NEG: tl.constexpr):
    """fp32 [BK] -> (codes int32 [BK / 4], d fp32 [BK / 32], sums int32 [BK / 32], negated
    codes or the codes again), as `quant_x` documents."""
    G: tl.constexpr = BK // 32
    x = tl.reshape(xf, (G, 32))
    amax = tl.max(tl.abs(x), axis=1)
    safe = tl.where(amax > 0, amax, 1.0)  # an all-zero block: codes 0, d 0
    inv = tl.where(amax > 0, tl.math.div_rn(tl.full((G,), 127.0, tl.float32), safe), 0.0)
    q = tl.floor(x * inv[:, None] + 0.5).to(tl.int32)  # [G, 32] in -127..127
    sums = tl.sum(q, axis=1)
    shift = (tl.arange(0, 4) * 8)[None, None, :]
    words = tl.sum(tl.reshape(q & 255, (G, 8, 4)) << shift, axis=2)  # disjoint bits: an or
    d = tl.math.div_rn(amax, tl.full((G,), 127.0, tl.float32))
    neg = words
    if NEG:
        neg = tl.sum(tl.reshape((0 - q) & 255, (G, 8, 4)) << shift, axis=2)
    return tl.reshape(words, (BK // 4,)), d, sums, tl.reshape(neg, (BK // 4,))


@triton.jit
def quant_x(x_row, k0, BK: tl.constexpr, NEG: tl.constexpr = False):
    """x[k0 : k0 + BK] -> (codes: int32 [BK / 4], four int8 in k order per word; d: fp32
    [BK / 32]; sums: int32 [BK / 32], each block's sum of codes; with NEG, the negated codes
    packed alike (NVFP4's dot), else the codes again)."""
    return _quant(tl.load(x_row + k0 + tl.arange(0, BK)).to(tl.float32), BK, NEG)


@triton.jit
def quant_store(xf, out_row, n0, ok, D):
    """Codes made once by the kernel that produces the activation, for every int8 GEMV
    program that reads it (`load_xq`), quantized as `quant_x` quantizes chunks: row i of the
    tile xf (fp32 [R, C], C a multiple of 32) holds values n0 + i C .. n0 + (i + 1) C of a row
    of D values (D a multiple of 32), stored into their place of its `xq_len(D)` layout; rows
    where ok [R] is false and values past D (zero in xf) are not stored. Producers: the
    RMSNorm (one tile [1, BLOCK] a row), the fused MoE's gate/up (one part of a's row a
    program), decode attention (the query heads of one KV head)."""
    R: tl.constexpr = xf.shape[0]
    C: tl.constexpr = xf.shape[1]
    i = tl.arange(0, R)[:, None]
    w = n0 // 4 + i * (C // 4) + tl.arange(0, C // 4)[None, :]
    g = n0 // 32 + i * (C // 32) + tl.arange(0, C // 32)[None, :]
    _store_codes(xf, out_row, w, g, ok, D)


@triton.jit
def quant_store_rows(xf, out_rows, n0, ok, D):
    """`quant_store` for a tile whose rows go to different rows of codes: row i of xf (fp32
    [R, C], C a multiple of 32) holds values n0 .. n0 + C of the row at out_rows[i] ([R]
    pointers; the grouped MoE's gate/up: one row per route of its group)."""
    C: tl.constexpr = xf.shape[1]
    w = n0 // 4 + tl.arange(0, C // 4)[None, :]
    g = n0 // 32 + tl.arange(0, C // 32)[None, :]
    _store_codes(xf, out_rows[:, None], w, g, ok, D)


@triton.jit
def _store_codes(xf, out, w, g, ok, D):
    """xf [R, C] quantized, its code words stored at out + w ([R, C / 4] offsets in the
    `xq_len(D)` layout) and its blocks' scales and sums at out + g ([R, C / 32])."""
    R: tl.constexpr = xf.shape[0]
    C: tl.constexpr = xf.shape[1]
    words, d, sums, neg = _quant(tl.reshape(xf, (R * C,)), R * C, True)
    mw = ok[:, None] & (w < D // 4)
    mg = ok[:, None] & (g < D // 32)
    tl.store(out + w, tl.reshape(words, (R, C // 4)), mask=mw)
    tl.store(out + D // 4 + w, tl.reshape(neg, (R, C // 4)), mask=mw)
    tl.store(out + D // 2 + g, tl.reshape(d.to(tl.int32, bitcast=True), (R, C // 32)),
             mask=mg)
    tl.store(out + D // 2 + D // 32 + g, tl.reshape(sums, (R, C // 32)), mask=mg)


@triton.jit
def load_xq(xq_row, k0, K: tl.constexpr, BK: tl.constexpr, NEG: tl.constexpr = False):
    """What `quant_x(x_row, k0, BK, NEG)` returns, read from a row `quant_store` wrote."""
    w = tl.arange(0, BK // 4)
    g = tl.arange(0, BK // 32)
    words = tl.load(xq_row + k0 // 4 + w)
    neg = words
    if NEG:
        neg = tl.load(xq_row + K // 4 + k0 // 4 + w)
    d = tl.load(xq_row + K // 2 + k0 // 32 + g).to(tl.float32, bitcast=True)
    sums = tl.load(xq_row + K // 2 + K // 32 + k0 // 32 + g)
    return words, d, sums, neg


# -- one format each: a chunk's weight words, loaded and expanded once (`_*_w`), then dotted
# with one activation chunk (`_*_dot`): fp32 [BN] partial sums over k0 .. k0 + BK -------------
@triton.jit
def _nvfp4_w(w_rows, s_rows, k0, n_ok, BK: tl.constexpr, ASM: tl.constexpr,
             EXPAND: tl.constexpr):
    """(words [BN, BK / 8], or with EXPAND their `_e2m1_expand`; block scales [BN, BK / 16]
    times 2^-8)."""
    w32 = w_rows.to(tl.pointer_type(tl.int32))  # a row's K / 2 bytes: K / 8 words
    w = tl.load(w32 + k0 // 8 + tl.arange(0, BK // 8)[None, :], mask=n_ok[:, None], other=0)
    s = tl.load(s_rows + k0 // 16 + tl.arange(0, BK // 16)[None, :], mask=n_ok[:, None],
                other=0).to(tl.int32)
    if EXPAND:
        w = _e2m1_expand(w, ASM)
    return w, _e4m3_div256(s)


@triton.jit
def _nvfp4_dot(wq, xw, xd, xn, BK: tl.constexpr, ASM: tl.constexpr, EXPANDED: tl.constexpr):
    w, sc = wq
    BN: tl.constexpr = sc.shape[0]
    xa, xb = tl.split(tl.reshape(xw, (BK // 8, 2)))  # words 2j, 2j + 1: weight word j's k
    na, nb = tl.split(tl.reshape(xn, (BK // 8, 2)))
    if EXPANDED:  # four dp4a on the magnitudes (the integer sum `_e2m1_dot` computes)
        p0, q0, p1, q1 = w
        dots = _dp4a(p0, xa[None, :], 0, ASM)
        dots = _dp4a(q0, na[None, :], dots, ASM)
        dots = _dp4a(p1, xb[None, :], dots, ASM)
        dots = _dp4a(q1, nb[None, :], dots, ASM)
    else:
        dots = _e2m1_dot(w, xa[None, :], xb[None, :], na[None, :], nb[None, :], ASM)
    blk = tl.sum(tl.reshape(dots, (BN, BK // 16, 2)), axis=2).to(tl.float32)  # [BN, BK / 16]
    part = tl.sum(tl.reshape(blk * sc, (BN, BK // 32, 2)), axis=2)
    # 2^8 / 2 undoes the scales' 2^-8 and the doubled codes (exact)
    return tl.sum(part * xd[None, :], axis=1) * 128.0


@triton.jit
def _byte_pair(lo4, hi4, HIGH: tl.constexpr):
    """[BN, S, 4] from words [BN, S]: for g < 4, the byte of sub-block 2g (HIGH: 2g + 1) of
    a Q4_K super-block, sub-blocks 0-3 being the bytes of lo4 and 4-7 those of hi4."""
    g = tl.arange(0, 4)[None, None, :]
    src = tl.where(g < 2, lo4[:, :, None], hi4[:, :, None])
    return (src >> ((g % 2) * 16 + (8 if HIGH else 0))) & 255


@triton.jit
def _q4_k_w(w_rows, k0, n_ok, BK: tl.constexpr):
    """Super-block s of a chunk: 144 bytes (d, dmin, 12 scale bytes, 128 code bytes); code
    word 8g + l (g < 4, l < 8) holds k = 64g + 4l .. + 3 (low nibbles, sub-block 2g) and the
    same + 32 (high, sub-block 2g + 1). The 16-byte head is read as four words, one vector
    load (144-byte blocks keep it 16-byte aligned), and the 6-bit scales and mins are cut
    from the words four at a time (llama.cpp's `get_scale_min_k4` on whole words): sub-blocks
    0-3 are bytes of w1 (scales) and w2 (mins) & 63; sub-blocks 4-7 take their low four bits
    from w3 and their top two from bits 6-7 of w1 / w2's bytes. Returns the low and high
    nibbles' codes [BN, S, 32], the scales and mins of sub-blocks 2g and 2g + 1 (fp32
    [BN, S, 4] each) and d, dmin [BN, S]."""
    BN: tl.constexpr = w_rows.shape[0]
    S: tl.constexpr = BK // 256
    blk = (w_rows + (k0 // 256 + tl.arange(0, S))[None, :] * 144).to(tl.pointer_type(tl.int32))
    q = tl.load((blk + 4)[:, :, None] + tl.arange(0, 32)[None, None, :],
                mask=n_ok[:, None, None], other=0)
    head = tl.load(blk[:, :, None] + tl.arange(0, 4)[None, None, :], mask=n_ok[:, None, None],
                   other=0)  # [BN, S, 4]: d | dmin << 16, scale bytes 0-3, 4-7, 8-11
    h02, h13 = tl.split(tl.reshape(head, (BN, S, 2, 2)))
    w0, w2 = tl.split(h02)
    w1, w3 = tl.split(h13)
    sc4 = w1 & 0x3F3F3F3F  # [BN, S]: sub-blocks 0-3's scales, a byte each
    sc8 = (w3 & 0x0F0F0F0F) | ((w1 >> 2) & 0x30303030)  # 4-7
    mn4 = w2 & 0x3F3F3F3F
    mn8 = ((w3 >> 4) & 0x0F0F0F0F) | ((w2 >> 2) & 0x30303030)
    return (q & 0x0F0F0F0F, (q >> 4) & 0x0F0F0F0F,
            _byte_pair(sc4, sc8, False).to(tl.float32), _byte_pair(sc4, sc8, True).to(tl.float32),
            _byte_pair(mn4, mn8, False).to(tl.float32), _byte_pair(mn4, mn8, True).to(tl.float32),
            _f16_bits(w0 & 0xFFFF), _f16_bits((w0 >> 16) & 0xFFFF))


@triton.jit
def _q4_k_dot(wq, xw, xd, xs, BK: tl.constexpr, ASM: tl.constexpr):
    """The mins use the activation block's integer sum (xs)."""
    lo, hi, sc_lo, sc_hi, mn_lo, mn_hi, d, dmin = wq
    BN: tl.constexpr = lo.shape[0]
    S: tl.constexpr = BK // 256
    x4 = tl.permute(tl.reshape(xw, (S, 4, 2, 8)), (0, 1, 3, 2))  # [S, g, l, half]
    x_lo, x_hi = tl.split(x4)  # [S, 4, 8]
    d_lo = _dp4a(lo, tl.reshape(x_lo, (S, 32))[None], 0, ASM)
    d_hi = _dp4a(hi, tl.reshape(x_hi, (S, 32))[None], 0, ASM)
    i_lo = tl.sum(tl.reshape(d_lo, (BN, S, 4, 8)), axis=3).to(tl.float32)  # [BN, S, 4]
    i_hi = tl.sum(tl.reshape(d_hi, (BN, S, 4, 8)), axis=3).to(tl.float32)
    xd_lo, xd_hi = tl.split(tl.reshape(xd, (S, 4, 2)))  # [S, 4]: sub-blocks 2g, 2g + 1
    xs_lo, xs_hi = tl.split(tl.reshape(xs, (S, 4, 2)))
    sums = tl.sum(sc_lo * (i_lo * xd_lo[None]) + sc_hi * (i_hi * xd_hi[None]), axis=2)
    mins = tl.sum(mn_lo * (xs_lo.to(tl.float32) * xd_lo)[None]
                  + mn_hi * (xs_hi.to(tl.float32) * xd_hi)[None], axis=2)  # [BN, S]
    return tl.sum(d * sums - dmin * mins, axis=1)


@triton.jit
def _q8_0_split_w(w_rows, s_rows, k0, n_ok, BK: tl.constexpr):
    """(codes [BN, BK / 4] words: the int8 values as they are, block scales [BN, BK / 32])."""
    w32 = w_rows.to(tl.pointer_type(tl.int32))  # a row's K int8 codes: K / 4 words
    w = tl.load(w32 + k0 // 4 + tl.arange(0, BK // 4)[None, :], mask=n_ok[:, None], other=0)
    d = tl.load(s_rows + k0 // 32 + tl.arange(0, BK // 32)[None, :], mask=n_ok[:, None],
                other=0.0).to(tl.float32)
    return w, d


@triton.jit
def _q8_0_split_dot(wq, xw, xd, BK: tl.constexpr, ASM: tl.constexpr):
    w, d = wq
    BN: tl.constexpr = w.shape[0]
    dots = _dp4a(w, xw[None, :], 0, ASM)
    blk = tl.sum(tl.reshape(dots, (BN, BK // 32, 8)), axis=2).to(tl.float32)
    return tl.sum(blk * d * xd[None, :], axis=1)


@triton.jit
def gemv_i8_row(FMT: tl.constexpr, w_rows, s_rows, x_row, n_ok, K: tl.constexpr,
                BK: tl.constexpr, ASM: tl.constexpr, XQ: tl.constexpr = False):
    """fp32 [BLOCK_N]: sum over k < K of W[n, k] x[k], x's chunks quantized in turn (XQ: x_row
    is a row `quant_store` quantized ahead), the chunk loop unrolled (`i8_chunk`)."""
    acc = tl.zeros((w_rows.shape[0],), dtype=tl.float32)
    for k0 in tl.static_range(0, K, BK):
        acc += gemv_i8_block(FMT, w_rows, s_rows, x_chunk(x_row, k0, K, BK, FMT == 1, XQ), k0,
                             n_ok, BK, ASM)
    return acc


@triton.jit
def x_chunk(x_row, k0, K: tl.constexpr, BK: tl.constexpr, NEG: tl.constexpr,
            XQ: tl.constexpr):
    """The quantized chunk k0 .. k0 + BK: read from a row quantized ahead (XQ), else made."""
    if XQ:
        r = load_xq(x_row, k0, K, BK, NEG)
    else:
        r = quant_x(x_row, k0, BK, NEG)
    return r


@triton.jit
def gemv_i8_block(FMT: tl.constexpr, w_rows, s_rows, xq, k0, n_ok, BK: tl.constexpr,
                  ASM: tl.constexpr):
    """fp32 [BLOCK_N]: sum over k0 <= k < k0 + BK of W[n, k] x[k], `xq` what
    `quant_x(x_row, k0, BK, FMT == 1)` returns."""
    return i8_dot(FMT, i8_weights(FMT, w_rows, s_rows, k0, n_ok, BK, ASM), xq, BK, ASM)


@triton.jit
def i8_weights(FMT: tl.constexpr, w_rows, s_rows, k0, n_ok, BK: tl.constexpr,
               ASM: tl.constexpr, EXPAND: tl.constexpr = False):
    """The weight rows' chunk k0 .. k0 + BK (rows where n_ok), loaded and expanded for
    `i8_dot`, which may dot it with several activation chunks (the grouped MoE: one expert's
    rows, the tokens of its routes): Q4_K's nibbles masked apart and its 6-bit scales and
    mins cut out, the block scales converted; NVFP4's codes with EXPAND become int8
    magnitudes (`_e2m1_expand`), else the fused prmt + dp4a of `_e2m1_dot` expands them in
    the dot (one dot: the fewest operations)."""
    if FMT == 1:
        wq = _nvfp4_w(w_rows, s_rows, k0, n_ok, BK, ASM, EXPAND)
    elif FMT == 13:
        wq = _q4_k_w(w_rows, k0, n_ok, BK)
    else:
        wq = _q8_0_split_w(w_rows, s_rows, k0, n_ok, BK)
    return wq


@triton.jit
def i8_dot(FMT: tl.constexpr, wq, xq, BK: tl.constexpr, ASM: tl.constexpr,
           EXPANDED: tl.constexpr = False):
    """fp32 [BLOCK_N]: the chunk's dot products of `i8_weights`' rows (EXPANDED as it was
    asked) with one activation chunk `xq` (what `quant_x(x_row, k0, BK, FMT == 1)` returns):
    integer dp4a sums per block, the block scales in fp32."""
    xw, xd, xs, xn = xq
    if FMT == 1:
        acc = _nvfp4_dot(wq, xw, xd, xn, BK, ASM, EXPANDED)
    elif FMT == 13:
        acc = _q4_k_dot(wq, xw, xd, xs, BK, ASM)
    else:
        acc = _q8_0_split_dot(wq, xw, xd, BK, ASM)
    return acc
