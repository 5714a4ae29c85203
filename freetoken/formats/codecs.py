"""Torch dequantization of every GGUF type that `gguf.quants` can dequantize, bit for bit.

Each `_<type>(b)` takes blocks uint8 `[n, type_size]` and returns fp32 `[n, block_size]`, doing
the same fp32 operations in the same order as gguf-py's numpy reference (so results match bit for
bit, NaN and inf scales included). The IQ lattice grids and sign table are gguf-py's own
(`gguf.quants.<TYPE>.grid`, `IQ2_XXS.ksigns`), decoded once and cached. Layouts are ggml's
`block_*` structs (ggml-common.h); QK_K = 256.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType
from gguf import quants as gq

T = GGMLQuantizationType
F32 = torch.float32


# -- byte helpers ---------------------------------------------------------------------------------
def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes uint8 [..., k * itemsize] viewed as `dtype` [..., k], copied first where they are
    not contiguous or not aligned to the item size (a view needs both)."""
    if not x.is_contiguous() or x.storage_offset() % dtype.itemsize:
        x = x.clone(memory_format=torch.contiguous_format)
    return x.view(dtype)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian f16 bytes [n, 2k] -> fp32 [n, k]."""
    return _as(b, torch.float16).to(F32)


def _le(b: torch.Tensor, width: int) -> torch.Tensor:
    """Little-endian unsigned integers of `width` bytes: uint8 [n, width*k] -> int64 [n, k]."""
    b = b.reshape(*b.shape[:-1], -1, width).long()
    return sum(b[..., i] << (8 * i) for i in range(width))


def _shifts(x: torch.Tensor, shifts: list[int], dim: int) -> torch.Tensor:
    """x >> each shift, the shifts stacked along a new axis at `dim`."""
    return torch.stack([x >> s for s in shifts], dim=dim)


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Per run of `group` bytes: the low nibbles, then the high nibbles. uint8 -> int64."""
    n = qs.shape[0]
    q = _shifts(qs.reshape(n, -1, group).long(), [0, 4], dim=-2) & 0x0F  # [n, g, 2, group]
    return q.reshape(n, -1)


def _bits(x: torch.Tensor, nbits: int) -> torch.Tensor:
    """Each byte's bits, least significant first: uint8 [n, k] -> int64 [n, k*nbits]."""
    return (_shifts(x.long(), list(range(nbits)), dim=-1) & 1).reshape(x.shape[0], -1)


@functools.cache
def _grid(qtype: T) -> torch.Tensor:
    cls = gq._type_traits[qtype]
    cls.init_grid()
    return torch.from_numpy(np.ascontiguousarray(cls.grid.reshape(cls.grid_shape)))


@functools.cache
def _ksigns() -> torch.Tensor:
    return torch.frombuffer(bytearray(gq.IQ2_XXS.ksigns), dtype=torch.uint8).long()


def _sign_table(idx: torch.Tensor) -> torch.Tensor:
    """ksigns[idx] expanded to +-1 per bit: int64 [...] -> fp32 [..., 8]."""
    bits = _shifts(_ksigns().to(idx.device)[idx], list(range(8)), dim=-1) & 1
    return torch.where(bits == 0, torch.tensor(1.0), torch.tensor(-1.0))


def _pm(bits: torch.Tensor) -> torch.Tensor:
    return torch.where(bits == 0, torch.tensor(1.0), torch.tensor(-1.0))


# -- fast paths: uint8 codes built with 64-bit word ops, one int8/uint8 -> fp32 pass into `out` --
# Each `_<type>_into(b, out)` fills fp32 `out` [n, block] from blocks `b` [n, type_size]. The
# fp32 operations are gguf-py's, in its order, done in place on cache-sized chunks (a broadcast
# torch.addcmul was 2x slower than mul_ then add_ here, and would fuse the two roundings).
_LO4 = 0x0F0F0F0F0F0F0F0F  # low nibble of each of 8 bytes
_B1 = 0x0101010101010101


def _words(x: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 8k] -> int64 [n, k]: 8 bytes per word, for byte-parallel masks and shifts."""
    return _as(x, torch.int64)


def _nib8(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Per run of `group` bytes (a multiple of 8): low nibbles, then high: uint8 [n, -1]."""
    n = qs.shape[0]
    x = _words(qs).reshape(n, -1, group // 8)
    return torch.stack((x & _LO4, (x >> 4) & _LO4), dim=-2).view(torch.uint8).reshape(n, -1)


def _planes(qh: torch.Tensor, width: int, count: int, at: int) -> torch.Tensor:
    """Bit planes of bytes: for each of `count` fields of `width` bits (lowest first), that field
    of every byte of `qh`, moved to bit `at`. uint8 [n, 8k] -> uint8 [n, count, 8k]."""
    x = _words(qh).unsqueeze(1)  # [n, 1, k]
    mask = ((1 << width) - 1) * _B1 << at
    fields = [(x << (at - s) if at >= s else x >> (s - at)) & mask
              for s in range(0, width * count, width)]
    return torch.cat(fields, dim=1).view(torch.uint8)


@functools.cache
def _bit_spread() -> torch.Tensor:
    """int64 [256]: byte i of entry v is bit i of v, at bit 4 (Q5_0 / Q5_1 high bits)."""
    return torch.tensor([sum(((v >> i) & 1) << (8 * i + 4) for i in range(8)) for v in range(256)],
                        dtype=torch.int64)


def _fill(out: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> None:
    """out = q (int codes, converted exactly) * d, broadcast over `out`'s shape."""
    out.copy_(q.reshape(out.shape)).mul_(d)


def _q4_0_into(b, out):
    q = _nib8(b[:, 2:], 16).view(torch.int8).sub_(8)
    _fill(out, q, _f16(b[:, :2]))


def _q4_1_into(b, out):
    out.copy_(_nib8(b[:, 4:], 16)).mul_(_f16(b[:, :2])).add_(_f16(b[:, 2:4]))


def _q5_codes(b: torch.Tensor, off: int) -> torch.Tensor:
    """Q5_0 / Q5_1 5-bit codes: 4-bit codes at `off + 4`, bit j of the u32 at `off` on the 4th
    bit of value j. uint8 [n, 32]."""
    hi = _bit_spread().to(b.device).index_select(0, b[:, off : off + 4].reshape(-1).int())
    return _nib8(b[:, off + 4 :], 16).bitwise_or_(hi.view(torch.uint8).reshape(b.shape[0], 32))


def _q5_0_into(b, out):
    _fill(out, _q5_codes(b, 2).view(torch.int8).sub_(16), _f16(b[:, :2]))


def _q5_1_into(b, out):
    out.copy_(_q5_codes(b, 4)).mul_(_f16(b[:, :2])).add_(_f16(b[:, 2:4]))


def _q8_0_into(b, out):
    _fill(out, b[:, 2:].view(torch.int8), _f16(b[:, :2]))


def _iq4_nl(b):
    kv = torch.tensor(gq.IQ4_NL.kvalues, dtype=F32)
    return _f16(b[:, :2]) * kv[_nibbles(b[:, 2:], 16)]


@functools.cache
def _kv8(qtype: T) -> torch.Tensor:
    """A 16-entry code book of small integers as int8 (looked up by int32 nibble index)."""
    return torch.tensor(gq._type_traits[qtype].kvalues, dtype=torch.int8)


def _lookup(qs: torch.Tensor, group: int, qtype: T) -> torch.Tensor:
    """Code-book values of the nibbles of `qs` (see `_nib8`): int8 [n, -1]."""
    idx = _nib8(qs, group)
    return _kv8(qtype).to(qs.device).index_select(0, idx.reshape(-1).int()).reshape(idx.shape)


def _mxfp4_into(b, out):
    e = b[:, :1].int()
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    _fill(out, _lookup(b[:, 1:], 16, T.MXFP4), bits.view(F32))


@functools.cache
def _ue4m3_half() -> torch.Tensor:
    """ggml_ue4m3_to_fp32 for all 256 bytes: exact powers of two, so Python math is exact."""
    def one(x: int) -> float:
        if x in (0, 0x7F):
            return 0.0
        e, m = (x >> 3) & 0xF, x & 7
        raw = m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        return raw * 0.5
    return torch.tensor([one(x) for x in range(256)], dtype=F32)


def _nvfp4_into(b, out):
    n = b.shape[0]
    d = _ue4m3_half().to(b.device).index_select(0, b[:, :4].reshape(-1).int()).reshape(n, 4, 1)
    _fill(out.view(n, 4, 16), _lookup(b[:, 4:], 8, T.NVFP4), d)


# -- k-quants (256-value super-blocks) -----------------------------------------------------------
def _q2_k(b):
    n = b.shape[0]
    sc, qs = b[:, :16].long(), b[:, 16:80].long()
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (sc & 0xF).to(F32)).reshape(n, 16, 1)
    ml = (dmin * (sc >> 4).to(F32)).reshape(n, 16, 1)
    q = (_shifts(qs.reshape(n, 2, 32), [0, 2, 4, 6], dim=-2) & 3).reshape(n, 16, 16)
    return (dl * q.to(F32) - ml).reshape(n, QK_K)


def _q3_k(b):
    n = b.shape[0]
    hmask, qs, sc, d = b[:, :32].long(), b[:, 32:96].long(), b[:, 96:108].long(), _f16(b[:, 108:])
    lo = _shifts(sc[:, :8], [0, 4], dim=1).reshape(n, 16) & 0x0F
    hi = _shifts(sc[:, 8:], [0, 2, 4, 6], dim=1).reshape(n, 16) & 0x03
    scales = ((lo | (hi << 4)) - 32).to(F32)
    dl = (d * scales).reshape(n, 16, 1)
    ql = (_shifts(qs.reshape(n, 2, 32), [0, 2, 4, 6], dim=-2) & 3).reshape(n, 16, 16)
    qh = (_shifts(hmask.reshape(n, 1, 32), list(range(8)), dim=-2) & 1).reshape(n, 16, 16)
    q = (ql - ((qh ^ 1) << 2)).to(F32)
    return (dl * q).reshape(n, QK_K)


def _scale_min_k4(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K 6-bit scales and mins: uint8 [n, 12] -> two int64 [n, 8]."""
    s = sc.long().reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    scale = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scale, mins


def _k4_head(b):
    n = b.shape[0]
    sc, m = _scale_min_k4(b[:, 4:16])
    d = (_f16(b[:, :2]) * sc.to(F32)).reshape(n, -1, 1)
    dm = (_f16(b[:, 2:4]) * m.to(F32)).reshape(n, -1, 1)
    return d, dm


def _q4_k_into(b, out):
    n = b.shape[0]
    d, dm = _k4_head(b)  # [n, 8, 1] each
    out.view(n, 8, 32).copy_(_nib8(b[:, 16:], 32).view(n, 8, 32)).mul_(d).sub_(dm)


def _q5_k_into(b, out):
    n = b.shape[0]
    d, dm = _k4_head(b)
    q = _nib8(b[:, 48:], 32).view(n, 8, 32).bitwise_or_(_planes(b[:, 16:48], 1, 8, 4))
    out.view(n, 8, 32).copy_(q).mul_(d).sub_(dm)


def _q6_k_into(b, out):
    n = b.shape[0]
    scales = b[:, 192:208].contiguous().view(torch.int8).to(F32)
    d = (_f16(b[:, 208:]) * scales).reshape(n, 16, 1)
    hi = _planes(b[:, 128:192].reshape(2 * n, 32), 2, 4, 4).view(n, 8, 32)  # [n, 2, 4, 32]
    q = _nib8(b[:, :128], 64).view(n, 8, 32).bitwise_or_(hi).view(torch.int8).sub_(32)
    _fill(out.view(n, 16, 16), q, d)


# -- ternary -------------------------------------------------------------------------------------
def _tq1_0(b):
    n = b.shape[0]
    qs, qh, d = b[:, :48], b[:, 48:52], _f16(b[:, 52:])
    p5 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.uint8).reshape(1, 1, 5, 1)
    # uint8 products wrap mod 256 exactly as numpy's do: the trit is then the top of byte * 3.
    q0 = (qs[:, :32].reshape(n, -1, 1, 32) * p5).reshape(n, -1)
    q1 = (qs[:, 32:].reshape(n, -1, 1, 16) * p5).reshape(n, -1)
    q2 = (qh.reshape(n, -1, 1, 4) * p5[:, :, :4]).reshape(n, -1)
    q = ((torch.cat([q0, q1, q2], dim=-1).long() * 3) >> 8) - 1
    return d * q.to(F32)


def _tq2_0(b):
    n = b.shape[0]
    q = (_shifts(b[:, :64].long().reshape(n, -1, 32), [0, 2, 4, 6], dim=-2) & 3).reshape(n, -1)
    return _f16(b[:, 64:]) * (q - 1).to(F32)


# -- i-quants ------------------------------------------------------------------------------------
def _iq2_xxs(b):
    n = b.shape[0]
    d = _f16(b[:, :2])
    qs = _le(b[:, 2:], 4).reshape(n, -1, 2)  # [n, 8, 2] u32 pairs
    db = (d * (0.5 + (qs[..., 1] >> 28).to(F32)) * 0.25).reshape(n, -1, 1, 1)
    signs = _sign_table(_shifts(qs[..., 1], [0, 7, 14, 21], dim=-1) & 0x7F)  # [n, 8, 4, 8]
    idx = b[:, 2:].reshape(n, -1, 2, 4)[:, :, 0].long()  # grid index bytes of qs[..., 0]
    grid = _grid(T.IQ2_XXS)[idx]  # [n, 8, 4, 8]
    return (db * grid * signs).reshape(n, -1)


def _nibble_scales(sc: torch.Tensor) -> torch.Tensor:
    return (_shifts(sc.long(), [0, 4], dim=-1) & 0x0F).reshape(sc.shape[0], -1)


def _iq2_db(d, sc, n):
    return (d * (0.5 + _nibble_scales(sc).to(F32)) * 0.25).reshape(n, -1, 1, 1)


def _iq2_xs(b):
    n = b.shape[0]
    qs = _le(b[:, 2:66], 2)  # [n, 32] u16
    db = _iq2_db(_f16(b[:, :2]), b[:, 66:], n)
    signs = _sign_table(qs >> 9).reshape(n, -1, 2, 8)
    grid = _grid(T.IQ2_XS)[qs & 511].reshape(n, -1, 2, 8)
    return (db * grid * signs).reshape(n, -1)


def _iq2_s(b):
    n = b.shape[0]
    qs, sg, qh = b[:, 2:34].long(), b[:, 34:66], b[:, 66:74].long()
    db = _iq2_db(_f16(b[:, :2]), b[:, 74:], n)
    signs = _pm(_bits(sg, 8)).reshape(n, -1, 2, 8)
    idx = qs | ((_shifts(qh, [0, 2, 4, 6], dim=-1) & 3) << 8).reshape(n, -1)
    grid = _grid(T.IQ2_S)[idx].reshape(n, -1, 2, 8)
    return (db * grid * signs).reshape(n, -1)


def _iq3_xxs(b):
    n = b.shape[0]
    d, qs, sc = _f16(b[:, :2]), b[:, 2:66].long(), _le(b[:, 66:], 4)  # sc [n, 8]
    db = (d * (0.5 + (sc >> 28).to(F32)) * 0.5).reshape(n, -1, 1, 1)
    signs = _sign_table(_shifts(sc, [0, 7, 14, 21], dim=-1) & 0x7F)  # [n, 8, 4, 8]
    grid = _grid(T.IQ3_XXS)[qs].reshape(n, -1, 4, 8)
    return (db * grid * signs).reshape(n, -1)


def _iq3_s(b):
    n = b.shape[0]
    d, qs, qh, sg = _f16(b[:, :2]), b[:, 2:66].long(), b[:, 66:74], b[:, 74:106]
    db = (d * (1 + 2 * _nibble_scales(b[:, 106:])).to(F32)).reshape(n, -1, 1, 1)
    signs = _pm(_bits(sg, 8)).reshape(n, -1, 4, 8)
    idx = qs | (_bits(qh, 8) << 8)
    grid = _grid(T.IQ3_S)[idx].reshape(n, -1, 4, 8)
    return (db * grid * signs).reshape(n, -1)


def _iq1_s(b):
    n = b.shape[0]
    d, qs, qh = _f16(b[:, :2]), b[:, 2:34].long(), _le(b[:, 34:], 2)  # qh [n, 8]
    dl = (d * (2 * ((qh >> 12) & 7) + 1).to(F32)).reshape(n, -1, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, 0.125, -0.125).to(F32).reshape(n, -1, 1, 1)
    idx = qs | ((_shifts(qh, [0, 3, 6, 9], dim=-1) & 7) << 8).reshape(n, -1)
    grid = _grid(T.IQ1_S)[idx].reshape(n, -1, 4, 8)
    return (dl * (grid + delta)).reshape(n, -1)


def _iq1_m(b):
    n = b.shape[0]
    qs, qh, sc = b[:, :32].long(), b[:, 32:48].long(), _le(b[:, 48:], 2)  # sc [n, 4] u16
    # The f16 super-block scale is spread over the top nibbles of the four u16 scale words.
    dbits = sum(((sc[:, i] & 0xF000) >> s) for i, s in enumerate([12, 8, 4, 0]))
    d = dbits.to(torch.int16).view(torch.float16).to(F32).reshape(n, 1)
    s3 = (_shifts(sc, [0, 3, 6, 9], dim=-1) & 7).reshape(n, -1)
    dl = (d * (2 * s3 + 1).to(F32)).reshape(n, -1, 2, 1, 1)
    qh2 = _shifts(qh, [0, 4], dim=-1)  # [n, 16, 2]
    idx = qs | ((qh2 & 7) << 8).reshape(n, -1)
    delta = torch.where((qh2 & 8) == 0, 0.125, -0.125).to(F32).reshape(n, -1, 2, 2, 1)
    grid = _grid(T.IQ1_M)[idx].reshape(n, -1, 2, 2, 8)
    return (dl * (grid + delta)).reshape(n, -1)


def _iq4_xs(b):
    n = b.shape[0]
    d, sh, sl = _f16(b[:, :2]), _le(b[:, 2:4], 2), b[:, 4:8].long()
    lo = (_shifts(sl, [0, 4], dim=-1) & 0x0F).reshape(n, -1)
    hi = (_shifts(sh, [2 * i for i in range(8)], dim=-1) & 3).reshape(n, -1)
    dl = (d * ((lo | (hi << 4)) - 32).to(F32)).reshape(n, -1, 1)
    kv = torch.tensor(gq.IQ4_NL.kvalues, dtype=F32)
    q = kv[_nibbles(b[:, 8:], 16)].reshape(n, -1, 32)
    return (dl * q).reshape(n, -1)


def _float_into(dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """F32 / F16 / BF16: torch's conversions widen exactly (bf16 is the top half of an fp32)."""
    def fill(b: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(_as(b, dtype))
    return fill


_INTO: dict[int, Callable[[torch.Tensor, torch.Tensor], None]] = {
    T.F32: _float_into(F32), T.F16: _float_into(torch.float16),
    T.BF16: _float_into(torch.bfloat16),
    T.Q4_0: _q4_0_into, T.Q4_1: _q4_1_into, T.Q5_0: _q5_0_into, T.Q5_1: _q5_1_into,
    T.Q8_0: _q8_0_into, T.Q4_K: _q4_k_into, T.Q5_K: _q5_k_into, T.Q6_K: _q6_k_into,
    T.MXFP4: _mxfp4_into, T.NVFP4: _nvfp4_into,
}
# The rest build their result and have it copied into `out`.
_CODECS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.TQ1_0: _tq1_0, T.TQ2_0: _tq2_0,
    T.IQ2_XXS: _iq2_xxs, T.IQ2_XS: _iq2_xs, T.IQ2_S: _iq2_s, T.IQ3_XXS: _iq3_xxs,
    T.IQ3_S: _iq3_s, T.IQ1_S: _iq1_s, T.IQ1_M: _iq1_m, T.IQ4_NL: _iq4_nl, T.IQ4_XS: _iq4_xs,
}
SUPPORTED_TYPES = tuple(GGMLQuantizationType(t) for t in [*_INTO, *_CODECS])

# Values per call: about 1 MiB of uint8 codes and 4 MiB of fp32 output per step, so the codes
# and the output stay in cache between the few passes over them (and the slow paths' int64
# temporaries stay bounded); fewer, larger steps cost Python overhead, smaller ones cache misses.
_CHUNK_VALUES = 1 << 20


def _into(qtype: GGMLQuantizationType) -> Callable[[torch.Tensor, torch.Tensor], None] | None:
    fill = _INTO.get(qtype)
    if fill is None and qtype in _CODECS:
        fn = _CODECS[qtype]

        def fill(b: torch.Tensor, out: torch.Tensor) -> None:
            out.copy_(fn(b))
    return fill


def dequantize_gguf(raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """GGUF blocks (uint8, any shape, `prod(shape)` values' worth of bytes) -> fp32 `shape`."""
    qtype = GGMLQuantizationType(ggml_type)
    fill = _into(qtype)
    if fill is None:
        raise NotImplementedError(f"no dequantization for GGUF type {qtype.name}")
    block, type_size = GGML_QUANT_SIZES[qtype]
    numel = math.prod(shape)
    if raw.dtype != torch.uint8 or raw.numel() * block != numel * type_size or numel % block:
        raise ValueError(f"{qtype.name}: {raw.numel()} bytes ({raw.dtype}) do not hold shape "
                         f"{tuple(shape)} (blocks of {block} values in {type_size} bytes)")
    blocks = raw.reshape(-1, type_size)
    out = torch.empty(len(blocks), block, dtype=F32, device=raw.device)
    step = max(1, _CHUNK_VALUES // block)
    # Constants the codecs build (torch.tensor(...)) land on the blocks' device; cached tables
    # are moved where they are used. The GPU reference path computes the same numbers.
    with torch.device(raw.device):
        for s in range(0, len(blocks), step):
            fill(blocks[s : s + step], out[s : s + step])
    return out.reshape(shape)
