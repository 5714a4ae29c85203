"""Small-batch fused MoE in tensor-core dots (2 to 128 tokens): Q4_K experts as int8, Q4_K
and NVFP4 ones decoded to fp16.

The per-route int8 GEMV (moe.py, BM = 1, `gemv_i8.py`'s dp4a) reads an expert's rows once per
route: at 16 tokens (128 routes over some 82 of 128 experts, 30B shape) it is bound by routes,
not by the distinct experts' bytes. The sorted path (BM = 16, `_align`) reads them once per
block of routes but decodes Q4_K to floats in registers (`fast_tile`), bound by the ALU. Here
the routes are grouped by slot as the sorted path groups them (`moe._align`, BM routes a
block), and a program multiplies its block's activation codes by the expert's 4-bit codes
kept as int8, on the tensor cores: `tl.dot(int8 [BM, 32], int8 [32, BN]) -> int32` per
32-value sub-block; the Q4_K scales, mins and the activation's block scales are applied to
the integer sums in fp32.

Activations are quantized per 32 values as the int8 GEMV quantizes them (`gemv_i8._quant`; x's
codes from the RMSNorm where attached, else `_quant_rows_kernel`), the GLU output by the
gate/up kernel (`gemv_i8.quant_store_rows`) for the down kernel. The integer sums are those
of `gemv_i8._q4_k_dot`; its fp32 epilogue is followed operation by operation (the pair of
sub-blocks 2g, 2g + 1 added in g order, super-blocks summed per chunk of CH super-blocks,
chunks added in order, no fused multiply-add), with CH the per-route path's chunk, so the
result is the per-route int8 path's bits where both reductions run in index order (Triton's
interpreter; on an H100 the per-route kernel's `tl.sum` associated its terms otherwise, so
there a's codes differed: each output differs by fp32 association only, a few eps of the sum
of its terms' magnitudes, and both stay within the float64 test's int8 bound).
Each token's routes are summed by `moe._sum_routes_kernel` in route order (deterministic).

Measured slower than the per-route GEMV, so it runs on request only (FREETOKEN_GPU_MOE_MMA):
on an H100 (bench_gpu_kernels.py --moe-mma, 30B shape, weights from HBM, 2026-12-07), us a
layer at 2 / 4 / 8 / 16 tokens, per-route 25.4 / 40.2 / 65.4 / 105.4, these kernels at their
best tiles (64 rows, 4 warps) 69.8 / 94.7 / 147.0 / 214.7 (32 rows 4 warps, 64 x 8 and 128 x 8
slower still); end to end (ab_env.py, 30B Q4_K fused, batch 16) 2,213.9 -> 1,263.6 tok/s.
The "f16" form (FREETOKEN_GPU_MOE_MMA_FORM=f16; `_f16_*` kernels) takes the ALU out of the
way instead: the codes are decoded to fp16 in registers by inline PTX (`_NIBBLES_F16`: a byte
permute puts each nibble under fp16's exponent of 1024, 1024 is taken away, q s - m in one
fused multiply-add; two values a register) and multiplied with x in fp16 on the tensor cores,
the expert's rows as M and the block's routes as N (wgmma's M is 64 rows), the Q4_K scales
folded into the values, so no epilogue per sub-block. Codes are loaded as 16-bit words, which
the dot operand's layout holds in pairs: even and odd bytes become separate K = 16 tiles, x's
columns taken in the same order. In its sm_90 SASS (compiled here, tiles 128 rows x 4 warps)
a weight costs about 3.8 instructions, 2 of them the decode, the rest the scales (computed by
each of the 4 threads that hold a row), the wgmma fences and the loads. Its values: each
weight rounded once to fp16 from q s16 - m16 (s16, m16 the sub-block's scale and min rounded
to fp16), x exact (bf16 values in fp16's range are fp16 values; beyond it they saturate), the
GLU output stored in fp16, fp32 accumulation. It takes NVFP4 banks too (`_E2M1_F16`: the
E2M1 magnitudes looked up as fp16 high bytes by a byte permute, the signs from a second one,
times the E4M3 block scale converted by `cvt`): E2M1 times E4M3 is an fp16 value, so there the
weights are exactly the codec's. Timed on an H100 (bench_gpu_kernels.py --moe-mma, 30B shape,
weights from HBM, 2026-12-07), us a layer at 2 / 4 / 8 / 16 tokens at its best tiles (64 rows,
4 warps): Q4_K 63.4 / 90.3 / 117.7 / 170.8 against the per-route GEMVs' 25.3 / 40.2 / 65.3 /
106.1 (the int8 form 77.8 / 116.7 / 183.0 / 275.1), NVFP4 116.5 / 166.6 / 296.2 / 426.2
against 22.3 / 39.8 / 61.0 / 100.7: slower still, so it stays on request. Its results once
came back in fp16 whatever x's dtype (the bf16 x converted for the kernels took the result's
dtype with it): a token of the 24-token test case whose sums passed fp16's range (up to
95,366) read inf on the GPU, where the test runs at the 30B's hidden size; the result is now
in x's dtype and the test checks it.
Where the int8 form's time went is not known yet. Suspects:
- each program ran gate's whole K and then up's in rolled loops: 16 dependent rounds of loads
  (hidden 2048) against the per-route GEMV's two unrolled chunks; gate and up now share one
  loop with a chunk's super-blocks unrolled (`_rows_dot`), measured slower again (32 rows,
  H100: 77.8 / 116.7 / 183.0 / 275.1 us), so that was not it;
- each 32-value sub-block's tl.dot is one MMA k-step followed by an fp32 epilogue over the
  whole [16, BN] tile (16 padded rows for some 1.6 routes an expert at 16 tokens);
- the codes' layout conversion to dot operands;
- at 2-4 tokens, the launches (the grouping's memset and three kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken import env
from freetoken.kernels.triton import pdl
from freetoken.kernels.triton.formats import F_NVFP4, format_id
from freetoken.kernels.triton.gemv_i8 import asm, quant_store, quant_store_rows, use_i8, xq_len
from freetoken.kernels.triton.linear import weight_args, xq_rows
from freetoken.kernels.triton.moe import (
    _ACT,
    _align,
    _block_routes,
    _down_i8_tiles,
    _i8_tiles,
    _sum_routes_kernel,
)
from freetoken.kernels.triton.moe_grouped import glu
from freetoken.kernels.triton.pdl import wait
from freetoken.kernels.triton.quant import _e2m1, _e4m3, _f16_bits
from freetoken.moe.banks import ExpertBank

Q4_K = 13  # format id (formats.py)
BM = 16  # routes a block (`moe._align`); tl.dot's M
# (BN, num_warps, unroll) of both kernels by default. Measured with gate and up in two rolled
# loops one after the other (bench_gpu_kernels.py --moe-mma, H100, module doc): 64 rows and 4
# warps the best of (32, 4), (64, 4), (64, 8), (128, 8). Since, gate and up share one loop and a
# chunk's super-blocks are unrolled (measured slower: module doc): 32 rows keep a chunk's
# codes of both (4 super-blocks, 2 x 32 rows x 144 bytes) in registers.
MMA_TILES = (32, 4, True)
# (BN, num_warps) of the fp16 form's kernels by default: the fastest of (64, 4), (128, 4),
# (128, 8) at 2-16 tokens on an H100 for both formats (module doc)
F16_TILES = (64, 4)
FORMS = ("i8", "f16")
F16_FORMATS = (F_NVFP4, Q4_K)  # weight formats the fp16 form decodes
MMA_FORM = "i8"  # the form FREETOKEN_GPU_MOE_MMA runs where FREETOKEN_GPU_MOE_MMA_FORM is unset


def supported_mma(bank: ExpertBank, dtype: torch.dtype, form: str | None = None) -> bool:
    """Whether the form takes this bank and activation (None: the form `fused_moe_mma` would
    run): "i8" both banks Q4_K and an x the int8 dots take (`gemv_i8.use_i8`: 16-bit, the
    switch on); "f16" both banks Q4_K or both NVFP4 (ModelOpt layout) and a 16-bit x. Hidden
    and expert width in whole 256-value blocks either way."""
    form = form or env.gpu_moe_mma_form() or MMA_FORM
    f13, f2 = format_id(bank.w13), format_id(bank.w2)
    if form == "f16":
        ok = f13 == f2 and f13 in F16_FORMATS and dtype in (torch.bfloat16, torch.float16)
    else:
        ok = f13 == Q4_K and f2 == Q4_K and use_i8(Q4_K, dtype)
    return ok and bank.hidden % 256 == 0 and bank.intermediate % 256 == 0


def _e4m3_ptx(device: torch.device) -> bool:
    """Whether the NVFP4 decode may use its PTX: not interpreting, and PTX's e4m3x2 to f16x2
    conversion there (sm_89 and later; else `_e2m1_f16`'s fp32 path, the same values)."""
    return (asm() and torch.version.hip is None
            and torch.cuda.get_device_capability(device) >= (8, 9))


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, stride_xm, stride_qm, K: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Program (t, c): values c BLOCK .. (c + 1) BLOCK of x's row t quantized into q's row t
    (`gemv_i8.quant_store`, the int8 GEMV's quantization bit for bit)."""
    t = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK
    cols = n0 + tl.arange(0, BLOCK)
    xf = tl.load(x_ptr + t * stride_xm + cols, mask=cols < K, other=0.0).to(tl.float32)
    quant_store(tl.reshape(xf, (1, BLOCK)), q_ptr + t * stride_qm, n0, tl.arange(0, 1) < 1, K)


@triton.jit
def _byte(v, i: tl.constexpr):
    return ((v >> (8 * i)) & 255).to(tl.float32)


@triton.jit
def _super_block(x_rows, w_rows, n_ok, sb, K: tl.constexpr):
    """fp32 [BM, BN]: super-block sb of the rows w_rows ([BN] byte pointers) against the
    activation rows x_rows ([BM] pointers to `quant_store` rows of K values), with the
    arithmetic of `gemv_i8._q4_k_dot` (its sums and mins per sub-block pair, in g order)."""
    BN: tl.constexpr = w_rows.shape[0]
    blk = w_rows + sb * 144
    head = tl.load(blk.to(tl.pointer_type(tl.int32))[:, None] + tl.arange(0, 4)[None, :],
                   mask=n_ok[:, None], other=0)  # [BN, 4]: d | dmin << 16, scale bytes
    h02, h13 = tl.split(tl.reshape(head, (BN, 2, 2)))
    w0, w2 = tl.split(h02)
    w1, w3 = tl.split(h13)
    sc4 = w1 & 0x3F3F3F3F  # sub-blocks 0-3's scales, a byte each
    sc8 = (w3 & 0x0F0F0F0F) | ((w1 >> 2) & 0x30303030)  # 4-7
    mn4 = w2 & 0x3F3F3F3F
    mn8 = ((w3 >> 4) & 0x0F0F0F0F) | ((w2 >> 2) & 0x30303030)
    d = _f16_bits(w0 & 0xFFFF)
    dmin = _f16_bits((w0 >> 16) & 0xFFFF)
    x8 = x_rows.to(tl.pointer_type(tl.int8))  # byte k of a row: code k
    j = tl.arange(0, 32)
    sums = tl.zeros((x_rows.shape[0], BN), dtype=tl.float32)
    mins = tl.zeros((x_rows.shape[0], BN), dtype=tl.float32)
    for g in tl.static_range(4):
        q = tl.load(blk[:, None] + 16 + 32 * g + j[None, :], mask=n_ok[:, None], other=0)
        lo = (q & 15).to(tl.int8)  # [BN, 32]: sub-block 2g
        hi = (q >> 4).to(tl.int8)  # 2g + 1
        k_lo = sb * 256 + 64 * g
        x_lo = tl.load(x8[:, None] + k_lo + j[None, :])
        x_hi = tl.load(x8[:, None] + k_lo + 32 + j[None, :])
        i_lo = tl.dot(x_lo, tl.trans(lo), out_dtype=tl.int32).to(tl.float32)
        i_hi = tl.dot(x_hi, tl.trans(hi), out_dtype=tl.int32).to(tl.float32)
        b = sb * 8 + 2 * g  # the activation's block of sub-block 2g
        xd_lo = tl.load(x_rows + K // 2 + b).to(tl.float32, bitcast=True)[:, None]
        xd_hi = tl.load(x_rows + K // 2 + b + 1).to(tl.float32, bitcast=True)[:, None]
        xs_lo = tl.load(x_rows + K // 2 + K // 32 + b).to(tl.float32)[:, None]
        xs_hi = tl.load(x_rows + K // 2 + K // 32 + b + 1).to(tl.float32)[:, None]
        sc = sc4 if g < 2 else sc8
        mn = mn4 if g < 2 else mn8
        at = (g % 2) * 2  # byte of sub-block 2g in its word (a constexpr: g is)
        sums += _byte(sc, at)[None, :] * (i_lo * xd_lo) \
            + _byte(sc, at + 1)[None, :] * (i_hi * xd_hi)
        mins += _byte(mn, at)[None, :] * (xs_lo * xd_lo) \
            + _byte(mn, at + 1)[None, :] * (xs_hi * xd_hi)
    return d[None, :] * sums - dmin[None, :] * mins


@triton.jit
def _rows_dot(x_rows, wa, wb, n_ok, K: tl.constexpr, CH: tl.constexpr, TWO: tl.constexpr,
              UNROLL: tl.constexpr):
    """fp32 [BM, BN] twice: the dots over K of the rows wa and (TWO) wb (else zeros), super-
    blocks summed per chunk of CH (the per-route GEMV's chunk of 256 CH values), the chunks
    added in order. Both row sets go through one loop, so their loads are in flight together;
    UNROLL unrolls a chunk's super-blocks (their loads issued at once), else a rolled loop (a
    smaller program); the order of the additions is the same either way."""
    acc_a = tl.zeros((x_rows.shape[0], wa.shape[0]), dtype=tl.float32)
    acc_b = tl.zeros((x_rows.shape[0], wa.shape[0]), dtype=tl.float32)
    for c in tl.range(K // (256 * CH)):
        pa = tl.zeros((x_rows.shape[0], wa.shape[0]), dtype=tl.float32)
        pb = tl.zeros((x_rows.shape[0], wa.shape[0]), dtype=tl.float32)
        if UNROLL:
            for s in tl.static_range(CH):
                pa, pb = _step(x_rows, wa, wb, n_ok, c * CH + s, K, TWO, pa, pb)
        else:
            for s in tl.range(CH):
                pa, pb = _step(x_rows, wa, wb, n_ok, c * CH + s, K, TWO, pa, pb)
        acc_a += pa
        acc_b += pb
    return acc_a, acc_b


@triton.jit
def _step(x_rows, wa, wb, n_ok, sb, K: tl.constexpr, TWO: tl.constexpr, pa, pb):
    pa += _super_block(x_rows, wa, n_ok, sb, K)
    if TWO:
        pb += _super_block(x_rows, wb, n_ok, sb, K)
    return pa, pb


@triton.jit
def _block(route_ids_ptr, block_slot_ptr, R, BM: tl.constexpr, BN: tl.constexpr, N):
    """Program (block, row block): its slot and routes (`moe._block_routes`; padding routes
    read as the block's first route, always a route of this slot, whose rows this layer
    writes: the activation loads are not masked, their results are), whether each is a
    route, its BN rows of N and whether each is a row."""
    slot, routes, r_ok = _block_routes(route_ids_ptr, block_slot_ptr, block_slot_ptr, R, BM,
                                       False)
    first = tl.load(route_ids_ptr + tl.program_id(0) * BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    return slot, tl.where(r_ok, routes, first), r_ok, rn, rn < N


@triton.jit
def _mma_gate_up_kernel(xq_ptr, w_ptr, bank_s_ptr, route_ids_ptr, block_slot_ptr, aq_ptr, R,
                        stride_xm, stride_ws, stride_wn, stride_am, stride_bs,
                        K: tl.constexpr, INTER: tl.constexpr, TOPK: tl.constexpr,
                        ACT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        CH: tl.constexpr, UNROLL: tl.constexpr = True,
                        PDL: tl.constexpr = False):
    """Program (block, row block): a = glu(g s[slot, 0], u s[slot, 1]) of the block's routes
    for the gate rows rn and up rows INTER + rn, stored quantized into their rows of aq
    (`quant_store_rows`; BN a multiple of 32). xq: x's rows quantized (`quant_store`)."""
    wait(PDL)  # pdl.py: the kernel before has completed
    slot, routes, r_ok, rn, n_ok = _block(route_ids_ptr, block_slot_ptr, R, BM, BN, INTER)
    if slot < 0:
        return
    w_slot = w_ptr + slot.to(tl.int64) * stride_ws
    wg = w_slot + rn.to(tl.int64) * stride_wn
    wu = w_slot + (rn + INTER).to(tl.int64) * stride_wn
    x_rows = xq_ptr + (routes // TOPK).to(tl.int64) * stride_xm
    acc_g, acc_u = _rows_dot(x_rows, wg, wu, n_ok, K, CH, True, UNROLL)
    s = bank_s_ptr + slot * stride_bs
    a = glu(acc_g * tl.load(s), acc_u * tl.load(s + 1), ACT)
    quant_store_rows(a, aq_ptr + routes.to(tl.int64) * stride_am, tl.program_id(1) * BN, r_ok,
                     INTER)


@triton.jit
def _mma_down_kernel(aq_ptr, w_ptr, bank_s_ptr, route_ids_ptr, block_slot_ptr, route_w_ptr,
                     y_ptr, R, stride_am, stride_ws, stride_wn, stride_ym, stride_bs,
                     K: tl.constexpr, HIDDEN: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, CH: tl.constexpr, UNROLL: tl.constexpr = True,
                     PDL: tl.constexpr = False):
    """Program (block, row block): y[r, rn] = (a_r Wd^T) s[slot, 2] route_weight[r] for the
    block's routes r, fp32, a read as `_mma_gate_up_kernel` quantized it."""
    wait(PDL)  # pdl.py: the kernel before has completed
    slot, routes, r_ok, rn, n_ok = _block(route_ids_ptr, block_slot_ptr, R, BM, BN, HIDDEN)
    if slot < 0:
        return
    w_rows = w_ptr + slot.to(tl.int64) * stride_ws + rn.to(tl.int64) * stride_wn
    acc, _ = _rows_dot(aq_ptr + routes.to(tl.int64) * stride_am, w_rows, w_rows, n_ok, K, CH,
                       False, UNROLL)
    r_w = tl.load(route_w_ptr + routes, mask=r_ok, other=0.0).to(tl.float32)
    y = acc * tl.load(bank_s_ptr + slot * stride_bs + 2) * r_w[:, None]
    out = y_ptr + routes[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(out, y, mask=r_ok[:, None] & n_ok[None, :])


# -- fp16 form: the codes decoded to fp16 in registers, fp16 tensor-core dots ---------------------
# Two 16-bit words of Q4_K codes (bytes b0 b1 | b2 b3) -> their 8 values in fp16, 2 a register:
# (lo b0, lo b2), (lo b1, lo b3), (hi b0, hi b2), (hi b1, hi b3) (lo: the low nibbles, sub-block
# 2g; hi: the high ones, 2g + 1). Each nibble q is put under fp16's exponent of 1024 by a byte
# permute (0x640q is 1024 + q exactly), 1024 taken away (exact), then q s - m in one fused
# multiply-add (rounded once): about two instructions a value.
_NIBBLES_F16 = tl.constexpr("""{
.reg .b32 t, a, b, k;
mov.b32 k, 0x64006400;
and.b32 t, $4, 0x0F0F0F0F;
prmt.b32 a, t, 0x64646464, 0x4240;
prmt.b32 b, t, 0x64646464, 0x4341;
sub.f16x2 a, a, k;
sub.f16x2 b, b, k;
fma.rn.f16x2 $0, a, $5, $6;
fma.rn.f16x2 $1, b, $5, $6;
shr.b32 t, $4, 4;
and.b32 t, t, 0x0F0F0F0F;
prmt.b32 a, t, 0x64646464, 0x4240;
prmt.b32 b, t, 0x64646464, 0x4341;
sub.f16x2 a, a, k;
sub.f16x2 b, b, k;
fma.rn.f16x2 $2, a, $7, $8;
fma.rn.f16x2 $3, b, $7, $8;
}""")


@triton.jit
def _nib(v, s, nm):
    """fp16 of v s + nm (v a nibble, s and nm fp16) rounded once: v s is exact in fp32 (4 by
    11 bits) and so, but for far-apart exponents, is v s + nm."""
    return (v.to(tl.float32) * s.to(tl.float32) + nm.to(tl.float32)).to(tl.float16)


@triton.jit
def _nibbles_f16(q, s_lo, nm_lo, s_hi, nm_hi, ASM: tl.constexpr):
    """q int16 [BN, 16] (code bytes 2i, 2i + 1), s and nm fp16 (nm = -m): fp16 [BN, 16] (lo
    of the even bytes, lo of the odd, hi of the even, hi of the odd), lo = (b & 15) s_lo +
    nm_lo, hi = (b >> 4) s_hi + nm_hi, each rounded once from its exact value. With ASM the
    PTX above; without (Triton's interpreter) the same values through fp32 (`_nib`)."""
    if ASM:
        le, lo, he, ho = tl.inline_asm_elementwise(
            _NIBBLES_F16, "=r,=r,=r,=r,r,r,r,r,r", [q, s_lo, nm_lo, s_hi, nm_hi],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2)
    else:
        w = q.to(tl.int32) & 0xFFFF
        le = _nib(w & 15, s_lo, nm_lo)
        lo = _nib((w >> 8) & 15, s_lo, nm_lo)
        he = _nib((w >> 4) & 15, s_hi, nm_hi)
        ho = _nib(w >> 12, s_hi, nm_hi)
    return le, lo, he, ho


# Two 16-bit words of NVFP4 codes (bytes b0 b1 | b2 b3; byte i: value 2i in its low nibble,
# 2i + 1 in its high one) and their two block scales (E4M3 bytes) -> the 8 values in fp16, 2 a
# register: (P, Q, R, T) = the values of nibbles 0, 1, 2, 3 of each word, word 0's in the low
# half. A byte permute looks each magnitude up as fp16's high byte (E2M1 0, 0.5, 1, 1.5, 2, 3,
# 4, 6: 0x00, 0x38, 0x3C, 0x3E, 0x40, 0x42, 0x44, 0x46, low byte 0); the same permute on the
# raw codes gives 0 for negative ones (its sign mode copies the looked-up byte's top bit), so
# their difference marks the negative nonzero values, whose top bit is set; times the scale,
# converted by cvt (E4M3 to fp16 is exact). E2M1 times E4M3 fits fp16 exactly (2 and 4
# mantissa bits, 2^-10 .. 2688): these are the codec's values, no rounding. The scales come as
# 16-bit words (a 32-bit register holds two), their low bytes permuted into one 16-bit pair.
_E2M1_F16 = tl.constexpr("""{
.reg .b32 l0, l1, t, a, b, h0, h1, s;
.reg .b16 s0, s1;
mov.b32 l0, 0x3E3C3800;
mov.b32 l1, 0x46444240;
prmt.b32 s, $5, 0, 0x20;
mov.b32 {s0, s1}, s;
cvt.rn.f16x2.e4m3x2 s, s0;
and.b32 t, $4, 0x7777;
prmt.b32 b, l0, l1, t;
prmt.b32 a, l0, l1, $4;
xor.b32 a, a, b;
add.u32 a, a, 0x7F7F7F7F;
and.b32 a, a, 0x80808080;
or.b32 h0, a, b;
shr.b32 t, $4, 16;
and.b32 a, t, 0x7777;
prmt.b32 b, l0, l1, a;
prmt.b32 a, l0, l1, t;
xor.b32 a, a, b;
add.u32 a, a, 0x7F7F7F7F;
and.b32 a, a, 0x80808080;
or.b32 h1, a, b;
prmt.b32 a, h0, h1, 0x4400;
and.b32 a, a, 0xFF00FF00;
mul.rn.f16x2 $0, a, s;
prmt.b32 a, h0, h1, 0x5511;
and.b32 a, a, 0xFF00FF00;
mul.rn.f16x2 $1, a, s;
prmt.b32 a, h0, h1, 0x6622;
and.b32 a, a, 0xFF00FF00;
mul.rn.f16x2 $2, a, s;
prmt.b32 a, h0, h1, 0x7733;
and.b32 a, a, 0xFF00FF00;
mul.rn.f16x2 $3, a, s;
}""")


@triton.jit
def _e2m1_f16(q, sc, ASM: tl.constexpr):
    """q int16 [BN, 16] (NVFP4 code bytes 2m, 2m + 1: values 4m .. 4m + 3), sc uint8 (each
    word's E4M3 block scale, widened to 16 bits for the PTX): fp16 [BN, 16] x 4, the values
    4m, 4m + 1, 4m + 2, 4m + 3 (exact: see above). With ASM the PTX above; without (Triton's
    interpreter, GPUs before sm_89) `quant._e2m1` and `_e4m3` in fp32, the same values."""
    if ASM:
        p, q1, r, t = tl.inline_asm_elementwise(
            _E2M1_F16, "=r,=r,=r,=r,r,r", [q, sc.to(tl.int16)],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2)
    else:
        w = q.to(tl.int32) & 0xFFFF
        s = _e4m3(sc.to(tl.int32))
        p = (_e2m1(w & 15) * s).to(tl.float16)
        q1 = (_e2m1((w >> 4) & 15) * s).to(tl.float16)
        r = (_e2m1((w >> 8) & 15) * s).to(tl.float16)
        t = (_e2m1(w >> 12) * s).to(tl.float16)
    return p, q1, r, t


@triton.jit
def _f16_act(p):
    """fp16 of the 16-bit activations at p (saturated at fp16's largest finite value: bf16
    values in range convert exactly, an fp16 x as it is). Unmasked: a block's padding routes
    read its first route's row (`_block`), and a transposed product's column depends on its
    own route's column only, so theirs are computed and not stored."""
    if p.dtype.element_ty == tl.float16:
        v = tl.load(p)
    else:
        v = tl.load(p).to(tl.float32)
        v = tl.minimum(tl.maximum(v, -65504.0), 65504.0).to(tl.float16)
    return v


@triton.jit
def _scale_pair(sc, mn, at: tl.constexpr, d, dmin):
    """fp16 [BN, 1] (s, -m) of the sub-block whose scale and min are byte `at` of sc and mn:
    s = d sc and m = dmin mn in fp32 (the codec's products), each rounded to fp16."""
    s = (d * _byte(sc, at)).to(tl.float16)[:, None]
    nm = (-(dmin * _byte(mn, at))).to(tl.float16)[:, None]
    return s, nm


@triton.jit
def _f16_codes(FMT: tl.constexpr, w_rows, s_rows, n_ok, sb, ASM: tl.constexpr):
    """The rows' values sb 256 .. sb 256 + 255 in fp16: 16 tiles [BN, 16] in the order of
    `_f16_acts` (Q4_K: `_q4_k_codes`; NVFP4: `_nvfp4_codes`)."""
    if FMT == 1:
        r = _nvfp4_codes(w_rows, s_rows, n_ok, sb, ASM)
    else:
        r = _q4_k_codes(w_rows, n_ok, sb, ASM)
    return r


@triton.jit
def _nvfp4_codes(w_rows, s_rows, n_ok, sb, ASM: tl.constexpr):
    """NVFP4 rows (codes w_rows, E4M3 block scales s_rows): for each 64 values t the values
    at k = 64t + 4m, + 1, + 2, + 3 (m < 16; `_e2m1_f16`)."""
    words = (w_rows + sb * 128).to(tl.pointer_type(tl.int16))[:, None] \
        + tl.arange(0, 16)[None, :]
    scales = s_rows[:, None] + sb * 16 + tl.arange(0, 16)[None, :] // 4
    m = n_ok[:, None]
    a0, a1, a2, a3 = _e2m1_f16(tl.load(words, mask=m, other=0),
                               tl.load(scales, mask=m, other=0), ASM)
    b0, b1, b2, b3 = _e2m1_f16(tl.load(words + 16, mask=m, other=0),
                               tl.load(scales + 4, mask=m, other=0), ASM)
    c0, c1, c2, c3 = _e2m1_f16(tl.load(words + 32, mask=m, other=0),
                               tl.load(scales + 8, mask=m, other=0), ASM)
    e0, e1, e2, e3 = _e2m1_f16(tl.load(words + 48, mask=m, other=0),
                               tl.load(scales + 12, mask=m, other=0), ASM)
    return a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, e0, e1, e2, e3


@triton.jit
def _q4_k_codes(w_rows, n_ok, sb, ASM: tl.constexpr):
    """Q4_K rows' super-block sb (`_nibbles_f16`): for each pair g of sub-blocks (2g, 2g + 1)
    the values at k = 64g + 2i, 64g + 2i + 1, 64g + 32 + 2i, 64g + 32 + 2i + 1 (i < 16)."""
    BN: tl.constexpr = w_rows.shape[0]
    blk = w_rows + sb * 144
    head = tl.load(blk.to(tl.pointer_type(tl.int32))[:, None] + tl.arange(0, 4)[None, :],
                   mask=n_ok[:, None], other=0)  # [BN, 4]: d | dmin << 16, scale bytes
    h02, h13 = tl.split(tl.reshape(head, (BN, 2, 2)))
    w0, w2 = tl.split(h02)
    w1, w3 = tl.split(h13)
    sc4 = w1 & 0x3F3F3F3F  # sub-blocks 0-3's scales, a byte each
    sc8 = (w3 & 0x0F0F0F0F) | ((w1 >> 2) & 0x30303030)  # 4-7
    mn4 = w2 & 0x3F3F3F3F
    mn8 = ((w3 >> 4) & 0x0F0F0F0F) | ((w2 >> 2) & 0x30303030)
    d = _f16_bits(w0 & 0xFFFF)
    dmin = _f16_bits((w0 >> 16) & 0xFFFF)
    words = blk.to(tl.pointer_type(tl.int16))[:, None] + tl.arange(0, 16)[None, :]
    m = n_ok[:, None]
    a0, a1, a2, a3 = _pair_f16(tl.load(words + 8, mask=m, other=0), sc4, mn4, 0, d, dmin, ASM)
    b0, b1, b2, b3 = _pair_f16(tl.load(words + 24, mask=m, other=0), sc4, mn4, 2, d, dmin,
                               ASM)
    c0, c1, c2, c3 = _pair_f16(tl.load(words + 40, mask=m, other=0), sc8, mn8, 0, d, dmin,
                               ASM)
    e0, e1, e2, e3 = _pair_f16(tl.load(words + 56, mask=m, other=0), sc8, mn8, 2, d, dmin,
                               ASM)
    return a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, e0, e1, e2, e3


@triton.jit
def _pair_f16(q, sc, mn, at: tl.constexpr, d, dmin, ASM: tl.constexpr):
    s_lo, nm_lo = _scale_pair(sc, mn, at, d, dmin)
    s_hi, nm_hi = _scale_pair(sc, mn, at + 1, d, dmin)
    return _nibbles_f16(q, s_lo, nm_lo, s_hi, nm_hi, ASM)


@triton.jit
def _f16_acts(FMT: tl.constexpr, xT_rows, sb):
    """x^T's values sb 256 .. sb 256 + 255 in fp16 (`_f16_act`): 16 tiles [16, BM] in
    `_f16_codes`' order."""
    if FMT == 1:
        x = xT_rows[None, :] + sb * 256 + 4 * tl.arange(0, 16)[:, None]
        r = (_f16_act(x), _f16_act(x + 1), _f16_act(x + 2), _f16_act(x + 3),
             _f16_act(x + 64), _f16_act(x + 65), _f16_act(x + 66), _f16_act(x + 67),
             _f16_act(x + 128), _f16_act(x + 129), _f16_act(x + 130), _f16_act(x + 131),
             _f16_act(x + 192), _f16_act(x + 193), _f16_act(x + 194), _f16_act(x + 195))
    else:
        x = xT_rows[None, :] + sb * 256 + 2 * tl.arange(0, 16)[:, None]
        r = (_f16_act(x), _f16_act(x + 1), _f16_act(x + 32), _f16_act(x + 33),
             _f16_act(x + 64), _f16_act(x + 65), _f16_act(x + 96), _f16_act(x + 97),
             _f16_act(x + 128), _f16_act(x + 129), _f16_act(x + 160), _f16_act(x + 161),
             _f16_act(x + 192), _f16_act(x + 193), _f16_act(x + 224), _f16_act(x + 225))
    return r


@triton.jit
def _f16_dots(acc, w, xs):
    """acc [BN, BM] + the 16 tiles of w ([BN, 16] each) times those of x^T ([16, BM]): fp16
    tensor-core dots, accumulated in fp32 in tile order."""
    for i in tl.static_range(16):
        acc = tl.dot(w[i], xs[i], acc)
    return acc


@triton.jit
def _f16_rows_dot(FMT: tl.constexpr, xT_rows, wa, sa, wb, sb_rows, n_ok, K: tl.constexpr,
                  TWO: tl.constexpr, BM: tl.constexpr, ASM: tl.constexpr):
    """fp32 [BN, BM] twice: the rows wa (block scales sa) and (TWO) wb (sb_rows; else zeros)
    times x^T (xT_rows [BM] pointers to 16-bit rows of K values), 256 values at a time, x's
    fp16 tiles loaded once for both."""
    acc_a = tl.zeros((wa.shape[0], BM), dtype=tl.float32)
    acc_b = tl.zeros((wa.shape[0], BM), dtype=tl.float32)
    for sb in tl.range(K // 256):
        xs = _f16_acts(FMT, xT_rows, sb)
        acc_a = _f16_dots(acc_a, _f16_codes(FMT, wa, sa, n_ok, sb, ASM), xs)
        if TWO:
            acc_b = _f16_dots(acc_b, _f16_codes(FMT, wb, sb_rows, n_ok, sb, ASM), xs)
    return acc_a, acc_b


@triton.jit
def _f16_rows_kernel(x_ptr, y_ptr, stride_xm, K, BLOCK: tl.constexpr):
    """y[t, c BLOCK ..] = x's values in fp16 (`_f16_act`: saturated), y contiguous."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + t * stride_xm + cols, mask=cols < K, other=0.0).to(tl.float32)
    v = tl.minimum(tl.maximum(v, -65504.0), 65504.0).to(tl.float16)
    tl.store(y_ptr + t * K + cols, v, mask=cols < K)


@triton.jit
def _f16_gate_up_kernel(x_ptr, w_ptr, s_ptr, bank_s_ptr, route_ids_ptr, block_slot_ptr, a_ptr,
                        R, stride_xm, stride_ws, stride_wn, stride_ss, stride_sn, stride_am,
                        stride_bs, FMT: tl.constexpr, K: tl.constexpr, INTER: tl.constexpr,
                        TOPK: tl.constexpr, ACT: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr = False):
    """Program (block, row block): a = glu(g s[slot, 0], u s[slot, 1]) of the block's routes
    for the gate rows rn and up rows INTER + rn, stored in fp16 (saturated) into a's rows.
    The products are computed transposed, [BN rows, BM routes]: the expert's rows fill the
    tensor cores' M, the few routes their N. s_ptr: NVFP4's block scales (FMT 1; else
    unused)."""
    wait(PDL)  # pdl.py: the kernel before has completed
    slot, routes, r_ok, rn, n_ok = _block(route_ids_ptr, block_slot_ptr, R, BM, BN, INTER)
    if slot < 0:
        return
    w_slot = w_ptr + slot.to(tl.int64) * stride_ws
    s_slot = s_ptr + slot.to(tl.int64) * stride_ss
    gate, up = rn.to(tl.int64), (rn + INTER).to(tl.int64)
    xT = x_ptr + (routes // TOPK).to(tl.int64) * stride_xm
    acc_g, acc_u = _f16_rows_dot(FMT, xT, w_slot + gate * stride_wn, s_slot + gate * stride_sn,
                                 w_slot + up * stride_wn, s_slot + up * stride_sn, n_ok, K,
                                 True, BM, ASM)
    s = bank_s_ptr + slot * stride_bs
    a = glu(acc_g * tl.load(s), acc_u * tl.load(s + 1), ACT)
    a = tl.minimum(tl.maximum(a, -65504.0), 65504.0).to(tl.float16)
    out = a_ptr + routes[None, :].to(tl.int64) * stride_am + rn[:, None]
    tl.store(out, a, mask=n_ok[:, None] & r_ok[None, :])


@triton.jit
def _f16_down_kernel(a_ptr, w_ptr, s_ptr, bank_s_ptr, route_ids_ptr, block_slot_ptr,
                     route_w_ptr, y_ptr, R, stride_am, stride_ws, stride_wn, stride_ss,
                     stride_sn, stride_ym, stride_bs, FMT: tl.constexpr, K: tl.constexpr,
                     HIDDEN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     ASM: tl.constexpr, PDL: tl.constexpr = False):
    """Program (block, row block): y[r, rn] = (a_r Wd^T) s[slot, 2] route_weight[r] for the
    block's routes r, fp32, a the fp16 rows `_f16_gate_up_kernel` stored."""
    wait(PDL)  # pdl.py: the kernel before has completed
    slot, routes, r_ok, rn, n_ok = _block(route_ids_ptr, block_slot_ptr, R, BM, BN, HIDDEN)
    if slot < 0:
        return
    w_rows = w_ptr + slot.to(tl.int64) * stride_ws + rn.to(tl.int64) * stride_wn
    s_rows = s_ptr + slot.to(tl.int64) * stride_ss + rn.to(tl.int64) * stride_sn
    aT = a_ptr + routes.to(tl.int64) * stride_am
    acc, _ = _f16_rows_dot(FMT, aT, w_rows, s_rows, w_rows, s_rows, n_ok, K, False, BM, ASM)
    r_w = tl.load(route_w_ptr + routes, mask=r_ok, other=0.0).to(tl.float32)
    y = acc * tl.load(bank_s_ptr + slot * stride_bs + 2) * r_w[None, :]
    out = y_ptr + routes[None, :].to(tl.int64) * stride_ym + rn[:, None]
    tl.store(out, y, mask=n_ok[:, None] & r_ok[None, :])


def _chunks(bank: ExpertBank, dtype: torch.dtype, tokens: int) -> tuple[int, int]:
    """Super-blocks per fp32 partial sum of gate/up and down: the per-route int8 GEMV's chunks
    at this size (`moe._i8_tiles`, `_down_i8_tiles`; the same association, the same bits)."""
    up = _i8_tiles(Q4_K, bank.hidden, dtype, None, tokens)
    down = _down_i8_tiles(Q4_K, bank.intermediate, dtype, None, tokens)
    return (up[1] // 256 if up else 1), (down[1] // 256 if down else 1)


def fused_moe_mma(x: torch.Tensor, bank: ExpertBank, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, activation: str = "silu",
                  expert_map: torch.Tensor | None = None,
                  tiles: tuple[int, ...] | None = None, form: str | None = None) -> torch.Tensor:
    """`moe.fused_moe_triton`'s contract ([T, H] in x.dtype) for banks `supported_mma` takes:
    routes grouped by slot in blocks of BM (`moe._align`), one program per (block, row block),
    each expert's rows read once per block of its routes, gate/up and down in tensor-core dots
    of the `form` (None: FREETOKEN_GPU_MOE_MMA_FORM, else MMA_FORM):
    - "i8": int8 codes (`_mma_*` kernels); `tiles` (BN, num_warps[, unroll]), BN a multiple
      of 32, unroll (default true) a chunk's super-blocks unrolled (`_rows_dot`); default
      MMA_TILES;
    - "f16": the codes decoded to fp16 (`_f16_*` kernels); `tiles` (BN, num_warps), BN a
      multiple of 16; default F16_TILES."""
    form = form or env.gpu_moe_mma_form() or MMA_FORM
    if form not in FORMS:
        raise ValueError(f"fused_moe_mma: form must be one of {FORMS}, got {form!r}")
    if form == "f16":
        return _fused_f16(x, bank, topk_ids, topk_weights, activation, expert_map, tiles)
    if activation not in _ACT:
        raise ValueError(f"activation must be silu or gelu_tanh, got {activation!r}")
    if not supported_mma(bank, x.dtype, "i8"):
        raise ValueError("fused_moe_mma: both banks must be Q4_K, x 16-bit with int8 dots on")
    bn, warps, *rest = tiles or MMA_TILES
    unroll = bool(rest[0]) if rest else True
    if bn % 32 or bn < 32:
        raise ValueError(f"fused_moe_mma: BN={bn} must be a multiple of 32")
    t, topk = topk_ids.shape
    h, inter, r = bank.hidden, bank.intermediate, topk_ids.numel()
    if r == 0:
        return torch.zeros(t, h, dtype=x.dtype, device=x.device)
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = xq_rows(x, t, h)
    if q is None:
        q = torch.empty(t, xq_len(h), dtype=torch.int32, device=x.device)
        block = min(1024, h)
        _quant_rows_kernel[(t, triton.cdiv(h, block))](x, q, x.stride(0), q.stride(0), K=h,
                                                      BLOCK=block, num_warps=4)
    route_ids, block_slot = _align(topk_ids, expert_map, bank.num_experts, BM)
    nb = block_slot.numel()
    ch13, ch2 = _chunks(bank, x.dtype, t)
    w13, _ = weight_args(bank.w13)
    w2, _ = weight_args(bank.w2)
    scales = bank.scales if bank.scales.stride(-1) == 1 else bank.scales.contiguous()
    sb = scales.stride(0)
    aq = torch.empty(r, xq_len(inter), dtype=torch.int32, device=x.device)
    _mma_gate_up_kernel[(nb, triton.cdiv(inter, bn))](
        q, w13, scales, route_ids, block_slot, aq, r, q.stride(0), w13.stride(0),
        w13.stride(1), aq.stride(0), sb, K=h, INTER=inter, TOPK=topk, ACT=_ACT[activation],
        BM=BM, BN=bn, CH=ch13, UNROLL=unroll, num_warps=warps, enable_fp_fusion=False, **pdl.opts())
    # a route whose expert maps to -1 (computed elsewhere) is in no block: its row reads zero
    y = (torch.empty if expert_map is None else torch.zeros)(r, h, dtype=torch.float32,
                                                              device=x.device)
    _mma_down_kernel[(nb, triton.cdiv(h, bn))](
        aq, w2, scales, route_ids, block_slot, topk_weights.reshape(-1).contiguous(), y, r,
        aq.stride(0), w2.stride(0), w2.stride(1), y.stride(0), sb, K=inter, HIDDEN=h, BM=BM,
        BN=bn, CH=ch2, UNROLL=unroll, num_warps=warps, enable_fp_fusion=False, **pdl.opts())
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    _sum_routes_kernel[(t, triton.cdiv(h, 1024))](y, out, h, TOPK=topk, BLOCK=1024,
                                                   num_warps=4, **pdl.opts())
    return out


def _fused_f16(x: torch.Tensor, bank: ExpertBank, topk_ids: torch.Tensor,
               topk_weights: torch.Tensor, activation: str, expert_map: torch.Tensor | None,
               tiles: tuple[int, ...] | None) -> torch.Tensor:
    """The "f16" form of `fused_moe_mma`: gate/up stores a in fp16, down y in fp32 per route,
    `_sum_routes_kernel` adds each token's routes in route order."""
    if activation not in _ACT:
        raise ValueError(f"activation must be silu or gelu_tanh, got {activation!r}")
    if not supported_mma(bank, x.dtype, "f16"):
        raise ValueError(
            "fused_moe_mma: the f16 form takes banks both Q4_K or both NVFP4 with hidden and "
            f"expert width multiples of 256 and a 16-bit x; got w13 {bank.w13.fmt} "
            f"(ggml type {bank.w13.ggml_type}), w2 {bank.w2.fmt} (ggml type "
            f"{bank.w2.ggml_type}), hidden {bank.hidden}, expert width {bank.intermediate}, "
            f"x {x.dtype}")
    bn, warps = tiles or F16_TILES
    if bn % 16 or bn < 16:
        raise ValueError(f"fused_moe_mma: BN={bn} must be a multiple of 16")
    t, topk = topk_ids.shape
    h, inter, r = bank.hidden, bank.intermediate, topk_ids.numel()
    if r == 0:
        return torch.zeros(t, h, dtype=x.dtype, device=x.device)
    x = x if x.stride(-1) == 1 else x.contiguous()
    out_dtype = x.dtype  # the result's, whatever the kernels read x as
    if x.dtype != torch.float16:  # once here, not in every program
        x16 = torch.empty(t, h, dtype=torch.float16, device=x.device)
        _f16_rows_kernel[(t, triton.cdiv(h, 1024))](x, x16, x.stride(0), h, BLOCK=1024,
                                                    num_warps=4)
        x = x16
    route_ids, block_slot = _align(topk_ids, expert_map, bank.num_experts, BM)
    nb = block_slot.numel()
    fmt = format_id(bank.w13)
    w13, s13 = weight_args(bank.w13)
    w2, s2 = weight_args(bank.w2)
    ptx = _e4m3_ptx(x.device) if fmt == F_NVFP4 else asm()
    scales = bank.scales if bank.scales.stride(-1) == 1 else bank.scales.contiguous()
    sb = scales.stride(0)
    a = torch.empty(r, inter, dtype=torch.float16, device=x.device)
    _f16_gate_up_kernel[(nb, triton.cdiv(inter, bn))](
        x, w13, s13, scales, route_ids, block_slot, a, r, x.stride(0), w13.stride(0),
        w13.stride(1), s13.stride(0), s13.stride(1), a.stride(0), sb, FMT=fmt, K=h,
        INTER=inter, TOPK=topk, ACT=_ACT[activation], BM=BM, BN=bn, ASM=ptx, num_warps=warps,
        **pdl.opts())
    # a route whose expert maps to -1 (computed elsewhere) is in no block: its row reads zero
    y = (torch.empty if expert_map is None else torch.zeros)(r, h, dtype=torch.float32,
                                                              device=x.device)
    _f16_down_kernel[(nb, triton.cdiv(h, bn))](
        a, w2, s2, scales, route_ids, block_slot, topk_weights.reshape(-1).contiguous(), y, r,
        a.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), y.stride(0), sb,
        FMT=fmt, K=inter, HIDDEN=h, BM=BM, BN=bn, ASM=ptx, num_warps=warps, **pdl.opts())
    out = torch.empty(t, h, dtype=out_dtype, device=x.device)
    _sum_routes_kernel[(t, triton.cdiv(h, 1024))](y, out, h, TOPK=topk, BLOCK=1024,
                                                   num_warps=4, **pdl.opts())
    return out
