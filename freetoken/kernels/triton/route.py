"""MoE router on the GPU: scores, top-k and renormalisation of one token in one program, and
the router's GEMV fused in front of them for decode.

softmax scoring: p = softmax(logits), the k largest p (largest first), optionally divided by
their sum. sigmoid scoring: p = sigmoid(logits), experts chosen by the k largest p + bias,
weights p of the chosen (without the bias), optionally renormalised. Ties go to the lower
expert id. One launch per layer where torch runs five to seven (cast, softmax, top-k's sort
and gather, sum, divide).

`gate_route_triton` also computes the logits (x @ W^T of the float router weight, fp32 sums,
rounded to x's dtype as `F.linear` returns them): the experts are split over several programs
per token (one program reading the whole weight would take microseconds), and the last of a
token's programs to finish (an atomic counter, which it resets for the next call: CUDA-graph
safe) scores the token. One launch where the unfused path runs three (GEMM, cast, route).
`norm_gate_route_triton` puts the post-attention residual step and RMSNorm in front; at decode
its programs split the hidden size instead (each a slice of every router row, the partial
logits added in slice order by the last), where each of the expert split's programs redid the
whole row's norm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken import env
from freetoken.kernels.triton import pdl
from freetoken.kernels.triton.arrive import counters, last_to_arrive
from freetoken.kernels.triton.gemv_i8 import quant_store, xq_len
from freetoken.kernels.triton.pdl import wait

_NO_KEY = tl.constexpr(-(2 ** 31))  # `_route_row`'s key of an expert that is no candidate


@triton.jit
def _route_row(x, e, ok, t, bias_ptr, ids_ptr, w_ptr, SIGMOID: tl.constexpr,
               HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, TOPK: tl.constexpr,
               BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Route token t from its fp32 logits x [BLOCK_E] (-inf where not `ok`).

    The program is one warp (up to 256 experts), and its chain of serial reductions is the
    kernel's latency. The top-k runs on int32 keys, the choices' fp32 bits made
    order-preserving, because a warp reduces a 32-bit integer in one instruction (redux.sync,
    sm_80 and later) where a float's max or sum takes five shuffle rounds: a round is a max of
    the keys and a min of the ids that hold it (ties to the lower id). Where the choice is p
    (no bias) the weight is the winning key's float, else a sum outside the chain. Measured on
    the H200 (CUDA graph, 8 of 128 experts, bf16): the fused norm + router 5.3 us against 5.9
    with float max / int min / float sum rounds, the router alone 1.8 against 2.4; one int64
    max of (key, BLOCK_E - 1 - id) a round, ten shuffles, was slower than either (6.1, 2.5)."""
    if SIGMOID:
        p = tl.sigmoid(x)
        choice = p
        if HAS_BIAS:
            choice = p + tl.load(bias_ptr + e, mask=ok, other=0.0)
    else:
        z = tl.exp(x - tl.max(x, axis=0))
        p = z / tl.sum(z, axis=0)
        choice = p
    # a negative float's bits grow with its magnitude: flipping the 31 below the sign makes
    # integer order float order, and the flip undoes itself (no choice is -0.0 or NaN: equal
    # keys are equal choices)
    bits = choice.to(tl.int32, bitcast=True)
    key = tl.where(ok, tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits), _NO_KEY)
    kk = tl.arange(0, BLOCK_K)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    ws = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        best = tl.max(key, axis=0)
        idx = tl.min(tl.where(key == best, e, BLOCK_E), axis=0)  # lowest id on ties
        if HAS_BIAS:
            wj = tl.sum(tl.where(e == idx, p, 0.0), axis=0)
        else:
            wj = tl.where(best < 0, best ^ 0x7FFFFFFF, best).to(tl.float32, bitcast=True)
        ids = tl.where(kk == j, idx.to(tl.int64), ids)
        ws = tl.where(kk == j, wj, ws)
        key = tl.where(e == idx, _NO_KEY, key)
    if RENORM:
        ws = ws / tl.sum(ws, axis=0)
    kmask = kk < TOPK
    tl.store(ids_ptr + t * TOPK + kk, ids, mask=kmask)
    tl.store(w_ptr + t * TOPK + kk, ws, mask=kmask)


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, E, stride_l, SIGMOID: tl.constexpr,
                  HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, TOPK: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)  # pdl.py: the kernel before has completed
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    x = tl.load(logits_ptr + t * stride_l + e, mask=ok, other=float("-inf")).to(tl.float32)
    _route_row(x, e, ok, t, bias_ptr, ids_ptr, w_ptr, SIGMOID, HAS_BIAS, RENORM, TOPK,
               BLOCK_E, BLOCK_K)


@triton.jit
def _gate_route_kernel(x_ptr, g_ptr, logits_ptr, count_ptr, bias_ptr, ids_ptr, w_ptr, E,
                       stride_x, stride_g, H: tl.constexpr, SIGMOID: tl.constexpr,
                       HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, TOPK: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BE: tl.constexpr,
                       BK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (t, b): logits of experts [b BE, (b + 1) BE) for token t into logits [T, E]
    (fp32 scratch); the token's last program routes it."""
    wait(PDL)  # pdl.py: the kernel before has completed
    t = tl.program_id(0).to(tl.int64)
    eb = tl.program_id(1) * BE + tl.arange(0, BE)
    eb_ok = eb < E
    acc = tl.zeros((BE,), dtype=tl.float32)
    for k0 in tl.range(0, H, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < H
        g = tl.load(g_ptr + eb[:, None].to(tl.int64) * stride_g + k[None, :],
                    mask=eb_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        xv = tl.load(x_ptr + t * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)
        acc += tl.sum(g * xv[None, :], axis=1)
    logit = acc.to(x_ptr.dtype.element_ty).to(tl.float32)  # F.linear's output dtype (HF)
    _store_and_route(logit, eb, eb_ok, t, E, logits_ptr, count_ptr, bias_ptr, ids_ptr, w_ptr,
                     SIGMOID, HAS_BIAS, RENORM, TOPK, BLOCK_E, BLOCK_K)


@triton.jit
def _store_and_route(logit, eb, eb_ok, t, E, logits_ptr, count_ptr, bias_ptr, ids_ptr, w_ptr,
                     SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                     TOPK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """A program's logits of experts eb into logits [T, E] (fp32 scratch); the last of token
    t's programs to arrive routes the token."""
    tl.store(logits_ptr + t * E + eb, logit, mask=eb_ok)
    if last_to_arrive(count_ptr + t, tl.num_programs(1)):
        e = tl.arange(0, BLOCK_E)
        ok = e < E
        x = tl.load(logits_ptr + t * E + e, mask=ok, other=float("-inf"),
                    cache_modifier=".cg")  # from L2: other SMs wrote them
        _route_row(x, e, ok, t, bias_ptr, ids_ptr, w_ptr, SIGMOID, HAS_BIAS, RENORM, TOPK,
                   BLOCK_E, BLOCK_K)


@triton.jit
def _residual(x_row, r_row, cols, ok):
    """x + residual at cols of a row, rounded to x's dtype as torch's add rounds it."""
    x = tl.load(x_row + cols, mask=ok, other=0.0)
    r = tl.load(r_row + cols, mask=ok, other=0.0)
    return (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)


@triton.jit
def _residual_inv(x_row, r_row, cols, ok, H: tl.constexpr, eps):
    """(s = x + residual over the row, 1 / rms(s)): the RMSNorm kernel's arithmetic."""
    s = _residual(x_row, r_row, cols, ok)
    sf = s.to(tl.float32)
    return s, 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / H + eps)


@triton.jit
def _norm_gate_route_kernel(x_ptr, r_ptr, nw_ptr, y_ptr, s_ptr, q_ptr, g_ptr, logits_ptr,
                            count_ptr, bias_ptr, ids_ptr, w_ptr, E, stride_x, stride_r,
                            stride_y, stride_s, stride_q, stride_g, eps, H: tl.constexpr,
                            QUANT: tl.constexpr, SIGMOID: tl.constexpr,
                            HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, TOPK: tl.constexpr,
                            BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BE: tl.constexpr,
                            BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    """Program (t, b): s = x + residual and y = rms_norm(s) of token t (norm.py's arithmetic,
    recomputed by each of the token's programs from 2 H values), stored with y's int8 codes by
    program b = 0; then the router's logits of experts [b BE, (b + 1) BE) from y, and the
    token's last program routes it (as `_gate_route_kernel`)."""
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    cols = tl.arange(0, BLOCK_H)
    ok = cols < H
    eb = b * BE + tl.arange(0, BE)
    eb_ok = eb < E
    # the router's rows first: no kernel writes them, so their loads (from HBM) are issued
    # before the wait and overlap it and the norm's loads (L2)
    g = tl.load(g_ptr + eb[:, None].to(tl.int64) * stride_g + cols[None, :],
                mask=eb_ok[:, None] & ok[None, :], other=0.0)
    wait(PDL)  # pdl.py: the kernel before has completed
    x, inv = _residual_inv(x_ptr + t * stride_x, r_ptr + t * stride_r, cols, ok, H, eps)
    xf = x.to(tl.float32)
    nw = tl.load(nw_ptr + cols, mask=ok, other=0.0)
    y = (xf * inv * nw).to(y_ptr.dtype.element_ty)
    if b == 0:
        tl.store(s_ptr + t * stride_s + cols, x, mask=ok)
        tl.store(y_ptr + t * stride_y + cols, y, mask=ok)
        if QUANT:  # the int8 GEMVs' activation, as the RMSNorm kernel quantizes it
            quant_store(tl.reshape(y.to(tl.float32), (1, BLOCK_H)), q_ptr + t * stride_q, 0,
                        tl.arange(0, 1) < 1, H)
    logit = tl.sum(g.to(tl.float32) * y.to(tl.float32)[None, :], axis=1)
    logit = logit.to(y_ptr.dtype.element_ty).to(tl.float32)  # F.linear's output dtype (HF)
    _store_and_route(logit, eb, eb_ok, t, E, logits_ptr, count_ptr, bias_ptr, ids_ptr, w_ptr,
                     SIGMOID, HAS_BIAS, RENORM, TOPK, BLOCK_E, BLOCK_K)


@triton.jit
def _norm_gate_route_split_kernel(x_ptr, r_ptr, nw_ptr, y_ptr, s_ptr, q_ptr, g_ptr, part_ptr,
                                  count_ptr, bias_ptr, ids_ptr, w_ptr, E, stride_x, stride_r,
                                  stride_y, stride_s, stride_q, stride_g, eps,
                                  H: tl.constexpr, QUANT: tl.constexpr,
                                  SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                                  RENORM: tl.constexpr, TOPK: tl.constexpr,
                                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                                  BH: tl.constexpr, P: tl.constexpr, PP: tl.constexpr,
                                  BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    """Program (t, p): the same residual step and routes as `_norm_gate_route_kernel`, split
    by hidden slices instead of experts: the row's sum of squares (every program, from the
    whole row: the same inv), then s, y and y's codes of values [p BH, (p + 1) BH) stored,
    and every expert's partial logit over the slice into part [T, PP, BLOCK_E] (fp32, PP the
    power of two from P); the token's last program adds the P partials in slice order (fixed:
    deterministic) and routes the token. A program reads a slice of every router row where
    the expert split reads whole rows, and its warps share the row's norm instead of each
    program redoing it in one."""
    t = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    k = p * BH + tl.arange(0, BH)
    k_ok = k < H
    # the router's slice first: no kernel writes it, its loads overlap the wait
    g = tl.load(g_ptr + e[:, None].to(tl.int64) * stride_g + k[None, :],
                mask=e_ok[:, None] & k_ok[None, :], other=0.0)
    wait(PDL)  # pdl.py: the kernel before has completed
    cols = tl.arange(0, BLOCK_H)
    _, inv = _residual_inv(x_ptr + t * stride_x, r_ptr + t * stride_r, cols, cols < H, H, eps)
    xs = _residual(x_ptr + t * stride_x, r_ptr + t * stride_r, k, k_ok)  # the slice's values
    nw = tl.load(nw_ptr + k, mask=k_ok, other=0.0)
    y = (xs.to(tl.float32) * inv * nw).to(y_ptr.dtype.element_ty)
    tl.store(s_ptr + t * stride_s + k, xs, mask=k_ok)
    tl.store(y_ptr + t * stride_y + k, y, mask=k_ok)
    if QUANT:  # the int8 GEMVs' activation, this slice's blocks of it
        quant_store(tl.reshape(y.to(tl.float32), (1, BH)), q_ptr + t * stride_q, p * BH,
                    tl.arange(0, 1) < 1, H)
    part = tl.sum(g.to(tl.float32) * y.to(tl.float32)[None, :], axis=1)
    tl.store(part_ptr + (t * PP + p) * BLOCK_E + e, part)
    if last_to_arrive(count_ptr + t, P):
        pp = tl.arange(0, PP)
        parts = tl.load(part_ptr + (t * PP + pp)[:, None] * BLOCK_E + e[None, :],
                        mask=(pp < P)[:, None], other=0.0,
                        cache_modifier=".cg")  # from L2: other SMs wrote them
        logit = tl.sum(parts, axis=0).to(y_ptr.dtype.element_ty).to(tl.float32)
        _route_row(tl.where(e_ok, logit, float("-inf")), e, e_ok, t, bias_ptr, ids_ptr, w_ptr,
                   SIGMOID, HAS_BIAS, RENORM, TOPK, BLOCK_E, BLOCK_K)


def _outputs(t: int, top_k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty((t, top_k), dtype=torch.int64, device=device),
            torch.empty((t, top_k), dtype=torch.float32, device=device))


def _warps(block_e: int) -> int:
    return 1 if block_e <= 256 else 4


def route_triton(logits: torch.Tensor, top_k: int, sigmoid: bool, renormalize: bool,
                 bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (unit stride in E), bias fp32 [E] or None -> (ids int64 [T, k],
    weights fp32 [T, k]). Checked by `freetoken.kernels.route`."""
    t, e = logits.shape
    ids, w = _outputs(t, top_k, logits.device)
    if t == 0:
        return ids, w
    block_e = triton.next_power_of_2(e)
    _route_kernel[(t,)](
        logits, bias if bias is not None else logits, ids, w, e, logits.stride(0),
        SIGMOID=sigmoid, HAS_BIAS=bias is not None, RENORM=renormalize, TOPK=top_k,
        BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k), num_warps=_warps(block_e),
        **pdl.opts())
    return ids, w


# Per-device arrival counters of the fused kernel, one per token, kept at zero between calls.
GATE_TOKENS = 64  # the fused kernel's token limit (decode); more tokens run GEMM + route


def _counts(device: torch.device) -> torch.Tensor:
    return counters("route", GATE_TOKENS, device)


def gate_route_triton(x: torch.Tensor, gate: torch.Tensor, top_k: int, sigmoid: bool,
                      renormalize: bool, bias: torch.Tensor | None, be: int = 2,
                      warps: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (T <= GATE_TOKENS, unit stride in H), gate [E, H] float (unit stride in H),
    bias fp32 [E] or None -> route_triton's (ids, weights) of the logits x @ gate^T in x's
    dtype. `be` experts per program, `warps` per program. Checked by
    `freetoken.kernels.route`.

    Measured on the H200 (bench_gpu_kernels.py --router, 128 experts, hidden 2048, bf16, CUDA
    graph): 2 experts and one warp per program 4.4 us at 1 token, 5.3 at 16, against the
    unfused GEMM + cast + route 8.3 / 9.7; 8 experts with 4 warps 8.6 / 8.8 (fewer programs
    streaming the weight, a 4-warp top-k)."""
    t, h = x.shape
    e = gate.shape[0]
    ids, w = _outputs(t, top_k, x.device)
    if t == 0:
        return ids, w
    logits = torch.empty((t, e), dtype=torch.float32, device=x.device)
    block_e = triton.next_power_of_2(e)
    _gate_route_kernel[(t, triton.cdiv(e, be))](
        x, gate, logits, _counts(x.device), bias if bias is not None else logits, ids, w, e,
        x.stride(0), gate.stride(0), H=h, SIGMOID=sigmoid, HAS_BIAS=bias is not None,
        RENORM=renormalize, TOPK=top_k, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
        BE=be, BK=min(2048, triton.next_power_of_2(h)), num_warps=warps, **pdl.opts())
    return ids, w


NORM_ROUTE_MAX_H = 4096  # the fused norm + router keeps a whole row in each program
# (experts, warps) per program of the fused norm + router: each program recomputes the
# token's residual sum and RMSNorm from the whole row, then its experts' logits
NORM_ROUTE_TILES = (2, 1)
# (hidden values, warps) per program of the split form (`_norm_gate_route_split_kernel`), the
# default at decode; 0: the expert split above. Measured on an H100 (2026-12-07,
# bench_gpu_kernels.py --norm-router, 128 x 2048 bf16 router from HBM, us at 1 / 4 / 16
# tokens): expert split 2 x 1 5.80 / 6.23 / 7.00 (the best other, 1 x 1, 5.56 / 5.96 / 9.13);
# by slices 32 x 2 5.07 / 5.59 / 7.13, 64 x 4 5.11 / 5.31 / 6.57, 128 x 4 5.29 / 5.42 / 6.25.
# Under ncu the expert split's one-warp programs held 255 registers and issued an instruction
# every 5 cycles: each redid the whole row's norm in one warp. End to end (ab_env.py, 30B
# Q4_K fused, H100, medians of 2 rounds): batch 1 425.1 -> 434.2 tok/s with 32 x 2; with
# 64 x 4 and the dense GEMV's 8 warps (linear.py: I8_WARPS) 420.4 -> 439.2, batch 16 2,214.5
# -> 2,209.8
NORM_ROUTE_SPLIT = (64, 4)


def norm_gate_route_triton(x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor,
                           eps: float, quantize: bool, gate: torch.Tensor, top_k: int,
                           sigmoid: bool, renormalize: bool, bias: torch.Tensor | None,
                           be: int | None = None, warps: int | None = None,
                           split: tuple[int, int] | None = None):
    """The post-attention residual step and the MoE router in one launch: x, residual [T, H]
    (T <= GATE_TOKENS, H <= NORM_ROUTE_MAX_H, unit stride in H), norm_w fp32 [H], gate [E, H]
    in x's dtype -> (y = rms_norm(x + residual), x + residual, y's int8 codes with `quantize`
    else None, ids, weights): `rms_norm_triton`'s three outputs and `gate_route_triton`'s
    routes of y. Checked by `freetoken.kernels.route.add_rms_norm_route`.
    `be` experts and `warps` warps per program: FREETOKEN_GPU_NORM_ROUTE_TILES where not
    given, else NORM_ROUTE_TILES. `split` (BH, warps): programs by hidden slices of BH values
    instead (`_norm_gate_route_split_kernel`; FREETOKEN_GPU_NORM_ROUTE_SPLIT where not given,
    else NORM_ROUTE_SPLIT; BH a power of two from 32, 0: off)."""
    if split is None:
        split = env.gpu_norm_route_split() or NORM_ROUTE_SPLIT
    if be is None or warps is None:  # read (and checked) whichever split runs
        be, warps = env.gpu_norm_route_tiles() or NORM_ROUTE_TILES
    t, h = x.shape
    e = gate.shape[0]
    y = torch.empty_like(x)
    s = torch.empty_like(x)
    q = torch.empty((t, xq_len(h)), dtype=torch.int32, device=x.device) if quantize else None
    ids, w = _outputs(t, top_k, x.device)
    if t == 0:
        return y, s, q, ids, w
    if quantize and h % 32:
        raise ValueError(f"norm_gate_route: quantize needs a width that is a multiple of 32, "
                         f"got {h}")
    q_ = q if q is not None else y
    block_e = triton.next_power_of_2(e)

    def args(scratch: torch.Tensor) -> tuple:  # both kernels' leading arguments
        return (x, residual, norm_w, y, s, q_, gate, scratch, _counts(x.device),
                bias if bias is not None else scratch, ids, w, e, x.stride(0),
                residual.stride(0), y.stride(0), s.stride(0), q_.stride(0), gate.stride(0),
                float(eps))

    consts = dict(H=h, QUANT=quantize, SIGMOID=sigmoid, HAS_BIAS=bias is not None,
                  RENORM=renormalize, TOPK=top_k, BLOCK_E=block_e,
                  BLOCK_K=triton.next_power_of_2(top_k), BLOCK_H=triton.next_power_of_2(h),
                  **pdl.opts(),
                  enable_fp_fusion=False)  # x * 127 / amax + 1/2 unfused, as in the RMSNorm
    if split[0]:
        bh = min(split[0], triton.next_power_of_2(h))
        n_p = triton.cdiv(h, bh)
        parts = torch.empty((t, triton.next_power_of_2(n_p), block_e), dtype=torch.float32,
                            device=x.device)
        _norm_gate_route_split_kernel[(t, n_p)](*args(parts), BH=bh, P=n_p, PP=parts.shape[1],
                                                num_warps=split[1], **consts)
        return y, s, q, ids, w
    logits = torch.empty((t, e), dtype=torch.float32, device=x.device)
    _norm_gate_route_kernel[(t, triton.cdiv(e, be))](*args(logits), BE=be, num_warps=warps,
                                                     **consts)
    return y, s, q, ids, w
