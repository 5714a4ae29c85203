"""The slot cache's plan (moe/slot_cache.py `SlotCache.plan`) for one layer call in one launch.

The torch version is some seventy small tensor ops; on a GPU, launched eagerly, that measured
1.7 ms of host time per layer call on the H200 machine (30% of a 2-layer step). Here one
program does the same, in the same order, with the same results:
1. clock += 1; count each expert's routes; hits get last_use = clock;
2. f = min(misses, unprotected slots, limit, n) with limit = table[misses] capped (the
   policy's F for each miss count, policy.limit_table: floor((misses + 1) * q*), or its
   split model, or every miss);
3. f times: the most-routed remaining miss (then the lower id) takes the unprotected slot
   with the smallest last_use * (S + 1) + slot (empty slots first, then the oldest, then the
   lower index), evicting its owner; the slot is stamped with the clock (so protected);
4. the fetch list [2, n] (-1 past f) and the counters.
Steps read what earlier steps wrote, across threads of the program: `tl.debug_barrier()`
between them (a CTA barrier orders global memory for the block).

`_ahead_kernel` is `SlotCache.plan_ahead` (fetching ahead): slots for up to n of the next
layer's predicted experts before its call, with the same victim rule and the clock unmoved,
stamped with the next call's clock (that call's fetches leave them alone while their copies
may still run). Slots it fills are `fresh` until their layer's next plan, which counts its
hits on them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton.gemv_i8 import asm
from freetoken.kernels.triton.handoff import interp_rounds, job_begin, job_post

MAX_ROUTES = 64  # T * k of a call planned here (decode); more: the torch ops
SCAN = 4096  # slots a chunk of the victim scan holds (one chunk: kept in registers)
# Values of the job a round of `write_job`'s loops copies: each round waits for its loads, so
# a decode step's x (T x hidden) goes out in as few rounds as the registers allow (one at one
# token of 2048; the send kernel's 8 warps copy 1024 a round)
JOB_BLOCK = 2048


@triton.jit
def _victim(lu, s, clock, S: tl.constexpr):
    """The unprotected slot (stamped before the clock) with the smallest (last_use + 1) *
    (S + 1) + slot of the chunk lu [SB] at slots s: empty slots first, then the oldest, then
    the lower index; `never` where the chunk has none. last_use + 1 >= 0 (empty: -1): `%` of
    a negative is negative."""
    never = 0x7FFFFFFFFFFFFFFF
    return tl.min(tl.where((s < S) & (lu < clock), (lu + 1) * (S + 1) + s, never), axis=0)


@triton.jit
def _take_slots(exs, f, lu1, s1, clock, last_ptr, owner_ptr, slot_of_ptr, fresh_ptr, out_ptr,
                base, N, fresh, S: tl.constexpr, SB: tl.constexpr, NB: tl.constexpr):
    """The f experts exs [NB] (layer offset base) take the best victims in turn, each then
    stamped with clock + fresh (protected: the call's clock, or the next call's for slots
    filled ahead): from the registers lu1 (last_use at s1) where one chunk holds the pool,
    else scans of last_use. Their old owners are evicted, fresh is set to `fresh`, and
    out [2, N] gets (expert, slot) rows, -1 past f. Returns the mask j < f."""
    stamp = clock + fresh
    never = 0x7FFFFFFFFFFFFFFF
    j = tl.arange(0, NB)
    slots = tl.zeros((NB,), tl.int64) - 1
    for i in range(0, NB):
        if i < f:
            if SB >= S:  # one chunk: from the registers
                slot = _victim(lu1, s1, clock, S) % (S + 1)
                lu1 = tl.where(s1 == slot, stamp, lu1)
            else:
                key = never
                for s0 in range(0, S, SB):
                    s = s0 + tl.arange(0, SB)
                    key = tl.minimum(key, _victim(tl.load(last_ptr + s, mask=s < S, other=0),
                                                  s, clock, S))
                slot = key % (S + 1)
                tl.store(last_ptr + slot, stamp)
                tl.debug_barrier()
            slots = tl.where(j == i, slot, slots)
    # the f assignments at once: distinct slots, so distinct old owners; the new keys are
    # owners of no slot, so no store below overlaps another
    mine = j < f
    tl.store(last_ptr + slots, tl.zeros((NB,), tl.int64) + stamp, mask=mine)
    tl.store(fresh_ptr + slots, tl.zeros((NB,), tl.int32) + fresh, mask=mine)
    old = tl.load(owner_ptr + slots, mask=mine, other=-1)
    tl.store(slot_of_ptr + old, tl.zeros((NB,), tl.int32) - 1, mask=mine & (old >= 0))
    tl.store(owner_ptr + slots, base + exs, mask=mine)
    tl.store(slot_of_ptr + base + exs, slots.to(tl.int32), mask=mine)
    rest = (j >= f) & (j < N)
    tl.store(out_ptr + j, tl.where(mine, exs, -1), mask=mine | rest)
    tl.store(out_ptr + N + j, tl.where(mine, slots, -1), mask=mine | rest)
    return mine


@triton.jit
def _free_slots(last_ptr, clock, limit, S: tl.constexpr, SB: tl.constexpr):
    """(last_use of the first chunk [SB] in registers, its slot ids, the count of slots
    stamped before the clock); no reads where limit is 0 (then nothing is fetched)."""
    s1 = tl.arange(0, SB)
    lu1 = tl.load(last_ptr + s1, mask=(s1 < S) & (limit > 0), other=0)
    free = tl.sum(((s1 < S) & (lu1 < clock)).to(tl.int32), axis=0)
    for s0 in range(SB, S, SB):  # more chunks: unprotected slots
        s = s0 + tl.arange(0, SB)
        lu = tl.load(last_ptr + s, mask=(s < S) & (limit > 0), other=0)
        free += tl.sum(((s < S) & (lu < clock)).to(tl.int32), axis=0)
    return lu1, s1, free


@triton.jit
def _pick(score, f, E: tl.constexpr, EB: tl.constexpr, NB: tl.constexpr):
    """The f experts of the highest scores in turn ([NB] ids, -1 past f; score [EB] int64,
    -1 = not a candidate, else ... * E + (E - 1 - e): no ties), and their mask [EB].
    A constant trip count, work only while i < f: the interpreter cannot take a computed loop
    bound (its scalars are 1-element arrays)."""
    e = tl.arange(0, EB)
    j = tl.arange(0, NB)
    exs = tl.zeros((NB,), tl.int64) - 1
    picked = e < 0
    for i in range(0, NB):
        if i < f:
            best = tl.max(score, axis=0)
            ex = E - 1 - best % E
            score = tl.where(e == ex, -1, score)
            picked = picked | (e == ex)
            exs = tl.where(j == i, ex, exs)
    return exs, picked


@triton.jit
def _plan_kernel(ids_ptr, R, slot_of_ptr, owner_ptr, last_ptr, fresh_ptr, clock_ptr, counters_ptr,
                 lim_ptr, out_ptr, base, cap, count, N, live_ptr, K,
                 x_ptr, w_ptr, seq_ptr, hi32, hf32, hx, layer, act, xdt, T,
                 o_go, o_job, o_ids, o_w, o_map, o_x,
                 S: tl.constexpr, E: tl.constexpr, LT: tl.constexpr, EB: tl.constexpr,
                 RB: tl.constexpr, NB: tl.constexpr, SB: tl.constexpr, HAS_LIVE: tl.constexpr,
                 SEND: tl.constexpr = False, H: tl.constexpr = 1, BLOCK: tl.constexpr = 512,
                 ASM: tl.constexpr = True, ROUNDS_IDS: tl.constexpr = 0,
                 ROUNDS_X: tl.constexpr = 0, AHEAD_COUNTS: tl.constexpr = False):
    """SEND: also post the hand-off's job (`handoff.job_begin` / `job_post`, the args from
    x_ptr on) as soon as the fetches are chosen, before their victim slots: the CPU worker
    starts one launch earlier than with a send kernel, and the victim scan after it.
    AHEAD_COUNTS: the hits on slots filled ahead count as fetches (`SlotCache.plan`): F =
    min(table[misses + a], cap) - a for a such hits."""
    # the loads that do not depend on each other first
    clock = tl.load(clock_ptr) + 1
    lt = tl.arange(0, LT)
    limits = tl.load(lim_ptr + lt)  # [LT] F by miss count, in registers before it is known
    e = tl.arange(0, EB)
    e_ok = e < E
    r = tl.arange(0, RB)
    ids = tl.load(ids_ptr + r, mask=r < R, other=-1)
    cur = tl.load(slot_of_ptr + base + e, mask=e_ok, other=-1)
    if HAS_LIVE:  # a CUDA graph's padding rows (from `live` on): not routed
        ids = tl.where(r < tl.load(live_ptr, volatile=True) * K, ids, -1)
    counts = tl.sum((ids[:, None] == e[None, :]).to(tl.int32), axis=0)  # [EB]
    used = (counts > 0) & e_ok
    hit = used & (cur >= 0)
    miss = used & (cur < 0)
    tl.store(last_ptr + tl.where(hit, cur, 0), tl.zeros((EB,), tl.int64) + clock, mask=hit)
    # hits on slots filled ahead (`_ahead_kernel`): counted, and no longer fresh
    fr = tl.load(fresh_ptr + tl.where(hit, cur, 0), mask=hit, other=0)
    tl.store(fresh_ptr + tl.where(hit, cur, 0), tl.zeros((EB,), tl.int32), mask=fr > 0)
    n_hit = tl.sum(hit.to(tl.int32), axis=0)
    n_miss = tl.sum(miss.to(tl.int32), axis=0)
    tl.debug_barrier()
    if AHEAD_COUNTS:
        n_ahead = tl.sum(fr, axis=0)
    else:
        n_ahead = 0
    at = tl.minimum(n_miss + n_ahead, LT - 1)
    limit = tl.sum(tl.where(lt == at, limits, 0), axis=0).to(tl.int64)
    limit = tl.maximum(tl.minimum(limit, cap) - n_ahead, 0)
    # the last_use of every slot, in registers when one chunk holds them (no reloads below)
    lu1, s1, free = _free_slots(last_ptr, clock, limit, S, SB)
    f = tl.minimum(tl.minimum(n_miss.to(tl.int64), free.to(tl.int64)),
                   tl.minimum(limit, N)).to(tl.int32)
    # the f fetches: the most-routed remaining miss each time
    exs, fetch = _pick(tl.where(miss, counts.to(tl.int64) * E + (E - 1 - e), -1), f, E, EB, NB)
    if SEND:  # the CPU's share is known now (misses not fetched): post the job before the
        # victims are chosen, the map from the registers (the worker reads its signs only:
        # a fetched expert's slot is not chosen yet, any slot >= 0 says "not the CPU's")
        n_job = job_begin(x_ptr, ids_ptr, w_ptr, seq_ptr, hi32, hf32, hx, layer, act, xdt, T,
                          o_job, o_ids, o_w, o_x, H, K, BLOCK, ROUNDS_IDS, ROUNDS_X)
        tl.store(hi32 + o_map + e, tl.where(fetch, 0, cur), mask=e_ok)
        job_post(n_job, hi32, o_go, ASM)
    _take_slots(exs, f, lu1, s1, clock, last_ptr, owner_ptr, slot_of_ptr, fresh_ptr, out_ptr,
                base, N, 0, S, SB, NB)
    tl.store(clock_ptr, clock)
    if count:
        tl.store(counters_ptr + 5, tl.load(counters_ptr + 5) + tl.sum(fr, axis=0))
        tl.store(counters_ptr, tl.load(counters_ptr) + n_hit)
        tl.store(counters_ptr + 1, tl.load(counters_ptr + 1) + n_miss)
        tl.store(counters_ptr + 3, tl.load(counters_ptr + 3) + n_miss - f)
    else:
        tl.store(counters_ptr + 3, tl.load(counters_ptr + 3) - f)
    tl.store(counters_ptr + 2, tl.load(counters_ptr + 2) + f)


@triton.jit
def _ahead_kernel(ids_ptr, R, slot_of_ptr, owner_ptr, last_ptr, fresh_ptr, clock_ptr,
                  counters_ptr, out_ptr, base, limit, N, live_ptr, K,
                  S: tl.constexpr, E: tl.constexpr, EB: tl.constexpr, RB: tl.constexpr,
                  NB: tl.constexpr, SB: tl.constexpr, HAS_LIVE: tl.constexpr):
    """`SlotCache.plan_ahead` in one program: the clock as it is (the current call's slots
    stay protected), up to `limit` of the predicted experts without a slot, most-routed first,
    then the first in ids, each taking the best victim as `_plan_kernel`'s fetches do, marked
    fresh and stamped with the next call's clock; counters[4] += their number."""
    clock = tl.load(clock_ptr)
    e = tl.arange(0, EB)
    e_ok = e < E
    r = tl.arange(0, RB)
    ids = tl.load(ids_ptr + r, mask=r < R, other=-1)
    if HAS_LIVE:  # a CUDA graph's padding rows: not predicted
        ids = tl.where(r < tl.load(live_ptr, volatile=True) * K, ids, -1)
    cur = tl.load(slot_of_ptr + base + e, mask=e_ok, other=0)
    on = ids[:, None] == e[None, :]  # [RB, EB]
    counts = tl.sum(on.to(tl.int32), axis=0)
    first = tl.min(tl.where(on, r[:, None], RB), axis=0)
    want = (counts > 0) & e_ok & (cur < 0)
    n_want = tl.sum(want.to(tl.int32), axis=0)
    lu1, s1, free = _free_slots(last_ptr, clock, limit, S, SB)
    f = tl.minimum(tl.minimum(n_want, free), tl.minimum(limit, N))
    key = (counts.to(tl.int64) * RB + (RB - 1 - first)) * E + (E - 1 - e)
    exs, _ = _pick(tl.where(want, key, -1), f, E, EB, NB)
    _take_slots(exs, f, lu1, s1, clock, last_ptr, owner_ptr, slot_of_ptr, fresh_ptr, out_ptr,
                base, N, 1, S, SB, NB)
    tl.store(counters_ptr + 4, tl.load(counters_ptr + 4) + f)


def scan_shape(S: int) -> tuple[int, int]:
    """(SB, num_warps) of the plan kernel for a pool of S slots: a chunk of the victim scan
    (one chunk, in registers, up to SCAN slots) and the warps that hold it."""
    sb = min(SCAN, triton.next_power_of_2(S))
    return sb, 4 if sb <= 1024 else 8


def plan_triton(cache, layer: int, ids: torch.Tensor, limits: torch.Tensor, cap: int,
                count: bool, live: torch.Tensor | None = None, job=None,
                ahead_counts: bool = False) -> torch.Tensor:
    """fetched int64 [2, n] for `SlotCache.plan` (see there); limits: int32 [LT] on the device,
    LT a power of two above MAX_ROUTES (policy.limit_table: F for each miss count), cap: the
    most to fetch. Route and fetch counts are compiled in as
    powers of two only: offload's later rounds plan other counts, and with the exact count
    compiled in, its batch-4 steps in a 2-layer smoke run took 58 ms compiling (7.6 ms with
    powers of two, 14 ms with the torch ops). live: an int32 [1] tensor (the hand-off's
    `live` word, its device copy on a GPU) holding the real tokens of the step; rows past it
    are ignored. job: the hand-off's job of this call (`handoff.job_args`), posted by the same
    launch once the fetches are chosen. ahead_counts: hits on slots filled ahead count as
    fetches (a FetchPolicy's limit, `SlotCache.plan`)."""
    E, S = cache.num_experts, cache.num_slots
    LT = limits.numel()
    if LT & (LT - 1) or LT <= MAX_ROUTES or limits.dtype != torch.int32:
        raise ValueError(f"plan_triton: limits must be int32 of a power-of-two length above "
                         f"{MAX_ROUTES}, got {limits.dtype} [{LT}]")
    flat = ids.reshape(-1)
    R = flat.numel()
    n = min(E, R)
    out = torch.empty(2, n, dtype=torch.int64, device=ids.device)
    if job is None:
        send, consts = (out,) * 6 + (0,) * 10, {}
    else:
        args, consts = job
        send = (args[0],) + args[2:]  # the plan's own ids are the job's
        consts = dict(consts, **interp_rounds(args[10], consts["K"], consts["H"], JOB_BLOCK))
    sb, warps = scan_shape(S)
    _plan_kernel[(1,)](
        flat, R, cache.slot_of, cache.owner, cache.last_use, cache.fresh, cache.clock,
        cache.counters,
        limits, out, layer * E, min(cap, n), int(count), n, live if live is not None else out,
        ids.shape[1] if ids.dim() == 2 else 1, *send, S=S, E=E, LT=LT, EB=triton.next_power_of_2(E),
        RB=max(16, triton.next_power_of_2(R)), NB=max(16, triton.next_power_of_2(n)), SB=sb,
        HAS_LIVE=live is not None, SEND=job is not None, H=consts.get("H", 1),
        ROUNDS_IDS=consts.get("ROUNDS_IDS", 0), ROUNDS_X=consts.get("ROUNDS_X", 0),
        BLOCK=JOB_BLOCK, ASM=asm(), AHEAD_COUNTS=ahead_counts, num_warps=warps)
    return out


def ahead_triton(cache, layer: int, ids: torch.Tensor, limit: int,
                 live: torch.Tensor | None = None) -> torch.Tensor:
    """fetched int64 [2, n] for `SlotCache.plan_ahead` (see there) in one launch; live as for
    `plan_triton`."""
    E, S = cache.num_experts, cache.num_slots
    flat = ids.reshape(-1)
    R = flat.numel()
    n = min(E, R)
    out = torch.empty(2, n, dtype=torch.int64, device=ids.device)
    sb, warps = scan_shape(S)
    _ahead_kernel[(1,)](
        flat, R, cache.slot_of, cache.owner, cache.last_use, cache.fresh, cache.clock,
        cache.counters, out, layer * E, max(0, min(limit, n)), n,
        live if live is not None else out, ids.shape[1] if ids.dim() == 2 else 1, S=S, E=E,
        EB=triton.next_power_of_2(E), RB=max(16, triton.next_power_of_2(R)),
        NB=max(16, triton.next_power_of_2(n)), SB=sb, HAS_LIVE=live is not None,
        num_warps=warps)
    return out
