"""Paged attention in Triton: the KV store, decode (split-K) and varlen prefill kernels.

Same contract as the torch reference (`freetoken.kernels.attention`): the KV cache of one layer
is `[2, num_pages, page_size, n_kv, d]`, query head h reads KV head h // (n_q / n_kv), a query
at position p sees keys j <= p (and p - j < window with a sliding window), scores are
`q.k * scale`, optionally soft-capped `c * tanh(s / c)`. Scores, softmax and accumulation are
fp32; bf16 / fp16 operands go to the tensor cores as they are, fp32 operands use IEEE dots.

Every size the kernels need at run time (sequence lengths, query offsets, pages) is read from
device tensors, never from the host, so the decode path can be captured in a CUDA graph. The
host only picks launch shapes from tensor shapes (batch, table width) and, for prefill, the
longest query chunk (`ctx.max_seqlen_q`, or T when the caller did not say).

Decode: one program per (sequence, kv head, split): the G query heads sharing a KV head are
the rows of one tile, so K and V are read once per KV head. Where few (sequence, kv head) pairs
would leave SMs idle, the sequence is split (split-K, down to one key block a split): each
split stores its (acc, max, denominator); up to MERGE_MAX_SPLITS splits each counts itself in
an arrival counter of its (sequence, kv head) (`arrive.py`) and the last to arrive merges them,
with no launch of its own; with more splits (where a lone merging program measured slower) or
beyond MERGE_COUNTERS pairs, `_merge_kernel` does it.
With `rope` it also does the step's q/k norm, rotary and KV store (`rotary._qk_rope_kernel`'s
work, which then needs no launch): each program ropes its query heads in registers, the split
that holds the step's position ropes the key head and stores k' and v before reading its keys.
Prefill: flash-attention over `cu_seqlens_q`, one program per (query block, query head,
sequence), reading K / V through the page table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken import env
from freetoken.kernels.triton import interpreting, pdl
from freetoken.kernels.triton.arrive import counters, last_to_arrive
from freetoken.kernels.triton.gemv_i8 import quant_store, xq_len
from freetoken.kernels.triton.pdl import wait
from freetoken.kernels.triton.rotary import _rope_rows, _store_step_kv

# A finite "minus infinity": a fully masked block gives weight 0, never NaN.
NEG = tl.constexpr(-1.0e30)


def _max_iters(keys: int, block: int) -> int:
    """0 for compiled kernels (they loop to the sequence's own end, read on the device). Under
    Triton's interpreter a runtime loop bound cannot be a Python index (numpy 2 refuses int()
    of a 1-element array), so there the loop runs a constexpr count of blocks covering `keys`
    and masks every key past the sequence."""
    if not interpreting():
        return 0
    return max(1, triton.cdiv(keys, block))


@triton.jit
def _softcap(s, cap):
    """cap * tanh(s / cap), tanh from exp of a non-positive number (no overflow)."""
    x = s / cap
    t = tl.exp(-2.0 * tl.abs(x))
    th = (1.0 - t) / (1.0 + t)
    return cap * tl.where(x < 0, -th, th)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, stride_kt, stride_kh, stride_vt,
                     stride_vh, v_plane, D: tl.constexpr, N_KV: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """One program per new token: its K and V rows into flat slot `slot` (< 0: padding)."""
    wait(PDL)  # pdl.py: the kernel before has completed
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = (offs < N_KV * D) & (slot >= 0)
    head, dim = offs // D, offs % D
    k = tl.load(k_ptr + t * stride_kt + head * stride_kh + dim, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + head * stride_vh + dim, mask=mask)
    dst = cache_ptr + slot * (N_KV * D) + offs
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + v_plane, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attend_block(q, acc, m, den, cache_ptr, v_plane, table_row, j, jmask, smask, kvh, dims,
                  dmask, scale, softcap, PAGE: tl.constexpr, N_KV: tl.constexpr,
                  D: tl.constexpr, HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """One online-softmax step over keys j [BLOCK_N] for the rows of q [M, D_PAD].

    `smask` [M, BLOCK_N]: which (row, key) pairs count. Returns (acc, m, den) updated."""
    page = tl.load(table_row + j // PAGE, mask=jmask, other=0).to(tl.int64)
    kv_off = (page * PAGE + j % PAGE)[:, None] * (N_KV * D) + kvh * D + dims[None, :]
    kvm = jmask[:, None] & dmask[None, :]
    k = tl.load(cache_ptr + kv_off, mask=kvm, other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale
    if HAS_SOFTCAP:
        s = _softcap(s, softcap)
    s = tl.where(smask, s, NEG)
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    den = den * alpha + tl.sum(p, 1)
    v = tl.load(cache_ptr + v_plane + kv_off, mask=kvm, other=0.0)
    if IEEE:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return acc * alpha[:, None] + pv, m_new, den


@triton.jit
def _store_rows(out, out_ptr, q8_ptr, b, kvh, heads, dims, gmask, dmask, stride_ot, stride_oh,
                stride_q8, N_KV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                QUANT: tl.constexpr):
    """The output rows out [G_PAD, D_PAD] of KV head kvh's query heads (QUANT: also their
    codes, `quant_store`, from the values as stored)."""
    dst = out_ptr + b * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])
    if QUANT:
        quant_store(out.to(out_ptr.dtype.element_ty).to(tl.float32),
                   q8_ptr + b.to(tl.int64) * stride_q8, kvh * G * D, gmask, N_KV * G * D)


@triton.jit
def _merge_splits(part_ptr, rows, gmask, dims, live_len, split_len, G_PAD: tl.constexpr,
                  D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr,
                  GROUP: tl.constexpr):
    """The merged output [G_PAD, D_PAD] of the partial rows `rows` [G_PAD] (query heads of
    one KV head; split s at rows * NUM_SPLITS + s), `_merge_kernel`'s arithmetic: weights
    exp(m - max m). A split that starts at or past the sequence's end (s split_len >=
    live_len: m = NEG, weight 0) is masked instead of read, which gives the same sums. The
    partials are read from L2 (other SMs wrote them) GROUP splits at a time, one [GROUP,
    G_PAD, D_PAD] load a round: a lone program's rounds are serial L2 latencies, so one split
    a round made 16 splits slower than the merge kernel's launch (MERGE_GROUP)."""
    s = tl.arange(0, S_PAD)
    live = (s < NUM_SPLITS) & (s * split_len < live_len)
    at = (rows[:, None] * NUM_SPLITS + s[None, :]).to(tl.int64) * (D_PAD + 2) + D_PAD
    ms = gmask[:, None] & live[None, :]
    m = tl.load(part_ptr + at, mask=ms, other=NEG, cache_modifier=".cg")
    top = tl.max(m, 1)  # [G_PAD]
    w = tl.exp(m - top[:, None])  # [G_PAD, S_PAD]; a masked split weighs 0
    den = tl.sum(tl.load(part_ptr + at + 1, mask=ms, other=0.0, cache_modifier=".cg") * w, 1)
    num = tl.zeros([G_PAD, D_PAD], tl.float32)
    for j0 in tl.static_range(0, NUM_SPLITS, GROUP):
        sj = j0 + tl.arange(0, GROUP)  # [GROUP]
        ok = ((sj < NUM_SPLITS) & (sj * split_len < live_len))[:, None] & gmask[None, :]
        base = part_ptr + (rows[None, :] * NUM_SPLITS + sj[:, None]).to(tl.int64) * (D_PAD + 2)
        wj = tl.exp(tl.load(base + D_PAD, mask=ok, other=NEG, cache_modifier=".cg")
                    - top[None, :])  # [GROUP, G_PAD]: w's columns sj
        a = tl.load(base[:, :, None] + dims[None, None, :], mask=ok[:, :, None], other=0.0,
                    cache_modifier=".cg")  # [GROUP, G_PAD, D_PAD]
        num += tl.sum(a * wj[:, :, None], 0)
    return num / tl.maximum(den, 1e-30)[:, None]


@triton.jit
def _decode_kernel(q_ptr, cache_ptr, table_ptr, seq_lens_ptr, out_ptr, part_ptr, q8_ptr,
                   count_ptr, stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
                   stride_q8, v_plane, scale, softcap, window, k_ptr, v_ptr, qw_ptr, kw_ptr,
                   cos_ptr, sin_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                   stride_cos, eps, PAGE: tl.constexpr,
                   N_KV: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, G: tl.constexpr,
                   G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
                   MAX_ITERS: tl.constexpr, QUANT: tl.constexpr = False,
                   MERGE: tl.constexpr = False, S_PAD: tl.constexpr = 2,
                   PDL: tl.constexpr = False, ROPE: tl.constexpr = False,
                   NORM: tl.constexpr = False, PARTIAL: tl.constexpr = False,
                   RH: tl.constexpr = 0, GROUP: tl.constexpr = 1):
    """QUANT (D = D_PAD, a multiple of 32): the output rows are also stored quantized for the
    output projection's int8 GEMV (`gemv_i8.quant_store`, rows of `xq_len(Hq D)` at q8).
    NUM_SPLITS > 1: partials [B, Hq, NUM_SPLITS, D_PAD + 2] at part; MERGE: the last split
    of a (sequence, kv head) to arrive (counter b N_KV + kvh at count) merges them into out,
    else `_merge_kernel` does.
    ROPE (D = D_PAD): q, k, v are the step's raw rows, and the kernel does
    `rotary._qk_rope_kernel`'s work with the KV store itself (norm weights at qw / kw with
    NORM, cos / sin rows at cos / sin, first 2 RH values rotated, PARTIAL where 2 RH < D,
    flat slots at slot); unused pointers and strides otherwise."""
    wait(PDL)  # pdl.py: the kernel before has completed
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    first = 0
    if HAS_WINDOW:  # keys j with (seq_len - 1) - j < window
        first = tl.maximum(seq_len - window, 0)
    # This split's share of the keys, sized from the sequence's own length (read here, so a
    # replayed graph splits each step's context evenly).
    split_len = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = first + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    g = tl.arange(0, G_PAD)
    dims = tl.arange(0, D_PAD)
    gmask, dmask = g < G, dims < D
    heads = kvh * G + g
    if ROPE:
        # The query heads roped in registers and rounded to q's dtype, the numbers of the q'
        # qk_rope stores. The split whose keys hold the newest position (seq_len - 1, the
        # step's token; the last non-empty split) ropes its key head and stores it and the
        # value head in the cache, then a barrier: the CTA's stores before its loads. The
        # other splits' keys end before that position: they never read it.
        t = b.to(tl.int64)
        cos, sin = cos_ptr + t * stride_cos, sin_ptr + t * stride_cos
        q = _rope_rows(q_ptr + t * stride_qt, heads, gmask, stride_qh, qw_ptr, cos, sin, eps,
                       D, RH, NORM, PARTIAL).to(q_ptr.dtype.element_ty)
        if (lo <= seq_len - 1) & (seq_len - 1 < hi):
            _store_step_kv(k_ptr + t * stride_kt + kvh * stride_kh,
                           v_ptr + t * stride_vt + kvh * stride_vh, kw_ptr, cos, sin, eps,
                           cache_ptr, v_plane, slot_ptr, b, kvh, N_KV, D, RH, NORM, PARTIAL)
            tl.debug_barrier()
    else:
        qm = gmask[:, None] & dmask[None, :]
        q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                    mask=qm, other=0.0)
    q = q.to(cache_ptr.dtype.element_ty)
    m = tl.full([G_PAD], NEG, tl.float32)
    den = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    table_row = table_ptr + b.to(tl.int64) * stride_table
    for it in range(0, MAX_ITERS if MAX_ITERS else tl.cdiv(hi - lo, BLOCK_N)):
        j = lo + it * BLOCK_N + tl.arange(0, BLOCK_N)
        jmask = j < hi
        acc, m, den = _attend_block(q, acc, m, den, cache_ptr, v_plane, table_row, j, jmask,
                                  jmask[None, :] & gmask[:, None], kvh, dims, dmask, scale,
                                  softcap, PAGE, N_KV, D, HAS_SOFTCAP, IEEE)
    if NUM_SPLITS == 1:
        _store_rows(acc / tl.maximum(den, 1e-30)[:, None], out_ptr, q8_ptr, b, kvh, heads,
                    dims, gmask, dmask, stride_ot, stride_oh, stride_q8, N_KV, G, D, QUANT)
    else:  # partials [B, Hq, NUM_SPLITS, D_PAD + 2]: acc, then m, then den
        rows = b * (N_KV * G) + heads
        base = part_ptr + (rows * NUM_SPLITS + split).to(tl.int64) * (D_PAD + 2)
        tl.store(base[:, None] + dims[None, :], acc, mask=gmask[:, None])
        tl.store(base + D_PAD, m, mask=gmask)
        tl.store(base + D_PAD + 1, den, mask=gmask)
        if MERGE:
            if last_to_arrive(count_ptr + b * N_KV + kvh, NUM_SPLITS):
                out = _merge_splits(part_ptr, rows, gmask, dims, seq_len - first, split_len,
                                    G_PAD, D_PAD, NUM_SPLITS, S_PAD, GROUP)
                _store_rows(out, out_ptr, q8_ptr, b, kvh, heads, dims, gmask, dmask,
                            stride_ot, stride_oh, stride_q8, N_KV, G, D, QUANT)


@triton.jit
def _merge_kernel(part_ptr, out_ptr, q8_ptr, stride_ot, stride_oh, stride_q8, H: tl.constexpr,
                  D: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  S_PAD: tl.constexpr, QUANT: tl.constexpr = False, PDL: tl.constexpr = False):
    """One program per (sequence, query head): softmax-weighted sum of its splits (QUANT: also
    quantized, as `_decode_kernel` stores it). The merge above MERGE_MAX_SPLITS splits, where
    the splits' counters do not fit MERGE_COUNTERS, or with `decode(fused_merge=False)`."""
    wait(PDL)  # pdl.py: the kernel before has completed
    b, h = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, S_PAD)
    dims = tl.arange(0, D_PAD)
    smask = s < NUM_SPLITS
    base = part_ptr + ((b * H + h) * NUM_SPLITS + s).to(tl.int64) * (D_PAD + 2)
    m = tl.load(base + D_PAD, mask=smask, other=NEG)
    den = tl.load(base + D_PAD + 1, mask=smask, other=0.0)
    acc = tl.load(base[:, None] + dims[None, :], mask=smask[:, None], other=0.0)
    w = tl.exp(m - tl.max(m, 0))  # [S_PAD]; an empty split (m = NEG) weighs 0
    out = tl.sum(acc * w[:, None], 0) / tl.maximum(tl.sum(den * w, 0), 1e-30)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < D)
    if QUANT:
        quant_store(tl.reshape(out.to(out_ptr.dtype.element_ty).to(tl.float32), (1, D_PAD)),
                   q8_ptr + b.to(tl.int64) * stride_q8, h * D, tl.arange(0, 1) < 1, H * D)


@triton.jit
def _prefill_kernel(q_ptr, cache_ptr, table_ptr, cu_ptr, seq_lens_ptr, out_ptr, stride_qt,
                    stride_qh, stride_ot, stride_oh, stride_table, v_plane, scale, softcap,
                    window, PAGE: tl.constexpr, N_KV: tl.constexpr, D: tl.constexpr,
                    D_PAD: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr, MAX_ITERS: tl.constexpr,
                    PDL: tl.constexpr = False):
    wait(PDL)  # pdl.py: the kernel before has completed
    mblk, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_lo = tl.load(cu_ptr + b)
    n_q = tl.load(cu_ptr + b + 1) - q_lo
    seq_len = tl.load(seq_lens_ptr + b)
    first = seq_len - n_q  # position of the sequence's first new token
    rows = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < n_q
    pos = first + rows
    dims = tl.arange(0, D_PAD)
    dmask = dims < D
    kvh = h // G
    qm = rmask[:, None] & dmask[None, :]
    tok = (q_lo + rows).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + dims[None, :], mask=qm,
                other=0.0)
    q = q.to(cache_ptr.dtype.element_ty)
    hi = tl.minimum(seq_len, first + (mblk + 1) * BLOCK_M)  # past the block's last query
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first + mblk * BLOCK_M - window + 1, 0)
    hi = tl.where(mblk * BLOCK_M < n_q, hi, lo)  # a block past this sequence's queries
    m = tl.full([BLOCK_M], NEG, tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table_row = table_ptr + b.to(tl.int64) * stride_table
    for it in range(0, MAX_ITERS if MAX_ITERS else tl.cdiv(hi - lo, BLOCK_N)):
        j = lo + it * BLOCK_N + tl.arange(0, BLOCK_N)
        jmask = j < hi
        smask = (j[None, :] <= pos[:, None]) & jmask[None, :] & rmask[:, None]
        if HAS_WINDOW:
            smask = smask & (pos[:, None] - j[None, :] < window)
        acc, m, den = _attend_block(q, acc, m, den, cache_ptr, v_plane, table_row, j, jmask,
                                  smask, kvh, dims, dmask, scale, softcap, PAGE, N_KV, D,
                                  HAS_SOFTCAP, IEEE)
    out = acc / tl.maximum(den, 1e-30)[:, None]
    dst = out_ptr + tok[:, None] * stride_ot + h * stride_oh + dims[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=qm)


# ---- launchers -----------------------------------------------------------------------------
def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def _tiles(d_pad: int) -> tuple[int, int, int]:
    """(decode keys per block, prefill queries per block at most, warps) for a head size.

    Chosen from ptxas's register report for sm_90 (bf16): these compile without spilling (or
    with under 100 bytes) where wider tiles spill kilobytes; d <= 128 measured on the H200."""
    if d_pad <= 128:
        return 64, 64, 4
    if d_pad <= 256:
        return 32, 32, 8
    return 16, 16, 8


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[T, H, d] with unit stride over d (the kernels index heads and rows by stride)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def store_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v [T, n_kv, d] into `cache` at flat slots [T]; a negative slot (padding) is skipped."""
    k, v = _rows(k), _rows(v)
    n_kv, d = cache.shape[-2:]
    if k.shape[0]:
        _store_kv_kernel[(k.shape[0],)](
            k, v, cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cache[1].numel(), D=d, N_KV=n_kv, BLOCK=_pow2(n_kv * d), **pdl.opts())


def num_splits(batch: int, n_kv: int, max_ctx: int, block_n: int) -> int:
    """Splits of the sequence for decode: enough programs to fill the GPU (some 256), at most
    one per key block (block_n keys, the kernel's step) of the table's capacity, 16 at most.
    Depends on shapes only (the same for every replay of a captured graph); each program
    sizes its share from the sequence's length, so a short context in a wide table leaves
    the later splits empty (they store m = NEG, weight 0, which the in-kernel merge does not
    read). A power of two, so eager steps, whose table width varies, compile at most five
    variants.

    One sequence at a short context is latency, not bandwidth: at splits = 1 a program walks
    its blocks one after the other (page table, K, dot, V), 4 programs for Qwen3-30B's KV
    heads. Split down to a block each, the blocks run side by side in programs of their own,
    then are merged (`decode`: by the last to arrive up to MERGE_MAX_SPLITS, else by
    `_merge_kernel`)."""
    if batch * n_kv >= 128:
        return 1
    want = max(1, min(256 // (batch * n_kv), 16, max_ctx // block_n))
    return 1 << (want.bit_length() - 1)


# Arrival counters of the in-kernel merge, one per (sequence, kv head). num_splits splits only
# below 128 pairs, so 128 would serve its choices; 4096 words (16 KiB a device) leave room for
# a forced `splits` (tests, benchmarks) up to 256 sequences of 16 KV heads. Beyond that the
# splits are merged by `_merge_kernel`.
MERGE_COUNTERS = 4096
# Splits up to which the last split merges (None in `decode`): measured on the H200
# (bench_gpu_kernels.py --attention, graph replays, bf16 KV, 2026-12-02), us in-kernel merge /
# merge launch: 2 splits (30B shape, 128-key table) 4.6 / 4.9 at batch 1, 5.2 / 5.5 at 4, 5.5 /
# 5.7 at 16; from 4 splits the lone merging program's serial read of every split's partials
# lost (35B, 4 splits: 5.4 / 5.3; 30B, 16 splits, 1024 keys: 9.7 / 6.1; 4096 keys: 14.2 /
# 10.5). End to end with the graphs' wide tables (16 splits at batch 1; at short contexts most
# of them empty, which the in-kernel merge skips) it lost as well: 30B Q4_K fused, H100,
# 2026-12-06, FREETOKEN_GPU_ATTN_MERGE_SPLITS=2 / 16, tok/s at batch 1 / 4: 32-token prompts
# 425.5 / 1082.9 against 408.2 / 1003.6, 1024-token prompts 408.2 / 1017.0 against 380.0 /
# 854.7 (benchmarks/ab_env.py).
MERGE_MAX_SPLITS = 2
# Splits the merging program reads a round (`_merge_splits`; at most the padded split count).
MERGE_GROUP = 4


def _rope_args(q: torch.Tensor, rope: tuple | None) -> tuple:
    """`_decode_kernel`'s arguments k_ptr .. eps: `rope`'s (`decode`), else unused ones."""
    if rope is None:
        return (q,) * 7 + (0,) * 5 + (0.0,)
    k, v, cos, sin, q_weight, k_weight, eps, slots = rope
    norm = q_weight is not None
    return (k, v, q_weight if norm else cos, k_weight if norm else cos, cos, sin, slots,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), float(eps))


def _rope_consts(q: torch.Tensor, rope: tuple | None) -> dict:
    """`_decode_kernel`'s ROPE constexprs for `rope` (`decode`)."""
    if rope is None:
        return {}
    d, r = q.shape[-1], rope[2].shape[-1]
    if d != _pow2(d) or rope[0].shape[0] != q.shape[0]:
        raise ValueError(f"decode(rope=...): d must be a power of two from 16 on and k one "
                         f"row per sequence, got q {list(q.shape)}, k {list(rope[0].shape)}")
    return dict(ROPE=True, NORM=rope[4] is not None, PARTIAL=r < d, RH=r // 2)


def decode(q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor,
           seq_lens: torch.Tensor, *, scale: float, window: int | None,
           softcap: float | None, splits: int | None = None, quantize: bool = False,
           fused_merge: bool | None = None, rope: tuple | None = None
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One query per sequence: q [B, n_q, d] at position seq_lens - 1 -> (out [B, n_q, d],
    with `quantize` and d a power of two from 32 on: out quantized for the output
    projection's int8 GEMV [B, xq_len(n_q d)], else None). `splits`: force a split count
    (else `num_splits`); `fused_merge`: the last split merges (True) or a launch of its own
    does (False: `_merge_kernel`, also the path beyond MERGE_COUNTERS (sequence, kv head)
    pairs); None: the last split up to MERGE_MAX_SPLITS splits.

    `rope` = (k, v, cos, sin, q_weight, k_weight, eps, slots): q, k [B, n_kv, d], v are the
    step's rows before `rotary.qk_rope_triton` (d a power of two from 16 on, unit stride in
    d, its other conditions checked by `freetoken.kernels.rotary`), and this one launch does
    its work with the KV store (k' and v at flat slots [B]) as well."""
    q = _rows(q)
    bsz, n_q, d = q.shape
    n_kv, page = cache.shape[-2], cache.shape[2]
    g = n_q // n_kv
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    d_pad = _pow2(d)
    block_n, _, warps = _tiles(d_pad)
    max_ctx = page_table.shape[1] * page
    splits = splits or num_splits(bsz, n_kv, max_ctx, block_n)
    part = (torch.empty(bsz, n_q, splits, d_pad + 2, dtype=torch.float32, device=q.device)
            if splits > 1 else out)
    if fused_merge is None:
        fused_merge = splits <= (env.gpu_attn_merge_splits() or MERGE_MAX_SPLITS)
    fused = splits > 1 and fused_merge and bsz * n_kv <= MERGE_COUNTERS
    count = counters("attn_merge", MERGE_COUNTERS, q.device) if fused else out
    quantize = quantize and d == d_pad and d % 32 == 0
    q8 = torch.empty(bsz, xq_len(n_q * d), dtype=torch.int32, device=q.device) \
        if quantize else out
    _decode_kernel[(bsz, n_kv, splits)](
        q, cache, page_table, seq_lens, out, part, q8, count, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), page_table.stride(0), q8.stride(0), cache[1].numel(),
        scale, softcap or 1.0, window or 0, *_rope_args(q, rope), PAGE=page, N_KV=n_kv, D=d,
        D_PAD=d_pad, G=g, G_PAD=_pow2(g), BLOCK_N=block_n, NUM_SPLITS=splits,
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
        IEEE=cache.dtype == torch.float32,
        MAX_ITERS=_max_iters(triton.cdiv(max_ctx, splits), block_n), QUANT=quantize,
        MERGE=fused, S_PAD=_pow2(splits, 2), GROUP=min(MERGE_GROUP, _pow2(splits, 2)),
        num_warps=warps, enable_fp_fusion=not quantize,
        **_rope_consts(q, rope), **pdl.opts())  # codes: as gemv_i8's
    if splits > 1 and not fused:
        _merge_kernel[(bsz, n_q)](part, out, q8, out.stride(0), out.stride(1), q8.stride(0),
                                  H=n_q, D=d, D_PAD=d_pad, NUM_SPLITS=splits,
                                  S_PAD=_pow2(splits, 2), QUANT=quantize,
                                  enable_fp_fusion=not quantize, **pdl.opts())
    return out, (q8 if quantize else None)


def prefill(q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor,
            cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, max_seqlen_q: int, *,
            scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """Varlen causal attention: q [T, n_q, d] (sequence b's new tokens at
    cu_seqlens_q[b]:cu_seqlens_q[b+1], the last at position seq_lens[b] - 1) -> [T, n_q, d]."""
    q = _rows(q)
    n_q, d = q.shape[1:]
    n_kv, page = cache.shape[-2], cache.shape[2]
    out = torch.empty_like(q)
    _, most_m, warps = _tiles(_pow2(d))
    block_m = min(most_m, 32 if max_seqlen_q <= 32 else 64)
    grid = (triton.cdiv(max(max_seqlen_q, 1), block_m), n_q, seq_lens.shape[0])
    _prefill_kernel[grid](
        q, cache, page_table, cu_seqlens_q, seq_lens, out, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), page_table.stride(0), cache[1].numel(), scale,
        softcap or 1.0, window or 0, PAGE=page, N_KV=n_kv, D=d, D_PAD=_pow2(d), G=n_q // n_kv,
        BLOCK_M=block_m, BLOCK_N=32, HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None, IEEE=cache.dtype == torch.float32,
        MAX_ITERS=_max_iters(page_table.shape[1] * page, 32), num_warps=warps, **pdl.opts())
    return out
