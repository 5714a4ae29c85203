"""Quantized linear and embedding on the GPU: weights stay in their storage format.

`y[M, N] = (x[M, K] @ W^T) * scale2` with W decoded tile by tile in registers
(`quant.decode_tile`, bit-exact values) and accumulated in fp32:
- one token (decode at batch 1): a GEMV, each program owns BLOCK_N output rows and reads their
  blocks once; products and sums in fp32 CUDA-core math;
- more tokens: tiles fed to `tl.dot` (tensor cores in bf16 / f16 when x is; fp32 activations
  use IEEE fp32 dots, so fp32 runs keep fp32 accuracy).
The second-level scale (scalar or one value per output row) multiplies the fp32 accumulator.
Decoding kernels run with `enable_fp_fusion=False`: the codecs round `q * d` before `- m`.
K is a constexpr (a model has a handful of input sizes): a fixed trip count for the compiler,
and Triton's interpreter (CI) cannot loop over a runtime bound under numpy 2.4.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken import env
from freetoken.formats.qweight import QuantWeight
from freetoken.kernels import xq
from freetoken.kernels.triton import pdl
from freetoken.kernels.triton.formats import F_Q8_0_SPLIT, format_id
from freetoken.kernels.triton.gemv import gemv_bk, gemv_block, gemv_chunk_error
from freetoken.kernels.triton.gemv_i8 import (
    I8_FORMATS,
    asm,
    gemv_i8_row,
    i8_chunk,
    i8_chunk_ok,
    i8_dot,
    i8_weights,
    use_i8,
    x_chunk,
    xq_len,
)
from freetoken.kernels.triton.pdl import prefetch_l2, wait
from freetoken.kernels.triton.quant import decode_tile
from freetoken.kernels.triton.tiles import _dequant_kernel, fast_tile, has_fast_tile

_DOT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _dot_acc(acc, x, w, DOT: tl.constexpr):
    """acc[BM, BN] += x[BM, BK] @ w[BN, BK]^T in the dot's precision (see module doc)."""
    if DOT == 1:
        acc += tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
    elif DOT == 2:
        acc += tl.dot(x.to(tl.float16), tl.trans(w.to(tl.float16)))
    else:
        acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
    return acc


@triton.jit
def _row_ptrs(w_ptr, s_ptr, rn, stride_wn, stride_sn, FMT: tl.constexpr):
    """Each output row's weight and block-scale pointers ([BN, 1]); FP8 scales cover 128 rows."""
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    if FMT == 3:
        s_rows = s_ptr + (rn // 128)[:, None].to(tl.int64) * stride_sn
    else:
        s_rows = s_ptr + rn[:, None].to(tl.int64) * stride_sn
    return w_rows, s_rows


@triton.jit
def _i8_tokens(FMT: tl.constexpr, w_rows, s_rows, x_ptr, stride_xm, t0, M, n_ok,
               K: tl.constexpr, BK: tl.constexpr, MT: tl.constexpr, ASM: tl.constexpr,
               XQ: tl.constexpr):
    """fp32 [MT, BN]: the int8 GEMV of tokens t0 .. t0 + MT (rows past M repeat row M - 1,
    not to be stored) against the same weight rows, each chunk's weight words loaded and
    expanded once (`i8_weights`) and dotted with every token's codes (`i8_dot`): per token
    the products, block sums and chunk order of `gemv_i8_row`, so the same bits."""
    BN: tl.constexpr = w_rows.shape[0]
    tt = tl.arange(0, MT)[:, None]
    acc = tl.zeros((MT, BN), dtype=tl.float32)
    for k0 in tl.static_range(0, K, BK):
        wq = i8_weights(FMT, w_rows, s_rows, k0, n_ok, BK, ASM, True)
        for j in tl.static_range(MT):
            row = x_ptr + tl.minimum(t0 + j, M - 1).to(tl.int64) * stride_xm
            part = i8_dot(FMT, wq, x_chunk(row, k0, K, BK, FMT == 1, XQ), BK, ASM, True)
            acc = tl.where(tt == j, acc + part[None, :], acc)
    return acc


@triton.jit
def _qmm_kernel(x_ptr, w_ptr, s_ptr, scale2_ptr, out_ptr, M, N,
                stride_xm, stride_wn, stride_sn, stride_om, K: tl.constexpr,
                FMT: tl.constexpr, SCALE2: tl.constexpr, DOT: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FAST: tl.constexpr,
                I8: tl.constexpr, ASM: tl.constexpr, XQ: tl.constexpr = False,
                PDL: tl.constexpr = False, MT: tl.constexpr = 1):
    """XQ: x_ptr / stride_xm are the rows quantized ahead (`kernels.xq`), int8 GEMV only.
    MT > 1 (int8 GEMV, BM = 1): a program takes MT tokens (`_i8_tokens`), grid (M / MT, N /
    BN), the weight rows read and expanded once for all of them."""
    pid_m = tl.program_id(0)  # tokens vary fastest: programs that share rows run together
    pid_n = tl.program_id(1)
    if BM == 1:  # decode with PDL: the weight rows on their way while the kernel before ends
        rows = tl.minimum(N - pid_n * BN, BN)
        prefetch_l2(w_ptr + pid_n.to(tl.int64) * BN * stride_wn,
                    rows * stride_wn * (w_ptr.dtype.element_ty.primitive_bitwidth // 8), PDL)
    wait(PDL)  # pdl.py: the kernel before has completed
    rm = pid_m * BM * MT + tl.arange(0, BM * MT)
    rn = pid_n * BN + tl.arange(0, BN)
    n_ok = rn < N
    w_rows, s_rows = _row_ptrs(w_ptr, s_ptr, rn, stride_wn, stride_sn, FMT)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((BM * MT, BN), dtype=tl.float32)
    if MT > 1:  # several tokens, int8 (the launcher's choice)
        acc = _i8_tokens(FMT, w_rows, s_rows, x_ptr, stride_xm, pid_m * MT, M, n_ok, K, BK, MT,
                         ASM, XQ)
    elif BM == 1 and I8:  # decode in int8 dots (gemv_i8.py)
        x_row = x_ptr + pid_m * stride_xm
        acc += gemv_i8_row(FMT, w_rows, s_rows, x_row, n_ok, K, BK, ASM, XQ)[None, :]
    elif BM == 1:  # decode: K is a multiple of BK (the launcher's gemv_bk)
        for k0 in tl.range(0, K, BK):
            acc += gemv_block(FMT, w_rows, s_rows, x_ptr + pid_m * stride_xm, k0, n_ok,
                              BK)[None, :]
    else:
        for k0 in tl.range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            k_ok = k < K
            if FAST:
                w = fast_tile(FMT, w_rows, s_rows, k0, n_ok, BK)
            else:
                w = decode_tile(FMT, w_rows, s_rows, k[None, :], n_ok[:, None] & k_ok[None, :])
            x = tl.load(x_rows + k[None, :], mask=(rm[:, None] < M) & k_ok[None, :], other=0.0)
            acc = _dot_acc(acc, x, w, DOT)
    if SCALE2 == 1:
        acc = acc * tl.load(scale2_ptr)
    elif SCALE2 == 2:
        acc = acc * tl.load(scale2_ptr + rn, mask=n_ok, other=0.0)[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & n_ok[None, :])


@triton.jit
def _decode_rows_kernel(ids_ptr, w_ptr, s_ptr, scale2_ptr, out_ptr, K, stride_wn, stride_sn,
                        stride_om, FMT: tl.constexpr, SCALE2: tl.constexpr, BK: tl.constexpr,
                        PDL: tl.constexpr = False):
    """out[t, :] = row ids[t] of W (decoded, times a scalar scale2): embedding and tests."""
    wait(PDL)  # pdl.py: the kernel before has completed
    t = tl.program_id(0)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    row = tl.load(ids_ptr + t + tl.arange(0, 1))  # [1]
    w_rows, s_rows = _row_ptrs(w_ptr, s_ptr, row, stride_wn, stride_sn, FMT)
    k_ok = k < K
    w = decode_tile(FMT, w_rows, s_rows, k[None, :], k_ok[None, :])
    if SCALE2 == 1:
        w = w * tl.load(scale2_ptr)
    out = out_ptr + t.to(tl.int64) * stride_om + k[None, :]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=k_ok[None, :])


# -- launchers ------------------------------------------------------------------------------------
def supported(qw: QuantWeight) -> bool:
    return format_id(qw) is not None


def weight_args(qw: QuantWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, block scales) as the kernels read them: bytes (float formats: their own dtype),
    the last dimension contiguous. Weights without block scales pass `data` twice (unused)."""
    data = qw.data
    if data.dtype == torch.float8_e4m3fn:
        data = data.view(torch.uint8)
    scales = data if qw.scales is None else qw.scales
    if scales.dtype == torch.float8_e4m3fn:
        scales = scales.view(torch.uint8)
    for name, t in (("data", data), ("scales", scales)):
        if t.stride(-1) != 1:
            raise ValueError(f"{qw.source or 'weight'}: {name} must have a contiguous last "
                             f"dimension for the GPU kernels (strides {t.stride()})")
    return data, scales


def _scale2_args(qw: QuantWeight, n: int, like: torch.Tensor) -> tuple[int, torch.Tensor]:
    s = qw.scale2
    if s is None:
        return 0, like
    if s.device != like.device or s.dtype != torch.float32:
        # once, kept on the weight: a copy per call would be a host transfer in every step
        # (and is refused inside a CUDA graph capture)
        s = s.to(device=like.device, dtype=torch.float32)
        qw.scale2 = s
    s = s.reshape(-1)
    if s.numel() == 1:
        return 1, s
    if s.numel() == n:
        return 2, s.contiguous()
    raise ValueError(f"{qw.source or 'weight'}: scale2 has {s.numel()} values; a linear takes "
                     f"1 or one per output row ({n})")


def xq_rows(x: torch.Tensor, m: int, k: int) -> torch.Tensor | None:
    """x's rows quantized ahead by their producer (`kernels.xq`), when they fit [m, K]."""
    q = xq.attached(x)
    return q if q is not None and tuple(q.shape) == (m, xq_len(k)) else None


# Tokens up to which the int8 GEMV runs once per token (BM = 1, the weight's later reads hit
# L2) instead of tl.dot tiles, per format. Measured on the H200 at 4 tokens
# (bench_gpu_kernels.py --sweep F --sweep-tokens 4, 2026-12-01): Q4_K qkv 5120x2048 8.9 us
# against 21.7 (best tl.dot tile), o_proj 2048x4096 7.5 against 23.7; NVFP4 22.1 against 21.7
# and 19.4 against 25.8 (its int8 expansion costs more per byte: four tokens, four times the
# one-token time).
I8_TOKENS = {1: 4, 13: 4, 18: 1}
# Tokens up to which the int8 GEMV takes several tokens a program instead (`_i8_tokens`: each
# weight chunk loaded and expanded once, dotted with every token's codes; the one-token
# kernel once per token pays NVFP4's expansion per token, and split Q8_0's tl.dot tiles decode
# every tile), per format, and the tiles (BN, BK at most, num_warps) it runs with;
# FREETOKEN_GPU_LINEAR_MT=N sets the tokens for every int8 format (0: off). Measured on the
# H200 (2026-12-04): NVFP4 qkv 5120x2048 (bench_gpu_kernels.py --linear-mt nvfp4) at 2 / 4 / 8
# / 16 tokens 5.8 / 10.1 / 31.9 / 29.6 us -> 5.7 / 8.9 / 16.2 / 32.1 with 16 rows, 2048-wide
# chunks, 8 warps; end to end (ab_env.py, 30B Q4_K fused: its dense linears are split Q8_0,
# 8 rows, 4 warps), tok/s without -> up to 4 / up to 8 tokens a program: batch 2 597.0 ->
# 754.5 / 754.1, 4 1,032.3 -> 1,191.6 / 1,190.9, 8 1,607.7 -> 1,608.5 / 1,651.7, 16
# 2,328.0 (tl.dot tiles either way); up to 16 (other tiles) lost at 16 tokens: 2,342.5 ->
# 2,055.6. Q4_K dense weights (not in the dummy models) are not measured: once per token.
I8_MULTI_TOKENS = {1: 8, 18: 8}
# Warps of the one-token int8 GEMV (8 rows, chunks up to 2048) by format, else 4. Measured on
# an H100 with the weights from HBM (bench_gpu_kernels.py --hbm-tiles Q8_0s, 2026-12-07, us):
# split Q8_0 qkv 5120 x 2048 6.34 -> 6.16, o_proj 2048 x 4096 6.52 -> 6.08 with 8 warps (the
# other 12 tiles of the sweep slower; L2-hot, as earlier sweeps timed them, 3.98 -> 3.81 and
# 4.29 -> 3.87); end to end with the norm + router split (route.NORM_ROUTE_SPLIT) 30B Q4_K
# fused at batch 1 434.2 -> 441.7 tok/s. NVFP4 and Q4_K dense weights not measured so.
I8_WARPS = {18: 8}
I8_MULTI_TILES = {1: (16, 2048, 8), 13: (8, 2048, 4), 18: (8, 2048, 4)}
# Tokens a program takes at most (the tokens' dots are unrolled: code size grows with it).
I8_MT_MAX = 16


def _i8_multi(fmt: int) -> int:
    """Tokens up to which `_i8_tokens` runs for this int8 format (0: never):
    FREETOKEN_GPU_LINEAR_MT where set, else I8_MULTI_TOKENS."""
    n = env.gpu_linear_mt()
    return I8_MULTI_TOKENS.get(fmt, 0) if n is None else (n if fmt in I8_FORMATS else 0)


def _i8_blocks(m: int, n: int, k: int, fmt: int) -> tuple[int, ...] | None:
    """(1, BN, BK, num_warps) of the int8 GEMV once per token (up to I8_TOKENS), (1, BN, BK,
    num_warps, MT) of several tokens a program (up to `_i8_multi`), or None: more tokens, or a K
    that does not split into its chunks. FREETOKEN_GPU_LINEAR_TILES sets one token's tiles
    (not the lm_head's). Measured on the H200 at one token (bench_gpu_kernels.py
    --sweep nvfp4,Q4_K --sweep-tokens 1, chunks unrolled): 8 rows, chunks up to 2048, 4 warps:
    NVFP4 qkv 5120x2048 4.5 us (against 8.3 for the fp32 GEMV), o_proj 2048x4096 4.6 (7.4); Q4_K
    5.2 and 5.3. Four tokens of Q4_K: 2 rows, one warp (more programs; the rows' bytes stay in
    L2 for the next token). The lm_head (151936 rows) 16 rows in 512-wide chunks (Q8_0: 78.5 us,
    4.2 TB/s)."""
    if 1 < m <= _i8_multi(fmt):
        bn, want, warps = I8_MULTI_TILES[fmt]
        bk = i8_chunk(fmt, k, want)
        return None if bk is None else (1, bn, bk, warps, min(I8_MT_MAX, 1 << (m - 1).bit_length()))
    if m > I8_TOKENS.get(fmt, 0):
        return None
    own = env.gpu_linear_tiles() if m == 1 and n <= 65536 else None
    bk = i8_chunk(fmt, k, 2048 if own is None else own[1])
    if bk is None:
        return None
    if own is not None:
        return 1, own[0], bk, own[2]
    if n > 65536:
        return 1, 16, min(bk, 512), 4
    if m > 1 and fmt == 13:
        return 1, 2, min(bk, 1024), 1
    return 1, 8, bk, I8_WARPS.get(fmt, 4)


def _blocks(m: int, n: int, k: int, fmt: int, dot: int) -> tuple[int, int, int, int]:
    """(BM, BN, BK, num_warps) by shape: GEMV rows per program sized so that at batch 1 there
    are several programs per SM; GEMM tiles for tl.dot otherwise."""
    # Measured on the H200 (benchmarks/bench_gpu_kernels.py --sweep, Qwen3-30B-A3B shapes):
    # at one token, NVFP4 / Q4_K rows in pairs with one warp per program beat 4-16 rows with
    # 4-8 warps by 1.2-2x (qkv 5120x2048: 707 / 659 GB/s); prefill (512 tokens) NVFP4 128x64
    # tiles, Q4_K 64x128 (86-105 / 82-99 TFLOP/s, against 56-82 with 64x64).
    # Q8_0 rows are 34-byte blocks (2-byte aligned: short loads): 1024-wide chunks keep 4x the
    # bytes of a 256-wide one in flight per program (qkv, o_proj and the lm_head of the dummy
    # models are Q8_0: more bytes per decode step than the routed experts). Measured on the
    # H200 at one token (profile_decode_step.py --kernel-ab): qkv 5120x2048 9.0 us against
    # 11.2, o_proj 2048x4096 8.1 against 12.1, lm_head 151936x2048 210 against 251 (1576 GB/s).
    # Split Q8_0 (formats.split_q8_0; measured with --sweep Q8_0s, bf16): one token, 8 rows in
    # 2048-wide chunks with 8 warps: qkv 5.0 us (2.2 TB/s), o_proj 4.8 us (1.9 TB/s), against
    # 9.0 / 7.9 on blocks; the lm_head 4 rows, 1024-wide, 4 warps: 107 us (3.1 TB/s, blocks
    # 210). 2-16 tokens: 16x32 tl.dot tiles over 256 values: lm_head 110-115 us (2.9-3.0 TB/s)
    # against 221-225 with 16x16, qkv 8.8-9.7 us against 13.8-14.1, o_proj 11.3-13.9 (14.0-14.6).
    if fmt == F_Q8_0_SPLIT and m <= 16:
        if m == 1:
            return (1, 8, gemv_bk(fmt, k, 2048), 8) if n <= 8192 else \
                (1, 4, gemv_bk(fmt, k, 1024), 4)
        if dot and k % 256 == 0:
            return 16, 32, 256, 4
    # NVFP4 at one token with K >= 4096 (o_proj / out_proj 2048x4096): 4 rows in 2048-wide
    # chunks, 4 warps, 7.4 us (634 GB/s) against 9.1 (521) for 2 rows in 256-wide chunks; at K
    # 2048 no chunk width or row count gained more than 5% (bench_gpu_kernels.py --sweep nvfp4
    # --sweep-tokens 1, H200, 2026-12-01): the decode's integer and conversion work per value
    # bounds these GEMVs, not the loads in flight.
    if fmt == 1 and m == 1 and k >= 4096 and k % 2048 == 0:
        return 1, 4, 2048, 4
    bk = gemv_bk(fmt, k, 1024 if fmt == 12 else 256)
    if m == 1 and bk is not None:
        if fmt in (1, 13):
            return 1, 2, bk, 1
        return 1, (4 if n <= 4096 else 8), bk, 4
    # 256-wide fast tiles for 16-bit dots; fp32 operands (tests, fp32 runs) are twice the bytes
    # in shared memory: 64-wide (NVFP4 / Q8_0 keep their fast tiles, Q4_K decodes per value).
    bk = 256 if dot and has_fast_tile(fmt, k, 256) else 64
    if m <= 16:
        return 16, 16, bk, 4
    if m <= 64:
        return triton.next_power_of_2(m), 32, bk, 4
    if dot and fmt == 1 and k % 128 == 0:
        return 128, 64, 128, 8
    if dot and fmt == 13 and bk == 256:
        return 64, 128, 256, 8
    return 64, 64, bk, 8


# Tokens from which a linear decodes its weight to x's 16-bit dtype (the fast tiles, exactly
# the values the tl.dot tiles feed the tensor cores) and multiplies with torch's GEMM instead:
# the tl.dot kernels decode every tile in registers and reach 25-150 TFLOP/s at these sizes,
# the decode pass plus the library GEMM 100-600. Measured on the H200 (bench_gpu_kernels.py
# --dense-gemm, 2026-12-02), us, tl.dot tiles -> decoded rows + GEMM: qkv 5120x2048 at 128 /
# 512 / 2048 tokens NVFP4 41.8 / 123.7 / 407.9 -> 21.8 / 35.3 / 82.0, Q4_K 43.3 / 130.7 /
# 443.4 -> 21.1 / 34.4 / 81.6, split Q8_0 32.1 / 77.7 / 293.6 -> 16.1 / 30.5 / 77.3; o_proj
# 2048x4096 NVFP4 80.9 / 81.6 / 323.9 -> 22.1 / 30.1 / 60.2.
DEQUANT_GEMM_TOKENS = 128
# Most bytes of decoded weight rows one GEMM takes: larger weights go in chunks of rows (a
# prefill that wants every position's logits must not allocate a whole lm_head in bf16).
DEQUANT_GEMM_BYTES = 64 << 20


def dequant_gemm(x2: torch.Tensor, qw: QuantWeight, out: torch.Tensor) -> bool:
    """out [M, N] = (x2 [M, K] @ W^T) * scale2 through decoded rows and torch's GEMM (16-bit
    x2, a format with fast tiles, K a multiple of 256); False (out untouched) where it does
    not apply. Each weight is decoded in fp32 as the codec does, times its scale2 (per tensor
    or per row), and rounded once to x2's dtype, the GEMM's operand; the GEMM accumulates in
    fp32 and rounds its output once. (The tl.dot path rounds the weight without scale2 and
    multiplies the fp32 sums: the same two roundings, in another place.) Two launches a call
    (one decode and one GEMM per chunk of rows)."""
    fmt, (n, k) = format_id(qw), (qw.out_features, qw.in_features)
    if x2.dtype not in (torch.bfloat16, torch.float16) or out.dtype != x2.dtype \
            or fmt is None or not has_fast_tile(fmt, k, 256):
        return False
    mode, s2 = _scale2_args(qw, n, out)
    data, scales = weight_args(qw)
    rows = max(256, DEQUANT_GEMM_BYTES // (2 * k) // 256 * 256)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        w = _dequant_rows(data[n0:n1], scales[n0:n1], fmt, k, x2.dtype,
                          s2=s2[n0:n1] if mode == 2 else s2, scale2=mode)
        if n1 - n0 == n:
            torch.mm(x2, w.t(), out=out)
        else:
            out[:, n0:n1] = torch.mm(x2, w.t())
    return True


def triton_linear(x: torch.Tensor, qw: QuantWeight,
                  tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """y[..., N] = (x[..., K] @ W^T) * scale2 in x's dtype (no bias), W in its storage format.

    `tiles` (BM, BN, BK, num_warps) overrides the choice by shape (tests, benchmarks); from
    `DEQUANT_GEMM_TOKENS` tokens without it, decoded rows and torch's GEMM (`dequant_gemm`)."""
    fmt = format_id(qw)
    if fmt is None:
        raise ValueError(f"{qw.source or 'weight'}: no GPU kernel for {qw.fmt} "
                         f"(ggml type {qw.ggml_type})")
    n, k = qw.out_features, qw.in_features
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:  # an empty batch: no grid to launch
        return out.reshape(*x.shape[:-1], n)
    if tiles is None and m >= DEQUANT_GEMM_TOKENS and dequant_gemm(x2, qw, out):
        return out.reshape(*x.shape[:-1], n)
    data, scales = weight_args(qw)
    mode, s2 = _scale2_args(qw, n, out)
    dot = _DOT.get(x.dtype, 0)
    # the int8 GEMV (`_i8_blocks` by token count: once per token up to I8_TOKENS, several a
    # program up to I8_MULTI_TOKENS), else the fp32 GEMV or tl.dot tiles
    if tiles is None:
        tiles = _i8_blocks(m, n, k, fmt) if use_i8(fmt, x.dtype) else None
        i8 = tiles is not None
    else:
        i8 = (len(tiles) > 4 or m <= I8_TOKENS.get(fmt, 0)) and use_i8(fmt, x.dtype)
    mt = tiles[4] if tiles is not None and len(tiles) > 4 else 1
    bm, bn, bk, warps = (tiles or _blocks(m, n, k, fmt, dot))[:4]
    if mt > 1 and not (i8 and bm == 1):
        raise ValueError(f"linear: tiles {tiles}: several tokens a program (MT = {mt}) need "
                         f"the int8 GEMV (BM = 1, a {qw.fmt} weight and a 16-bit x)")
    if bm == 1 and k % bk:
        raise ValueError(f"linear: GEMV chunk BK={bk} must divide K={k}")
    if bm == 1 and not i8 and (why := gemv_chunk_error(fmt, bk, "linear")):
        raise ValueError(why)
    if i8 and not i8_chunk_ok(fmt, k, bk):
        raise ValueError(f"linear: int8 GEMV chunk BK={bk} does not tile K={k} for "
                         f"{qw.fmt}")
    grid = (triton.cdiv(m, bm * mt), triton.cdiv(n, bn))
    q = xq_rows(x, m, k) if i8 and bm == 1 else None
    xs = x2 if q is None else q  # the int8 GEMV reads x quantized ahead where it was
    _qmm_kernel[grid](xs, data, scales, s2, out, m, n, xs.stride(0), data.stride(-2),
                      scales.stride(-2), out.stride(0), K=k, FMT=fmt, SCALE2=mode, DOT=dot,
                      BM=bm, BN=bn, BK=bk, FAST=has_fast_tile(fmt, k, bk), I8=i8, ASM=asm(),
                      XQ=q is not None, MT=mt, num_warps=warps, enable_fp_fusion=False,
                      **pdl.opts())
    return out.reshape(*x.shape[:-1], n)


def triton_rows(qw: QuantWeight, ids: torch.Tensor, dtype: torch.dtype,
                apply_scale2: bool = True) -> torch.Tensor:
    """Rows `ids` of a 2-D weight, decoded on the device: [len(ids), K] in `dtype`."""
    fmt = format_id(qw)
    if fmt is None:
        raise ValueError(f"{qw.source or 'weight'}: no GPU kernel for {qw.fmt}")
    flat = ids.reshape(-1).to(torch.int32)
    k = qw.in_features
    out = torch.empty(flat.numel(), k, dtype=dtype, device=qw.data.device)
    data, scales = weight_args(qw)
    mode, s2 = (0, out) if not apply_scale2 else _scale2_args(qw, qw.out_features, out)
    if mode == 2:
        raise ValueError(f"{qw.source or 'weight'}: per-row scale2 on an embedding table")
    bk = 256
    grid = (flat.numel(), triton.cdiv(k, bk))
    if flat.numel():
        _decode_rows_kernel[grid](flat, data, scales, s2, out, k, data.stride(-2),
                                  scales.stride(-2), out.stride(0), FMT=fmt, SCALE2=mode, BK=bk,
                                  enable_fp_fusion=False, **pdl.opts())
    return out


def triton_dequantize(qw: QuantWeight, dtype: torch.dtype = torch.float32,
                      bn: int = 16) -> torch.Tensor:
    """The whole 2-D weight decoded on the device by the fast tiles (no scale2): [N, K]."""
    fmt, k = format_id(qw), qw.shape[-1]
    bk = 256 if fmt == 13 else 64
    if fmt is None or not has_fast_tile(fmt, k, bk):
        raise ValueError(f"{qw.source or 'weight'}: no fast tile decode for {qw.fmt} K={k}")
    data, scales = weight_args(qw)
    return _dequant_rows(data, scales, fmt, k, dtype, bn, bk)


def _dequant_rows(data: torch.Tensor, scales: torch.Tensor, fmt: int, k: int,
                  dtype: torch.dtype, bn: int = 16, bk: int = 256,
                  s2: torch.Tensor | None = None, scale2: int = 0) -> torch.Tensor:
    """Rows of a weight (`weight_args`' tensors, 2-D) decoded by the fast tiles, times scale2
    (`_scale2_args`' mode and values) when given: [rows, K]."""
    n = data.shape[0]
    out = torch.empty(n, k, dtype=dtype, device=data.device)
    _dequant_kernel[(triton.cdiv(n, bn), k // bk)](
        data, scales, out, n, data.stride(-2), scales.stride(-2), out.stride(0), K=k, FMT=fmt,
        BN=bn, BK=bk, s2_ptr=out if s2 is None else s2, SCALE2=scale2,
        enable_fp_fusion=False)
    return out


def triton_embedding(ids: torch.Tensor, qw: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """Embedding rows decoded on the device (times a scalar scale2): [*ids.shape, K]."""
    return triton_rows(qw, ids, dtype).reshape(*ids.shape, qw.in_features)
