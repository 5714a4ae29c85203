"""Weight formats decoded inside Triton kernels, bit for bit as the `freetoken.formats` codecs.

`decode_tile(FMT, w_rows, s_rows, k, mask)` returns the fp32 values of a [BLOCK_N, BLOCK_K] tile:
`w_rows` [BLOCK_N, 1] points at each row's first byte (its first element for float formats),
`s_rows` [BLOCK_N, 1] at the row's block scales (NVFP4, MXFP4, FP8 block, split Q8_0; unused
otherwise),
`k` [1, BLOCK_K] holds logical column indices, `mask` which elements exist. Every fp32 operation
is the codec's, in its order (`q * d - m` is a multiply then a subtract: kernels that decode are
launched with `enable_fp_fusion=False`, so no FMA merges the two roundings). Bytes are loaded one
at a time: ggml's blocks (18, 20, 34, 144, 176, 210 bytes) are not word aligned.

Format ids (`FMT`, a constexpr) are given by `formats.format_id(qw)`; `None` there means no
kernel (the loader may decode such a weight once: `kernels.linear.dequantize_at_load`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.kernels.triton.formats import format_id  # noqa: F401 - for the launchers


# -- bit helpers ----------------------------------------------------------------------------------
@triton.jit
def _u8(p, mask):
    return tl.load(p, mask=mask, other=0).to(tl.int32)


@triton.jit
def _i8(p, mask):
    return tl.load(p, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.int32)


@triton.jit
def _f32_bits(b):
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _f16_bits(u):
    """An f16 bit pattern (int32, 0 .. 65535) -> its value in fp32 (exact)."""
    return u.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16(p, mask):
    """Little-endian f16 at byte pointer p (any alignment) -> fp32 (exact)."""
    return _f16_bits(_u8(p, mask) | (_u8(p + 1, mask) << 8))


@triton.jit
def _nibble(byte, high):
    return tl.where(high, byte >> 4, byte & 15)


@triton.jit
def _e2m1(c):
    """E2M1 code 0..15 -> fp32; code 8 (-0) decodes as +0.0, as the codecs' table does."""
    m = c & 7
    mag = tl.where(m < 2, m.to(tl.float32) * 0.5, _f32_bits(((m >> 1) + 126) << 23 | (m & 1) << 22))
    return tl.where((c >= 8) & (m != 0), -mag, mag)


@triton.jit
def _e4m3(b):
    """E4M3 (fn) byte -> fp32 as torch converts it: subnormals, +-0, NaN for 0x7F / 0xFF."""
    e = (b >> 3) & 15
    m = b & 7
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, _f32_bits((e + 120) << 23 | m << 20))
    bits = tl.where((b & 127) == 127, 0x7FC00000, mag.to(tl.int32, bitcast=True))
    # NOTE: the sign goes in as a bit: Triton's `-x` is `0 - x`, which turns -0.0 into +0.0.
    return _f32_bits(bits | ((b >> 7) << 31))


@triton.jit
def _ue4m3_half(b):
    """ggml's UE4M3 (bit 7 ignored; bytes 0 and 0x7F -> 0) times 0.5: GGUF NVFP4's block scale."""
    x = b & 127
    e = (x >> 3) & 15
    m = x & 7
    mag = tl.where(e == 0, m.to(tl.float32) * 0.0009765625, _f32_bits((e + 119) << 23 | m << 20))
    return tl.where(b == 127, 0.0, mag)


@triton.jit
def _e2m1x2_int(c):
    """E2M1 code (0..15) -> twice its value as an int: ggml's doubled table (0, 1, 2, 3, 4, 6,
    8, 12, then negatives)."""
    m = c & 7
    v = tl.where(m < 4, m, tl.where(m < 6, 2 * m - 4, 4 * m - 16))
    return tl.where(c >= 8, -v, v)


@triton.jit
def _kv_e2m1x2(c):
    """ggml's doubled E2M1 table as fp32."""
    return _e2m1x2_int(c).to(tl.float32)


# -- one function per format: fp32 [BLOCK_N, BLOCK_K] ---------------------------------------------
@triton.jit
def _nvfp4(w_rows, s_rows, k, mask):
    code = _nibble(_u8(w_rows + k // 2, mask), (k & 1) == 1)
    return _e2m1(code) * _e4m3(_u8(s_rows + k // 16, mask))


@triton.jit
def _mxfp4(w_rows, s_rows, k, mask):
    code = _nibble(_u8(w_rows + k // 2, mask), (k & 1) == 1)
    e = _u8(s_rows + k // 32, mask)
    bits = tl.where(e == 0, 1 << 22, tl.where(e == 255, 0x7FC00000, e << 23))
    return _e2m1(code) * _f32_bits(bits)


@triton.jit
def _fp8_block(w_rows, s_rows, k, mask):
    return _e4m3(_u8(w_rows + k, mask)) * tl.load(s_rows + k // 128, mask=mask, other=0.0)


@triton.jit
def _q4_0(w_rows, k, mask):
    blk = w_rows + (k // 32) * 18
    j = k % 32
    q = _nibble(_u8(blk + 2 + j % 16, mask), j >= 16) - 8
    return q.to(tl.float32) * _f16(blk, mask)


@triton.jit
def _q4_1(w_rows, k, mask):
    blk = w_rows + (k // 32) * 20
    j = k % 32
    q = _nibble(_u8(blk + 4 + j % 16, mask), j >= 16)
    return q.to(tl.float32) * _f16(blk, mask) + _f16(blk + 2, mask)


@triton.jit
def _q8_0(w_rows, k, mask):
    blk = w_rows + (k // 32) * 34
    return _i8(blk + 2 + k % 32, mask).to(tl.float32) * _f16(blk, mask)


@triton.jit
def _q8_0_split(w_rows, s_rows, k, mask):
    """Split Q8_0 (`formats.split_q8_0`): int8 codes [N, K], f16 d [N, K/32]."""
    q = tl.load(w_rows + k, mask=mask, other=0).to(tl.float32)
    return q * tl.load(s_rows + k // 32, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _k4_scale_min(sc, sub, mask):
    """Q4_K / Q5_K 6-bit scale and min of sub-block `sub` (0..7) from the 12 bytes at `sc`."""
    lo = sub < 4
    a = _u8(sc + sub % 4, mask)  # byte j (j < 4) or j - 4 (j >= 4)
    b = _u8(sc + 4 + sub % 4, mask)  # byte j + 4 or j
    c = _u8(sc + 8 + sub % 4, mask)  # byte j + 4 (j >= 4)
    scale = tl.where(lo, a & 63, (c & 15) | ((a >> 6) << 4))
    mn = tl.where(lo, b & 63, (c >> 4) | ((b >> 6) << 4))
    return scale, mn


@triton.jit
def _q4_k(w_rows, k, mask):
    blk = w_rows + (k // 256) * 144
    r = k % 256
    sub = r // 32
    scale, mn = _k4_scale_min(blk + 4, sub, mask)
    d = _f16(blk, mask) * scale.to(tl.float32)
    dm = _f16(blk + 2, mask) * mn.to(tl.float32)
    q = _nibble(_u8(blk + 16 + (sub // 2) * 32 + r % 32, mask), (sub & 1) == 1)
    return q.to(tl.float32) * d - dm


@triton.jit
def _q5_k(w_rows, k, mask):
    blk = w_rows + (k // 256) * 176
    r = k % 256
    sub = r // 32
    scale, mn = _k4_scale_min(blk + 4, sub, mask)
    d = _f16(blk, mask) * scale.to(tl.float32)
    dm = _f16(blk + 2, mask) * mn.to(tl.float32)
    lo = _nibble(_u8(blk + 48 + (sub // 2) * 32 + r % 32, mask), (sub & 1) == 1)
    hi = (_u8(blk + 16 + r % 32, mask) >> sub) & 1
    return (lo | (hi << 4)).to(tl.float32) * d - dm


@triton.jit
def _q6_k(w_rows, k, mask):
    blk = w_rows + (k // 256) * 210
    r = k % 256
    h = r // 128  # half of the super-block
    f = (r % 128) // 32  # which quarter of the half
    j = r % 32
    lo = _nibble(_u8(blk + 64 * h + 32 * (f & 1) + j, mask), f >= 2)
    hi = (_u8(blk + 128 + 32 * h + j, mask) >> (2 * f)) & 3
    q = (lo | (hi << 4)) - 32
    d = _f16(blk + 208, mask) * _i8(blk + 192 + r // 16, mask).to(tl.float32)
    return q.to(tl.float32) * d


@triton.jit
def _gguf_mxfp4(w_rows, k, mask):
    blk = w_rows + (k // 32) * 17
    j = k % 32
    e = _u8(blk, mask)
    q = _nibble(_u8(blk + 1 + j % 16, mask), j >= 16)
    scale = _f32_bits(tl.where(e < 2, 0x00200000 << e, (e - 1) << 23))
    return _kv_e2m1x2(q) * scale


@triton.jit
def _gguf_nvfp4(w_rows, k, mask):
    blk = w_rows + (k // 64) * 36
    r = k % 64
    sub = r // 16
    q = _nibble(_u8(blk + 4 + 8 * sub + r % 8, mask), (r % 16) >= 8)
    return _kv_e2m1x2(q) * _ue4m3_half(_u8(blk + sub, mask))


@triton.jit
def decode_tile(FMT: tl.constexpr, w_rows, s_rows, k, mask):
    """fp32 [BLOCK_N, BLOCK_K] values of the tile (see the module docstring)."""
    if FMT == 0:
        w = tl.load(w_rows + k, mask=mask, other=0.0).to(tl.float32)
    elif FMT == 1:
        w = _nvfp4(w_rows, s_rows, k, mask)
    elif FMT == 2:
        w = _mxfp4(w_rows, s_rows, k, mask)
    elif FMT == 3:
        w = _fp8_block(w_rows, s_rows, k, mask)
    elif FMT == 10:
        w = _q4_0(w_rows, k, mask)
    elif FMT == 11:
        w = _q4_1(w_rows, k, mask)
    elif FMT == 12:
        w = _q8_0(w_rows, k, mask)
    elif FMT == 13:
        w = _q4_k(w_rows, k, mask)
    elif FMT == 14:
        w = _q5_k(w_rows, k, mask)
    elif FMT == 15:
        w = _q6_k(w_rows, k, mask)
    elif FMT == 16:
        w = _gguf_mxfp4(w_rows, k, mask)
    elif FMT == 18:
        w = _q8_0_split(w_rows, s_rows, k, mask)
    else:
        w = _gguf_nvfp4(w_rows, k, mask)
    return w
