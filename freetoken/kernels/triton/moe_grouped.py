"""Fused MoE at decode batches (2-16 tokens): each expert's weights read once per step.

The per-route GEMV of `moe.py` reads an expert once for every route that picks it (at 16
tokens, top-8 over 128 experts: 128 routes for about 82 distinct experts). Here routes are
grouped by slot on the device and one program per (group, BN output rows) reads the group's
weight rows once and multiplies them by every routed token's activations:
1. `_group_kernel` (one program, no host sync, fixed shapes): each route's slot (through the
   expert map, -1 = skip), its rank among the earlier routes of its slot, and groups of at
   most BT routes of one slot (a slot with more routes gets several groups). Tables are sized
   by the worst case, R groups; after the last group each route mapped to -1 gets a group of
   its own (slot -1), then the rest hold no route and exit at once.
2. gate/up: a[r, n] = glu(x Wg^T * s[slot, 0], x Wu^T * s[slot, 1]);
3. down: y[r, :] = (a[r] Wd^T) * s[slot, 2] * route_weight[r];
then each token's k rows are summed in route order in fp32 (deterministic): by the int8 down
kernel's last-arriving programs (`arrive.sum_when_last`, as `moe._down_kernel` sums at decode) or
by `moe._sum_routes_kernel`.
Two kernels for each step:
- int8 (`_gate_up_i8_kernel`, `_down_i8_kernel`; NVFP4, Q4_K and split Q8_0 with 16-bit
  activations, where the per-route path takes int8 dots): `moe.py`'s decode GEMV of
  `gemv_i8.py` with the weights hoisted out of the token loop: each chunk of weight words is
  loaded and expanded once (`i8_weights`: Q4_K's nibbles and 6-bit scales, NVFP4's codes as
  int8 magnitudes) and dotted with each of the group's BT token code rows (`i8_dot`: dp4a, the
  block scales in the fp32 epilogue). Per route the chunks, integer sums and fp32 operations
  are the per-route kernel's, so with the same row blocks and chunks a route's a (or its codes,
  quantized for down as the per-route path does: `QA`) and y are its bits. A group's empty
  places are computed on a real row and dropped (no branch: every chunk's loads go out
  before the first dots wait on them);
- fp32 (other formats, fp32 activations): broadcast FMAs over [BT, BN, BK] (`multi_dot`, the
  GEMV's block-scale association of `gemv.py` with a token axis in front): at a few tokens per
  expert a tensor-core tile would be mostly padding.
Status: both are correct (tests/kernels/test_triton_moe_grouped.py: the int8 kernels bit for
bit against the per-route int8 path in Triton's interpreter) and both measured slower than the
per-route GEMV on the H200 (numbers at `moe.GROUPED_TOKENS`): the fp32 kernels 2-5x (the
padded fp32 FMAs bound them, not the bytes), the int8 ones about 2x at 4-16 tokens (their
narrow row blocks: a group's expanded chunks stay in registers for its BT dots). So
`fused_moe_triton` runs them on request only (`grouped=True`, or FREETOKEN_GPU_MOE_GROUPED).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton.arrive import sum_when_last
from freetoken.kernels.triton.gemv import _e2m1_scaled
from freetoken.kernels.triton.gemv_i8 import asm, i8_dot, i8_weights, quant_store_rows, x_chunk
from freetoken.kernels.triton.linear import _row_ptrs
from freetoken.kernels.triton.quant import _e4m3, _f16, _k4_scale_min, decode_tile

MAX_ROUTES = 256  # the group kernel holds an [R, R] comparison in one program


# -- dot products of BT activation rows with BN weight rows over BK values ------------------------
@triton.jit
def _nvfp4_multi(w_rows, s_rows, x_rows, x_ok, k0, n_ok, BK: tl.constexpr):
    G: tl.constexpr = BK // 16
    g = tl.arange(0, G)
    i = tl.arange(0, 8)
    q = tl.load(w_rows[:, :, None] + (k0 // 2 + 8 * g)[None, :, None] + i[None, None, :],
                mask=n_ok[:, None, None], other=0).to(tl.int32)  # [BN, G, 8]
    w_lo = _e2m1_scaled(q & 15)
    w_hi = _e2m1_scaled(q >> 4)
    xk = x_rows[:, None, None] + (k0 + 16 * g[:, None] + 2 * i[None, :])[None]  # [BT, G, 8]
    xm = x_ok[:, None, None]
    x_lo = tl.load(xk, mask=xm, other=0.0).to(tl.float32)
    x_hi = tl.load(xk + 1, mask=xm, other=0.0).to(tl.float32)
    part = tl.sum(w_lo[None] * x_lo[:, None] + w_hi[None] * x_hi[:, None], axis=3)  # [BT,BN,G]
    s = _e4m3(tl.load(s_rows + k0 // 16 + g[None, :], mask=n_ok[:, None], other=0).to(tl.int32))
    return tl.sum(part * (s * 16384.0)[None], axis=2)  # 2^14 undoes the decode's 2^-14 (exact)


@triton.jit
def _q8_0_multi(w_rows, x_rows, x_ok, k0, n_ok, BK: tl.constexpr):
    G: tl.constexpr = BK // 32
    g = tl.arange(0, G)
    i = tl.arange(0, 32)
    blk = w_rows + (k0 // 32 + g[None, :]) * 34  # [BN, G]
    q = tl.load(blk[:, :, None] + 2 + i[None, None, :], mask=n_ok[:, None, None], other=0)
    q = q.to(tl.int8, bitcast=True).to(tl.float32)
    xk = x_rows[:, None, None] + (k0 + 32 * g[:, None] + i[None, :])[None]  # [BT, G, 32]
    x = tl.load(xk, mask=x_ok[:, None, None], other=0.0).to(tl.float32)
    part = tl.sum(q[None] * x[:, None], axis=3)  # [BT, BN, G]
    return tl.sum(part * _f16(blk, n_ok[:, None])[None], axis=2)


@triton.jit
def _q4_k_multi(w_rows, x_rows, x_ok, k0, n_ok, BK: tl.constexpr):
    """BK = 256, one super-block per row (layout: `gemv._q4_k_dot`)."""
    blk = w_rows + (k0 // 256) * 144  # [BN, 1]
    g = tl.arange(0, 4)
    j = tl.arange(0, 32)
    q = tl.load(blk[:, :, None] + 16 + 32 * g[None, :, None] + j[None, None, :],
                mask=n_ok[:, None, None], other=0).to(tl.int32)  # [BN, 4, 32]
    xk = x_rows[:, None, None] + (k0 + 64 * g[:, None] + j[None, :])[None]  # [BT, 4, 32]
    xm = x_ok[:, None, None]
    x_lo = tl.load(xk, mask=xm, other=0.0).to(tl.float32)
    x_hi = tl.load(xk + 32, mask=xm, other=0.0).to(tl.float32)
    dot_lo = tl.sum((q & 15).to(tl.float32)[None] * x_lo[:, None], axis=3)  # [BT, BN, 4]
    dot_hi = tl.sum((q >> 4).to(tl.float32)[None] * x_hi[:, None], axis=3)
    m2 = n_ok[:, None]
    sc_lo, mn_lo = _k4_scale_min(blk + 4, 2 * g[None, :], m2)  # [BN, 4]
    sc_hi, mn_hi = _k4_scale_min(blk + 4, 2 * g[None, :] + 1, m2)
    d = _f16(blk, m2)[None]  # [1, BN, 1]
    dmin = _f16(blk + 2, m2)[None]
    sums = sc_lo.to(tl.float32)[None] * dot_lo + sc_hi.to(tl.float32)[None] * dot_hi
    mins = mn_lo.to(tl.float32)[None] * tl.sum(x_lo, axis=2)[:, None] \
        + mn_hi.to(tl.float32)[None] * tl.sum(x_hi, axis=2)[:, None]
    return tl.sum(d * sums - dmin * mins, axis=2)


@triton.jit
def multi_dot(FMT: tl.constexpr, w_rows, s_rows, x_rows, x_ok, k0, n_ok, BK: tl.constexpr):
    """fp32 [BT, BN]: sum over k0 <= k < k0 + BK of W[n, k] x_t[k] for the BT activation rows
    at `x_rows` ([BT] pointers, `x_ok` which exist); K a multiple of BK. NVFP4, Q8_0 and Q4_K
    apply block scales once per block (as `gemv.gemv_block`); other formats multiply the
    codecs' exact values (`quant.decode_tile`)."""
    if FMT == 1:
        acc = _nvfp4_multi(w_rows, s_rows, x_rows, x_ok, k0, n_ok, BK)
    elif FMT == 12:
        acc = _q8_0_multi(w_rows, x_rows, x_ok, k0, n_ok, BK)
    elif FMT == 13:
        acc = _q4_k_multi(w_rows, x_rows, x_ok, k0, n_ok, BK)
    else:
        k = k0 + tl.arange(0, BK)
        w = decode_tile(FMT, w_rows, s_rows, k[None, :], n_ok[:, None])  # [BN, BK]
        x = tl.load(x_rows[:, None] + k[None, :], mask=x_ok[:, None], other=0.0)
        acc = tl.sum(w[None] * x.to(tl.float32)[:, None], axis=2)
    return acc


# -- routes grouped by slot on the device ---------------------------------------------------------
@triton.jit
def _group_kernel(ids_ptr, map_ptr, grp_slot_ptr, grp_cnt_ptr, grp_routes_ptr, R,
                  RP: tl.constexpr, BT: tl.constexpr, HAS_MAP: tl.constexpr):
    """Groups of at most BT routes sharing a slot, numbered in the order of their first route.

    Route i of slot s with rank q (earlier routes of s) sits at grp_routes[G * BT + q % BT]
    where G is its group: the number of group leaders (routes with q % BT == 0) before the
    leader of its own chunk. grp_slot[G] = s and grp_cnt[G] = routes in the group; groups
    G >= the number of groups get slot -1: first one for each route whose slot is -1, in
    route order (count 1, the route in place 0), then empty ones (count 0). Nothing else is
    written (masked reads only)."""
    i = tl.arange(0, RP)
    ok = i < R
    e = tl.load(ids_ptr + i, mask=ok, other=0).to(tl.int32)
    if HAS_MAP:
        s = tl.load(map_ptr + e, mask=ok, other=-1)
    else:
        s = e
    s = tl.where(ok, s, -1)
    valid = s >= 0
    same = (s[:, None] == s[None, :]) & valid[:, None]  # [RP, RP]: row i, column j
    before = i[None, :] < i[:, None]  # j < i
    rank = tl.sum((same & before).to(tl.int32), axis=1)
    count = tl.sum(same.to(tl.int32), axis=1)
    chunk = rank // BT * BT  # rank of the leader of i's group
    lead = valid & (rank == chunk)
    # i's leader: the route j of i's slot whose rank is `chunk`; G = leaders before it
    is_mine = same & (rank[None, :] == chunk[:, None])
    leader = tl.max(tl.where(is_mine, i[None, :], -1), axis=1)
    grp = tl.sum((lead[None, :] & (i[None, :] < leader[:, None])).to(tl.int32), axis=1)
    tl.store(grp_routes_ptr + grp * BT + rank - chunk, i, mask=valid)
    tl.store(grp_slot_ptr + grp, s, mask=lead)
    tl.store(grp_cnt_ptr + grp, tl.minimum(count - rank, BT), mask=lead)
    groups = tl.sum(lead.to(tl.int32), axis=0)
    # a route mapped to -1 (computed elsewhere) gets a group of its own after the others, slot
    # -1 and one route (the int8 down kernel writes its zero row and counts it for its token's
    # sum); the groups after those hold no route (count 0)
    away = ok & ~valid
    nth = tl.sum((away[None, :] & before).to(tl.int32), axis=1)
    tl.store(grp_routes_ptr + (groups + nth) * BT, i, mask=away)
    n_away = tl.sum(away.to(tl.int32), axis=0)
    rest = ok & (i >= groups)
    tl.store(grp_slot_ptr + i, tl.full((RP,), -1, tl.int32), mask=rest)
    tl.store(grp_cnt_ptr + i, (i < groups + n_away).to(tl.int32), mask=rest)


@triton.jit
def _group_routes(grp_slot_ptr, grp_cnt_ptr, grp_routes_ptr, BT: tl.constexpr):
    g = tl.program_id(0)
    slot = tl.load(grp_slot_ptr + g)
    t = tl.arange(0, BT)
    r_ok = t < tl.load(grp_cnt_ptr + g)
    routes = tl.load(grp_routes_ptr + g * BT + t, mask=r_ok, other=0)
    return slot, routes, r_ok


# -- the two expert kernels -----------------------------------------------------------------------
@triton.jit
def glu(g, u, ACT: tl.constexpr):
    """The experts' GLU in fp32 (ACT 0: silu, 1: gelu_tanh), shared by moe.py's kernels."""
    if ACT == 0:
        a = g * tl.sigmoid(g) * u
    else:  # gelu, tanh approximation; tanh(z) = 2 sigmoid(2z) - 1
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (2.0 * tl.sigmoid(2.0 * z)) * u
    return a


@triton.jit
def gate_up_rows(w_ptr, s_ptr, slot, rn, stride_ws, stride_ss, stride_wn, stride_sn,
                 INTER: tl.constexpr, FMT: tl.constexpr):
    """The gate rows rn and the up rows INTER + rn of a slot's w13 (weight and block-scale
    pointers, `linear._row_ptrs`): (wg, sg, wu, su)."""
    w_slot = w_ptr + slot.to(tl.int64) * stride_ws
    s_slot = s_ptr + slot.to(tl.int64) * stride_ss
    wg, sg = _row_ptrs(w_slot, s_slot, rn, stride_wn, stride_sn, FMT)
    wu, su = _row_ptrs(w_slot, s_slot, rn + INTER, stride_wn, stride_sn, FMT)
    return wg, sg, wu, su


@triton.jit
def _gate_up_grouped_kernel(x_ptr, w_ptr, s_ptr, bank_s_ptr, grp_slot_ptr, grp_cnt_ptr,
                            grp_routes_ptr, a_ptr, stride_xm, stride_ws, stride_wn, stride_ss,
                            stride_sn, stride_am, K: tl.constexpr, INTER: tl.constexpr,
                            TOPK: tl.constexpr, FMT: tl.constexpr, ACT: tl.constexpr,
                            BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                            UNROLL: tl.constexpr, stride_bs=4):
    slot, routes, r_ok = _group_routes(grp_slot_ptr, grp_cnt_ptr, grp_routes_ptr, BT)
    if slot < 0:
        return
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = rn < INTER
    wg, sg, wu, su = gate_up_rows(w_ptr, s_ptr, slot, rn, stride_ws, stride_ss, stride_wn,
                                  stride_sn, INTER, FMT)
    x_rows = x_ptr + (routes // TOPK).to(tl.int64) * stride_xm  # [BT]
    acc_g = tl.zeros((BT, BN), dtype=tl.float32)
    acc_u = tl.zeros((BT, BN), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, loop_unroll_factor=UNROLL):
        acc_g += multi_dot(FMT, wg, sg, x_rows, r_ok, k0, n_ok, BK)
        acc_u += multi_dot(FMT, wu, su, x_rows, r_ok, k0, n_ok, BK)
    s = bank_s_ptr + slot * stride_bs
    a = glu(acc_g * tl.load(s), acc_u * tl.load(s + 1), ACT)
    out = a_ptr + routes[:, None].to(tl.int64) * stride_am + rn[None, :]
    tl.store(out, a, mask=r_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_grouped_kernel(a_ptr, w_ptr, s_ptr, bank_s_ptr, grp_slot_ptr, grp_cnt_ptr,
                         grp_routes_ptr, route_w_ptr, y_ptr, stride_am, stride_ws, stride_wn,
                         stride_ss, stride_sn, stride_ym, K: tl.constexpr,
                         HIDDEN: tl.constexpr, FMT: tl.constexpr, BT: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr, UNROLL: tl.constexpr,
                         stride_bs=4):
    slot, routes, r_ok = _group_routes(grp_slot_ptr, grp_cnt_ptr, grp_routes_ptr, BT)
    if slot < 0:
        return
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = rn < HIDDEN
    w_rows, s_rows = _row_ptrs(w_ptr + slot.to(tl.int64) * stride_ws,
                               s_ptr + slot.to(tl.int64) * stride_ss, rn, stride_wn, stride_sn,
                               FMT)
    a_rows = a_ptr + routes.to(tl.int64) * stride_am  # [BT]
    acc = tl.zeros((BT, BN), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, loop_unroll_factor=UNROLL):
        acc += multi_dot(FMT, w_rows, s_rows, a_rows, r_ok, k0, n_ok, BK)
    r_w = tl.load(route_w_ptr + routes, mask=r_ok, other=0.0).to(tl.float32)
    y = acc * tl.load(bank_s_ptr + slot * stride_bs + 2) * r_w[:, None]
    out = y_ptr + routes[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(out, y, mask=r_ok[:, None] & n_ok[None, :])


# -- the two expert kernels in int8 dots ---------------------------------------------------------
@triton.jit
def _route_at(grp_routes_ptr, g, t: tl.constexpr, cnt, BT: tl.constexpr):
    """Place t of group g: its route, or route 0 where the group has fewer routes (an empty
    place is computed on real rows and dropped: no branch, the loads stay in flight)."""
    return tl.load(grp_routes_ptr + g * BT + t, mask=t < cnt, other=0)


@triton.jit
def _put(acc, t: tl.constexpr, v):
    """acc [BN, BT] with v [BN] added to column t; the other columns as they were."""
    return tl.where(tl.arange(0, acc.shape[1])[None, :] == t, acc + v[:, None], acc)


@triton.jit
def _gate_up_i8_kernel(x_ptr, w_ptr, s_ptr, bank_s_ptr, grp_slot_ptr, grp_cnt_ptr,
                       grp_routes_ptr, a_ptr, stride_xm, stride_ws, stride_wn, stride_ss,
                       stride_sn, stride_am, stride_bs, K: tl.constexpr, INTER: tl.constexpr,
                       TOPK: tl.constexpr, FMT: tl.constexpr, ACT: tl.constexpr,
                       BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       ASM: tl.constexpr, XQ: tl.constexpr, QA: tl.constexpr):
    """`moe._gate_up_kernel`'s int8 decode GEMV (XQ, QA as there) for the routes of a group:
    each chunk of the expert's gate and up rows is loaded and expanded once (`i8_weights`)
    and dotted with the chunk of every route's x (`i8_dot`), per route the chunks in the
    same order: the per-route kernel's bits."""
    slot, routes, r_ok = _group_routes(grp_slot_ptr, grp_cnt_ptr, grp_routes_ptr, BT)
    if slot < 0:
        return
    g = tl.program_id(0)
    cnt = tl.load(grp_cnt_ptr + g)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = rn < INTER
    wg, sg, wu, su = gate_up_rows(w_ptr, s_ptr, slot, rn, stride_ws, stride_ss, stride_wn,
                                  stride_sn, INTER, FMT)
    acc_g = tl.zeros((BN, BT), dtype=tl.float32)  # column t: the group's route t
    acc_u = tl.zeros((BN, BT), dtype=tl.float32)
    for k0 in tl.static_range(0, K, BK):
        chunk_g = i8_weights(FMT, wg, sg, k0, n_ok, BK, ASM, True)
        chunk_u = i8_weights(FMT, wu, su, k0, n_ok, BK, ASM, True)
        for t in tl.static_range(BT):
            r = _route_at(grp_routes_ptr, g, t, cnt, BT)
            xq = x_chunk(x_ptr + (r // TOPK).to(tl.int64) * stride_xm, k0, K, BK, FMT == 1, XQ)
            acc_g = _put(acc_g, t, i8_dot(FMT, chunk_g, xq, BK, ASM, True))
            acc_u = _put(acc_u, t, i8_dot(FMT, chunk_u, xq, BK, ASM, True))
    s = bank_s_ptr + slot * stride_bs
    a = glu(acc_g * tl.load(s), acc_u * tl.load(s + 1), ACT)  # [BN, BT]
    if QA:  # rows n0 .. n0 + BN of each route's codes: BN / 32 whole blocks
        quant_store_rows(tl.trans(a), a_ptr + routes.to(tl.int64) * stride_am,
                         tl.program_id(1) * BN, r_ok, INTER)
    else:
        out = a_ptr + routes[None, :].to(tl.int64) * stride_am + rn[:, None]
        tl.store(out, a, mask=n_ok[:, None] & r_ok[None, :])


@triton.jit
def _down_i8_kernel(a_ptr, w_ptr, s_ptr, bank_s_ptr, grp_slot_ptr, grp_cnt_ptr, grp_routes_ptr,
                    route_w_ptr, y_ptr, out_ptr, count_ptr, stride_am, stride_ws, stride_wn,
                    stride_ss, stride_sn, stride_ym, stride_om, stride_bs, K: tl.constexpr,
                    HIDDEN: tl.constexpr, TOPK: tl.constexpr, FMT: tl.constexpr,
                    BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ASM: tl.constexpr,
                    XQ: tl.constexpr, SUM: tl.constexpr):
    """`moe._down_kernel`'s int8 decode GEMV (XQ as there) for the routes of a group, the
    weight chunks expanded once as in `_gate_up_i8_kernel`: y[r, :] = (a[r] Wd^T) *
    s[slot, 2] * route_weight[r]. A route mapped to -1 (a group of its own, slot -1) gets its
    zero row. SUM: each route then counts for its token's sum (`arrive.sum_when_last`)."""
    g = tl.program_id(0)
    slot = tl.load(grp_slot_ptr + g)
    cnt = tl.load(grp_cnt_ptr + g)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = rn < HIDDEN
    if slot < 0:
        if cnt > 0:  # a route another path computes: its row reads zero
            r = tl.load(grp_routes_ptr + g * BT)
            tl.store(y_ptr + r.to(tl.int64) * stride_ym + rn, tl.zeros((BN,), tl.float32),
                     mask=n_ok)
            if SUM:
                sum_when_last(y_ptr, out_ptr, count_ptr, r // TOPK, rn, n_ok, stride_ym,
                              stride_om, TOPK)
        return
    t_ok = tl.arange(0, BT) < cnt
    routes = tl.load(grp_routes_ptr + g * BT + tl.arange(0, BT), mask=t_ok, other=0)
    w_rows, s_rows = _row_ptrs(w_ptr + slot.to(tl.int64) * stride_ws,
                               s_ptr + slot.to(tl.int64) * stride_ss, rn, stride_wn, stride_sn,
                               FMT)
    acc = tl.zeros((BN, BT), dtype=tl.float32)
    for k0 in tl.static_range(0, K, BK):
        chunk = i8_weights(FMT, w_rows, s_rows, k0, n_ok, BK, ASM, True)
        for t in tl.static_range(BT):
            r = _route_at(grp_routes_ptr, g, t, cnt, BT)
            xq = x_chunk(a_ptr + r.to(tl.int64) * stride_am, k0, K, BK, FMT == 1, XQ)
            acc = _put(acc, t, i8_dot(FMT, chunk, xq, BK, ASM, True))
    r_w = tl.load(route_w_ptr + routes, mask=t_ok, other=0.0).to(tl.float32)
    y = acc * tl.load(bank_s_ptr + slot * stride_bs + 2) * r_w[None, :]
    out = y_ptr + routes[None, :].to(tl.int64) * stride_ym + rn[:, None]
    tl.store(out, y, mask=n_ok[:, None] & t_ok[None, :])
    if SUM:
        for t in tl.static_range(BT):
            if t < cnt:
                r = _route_at(grp_routes_ptr, g, t, cnt, BT)
                sum_when_last(y_ptr, out_ptr, count_ptr, r // TOPK, rn, n_ok, stride_ym,
                              stride_om, TOPK)


# -- launchers ------------------------------------------------------------------------------------
def group_routes(topk_ids: torch.Tensor, expert_map: torch.Tensor | None,
                 bt: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grp_slot int32 [R], grp_cnt int32 [R], grp_routes int32 [R * bt]) on the device
    (`_group_kernel`); only the first `grp_cnt[g]` routes of a group are defined."""
    r = topk_ids.numel()
    if r > MAX_ROUTES:
        raise ValueError(f"fused_moe grouped: {r} routes, at most {MAX_ROUTES}")
    dev = topk_ids.device
    ids = topk_ids.reshape(-1)
    grp_slot = torch.empty(r, dtype=torch.int32, device=dev)
    grp_cnt = torch.empty(r, dtype=torch.int32, device=dev)
    grp_routes = torch.empty(r * bt, dtype=torch.int32, device=dev)
    rp = max(16, triton.next_power_of_2(r))
    _group_kernel[(1,)](ids, ids if expert_map is None else expert_map, grp_slot, grp_cnt,
                        grp_routes, r, RP=rp, BT=bt, HAS_MAP=expert_map is not None,
                        num_warps=4 if rp <= 64 else 8)
    return grp_slot, grp_cnt, grp_routes


def grouped_gate_up(x: torch.Tensor, w13: tuple[torch.Tensor, torch.Tensor], fmt: int,
                    scales: torch.Tensor, groups: tuple[torch.Tensor, ...], a: torch.Tensor,
                    act: int, h: int, inter: int, topk: int, bt: int,
                    tiles: tuple[int, int, int, bool], unroll: int = 1, xq: bool = False,
                    qa: bool = False) -> None:
    """Fills a's rows of the routes in `groups` (`group_routes` with BT = bt): fp32 [R, I],
    or with qa (int8) their codes [R, xq_len(I)] (`gemv_i8.quant_store`'s layout). x [T, H]:
    the activations, or with xq (int8) their rows quantized ahead (`kernels.xq`). `tiles`
    (BN, BK, num_warps, int8): the int8 kernel or the fp32 one (its K loop unrolled by
    `unroll`); BK divides H. `scales` [S, 4] rows of the bank's scales, the last dim dense."""
    bn, bk, warps, i8 = tiles
    (wd, ws), (grp_slot, grp_cnt, grp_routes) = w13, groups
    grid = (grp_slot.numel(), triton.cdiv(inter, bn))
    args = (x, wd, ws, scales, grp_slot, grp_cnt, grp_routes, a, x.stride(0), wd.stride(0),
            wd.stride(1), ws.stride(0), ws.stride(-2), a.stride(0))
    kw = dict(K=h, INTER=inter, TOPK=topk, FMT=fmt, ACT=act, BT=bt, BN=bn, BK=bk,
              num_warps=warps, enable_fp_fusion=False)
    if i8:
        _gate_up_i8_kernel[grid](*args, scales.stride(0), ASM=asm(), XQ=xq, QA=qa, **kw)
    else:
        _gate_up_grouped_kernel[grid](*args, UNROLL=unroll, stride_bs=scales.stride(0), **kw)


def grouped_down(a: torch.Tensor, w2: tuple[torch.Tensor, torch.Tensor], fmt: int,
                 scales: torch.Tensor, groups: tuple[torch.Tensor, ...], rw: torch.Tensor,
                 y: torch.Tensor, h: int, inter: int, topk: int, bt: int,
                 tiles: tuple[int, int, int, bool], unroll: int = 1, xq: bool = False,
                 sums: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Fills y [R, H] (fp32) with each grouped route's expert output, a as `grouped_gate_up`
    left it (xq: codes). A route mapped to -1 must read zero: the int8 kernel writes its zero
    row, the fp32 one leaves y as it is (zeroed by the caller). `sums` (out [T, H], zeroed
    int32 counters, at least T * cdiv(H, BN); int8 only): each token's rows are also summed
    into out, in route order (`arrive.sum_when_last`)."""
    bn, bk, warps, i8 = tiles
    (wd, ws), (grp_slot, grp_cnt, grp_routes) = w2, groups
    grid = (grp_slot.numel(), triton.cdiv(h, bn))
    kw = dict(K=inter, HIDDEN=h, FMT=fmt, BT=bt, BN=bn, BK=bk, num_warps=warps,
              enable_fp_fusion=False)
    strides = (a.stride(0), wd.stride(0), wd.stride(1), ws.stride(0), ws.stride(-2),
               y.stride(0))
    if i8:
        out, count = sums if sums is not None else (y, grp_cnt)  # (unused without SUM)
        _down_i8_kernel[grid](a, wd, ws, scales, grp_slot, grp_cnt, grp_routes, rw, y, out,
                              count, *strides, out.stride(0), scales.stride(0), TOPK=topk,
                              ASM=asm(), XQ=xq, SUM=sums is not None, **kw)
    else:
        _down_grouped_kernel[grid](a, wd, ws, scales, grp_slot, grp_cnt, grp_routes, rw, y,
                                   *strides, UNROLL=unroll, stride_bs=scales.stride(0), **kw)
