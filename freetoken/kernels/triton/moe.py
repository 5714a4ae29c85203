"""Fused MoE on the GPU: two kernels over a bank or a pool of slots, no host syncs.

Routes (token t, choice j; route r = t * k + j) are grouped into blocks of BM routes that share
one slot (`_align`); a program owns one block and BN output rows:
1. `_gate_up_kernel`: g = x Wg^T * s[slot, 0], u = x Wu^T * s[slot, 1] from the slot's w13 rows
   (gate rows n, up rows I + n, decoded in registers), a[r, n] = glu(g, u), fp32;
2. `_down_kernel`: y[r, :] = (a[r] Wd^T) * s[slot, 2] * route_weight[r], fp32 per route;
then `_sum_routes_kernel` sums each token's k rows in fp32 and casts them (one launch):
deterministic (no atomics on the values), and a route whose expert maps to slot -1 keeps its
zero row (another path computes it). At decode the sum needs no launch of its own: the last of
a token's route programs to finish a row block adds the k rows in the same order
(`_arrive_and_sum`, an arrival counter as the router's).
Decode (few routes) uses BM = 1: one program per (route, row block) for gate / up, a GEMV over
that expert's rows with no sort at all (vLLM's sort/align only pays off once several routes
share an expert); block b is route b, whose slot is topk_ids[b] itself (or
expert_map[topk_ids[b]], read in the kernels, which also write the zero rows of routes mapped
to -1): no launch prepares the routes. Where the int8 down GEMV takes the intermediate size in
one chunk, down and the routes' sum are one kernel, `_down_sum_kernel` (program = token and
row block, the k routes' terms added in order in fp32: deterministic, no [routes, H] buffer,
one launch fewer). Measured on the H200 (ft bench decode, fused): the 35B shape (FFN 512, one
chunk) 308.6 -> 312.5 tok/s at batch 1, 826.8 -> 890.1 at 4, 1869.8 -> 1965.2 at 16; with
FFN 768 (three chunks of 256 per route, 24 unrolled chunk bodies a program) the 30B shape lost
10% at batch 1 (303.9 -> 271.0), so there the per-route kernel and the sum stay; once a is
quantized by gate/up (below) the per-route kernel won at 1 token for FFN 512 too, so the
down-and-sum kernel runs from `DOWN_SUM_TOKENS` tokens. The GEMVs multiply in int8 where the
format and a 16-bit x allow (`gemv_i8.py`), else in fp32 (`gemv.py`); x may come quantized
by the RMSNorm before (`kernels/xq.py`), and for NVFP4 from two tokens on gate/up stores its
GLU output quantized for down (`QUANT_A_FORMATS`, `QUANT_A_TOKENS`).
Bigger batches group routes by slot on the device and pad each slot's run to BM (`_align`,
three small kernels and a memset whose sizes depend only on shapes, so the step can be
captured in a CUDA graph; they replaced some twenty torch launches a layer, a prefill's host
time).
`moe_grouped.py` (routes grouped by slot in one small kernel, each group's expert rows read
and expanded once for all of its tokens; int8 dots with the per-route path's bits where it
takes them) runs on request only (`grouped=True`, FREETOKEN_GPU_MOE_GROUPED): the fp32 and the
int8 kernels both measured slower than the per-route GEMV (see `GROUPED_TOKENS`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken import env
from freetoken.kernels.l2 import l2_join
from freetoken.kernels.norm import FOLD_ROWS, fold_buffers, fold_done
from freetoken.kernels.triton import interpreting, l2, pdl
from freetoken.kernels.triton.arrive import counters, last_to_arrive, sum_when_last
from freetoken.kernels.triton.gemv import gemv_bk, gemv_block, gemv_chunk_error
from freetoken.kernels.triton.gemv_i8 import (
    asm,
    gemv_i8_block,
    gemv_i8_row,
    i8_chunk,
    quant_store,
    use_i8,
    x_chunk,
    xq_len,
)
from freetoken.kernels.triton.linear import _DOT, _dot_acc, _row_ptrs, weight_args, xq_rows
from freetoken.kernels.triton.moe_grouped import (
    MAX_ROUTES,
    gate_up_rows,
    glu,
    group_routes,
    grouped_down,
    grouped_gate_up,
)
from freetoken.kernels.triton.norm import norm_row
from freetoken.kernels.triton.pdl import wait
from freetoken.kernels.triton.quant import decode_tile, format_id
from freetoken.kernels.triton.tiles import fast_tile, has_fast_tile
from freetoken.moe.banks import ExpertBank

_ACT = {"silu": 0, "gelu_tanh": 1}


@triton.jit
def _block_routes(route_ids_ptr, block_slot_ptr, map_ptr, R, BM: tl.constexpr,
                  MAP: tl.constexpr):
    pid_b = tl.program_id(0)
    slot = tl.load(block_slot_ptr + pid_b)
    if MAP:  # decode with a map: block_slot holds the route's expert, the map its slot
        slot = tl.load(map_ptr + slot)
    if BM == 1:  # decode: block b is route b (no route table to read)
        routes = pid_b + tl.arange(0, 1)
    else:
        routes = tl.load(route_ids_ptr + pid_b * BM + tl.arange(0, BM))
    return slot, routes, routes < R


@triton.jit
def _sum_routes_kernel(y_ptr, out_ptr, H, TOPK: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr = False):
    """out[t, n] = sum_j y[t * TOPK + j, n] (fp32, in j order), stored in out's dtype."""
    wait(PDL)  # pdl.py: the kernel before has completed
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        acc += tl.load(y_ptr + (t * TOPK + j) * H + n, mask=ok, other=0.0)
    tl.store(out_ptr + t * H + n, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, bank_s_ptr, route_ids_ptr, block_slot_ptr, map_ptr,
                    a_ptr, R, stride_xm, stride_ws, stride_wn, stride_ss, stride_sn, stride_am,
                    K: tl.constexpr, INTER: tl.constexpr, TOPK: tl.constexpr,
                    FMT: tl.constexpr, DOT: tl.constexpr, ACT: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FAST: tl.constexpr,
                    UNROLL: tl.constexpr, MAP: tl.constexpr, I8: tl.constexpr = False,
                    ASM: tl.constexpr = True, XQ: tl.constexpr = False, QA: tl.constexpr = False,
                    stride_bs=4, PDL: tl.constexpr = False):
    """XQ: x_ptr / stride_xm are the rows quantized ahead (`kernels.xq`), int8 GEMV only.
    QA (decode, BN a multiple of 32): a is stored quantized for the int8 down GEMV instead
    (a_ptr: rows of `xq_len(INTER)` words, `gemv_i8.quant_store`'s layout), the GLU output
    quantized once here rather than in each down program."""
    wait(PDL)  # pdl.py: the kernel before has completed
    slot, routes, r_ok = _block_routes(route_ids_ptr, block_slot_ptr, map_ptr, R, BM, MAP)
    if slot < 0:
        return
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = rn < INTER
    wg, sg, wu, su = gate_up_rows(w_ptr, s_ptr, slot, rn, stride_ws, stride_ss, stride_wn,
                                  stride_sn, INTER, FMT)
    x_rows = x_ptr + (routes // TOPK)[:, None].to(tl.int64) * stride_xm
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    if BM == 1 and I8:  # decode in int8 dots (gemv_i8.py), x quantized once for both, the
        x_row = x_ptr + (tl.program_id(0) // TOPK).to(tl.int64) * stride_xm  # chunks unrolled
        for k0 in tl.static_range(0, K, BK):
            xq = x_chunk(x_row, k0, K, BK, FMT == 1, XQ)
            acc_g += gemv_i8_block(FMT, wg, sg, xq, k0, n_ok, BK, ASM)[None, :]
            acc_u += gemv_i8_block(FMT, wu, su, xq, k0, n_ok, BK, ASM)[None, :]
    elif BM == 1:  # decode: one route (route = block), K a multiple of BK
        x_row = x_ptr + (tl.program_id(0) // TOPK).to(tl.int64) * stride_xm
        for k0 in tl.range(0, K, BK, loop_unroll_factor=UNROLL):
            acc_g += gemv_block(FMT, wg, sg, x_row, k0, n_ok, BK)[None, :]
            acc_u += gemv_block(FMT, wu, su, x_row, k0, n_ok, BK)[None, :]
    else:
        for k0 in tl.range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            k_ok = k < K
            w_ok = n_ok[:, None] & k_ok[None, :]
            x = tl.load(x_rows + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            if FAST:
                g = fast_tile(FMT, wg, sg, k0, n_ok, BK)
                u = fast_tile(FMT, wu, su, k0, n_ok, BK)
            else:
                g = decode_tile(FMT, wg, sg, k[None, :], w_ok)
                u = decode_tile(FMT, wu, su, k[None, :], w_ok)
            acc_g = _dot_acc(acc_g, x, g, DOT)
            acc_u = _dot_acc(acc_u, x, u, DOT)
    s = bank_s_ptr + slot * stride_bs
    a = glu(acc_g * tl.load(s), acc_u * tl.load(s + 1), ACT)
    if QA:  # rows n0 .. n0 + BN: BN / 32 whole blocks of the row's codes
        n0 = tl.program_id(1) * BN
        quant_store(a, a_ptr + tl.program_id(0).to(tl.int64) * stride_am, n0, r_ok, INTER)
    else:
        out = a_ptr + routes[:, None].to(tl.int64) * stride_am + rn[None, :]
        tl.store(out, a, mask=r_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(a_ptr, w_ptr, s_ptr, bank_s_ptr, route_ids_ptr, block_slot_ptr, map_ptr,
                 route_w_ptr, y_ptr, R, stride_am, stride_ws, stride_wn, stride_ss, stride_sn,
                 stride_ym,
                 K: tl.constexpr, HIDDEN: tl.constexpr, FMT: tl.constexpr, DOT: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FAST: tl.constexpr,
                 UNROLL: tl.constexpr, MAP: tl.constexpr, I8: tl.constexpr = False,
                 ASM: tl.constexpr = True, XQ: tl.constexpr = False,
                 SUM: tl.constexpr = False, count_ptr=None, out_ptr=None, stride_om=0,
                 TOPK: tl.constexpr = 1, stride_bs=4, PDL: tl.constexpr = False,
                 NORM: tl.constexpr = False, ncount_ptr=None, res_ptr=None, nw_ptr=None,
                 ny_ptr=None, ns_ptr=None, nq_ptr=None, stride_nr=0, stride_ny=0, stride_ns=0,
                 stride_nq=0, eps=0.0, NQUANT: tl.constexpr = False,
                 BLOCK_H: tl.constexpr = 1):
    """XQ: a_ptr / stride_am are a's rows quantized by `_gate_up_kernel` (QA). SUM (decode,
    BM = 1): the token's routes' rows are also summed into out (`_arrive_and_sum`); NORM: and
    the next residual step of the token's out row is computed by the last of its row blocks
    to be summed (`_arrive_and_norm`)."""
    wait(PDL)  # pdl.py: the kernel before has completed
    slot, routes, r_ok = _block_routes(route_ids_ptr, block_slot_ptr, map_ptr, R, BM, MAP)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = rn < HIDDEN
    if slot < 0:
        if MAP:  # a route another path computes: its row reads zero (y is not cleared)
            zero = tl.zeros((BN,), dtype=tl.float32)
            tl.store(y_ptr + tl.program_id(0).to(tl.int64) * stride_ym + rn, zero, mask=n_ok)
        if SUM:
            _arrive_and_sum(y_ptr, out_ptr, count_ptr, rn, n_ok, stride_ym, stride_om, TOPK,
                            NORM, ncount_ptr, res_ptr, nw_ptr, ny_ptr, ns_ptr, nq_ptr,
                            stride_nr, stride_ny, stride_ns, stride_nq, eps, HIDDEN, NQUANT,
                            BLOCK_H)
        return
    w_rows, s_rows = _row_ptrs(w_ptr + slot.to(tl.int64) * stride_ws,
                               s_ptr + slot.to(tl.int64) * stride_ss, rn, stride_wn, stride_sn,
                               FMT)
    a_rows = a_ptr + routes[:, None].to(tl.int64) * stride_am
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if BM == 1 and I8:  # decode in int8 dots (gemv_i8.py)
        a_row = a_ptr + tl.program_id(0).to(tl.int64) * stride_am
        acc += gemv_i8_row(FMT, w_rows, s_rows, a_row, n_ok, K, BK, ASM, XQ)[None, :]
    elif BM == 1:  # decode: one route (route = block), K a multiple of BK
        a_row = a_ptr + tl.program_id(0).to(tl.int64) * stride_am
        for k0 in tl.range(0, K, BK, loop_unroll_factor=UNROLL):
            acc += gemv_block(FMT, w_rows, s_rows, a_row, k0, n_ok, BK)[None, :]
    else:
        for k0 in tl.range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            k_ok = k < K
            if FAST:
                w = fast_tile(FMT, w_rows, s_rows, k0, n_ok, BK)
            else:
                w = decode_tile(FMT, w_rows, s_rows, k[None, :], n_ok[:, None] & k_ok[None, :])
            a = tl.load(a_rows + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            acc = _dot_acc(acc, a, w, DOT)
    r_w = tl.load(route_w_ptr + routes, mask=r_ok, other=0.0).to(tl.float32)
    y = acc * tl.load(bank_s_ptr + slot * stride_bs + 2) * r_w[:, None]
    out = y_ptr + routes[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(out, y, mask=r_ok[:, None] & n_ok[None, :])
    if SUM:
        _arrive_and_sum(y_ptr, out_ptr, count_ptr, rn, n_ok, stride_ym, stride_om, TOPK,
                        NORM, ncount_ptr, res_ptr, nw_ptr, ny_ptr, ns_ptr, nq_ptr,
                        stride_nr, stride_ny, stride_ns, stride_nq, eps, HIDDEN, NQUANT,
                        BLOCK_H)


@triton.jit
def _arrive_and_sum(y_ptr, out_ptr, count_ptr, rn, n_ok, stride_ym, stride_om,
                    TOPK: tl.constexpr, NORM: tl.constexpr = False, ncount_ptr=None,
                    res_ptr=None, nw_ptr=None, ny_ptr=None, ns_ptr=None, nq_ptr=None,
                    stride_nr=0, stride_ny=0, stride_ns=0, stride_nq=0, eps=0.0,
                    HIDDEN: tl.constexpr = 1, NQUANT: tl.constexpr = False,
                    BLOCK_H: tl.constexpr = 1):
    """Decode (program (route, row block)): the last of a token's TOPK route programs of this
    row block to arrive (an atomic counter per token and row block, which it resets for the
    next call: CUDA-graph safe) adds the token's rows of y in route order in fp32, as
    `_sum_routes_kernel` does, into out in its dtype: the sum without a launch of its own.
    NORM: then the last of the token's row blocks to be summed (a second counter, per token)
    computes the next residual step of the token's whole out row (`_arrive_and_norm`)."""
    t = tl.program_id(0) // TOPK
    if sum_when_last(y_ptr, out_ptr, count_ptr, t, rn, n_ok, stride_ym, stride_om, TOPK):
        if NORM:
            _arrive_and_norm(t.to(tl.int64), out_ptr, stride_om, ncount_ptr, res_ptr, nw_ptr,
                             ny_ptr, ns_ptr, nq_ptr, stride_nr, stride_ny, stride_ns,
                             stride_nq, eps, HIDDEN, NQUANT, BLOCK_H)


@triton.jit
def _arrive_and_norm(t, out_ptr, stride_om, ncount_ptr, res_ptr, nw_ptr, ny_ptr, ns_ptr,
                     nq_ptr, stride_nr, stride_ny, stride_ns, stride_nq, eps,
                     HIDDEN: tl.constexpr, NQUANT: tl.constexpr, BLOCK_H: tl.constexpr):
    """The last of token t's row blocks to store its out values (a counter per token, reset
    for the next call) reads the whole row back from L2 and computes the residual step that
    takes it next (`kernels/norm.py`: folding) with the RMSNorm kernel's arithmetic
    (`norm.norm_row`): the next layer's add + RMSNorm (+ codes) without a launch of its own."""
    if last_to_arrive(ncount_ptr + t, tl.num_programs(1)):
        cols = tl.arange(0, BLOCK_H)
        ok = cols < HIDDEN
        row = tl.load(out_ptr + t * stride_om + cols, mask=ok, other=0.0,
                      cache_modifier=".cg")  # other SMs wrote them
        norm_row(row, res_ptr + t * stride_nr, nw_ptr, ny_ptr + t * stride_ny,
                 ns_ptr + t * stride_ns, nq_ptr + t * stride_nq, cols, ok, HIDDEN, eps, True,
                 NQUANT, BLOCK_H)


@triton.jit
def _down_sum_kernel(a_ptr, w_ptr, s_ptr, bank_s_ptr, ids_ptr, map_ptr, route_w_ptr, out_ptr,
                     stride_am, stride_ws, stride_wn, stride_ss, stride_sn, stride_om,
                     K: tl.constexpr, HIDDEN: tl.constexpr, TOPK: tl.constexpr,
                     FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     MAP: tl.constexpr, ASM: tl.constexpr, XQ: tl.constexpr = False,
                     stride_bs=4, PDL: tl.constexpr = False):
    """Decode's down projection and the routes' sum in one launch: program (t, row block)
    computes y_j = (a[t k + j] Wd_j^T) * s[slot_j, 2] * route_weight, j = 0 .. k - 1, as an
    int8 GEMV each (K in one chunk of BK), and adds them in j order in fp32 (as
    `_sum_routes_kernel` adds `_down_kernel`'s rows). A route whose slot is -1 (computed
    elsewhere) adds nothing: its loads are masked off and its term is dropped."""
    wait(PDL)  # pdl.py: the kernel before has completed
    t = tl.program_id(0)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = rn < HIDDEN
    total = tl.zeros((BN,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        r = t * TOPK + j
        slot = tl.load(ids_ptr + r)
        if MAP:
            slot = tl.load(map_ptr + slot)
        here = slot >= 0
        slot = tl.maximum(slot, 0)
        w_rows, s_rows = _row_ptrs(w_ptr + slot.to(tl.int64) * stride_ws,
                                   s_ptr + slot.to(tl.int64) * stride_ss, rn, stride_wn,
                                   stride_sn, FMT)
        ok = n_ok & here
        acc = gemv_i8_row(FMT, w_rows, s_rows, a_ptr + r.to(tl.int64) * stride_am, ok, K, BK,
                          ASM, XQ)
        r_w = tl.load(route_w_ptr + r).to(tl.float32)
        y = acc * tl.load(bank_s_ptr + slot * stride_bs + 2) * r_w
        total += tl.where(here, y, 0.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_om + rn, total.to(out_ptr.dtype.element_ty),
             mask=n_ok)


# -- routing on the device ------------------------------------------------------------------------
@triton.jit
def _route_slots(ids_ptr, map_ptr, R, S, CH: tl.constexpr, MAP: tl.constexpr):
    """Routes [pid CH, (pid + 1) CH): (index, slot, whether the route is here)."""
    i = tl.program_id(0) * CH + tl.arange(0, CH)
    ok = i < R
    s = tl.load(ids_ptr + i, mask=ok, other=-1).to(tl.int32)
    if MAP:
        s = tl.load(map_ptr + s, mask=ok, other=-1).to(tl.int32)
    return i, s, ok & (s >= 0) & (s < S)


@triton.jit
def _align_count_kernel(ids_ptr, map_ptr, counts_ptr, route_ids_ptr, block_slot_ptr, R, S,
                        BLOCKS, POSITIONS, CH: tl.constexpr, MAP: tl.constexpr):
    """Program p: positions [p CH, (p + 1) CH) padding (R) and those blocks unused (-1), and
    its routes counted per slot (the grid covers POSITIONS >= R)."""
    i, s, ok = _route_slots(ids_ptr, map_ptr, R, S, CH, MAP)
    tl.store(route_ids_ptr + i, tl.zeros((CH,), tl.int32) + R, mask=i < POSITIONS)
    tl.store(block_slot_ptr + i, tl.full((CH,), -1, tl.int32), mask=i < BLOCKS)
    tl.atomic_add(counts_ptr + s, 1, mask=ok)


@triton.jit
def _align_start_kernel(counts_ptr, start_ptr, S, BM: tl.constexpr, SP: tl.constexpr):
    """One program: start[s] = the first padded position of slot s, the exclusive prefix sum
    of the counts rounded up to BM (SP >= S, a power of two)."""
    j = tl.arange(0, SP)
    c = tl.load(counts_ptr + j, mask=j < S, other=0, cache_modifier=".cg")
    padded = (c + BM - 1) // BM * BM
    tl.store(start_ptr + j, tl.cumsum(padded, 0) - padded, mask=j < S)


@triton.jit
def _align_place_kernel(ids_ptr, map_ptr, start_ptr, seen_ptr, route_ids_ptr, block_slot_ptr,
                        R, S, BM: tl.constexpr, CH: tl.constexpr, MAP: tl.constexpr):
    """Each route at its slot's start + its rank there (an atomic counter per slot: the order
    of a slot's routes is the order the programs reach it); a block's first route names the
    block's slot."""
    i, s, ok = _route_slots(ids_ptr, map_ptr, R, S, CH, MAP)
    rank = tl.atomic_add(seen_ptr + s, 1, mask=ok)
    dest = tl.load(start_ptr + s, mask=ok, other=0, cache_modifier=".cg") + rank
    tl.store(route_ids_ptr + dest, i, mask=ok)
    tl.store(block_slot_ptr + dest // BM, s, mask=ok & (rank % BM == 0))


def _align(topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_slots: int,
           bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Routes grouped by slot, each slot's run padded to a multiple of `bm`: a memset and
    three small kernels, no host sync, sizes from shapes only (a CUDA graph can hold them).

    topk_ids [T, k] (route r = t k + j), slot = expert_map[id] with a map (-1: not here) ->
    (route_ids int32 [blocks * bm], padding = R; block_slot int32 [blocks], -1 for unused
    blocks), blocks = an upper bound from R and the slot count. A slot's routes are in no
    fixed order: a route's output row does not depend on its place in a block (tl.dot rows
    are independent sums over the same K order), and the routes' sum goes by route index."""
    ids = topk_ids.reshape(-1)
    r, dev = ids.numel(), ids.device
    blocks = triton.cdiv(r, bm) + min(r, num_slots)
    scratch = torch.zeros(3 * num_slots, dtype=torch.int32, device=dev)
    counts, start, seen = scratch.view(3, num_slots)
    route_ids = torch.empty(blocks * bm, dtype=torch.int32, device=dev)
    block_slot = torch.empty(blocks, dtype=torch.int32, device=dev)
    has_map = expert_map is not None
    emap = expert_map if has_map else ids
    ch = 256
    _align_count_kernel[(triton.cdiv(blocks * bm, ch),)](
        ids, emap, counts, route_ids, block_slot, r, num_slots, blocks, blocks * bm, CH=ch,
        MAP=has_map, num_warps=4)
    sp = triton.next_power_of_2(num_slots)
    _align_start_kernel[(1,)](counts, start, num_slots, BM=bm, SP=sp,
                              num_warps=4 if sp <= 1024 else 8)
    _align_place_kernel[(triton.cdiv(r, ch),)](
        ids, emap, start, seen, route_ids, block_slot, r, num_slots, BM=bm, CH=ch,
        MAP=has_map, num_warps=4)
    return route_ids, block_slot


def _routes(topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_slots: int,
            bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    if bm == 1:  # route r is block r: the kernels read no route table (`_block_routes`)
        slots = topk_ids.reshape(-1)  # a view: no launch (a map is read in the kernels)
        return slots, slots
    return _align(topk_ids, expert_map, num_slots, bm)


# -- launcher -------------------------------------------------------------------------------------
# Decode in int8, formats (of both banks) for which gate/up stores the GLU output quantized
# (rows in blocks of 32, so its programs take 32 rows) and the down GEMV reads the codes
# instead of quantizing a again in every program. Measured on the H200 (one MoE layer, CUDA
# graph, 16 expert sets cycled so the weights come from HBM; x quantized by the norm), us at
# 1 / 4 / 16 tokens: NVFP4 128 x 2048 x 768 15.8 / 37.0 / 119.2 -> 16.3 / 35.8 / 106.1, 256 x
# 2048 x 512 (per-route down) 14.6 / 25.0 / 78.1 against 19.2 / 31.7 / 82.4; Q4_K 128 x 2048 x
# 768 lost (22.0 / 64.9 / 217.1 -> 28.8 / 78.4 / 252.0: its 32-row gate/up programs are too
# few and too long). At one token it lost for NVFP4 too, once gate/up read 2048-wide chunks
# (`_i8_tiles`): 17.8 against 15.7 us (128 x 2048 x 768), 16.4 against 13.1 (256 x 2048 x 512)
# (scratch sweep of BN / BK / warps, H200, 2026-12-01), so it starts at QUANT_A_TOKENS.
QUANT_A_FORMATS = (1,)
QUANT_A_TOKENS = 2
# Tokens from which the down-and-sum kernel replaces the per-route down GEMV and the sum where
# the FFN is one chunk (same measurement, NVFP4 256 x 2048 x 512 with quantized a: 17.5 /
# 25.2 / 73.5 us against 14.6 / 25.0 / 78.1 at 1 / 4 / 16 tokens).
DOWN_SUM_TOKENS = 8
# Arrival counters of the decode down kernel's sums (`_arrive_and_sum`): one per token and row
# block; more than this and the separate sum kernel runs.
SUM_COUNTERS = 16384
# The most tokens at which the down kernel's last programs compute the next residual step
# (kernels/norm.py: folding; its FOLD_MAX_H bounds the row, one program holding it).
# Measured on the H200 (30B shape, fused, ab_env, tok/s
# without -> with, 2026-12-04): Q4_K batch 1 448.5 -> 453.3 and 447.7 -> 452.3, batch 2
# 592.4 -> 600.4, batch 4 1,026.9 -> 1,033.4, batch 16 2,406.9 -> 2,329.8; NVFP4 batch 1
# 450.7 -> 457.6, batch 16 2,270.5 -> 2,240.0 (at 16 tokens the per-token tails of the last
# row blocks cost more than the RMSNorm launch they replace); 8 not measured
NORM_FOLD_TOKENS = 4


def supported(bank: ExpertBank) -> bool:
    return format_id(bank.w13) is not None and format_id(bank.w2) is not None


def _tiles(tokens: int, topk: int, bank: ExpertBank, dot: int) -> tuple[int, int, int, int]:
    """(BM, BN, BK, num_warps): BM = 1 (per-route GEMV) at decode sizes, tl.dot tiles above.
    The GEMV needs both K's (hidden, intermediate) to split into whole BK chunks."""
    # Measured on the H200 (bench_gpu_kernels.py --sweep, 128 experts, 2048 x 768, top-8):
    # one token, 2 rows per program and one warp: 34 us a layer for NVFP4 and Q4_K (620 GB/s),
    # against 39-61 us with 4 rows and 4 warps; 16 tokens (about 120 experts), 16 rows and 4
    # warps: 300 / 474 us against 419 / 675; 512 tokens NVFP4 64x64x128 (1246 us), Q4_K
    # 64x128x256 (986 us).
    f13, f2 = format_id(bank.w13), format_id(bank.w2)
    bk13 = gemv_bk(f13, bank.hidden)
    bk2 = gemv_bk(f2, bank.intermediate)
    if tokens <= 16 and bk13 is not None and bk2 is not None:
        routes = tokens * topk
        return (1, 2, min(bk13, bk2), 1) if routes <= 16 else (1, 16, min(bk13, bk2), 4)
    fast = has_fast_tile(f13, bank.hidden, 256) and has_fast_tile(f2, bank.intermediate, 256)
    bk = 256 if fast and dot else 64  # fp32 operands: half the width (shared memory)
    if tokens <= 128:
        return 16, 32, bk, 4
    if dot and f13 == f2 == 1 and bank.hidden % 128 == 0 and bank.intermediate % 128 == 0:
        # by routes per expert (a block holds one expert's routes): measured on the H200
        # (bench_gpu_kernels.py --sweep nvfp4 --sweep-tokens 512,2048, 128 experts, 2048 x
        # 768, top-8, 2026-12-02): 128 a expert (2048 tokens) 128x128x128 8 warps 2208 us
        # against 2853 with 64x64x128. At 32 a expert (512 tokens) 32x64x64 4 warps timed
        # 1106 against 1217 alone, but with it the 30B's prefill of 512 tokens took 0.103-0.117
        # s in ft bench prefill against 0.054 for Q4_K experts (which kept their tiles) in
        # the same run: not taken until that is understood
        if tokens * topk >= 128 * bank.num_experts:
            return 128, 128, 128, 8
        return 64, 64, 128, 4
    if dot and f13 == f2 == 13 and bk == 256:
        return 64, 128, 256, 8
    return 64, 64, bk, 8


# (BN, BK at most, num_warps) of the per-route int8 GEMVs from 2 tokens, by format id (NVFP4 1,
# Q4_K 13; others keep 16 rows and 4 warps). Measured on the H200 (2026-12-04): the MoE layer
# at 16 tokens (bench_gpu_kernels.py --sweep Q4_K,nvfp4 --sweep-tokens 16, 128 x 2048 x 768,
# top-8, us) Q4_K 16 rows 133.5, 32 106.7, 64 97.1, 128 (8 warps) 127.0; NVFP4 118.0 / 109.1
# / 125.7; 8 warps lost everywhere. End to end (benchmarks/ab_env.py, fused, tok/s, these
# tiles against 16 rows): 30B Q4_K batch 4 945.9 -> 1033.2, 16 1937.8 -> 2401.5 (32 rows:
# 1001.0 / 2258.1); 35B NVFP4 1038.6 -> 1053.5 and 2195.7 -> 2224.5. Wider chunks and fewer
# warps lost too, from HBM on an H100 (bench_gpu_kernels.py --moe-switch
# FREETOKEN_GPU_MOE_ROUTE_TILES=,64x2048x4,64x1024x2,32x2048x4,64x2048x8,128x1024x4,
# 2026-12-07), us a layer at 2 / 16 tokens: Q4_K these tiles 26.1 / 107.3, the others 27.8-49.7
# / 116.9-144.6; NVFP4 22.3 / 102.1 against 26.4-84.4 / 118.7-358.6.
ROUTE_TILES = {1: (32, 1024, 4), 13: (64, 1024, 4)}


def _i8_tiles(fmt: int, k: int, dtype: torch.dtype,
              tiles: tuple[int, int, int, int] | None,
              tokens: int) -> tuple[int, int, int, bool] | None:
    """(BN, BK, num_warps, True) of a decode kernel in int8 dots (gemv_i8.py) over K for a
    step of `tokens` tokens, or None for the fp32 GEMV (format, activation dtype, the switch,
    or chunks that do not tile K).
    `tiles` (BM, BN, BK, num_warps) overrides the choice, as for the fp32 GEMV (BK: at most,
    halved until it tiles K: gate / up and down have different K's)."""
    if not use_i8(fmt, dtype):
        return None
    # Measured on the H200 (bench_gpu_kernels.py --sweep F --sweep-tokens 1, one token, top-8):
    # 16 rows, chunks up to 1024, 4 warps: 128 experts 2048 x 768 NVFP4 15.8 us a layer,
    # Q4_K 20.0 (the fp32 GEMV: 28); 256 experts 2048 x 512 NVFP4 12.3 us.
    # One token of NVFP4 (no quantized GLU output then): chunks up to 2048, a whole
    # hidden-2048 row in one chunk, 15.7 us against 17.3 with 1024 (128 x 2048 x 768; 256 x
    # 2048 x 512 13.1 against 15.0); Q4_K lost with them (16.2 against 15.3: registers).
    # From 2 tokens (up to 16: above, tl.dot tiles): FREETOKEN_GPU_MOE_ROUTE_TILES, else
    # ROUTE_TILES, stands in for `tiles` when it is not given; at one token
    # FREETOKEN_GPU_MOE_ONE_TILES. With the weights from HBM (bench_gpu_kernels.py --hbm-tiles,
    # H100, 2026-12-07; the figures above replayed one call, its 8 experts in L2) one token of
    # Q4_K took 17.43 us with these tiles, 16.55 with 2048-wide gate/up chunks (16 x 2048 x 4),
    # 18.54 with 32 rows; end to end (ab_env.py, H100, 30B Q4_K fused, batch 1) 443.3 tok/s
    # with these tiles, 441.4 with 2048-wide chunks: these stay.
    if tiles is None and tokens == 1 and (one := env.gpu_moe_one_tiles()) is not None:
        tiles = (1, *one)
    if tiles is None and tokens >= 2:
        chosen = env.gpu_moe_route_tiles() or ROUTE_TILES.get(fmt)
        if chosen is not None:
            tiles = (1, *chosen)
    want = 2048 if fmt == 1 and tokens == 1 else 1024
    bk = i8_chunk(fmt, k, want if tiles is None else tiles[2])
    if bk is None:
        return None
    return (16, bk, 4, True) if tiles is None else (tiles[1], bk, tiles[3], True)


def _down_i8_tiles(fmt: int, k: int, dtype: torch.dtype,
                   tiles: tuple[int, int, int, int] | None,
                   tokens: int) -> tuple[int, int, int, bool] | None:
    """`_i8_tiles` of the down GEMV: FREETOKEN_GPU_MOE_DOWN_TILES, where set and no `tiles`
    are given, at every decode size."""
    own = env.gpu_moe_down_tiles() if tiles is None else None
    return _i8_tiles(fmt, k, dtype, tiles if own is None else (1, *own), tokens)


def _unroll(unroll: int | None, bm: int, bn: int, k: int, bk: int) -> int:
    """K-loop unroll of the per-route GEMV: with 2 rows and one warp a program holds few bytes
    per chunk, and a rolled loop waits one memory round trip per chunk (8 for gate/up at
    hidden 2048): unrolled, the chunks' loads are in flight together. Measured on the H200
    (profile_decode_step.py --kernel-ab, one MoE layer): 1 token 28.2 us unrolled against 28.9
    rolled (Q4_K; NVFP4 28.6 / 28.8); at 16 tokens (16 rows, 4 warps) unrolling by 2 or 4 lost
    2-10%, so that configuration stays rolled."""
    if unroll is not None:
        return unroll
    return min(8, k // bk) if bm == 1 and bn <= 2 else 1


# Tokens per step at which the grouped kernels (moe_grouped.py: each expert's rows read once
# for all of its routes) replace the per-route GEMV by default, where both kernels take int8
# dots; None = never (they run with grouped=True only); FREETOKEN_GPU_MOE_GROUPED=LO-HI sets
# the span at run time. The fp32 grouped kernels were measured on the H200 (Q4_K, 128 experts,
# 2048 x 768, top-8, graph-replayed us per layer): 4 tokens per-route 144, grouped BT=2 BN=2
# 330, BT=2 BN=4 345 (322 rolled), BT=4 BN=4 750; 16 tokens per-route 474, grouped BT=2 BN=4
# 1113, BT=4 BN=4 2339 (1564 rolled): time grew with BT, not with the bytes read (the padded
# fp32 broadcast FMAs over [BT, BN, BK] bound them). The int8 grouped kernels lost too
# (bench_gpu_kernels.py --moe-grouped, H200, 2026-12-04, Q4_K, us per layer at 4 / 8 / 16
# tokens): per-route 33.2 / 57.5 / 99.7, grouped BT 2, 16 rows, 4 warps, 512-wide chunks
# 68.4 / 121.4 / 207.8 (BT 4: 96.1 / 174.2 / 278.9; 32 rows, 8 warps: 73.1 / 126.1 / 218.8);
# end to end (ab_env.py, 30B Q4_K fused) batch 4 1,190 -> 762 tok/s, 16 2,056 -> 1,205. Their
# narrow row blocks (registers hold a group's expanded chunks) read too few bytes a program.
GROUPED_TOKENS: tuple[int, int] | None = None
# Token counts at which fused_moe_triton runs the tensor-core kernels of moe_mma.py (in the form
# FREETOKEN_GPU_MOE_MMA_FORM / moe_mma.MMA_FORM picks) where FREETOKEN_GPU_MOE_MMA is unset and
# the call names no tiles and no grouping; None: never
MMA_TOKENS: tuple[int, int] | None = None
# (BN, BK at most, num_warps) of the int8 grouped kernels by format id (NVFP4 1, Q4_K 13, split
# Q8_0 18), and BT, the routes a group holds. Chosen by registers, not by time (timed against
# the per-route GEMV at GROUPED_TOKENS: slower): a group's expanded weight chunks stay in
# registers for its BT dots (NVFP4 expands a code word into four), so rows and chunks are
# narrower than the per-route GEMV's (`ROUTE_TILES`); these are the widest whose gate/up
# kernel (BT 2, hidden 2048) ptxas -v compiles for sm_90a without spilling registers (Q4_K
# 32 rows in 512-wide chunks with 4 warps spilled 1.2 KB a thread, with 8 none). The
# per-route tiles themselves (64 rows, 1024-wide, spilling) are not timed yet.
GROUP_I8_TILES = {1: (16, 512, 4), 13: (32, 512, 8), 18: (16, 512, 4)}
GROUP_BT = 2


def _grouped_tiles(tokens: int, topk: int, bank: ExpertBank, dtype: torch.dtype,
                   grouped: bool | None, group_tiles: tuple[int, ...] | None
                   ) -> tuple[int, tuple[int, int, int, bool], tuple[int, int, int, bool]] | None:
    """(BT, gate/up's (BN, BK, num_warps, int8), down's) of the grouped kernels, or None for
    the other paths: off (`grouped=False`; None: by size, `GROUPED_TOKENS` or the switch, and
    only where both kernels take int8 dots), too many routes, or a K no chunk divides.
    `group_tiles` (BT, BN, num_warps[, BK at most]) overrides the choice."""
    if grouped is False or tokens * topk > MAX_ROUTES:
        return None
    up = _group_kernel_tiles(format_id(bank.w13), bank.hidden, dtype, group_tiles)
    down = _group_kernel_tiles(format_id(bank.w2), bank.intermediate, dtype, group_tiles)
    if up is None or down is None:
        return None
    if grouped is None:
        span = env.gpu_moe_grouped() or GROUPED_TOKENS
        if span is None or not span[0] <= tokens <= span[1] or not (up[3] and down[3]):
            return None
    return (group_tiles[0] if group_tiles else GROUP_BT), up, down


def _group_kernel_tiles(fmt: int, k: int, dtype: torch.dtype,
                        group_tiles: tuple[int, ...] | None) -> tuple[int, int, int, bool] | None:
    """(BN, BK, num_warps, int8) of one grouped kernel over K: int8 dots where the format and
    x allow (`use_i8`) and a chunk tiles K, else the fp32 kernel (`gemv_bk`'s chunk), else
    None."""
    if use_i8(fmt, dtype):
        bn, want, warps = GROUP_I8_TILES.get(fmt, (16, 512, 4))
        if group_tiles:
            bn, warps = group_tiles[1:3]
            want = group_tiles[3] if len(group_tiles) > 3 else want
        bk = i8_chunk(fmt, k, want)
        if bk is not None:
            return bn, bk, warps, True
    bk = gemv_bk(fmt, k)
    if bk is None:
        return None
    bn, warps = group_tiles[1:3] if group_tiles else (4, 1)
    return bn, bk, warps, False


def _group_unroll(unroll: int | None, bn: int, k: int, bk: int) -> int:
    """K-loop unroll of the fp32 grouped kernels: programs of a few rows hold few bytes per
    chunk, so (as for the per-route GEMV, `_unroll`) the chunks' loads go out together."""
    if unroll is not None:
        return unroll
    return min(8, k // bk) if bn <= 4 else 1


def _fused_grouped(x: torch.Tensor, bank: ExpertBank, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor, act: int, expert_map: torch.Tensor | None,
                   tiles: tuple, unroll: int | None, quant_a: bool | None) -> torch.Tensor:
    """The grouped decode path: routes grouped by slot (`group_routes`), gate/up and down one
    program per (group, row block), in int8 dots where the per-route path takes them (the
    same bits per route), the GLU output quantized for an int8 down where it quantizes it;
    the routes' sum by the down kernel's last-arriving programs (int8) or `_sum_routes_kernel`."""
    t, topk = topk_ids.shape
    h, inter, r = bank.hidden, bank.intermediate, topk_ids.numel()
    bt, up, down = tiles
    f13, f2 = format_id(bank.w13), format_id(bank.w2)
    groups = group_routes(topk_ids, expert_map, bt)
    scales = bank.scales if bank.scales.stride(-1) == 1 else bank.scales.contiguous()
    q = xq_rows(x, t, h) if up[3] else None
    if quant_a is None:  # as the per-route path chooses (`QUANT_A_FORMATS`)
        quant_a = f13 == f2 and f13 in QUANT_A_FORMATS and t >= QUANT_A_TOKENS
    qa_rows = max(32, up[0] // 32 * 32)
    qa = up[3] and down[3] and quant_a and inter % qa_rows == 0
    if qa:
        up = (qa_rows, *up[1:])
        a = torch.empty(r, xq_len(inter), dtype=torch.int32, device=x.device)
    else:
        a = torch.empty(r, inter, dtype=torch.float32, device=x.device)
    grouped_gate_up(x if q is None else q, weight_args(bank.w13), f13, scales, groups, a, act,
                    h, inter, topk, bt, up, _group_unroll(unroll, up[0], h, up[1]),
                    xq=q is not None, qa=qa)
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    sums = down[3] and t * triton.cdiv(h, down[0]) <= SUM_COUNTERS and env.gpu_down_arrive_sum()
    # a route mapped to -1 must read zero: the int8 down kernel writes its row, the fp32 one not
    y = (torch.zeros if expert_map is not None and not down[3] else torch.empty)(
        r, h, dtype=torch.float32, device=x.device)
    grouped_down(a, weight_args(bank.w2), f2, scales, groups,
                 topk_weights.reshape(-1).contiguous(), y, h, inter, topk, bt, down,
                 _group_unroll(unroll, down[0], inter, down[1]), xq=qa,
                 sums=(out, counters("grouped_sum", SUM_COUNTERS, x.device)) if sums else None)
    if not sums:
        _sum_routes_kernel[(t, triton.cdiv(h, 1024))](y, out, h, TOPK=topk, BLOCK=1024,
                                                       num_warps=4, **pdl.opts())
    return out


def fused_moe_triton(x: torch.Tensor, bank: ExpertBank, topk_ids: torch.Tensor,
                     topk_weights: torch.Tensor, activation: str = "silu",
                     expert_map: torch.Tensor | None = None,
                     tiles: tuple[int, int, int, int] | None = None,
                     unroll: int | None = None, grouped: bool | None = None,
                     group_tiles: tuple[int, ...] | None = None,
                     quant_a: bool | None = None, down_sum: bool | None = None,
                     norm_fold=None) -> torch.Tensor:
    """The contract of `freetoken.kernels.moe.fused_moe` (checked there) on CUDA tensors.

    `tiles` (BM, BN, BK, num_warps) overrides the choice by batch size (tests under the
    interpreter use wide row blocks: fewer programs to interpret); `unroll` the GEMV's K-loop
    unroll (`_unroll`; 1 = rolled, for A/B measurements). `grouped` forces the grouped decode
    kernels on (True, where their chunking divides the K's; int8 dots where the per-route
    path takes them) or off (False); None picks them by batch size where both kernels take
    int8 dots (FREETOKEN_GPU_MOE_GROUPED, else `GROUPED_TOKENS`; today never). `group_tiles`
    (BT, BN, num_warps[, BK at most]) overrides their tiles. `quant_a` forces gate/up's
    quantized GLU output for the int8 down GEMV on or off (None: `QUANT_A_FORMATS`);
    `down_sum` the int8 down-and-sum kernel (None: where the FFN is one chunk, from
    `DOWN_SUM_TOKENS` tokens). `norm_fold` (`kernels/norm.py` NormFold): the residual step
    that takes y next, computed by the per-route down kernel's last-arriving programs where
    it sums the routes (the output then carries it), else ignored."""
    if activation not in _ACT:
        raise ValueError(f"activation must be silu or gelu_tanh, got {activation!r}")
    t, topk = topk_ids.shape
    h, inter, r = bank.hidden, bank.intermediate, topk_ids.numel()
    x = x if x.stride(-1) == 1 else x.contiguous()
    span = env.gpu_moe_mma()
    if span is None and tiles is None and grouped is None:
        span = MMA_TOKENS
    if span and span[0] <= t <= span[1]:  # moe_mma.py
        from freetoken.kernels.triton import moe_mma
        if moe_mma.supported_mma(bank, x.dtype):
            return moe_mma.fused_moe_mma(x, bank, topk_ids, topk_weights, activation,
                                         expert_map)
    gt = (_grouped_tiles(t, topk, bank, x.dtype, grouped, group_tiles)
          if tiles is None or grouped else None)
    if gt is not None and r > 0:
        return _fused_grouped(x, bank, topk_ids, topk_weights, _ACT[activation], expert_map,
                              gt, unroll, quant_a)
    dot = _DOT.get(x.dtype, 0)
    bm, bn, bk, warps = tiles or _tiles(t, topk, bank, dot)
    f13, f2 = format_id(bank.w13), format_id(bank.w2)
    # (BN, BK, num_warps, int8) of each kernel: the int8 GEMV where its format and x allow
    up = _i8_tiles(f13, h, x.dtype, tiles, t) if bm == 1 else None
    down = _down_i8_tiles(f2, inter, x.dtype, tiles, t) if bm == 1 else None
    up, down = up or (bn, bk, warps, False), down or (bn, bk, warps, False)
    if bm == 1 and (h % up[1] or inter % down[1]):
        raise ValueError(f"fused_moe: GEMV chunks BK={up[1]} / {down[1]} must divide hidden "
                         f"{h} / intermediate {inter}")
    for name, f, (_, chunk, _, i8) in (("gate/up", f13, up), ("down", f2, down)):
        if bm == 1 and not i8 and (why := gemv_chunk_error(f, chunk, f"fused_moe {name}")):
            raise ValueError(why)
    route_ids, block_slot = _routes(topk_ids, expert_map, bank.num_experts, bm)
    if r == 0:
        return torch.zeros(t, h, dtype=x.dtype, device=x.device)
    # Every route's row is written unless a map sends it elsewhere (then it must read zero:
    # the decode kernels write those zeros themselves, or add nothing for it; the sorted
    # path's y is cleared).
    mapped = expert_map is not None and bm == 1
    emap = expert_map if mapped else block_slot
    w13, s13 = weight_args(bank.w13)
    w2, s2 = weight_args(bank.w2)
    # a slot pool's scales are a strided view [S, 4] (each slot holds its own row): read in
    # place through their row stride, not copied every layer call
    scales = bank.scales if bank.scales.stride(-1) == 1 else bank.scales.contiguous()
    sb = scales.stride(0)
    rw = topk_weights.reshape(-1).contiguous()
    nb = block_slot.numel()
    bn, bk, warps, i8 = up
    # the per-route kernels' register cap (occupancy against spills), on request only: on an
    # H100 (bench_gpu_kernels.py --moe-switch FREETOKEN_GPU_MOE_MAXNREG=0,128,96,72, weights
    # from HBM, 2026-12-07) every cap lost from 2 tokens on, Q4_K at 16 tokens 106.6 us a
    # layer uncapped against 126.8 / 183.6 / 270.8 (NVFP4 100.5 against 104.5 / 128.4 /
    # 206.3), one token unchanged (15.9 / 15.7 / 15.8 / 17.6); end to end 30B Q4_K fused
    # (ab_env.py) batch 16 2,238.1 -> 1,966.0 tok/s at 128, batch 4 1,095.9 -> 1,031.4: the
    # spills cost more than the occupancy gains
    nreg = env.gpu_moe_maxnreg() if bm == 1 and not interpreting() else None
    if nreg is not None and torch.version.hip is not None:
        raise ValueError("FREETOKEN_GPU_MOE_MAXNREG caps registers through PTX (.maxnreg): "
                         "NVIDIA GPUs only, not ROCm")
    regs = {} if nreg is None else {"maxnreg": nreg}
    q = xq_rows(x, t, h) if i8 else None
    xs = x if q is None else q  # the int8 GEMV reads x quantized ahead where it was
    # the GLU output quantized once, by gate/up programs of whole 32-value blocks, for an
    # int8 down GEMV (`QUANT_A_FORMATS`); else stored in fp32
    if quant_a is None:
        quant_a = f13 == f2 and f13 in QUANT_A_FORMATS and t >= QUANT_A_TOKENS
    qa_rows = max(32, bn // 32 * 32)
    qa = i8 and down[3] and quant_a and inter % qa_rows == 0
    if qa:
        bn = qa_rows
        a = torch.empty(r, xq_len(inter), dtype=torch.int32, device=x.device)
    else:
        a = torch.empty(r, inter, dtype=torch.float32, device=x.device)
    # the routed experts' down rows asked of L2 while gate/up runs (FREETOKEN_GPU_L2_AHEAD:
    # down; kernels/triton/l2.py), joined once down has read them
    ahead = (l2.ahead_experts(w2, topk_ids, expert_map if mapped else None)
             if bm == 1 and l2.wants("down", x) else None)
    _gate_up_kernel[(nb, triton.cdiv(inter, bn))](
        xs, w13, s13, scales, route_ids, block_slot, emap, a, r, xs.stride(0), w13.stride(0),
        w13.stride(1), s13.stride(0), s13.stride(-2), a.stride(0), K=h, INTER=inter, TOPK=topk,
        FMT=f13, DOT=dot, ACT=_ACT[activation], BM=bm, BN=bn, BK=bk,
        FAST=has_fast_tile(f13, h, bk), UNROLL=_unroll(unroll, bm, bn, h, bk),
        MAP=mapped, I8=i8, ASM=asm(), XQ=q is not None, QA=qa, stride_bs=sb,
        num_warps=warps, enable_fp_fusion=False, **pdl.opts(), **regs)
    bn, bk, warps, i8 = down
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    if down_sum is None:  # (int8: decode only) one chunk: down and the routes' sum together
        down_sum = bk == inter and t >= DOWN_SUM_TOKENS
    if i8 and down_sum:
        _down_sum_kernel[(t, triton.cdiv(h, bn))](
            a, w2, s2, scales, route_ids, emap, rw, out, a.stride(0), w2.stride(0),
            w2.stride(1), s2.stride(0), s2.stride(-2), out.stride(0), K=inter, HIDDEN=h,
            TOPK=topk, FMT=f2, BN=bn, BK=bk, MAP=mapped, ASM=asm(), XQ=qa, stride_bs=sb,
            num_warps=warps, enable_fp_fusion=False, **pdl.opts(), **regs)
        l2_join(ahead)
        return out
    y = (torch.empty if expert_map is None or mapped else torch.zeros)(
        r, h, dtype=torch.float32, device=x.device)
    n_blocks = triton.cdiv(h, bn)
    # decode: the last route program of each (token, row block) sums the token's rows
    sums = bm == 1 and t * n_blocks <= SUM_COUNTERS and env.gpu_down_arrive_sum()
    fold = norm_fold if sums and t <= NORM_FOLD_TOKENS else None
    norm, folded = _fold_args(fold, x.device) if fold is not None else ({}, None)
    _down_kernel[(nb, n_blocks)](
        a, w2, s2, scales, route_ids, block_slot, emap, rw, y, r, a.stride(0), w2.stride(0),
        w2.stride(1), s2.stride(0), s2.stride(-2), y.stride(0), K=inter, HIDDEN=h,
        FMT=f2, DOT=dot, BM=bm, BN=bn, BK=bk, FAST=has_fast_tile(f2, inter, bk),
        UNROLL=_unroll(unroll, bm, bn, inter, bk), MAP=mapped, I8=i8, ASM=asm(), XQ=qa,
        SUM=sums, count_ptr=counters("down_sum", SUM_COUNTERS, x.device) if sums else None,
        out_ptr=out if sums else None, stride_om=out.stride(0), TOPK=topk,
        stride_bs=sb, num_warps=warps, enable_fp_fusion=False, **pdl.opts(), **norm, **regs)
    l2_join(ahead)
    if not sums:
        _sum_routes_kernel[(t, triton.cdiv(h, 1024))](y, out, h, TOPK=topk, BLOCK=1024,
                                                       num_warps=4, **pdl.opts())
    if fold is not None:
        out = fold_done(out, fold, *folded)
    return out


def _fold_args(fold, device) -> tuple[dict, tuple]:
    """(the down kernel's NORM arguments for `fold` (kernels/norm.py NormFold), the buffers
    they write: y, s, codes or None)."""
    y, s, q = fold_buffers(fold)
    r = fold.residual
    q_ = q if q is not None else y
    return dict(NORM=True, ncount_ptr=counters("down_norm", FOLD_ROWS, device), res_ptr=r,
                nw_ptr=fold.weight, ny_ptr=y, ns_ptr=s, nq_ptr=q_, stride_nr=r.stride(0),
                stride_ny=y.stride(0), stride_ns=s.stride(0), stride_nq=q_.stride(0),
                eps=fold.eps, NQUANT=q is not None,
                BLOCK_H=triton.next_power_of_2(r.shape[-1])), (y, s, q)

