"""Fused MoE at decode batches (2-16 tokens): each expert's weights read once per step.

The per-route GEMV of `moe.py` reads an expert once for every route that picks it (at 16
tokens, top-8 over 128 experts: 128 routes for about 82 distinct experts). Here routes are
grouped by slot on the device and one program per (group, BN output rows) decodes the
group's weight rows once and multiplies them by every routed token's activations:
1. `_group_kernel` (one program, no host sync, fixed shapes): each route's slot (through the
   expert map, -1 = skip), its rank among the earlier routes of its slot, and groups of at
   most BT routes of one slot (a slot with more routes gets several groups). Tables are sized
   by the worst case, R groups; groups past the last one hold slot -1 and exit at once.
2. `_gate_up_grouped_kernel`: a[r, n] = glu(x Wg^T * s[slot, 0], x Wu^T * s[slot, 1]);
3. `_down_grouped_kernel`: y[r, :] = (a[r] Wd^T) * s[slot, 2] * route_weight[r];
then `moe._sum_routes_kernel` sums each token's k rows (fp32, deterministic).
The dot products are fp32 broadcast FMAs over [BT, BN, BK] (`multi_dot`, the GEMV's
block-scale association of `gemv.py` with a token axis in front): at a few tokens per expert a
tensor-core tile would be mostly padding.
Status: correct (tests/kernels/test_triton_moe_grouped.py) but measured 2-5x slower than the
per-route GEMV on the H200 (numbers at `moe.GROUPED_TOKENS`), so `fused_moe_triton` runs it on
request only (`grouped=True`). Its time grows with BT, not with the bytes: the padded fp32
FMAs over [BT, BN, BK] (most groups hold 1-2 routes) bound it, as the decode arithmetic per
weight bounds the per-route GEMV at 16 tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton.gemv import _e2m1_scaled
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
    G >= the number of groups get slot -1. Nothing else is written (masked reads only)."""
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
    tl.store(grp_slot_ptr + i, tl.full((RP,), -1, tl.int32), mask=ok & (i >= groups))


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
def _gate_up_grouped_kernel(x_ptr, w_ptr, s_ptr, bank_s_ptr, grp_slot_ptr, grp_cnt_ptr,
                            grp_routes_ptr, a_ptr, stride_xm, stride_ws, stride_wn, stride_ss,
                            stride_sn, stride_am, K: tl.constexpr, INTER: tl.constexpr,
                            TOPK: tl.constexpr, FMT: tl.constexpr, ACT: tl.constexpr,
                            BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                            UNROLL: tl.constexpr):
    slot, routes, r_ok = _group_routes(grp_slot_ptr, grp_cnt_ptr, grp_routes_ptr, BT)
    if slot < 0:
        return
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = rn < INTER
    w_slot = w_ptr + slot.to(tl.int64) * stride_ws
    s_slot = s_ptr + slot.to(tl.int64) * stride_ss
    wg, sg = _row_ptrs(w_slot, s_slot, rn, stride_wn, stride_sn, FMT)
    wu, su = _row_ptrs(w_slot, s_slot, rn + INTER, stride_wn, stride_sn, FMT)
    x_rows = x_ptr + (routes // TOPK).to(tl.int64) * stride_xm  # [BT]
    acc_g = tl.zeros((BT, BN), dtype=tl.float32)
    acc_u = tl.zeros((BT, BN), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, loop_unroll_factor=UNROLL):
        acc_g += multi_dot(FMT, wg, sg, x_rows, r_ok, k0, n_ok, BK)
        acc_u += multi_dot(FMT, wu, su, x_rows, r_ok, k0, n_ok, BK)
    s = bank_s_ptr + slot * 4
    a = glu(acc_g * tl.load(s), acc_u * tl.load(s + 1), ACT)
    out = a_ptr + routes[:, None].to(tl.int64) * stride_am + rn[None, :]
    tl.store(out, a, mask=r_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_grouped_kernel(a_ptr, w_ptr, s_ptr, bank_s_ptr, grp_slot_ptr, grp_cnt_ptr,
                         grp_routes_ptr, route_w_ptr, y_ptr, stride_am, stride_ws, stride_wn,
                         stride_ss, stride_sn, stride_ym, K: tl.constexpr,
                         HIDDEN: tl.constexpr, FMT: tl.constexpr, BT: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr, UNROLL: tl.constexpr):
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
    y = acc * tl.load(bank_s_ptr + slot * 4 + 2) * r_w[:, None]
    out = y_ptr + routes[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(out, y, mask=r_ok[:, None] & n_ok[None, :])


# -- launcher -------------------------------------------------------------------------------------
def group_routes(topk_ids: torch.Tensor, expert_map: torch.Tensor | None,
                 bt: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grp_slot int32 [R], grp_cnt int32 [R], grp_routes int32 [R * bt]) on the device; only
    the first `grp_cnt[g]` routes of a group with grp_slot[g] >= 0 are defined."""
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


def grouped_expert_kernels(x: torch.Tensor, w13: tuple[torch.Tensor, torch.Tensor],
                           w2: tuple[torch.Tensor, torch.Tensor], fmts: tuple[int, int],
                           scales: torch.Tensor, topk_ids: torch.Tensor, rw: torch.Tensor,
                           expert_map: torch.Tensor | None, y: torch.Tensor, act: int,
                           inter: int, tiles: tuple[int, int, int, int, int],
                           unroll: tuple[int, int]) -> None:
    """Fills y [R, H] (fp32, one row per route) with each route's routed expert output.
    `tiles` = (BT, BN, BK gate/up, BK down, num_warps): the BKs divide H and I
    (`gemv.gemv_bk`; 256 for the K-quants); `unroll` the two K loops' unroll factors."""
    bt, bn, bk13, bk2, warps = tiles
    h = x.shape[1]
    r = topk_ids.numel()
    topk = topk_ids.shape[1]
    grp_slot, grp_cnt, grp_routes = group_routes(topk_ids, expert_map, bt)
    a = torch.empty(r, inter, dtype=torch.float32, device=x.device)
    (wd13, ws13), (wd2, ws2) = w13, w2
    _gate_up_grouped_kernel[(r, triton.cdiv(inter, bn))](
        x, wd13, ws13, scales, grp_slot, grp_cnt, grp_routes, a, x.stride(0), wd13.stride(0),
        wd13.stride(1), ws13.stride(0), ws13.stride(-2), a.stride(0), K=h, INTER=inter,
        TOPK=topk, FMT=fmts[0], ACT=act, BT=bt, BN=bn, BK=bk13, UNROLL=unroll[0],
        num_warps=warps, enable_fp_fusion=False)
    _down_grouped_kernel[(r, triton.cdiv(h, bn))](
        a, wd2, ws2, scales, grp_slot, grp_cnt, grp_routes, rw, y, a.stride(0), wd2.stride(0),
        wd2.stride(1), ws2.stride(0), ws2.stride(-2), y.stride(0), K=inter, HIDDEN=h,
        FMT=fmts[1], BT=bt, BN=bn, BK=bk2, UNROLL=unroll[1], num_warps=warps,
        enable_fp_fusion=False)
