"""GPU kernels of the expert-cache hand-off (freetoken/moe/handoff.py) and of slot fills, with
no host sync and no host call, so that a decode step with the offload, hybrid or cpu backend
stays one CUDA graph.

Host memory is reached directly: the hand-off buffer is pinned (cudaHostAlloc) and the host
banks are registered with CUDA (moe/host_banks.py); on a system with unified addressing
both are mapped at the same address on the device, which Triton takes as a pointer.
- `send`: one program writes a layer call's job (ids, weights, the layer's expert -> slot
  map, x) into the buffer, then `go` = the next job number after a system-scope fence by
  every thread and a CTA barrier (the CPU worker sees the whole job once it sees `go`). The
  worker reads only the map's signs (-1: the CPU computes the expert's routes).
- `receive_add`: every program polls `done` until it equals the job number (a bounded wait:
  after TIMEOUT_S it gives up and sets the buffer's timeout word, which the host turns into an
  error after the step, rather than hang the GPU), fences, then y + out in fp32. With the
  layer's shared expert (sh, and its gate's x and weight row) it adds y + gate * sh too, in
  the same launch: a grid of (token, block of H), each program computing its token's gate
  and that part of the sum before it polls, with the two launches' bits (see `receive_add`).
  With a fold (`kernels/norm.py`: the next layer's residual step) a program a token holds its
  row and computes that step too (`_receive_norm_kernel`, `_receive_shared_norm_kernel`).
- `post_hint`: one program writes the next MoE layer's predicted misses (the experts of its
  predicted routes on live rows that its map gives no slot, most-routed first, then the lower
  id: the slot plan's fetch order), their count and the layer into the buffer's hint, then
  the tag (the job number the plan kernel just posted) after a system-scope fence.
- `post_ahead`: one program lists the experts given slots ahead of the next layer's call
  ((expert, slot) pairs) for the worker, who copies them after its job with the copy engine;
  the list's number (a device counter) goes to the buffer's tag last and to the layer's
  entry of a device table; `wait_ahead` polls `ahead_done` (which the worker's stream writes
  once the copies are complete) until it reaches that number, bounded as the receive's wait.
- `fill`: copies fetched experts (the plan's (expert, slot) list, -1 = nothing) from the
  host bank's parts into their slots: a grid over (fetch, part, chunk) of PCIe reads; each
  part's host address, slot offset and size come from a small table on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.norm import fold_buffers, fold_done
from freetoken.kernels.triton import interpreting
from freetoken.kernels.triton.glu import (
    GATE_WARPS,
    gate_block,
    gate_folds,
    gated_sum,
    sigmoid_dot,
)
from freetoken.kernels.triton.norm import norm_row, norm_warps

TIMEOUT_S = 30.0  # a hand-off answered later than this is an error (the worker died or hung)
FILL_CHUNK = 4096  # 4-byte words one fill program copies


@triton.jit
def _fence_sys(v, ASM: tl.constexpr = True):
    """membar.sys on every thread; returns v (a data dependency for what must come after).
    Not ASM (Triton's interpreter, which runs no PTX and orders its stores anyway): v."""
    if ASM:
        v = tl.inline_asm_elementwise("membar.sys;\n\tmov.b32 $0, $1;", "=r,r", [v],
                                      dtype=tl.int32, is_pure=False, pack=1)
    return v


@triton.jit
def _now_ns(v):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [v], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def job_begin(x_ptr, ids_ptr, w_ptr, seq_ptr, hi32, hf32, hx, layer, act, xdt, T, o_job, o_ids,
              o_w, o_x, H: tl.constexpr, K, BLOCK: tl.constexpr, ROUNDS_IDS: tl.constexpr = 0,
              ROUNDS_X: tl.constexpr = 0):
    """A job's header, ids, weights and x into the pinned buffer (one program); returns its
    number, for `job_post` once the map is written too. ROUNDS_IDS / ROUNDS_X: the copy
    loops' trip counts where a loop cannot run to a device value (Triton's interpreter:
    `interp_rounds`), else 0."""
    n = tl.load(seq_ptr) + 1
    tl.store(seq_ptr, n)
    tl.store(hi32 + o_job, layer)
    tl.store(hi32 + o_job + 1, T)
    tl.store(hi32 + o_job + 2, act)
    tl.store(hi32 + o_job + 3, xdt)
    offs = tl.arange(0, BLOCK)
    tk = T * K
    for s in range(0, ROUNDS_IDS * BLOCK if ROUNDS_IDS else tk, BLOCK):
        m = s + offs < tk
        tl.store(hi32 + o_ids + s + offs, tl.load(ids_ptr + s + offs, mask=m).to(tl.int32),
                 mask=m)
        tl.store(hf32 + o_w + s + offs, tl.load(w_ptr + s + offs, mask=m).to(tl.float32),
                 mask=m)
    th = T * H
    for s in range(0, ROUNDS_X * BLOCK if ROUNDS_X else th, BLOCK):
        m = s + offs < th
        tl.store(hx + o_x + s + offs, tl.load(x_ptr + s + offs, mask=m), mask=m)
    return n


@triton.jit
def job_post(n, hi32, o_go, ASM: tl.constexpr = True):
    """Post job n: `go` = n after a system-scope fence by every thread and a CTA barrier (the
    worker sees the whole job once it sees `go`)."""
    n = _fence_sys(n, ASM)
    tl.debug_barrier()
    tl.store(hi32 + o_go, n)


@triton.jit
def write_job(x_ptr, ids_ptr, w_ptr, map_ptr, seq_ptr, hi32, hf32, hx, layer, act, xdt, T,
              o_go, o_job, o_ids, o_w, o_map, o_x, H: tl.constexpr, K, E: tl.constexpr,
              BLOCK: tl.constexpr):
    """Write a job (header, ids, weights, map [E] from map_ptr, x) into the pinned buffer and
    post it (`job_post`). One program. The slot plan kernel (kernels/triton/slot_plan.py)
    posts its jobs with `job_begin` / `job_post` and the map from its registers."""
    n = job_begin(x_ptr, ids_ptr, w_ptr, seq_ptr, hi32, hf32, hx, layer, act, xdt, T, o_job,
                  o_ids, o_w, o_x, H, K, BLOCK)
    offs = tl.arange(0, BLOCK)
    for s in range(0, E, BLOCK):
        m = s + offs < E
        tl.store(hi32 + o_map + s + offs, tl.load(map_ptr + s + offs, mask=m), mask=m)
    job_post(n, hi32, o_go)


@triton.jit
def _send_kernel(x_ptr, ids_ptr, w_ptr, map_ptr, seq_ptr, hi32, hf32, hx, layer, act, xdt, T,
                 o_go, o_job, o_ids, o_w, o_map, o_x,
                 H: tl.constexpr, K: tl.constexpr, E: tl.constexpr, BLOCK: tl.constexpr):
    write_job(x_ptr, ids_ptr, w_ptr, map_ptr, seq_ptr, hi32, hf32, hx, layer, act, xdt, T,
              o_go, o_job, o_ids, o_w, o_map, o_x, H, K, E, BLOCK)


@triton.jit
def _poll(hi32, o_word, o_timeout, want, EXACT: tl.constexpr, timeout_ns, ASM: tl.constexpr):
    """Poll the host-written word at o_word until it equals `want` (EXACT) or reaches it in
    int32 order, wrapping (not EXACT), or give up after timeout_ns and set the timeout word.
    Returns the last value read and the nanoseconds polled (not ASM, Triton's interpreter,
    which has no clock: a poll counts as a nanosecond)."""
    if ASM:
        t0 = _now_ns(want)
        waited = t0 - t0
    else:
        waited = want.to(tl.int64) * 0
    d = tl.load(hi32 + o_word, volatile=True)
    while _short(d, want, EXACT) & (waited < timeout_ns):
        d = tl.load(hi32 + o_word, volatile=True)
        if ASM:
            waited = _now_ns(d) - t0
        else:
            waited += 1
    if _short(d, want, EXACT):
        tl.store(hi32 + o_timeout, 1)
    return d, waited


@triton.jit
def _short(d, want, EXACT: tl.constexpr):
    """Whether the word d has not reached `want` yet (see `_poll`)."""
    if EXACT:
        return d != want
    return (d - want) < 0


@triton.jit
def _await_answer(seq_ptr, hi32, o_done, o_timeout, timeout_ns, waits_ptr, first,
                  ASM: tl.constexpr):
    """Poll `done` until it equals the job number, or give up after timeout_ns and set the
    timeout word; where `first` (one program of the launch), add the nanoseconds polled and 1
    to waits_ptr (int64 [2]: the device's wait for the CPU's answer, which
    profile_decode_step.py reports). Returns `done` after a system-scope fence: the answer's
    loads take a data dependency on it."""
    n = tl.load(seq_ptr)
    d, waited = _poll(hi32, o_done, o_timeout, n, True, timeout_ns, ASM)
    if first:
        tl.atomic_add(waits_ptr, waited)
        tl.atomic_add(waits_ptr + 1, 1)
    return _fence_sys(d, ASM)


@triton.jit
def _receive_kernel(y_ptr, out_ptr, seq_ptr, hi32, hf32, o_done, o_timeout, o_out, N,
                    timeout_ns, waits_ptr, BLOCK: tl.constexpr, ASM: tl.constexpr = True):
    """out = y + the CPU's out over the flattened [T, H], BLOCK values a program."""
    d = _await_answer(seq_ptr, hi32, o_done, o_timeout, timeout_ns, waits_ptr,
                      tl.program_id(0) == 0, ASM)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    c = tl.load(hf32 + o_out + offs + (d - d), mask=m, other=0.0, cache_modifier=".cv")
    y = tl.load(y_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (y + c).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _receive_norm_kernel(y_ptr, out_ptr, seq_ptr, hi32, hf32, o_done, o_timeout, o_out,
                         timeout_ns, waits_ptr, res_ptr, nw_ptr, ny_ptr, ns_ptr, nq_ptr,
                         stride_r, stride_ny, stride_ns, stride_nq, eps, H: tl.constexpr,
                         QUANT: tl.constexpr, BLOCK: tl.constexpr, ASM: tl.constexpr = True):
    """Program t: token t's row of `_receive_kernel` (out = y + the CPU's out, y and out
    [T, H] contiguous), then the residual step that takes it next (`kernels/norm.py`:
    folding) with the RMSNorm kernel's arithmetic (`norm.norm_row`): the next layer's add +
    RMSNorm (+ codes) in the receive's launch."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    y = tl.load(y_ptr + t * H + cols, mask=ok, other=0.0).to(tl.float32)
    d = _await_answer(seq_ptr, hi32, o_done, o_timeout, timeout_ns, waits_ptr,
                      tl.program_id(0) == 0, ASM)
    c = tl.load(hf32 + o_out + t * H + cols + (d - d), mask=ok, other=0.0, cache_modifier=".cv")
    o = (y + c).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * H + cols, o, mask=ok)
    norm_row(o, res_ptr + t * stride_r, nw_ptr, ny_ptr + t * stride_ny, ns_ptr + t * stride_ns,
             nq_ptr + t * stride_nq, cols, ok, H, eps, True, QUANT, BLOCK)


@triton.jit
def _receive_shared_kernel(y_ptr, sh_ptr, x_ptr, w_ptr, out_ptr, seq_ptr, hi32, hf32, o_done,
                           o_timeout, o_out, stride_sh, stride_x, timeout_ns, waits_ptr,
                           H: tl.constexpr, BLOCK: tl.constexpr, GATE: tl.constexpr,
                           ASM: tl.constexpr = True):
    """Program (t, j): values [j BLOCK, (j + 1) BLOCK) of token t's row, out = y + gate * sh,
    rounded to out's dtype as `_gated_add_kernel` stores it, + the CPU's out in fp32 (the two
    launches' bits); gate = `sigmoid_dot` of the row of x and w (each program of the token
    computes it again: H values), else 1. y and out [T, H] contiguous. The shared expert's
    part is computed before the wait, which it may overlap."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = h < H
    dt = out_ptr.dtype.element_ty
    ys = _shared_sum(y_ptr, sh_ptr, x_ptr, w_ptr, t, h, m, stride_sh, stride_x, dt, H, BLOCK,
                     GATE)
    d = _await_answer(seq_ptr, hi32, o_done, o_timeout, timeout_ns, waits_ptr,
                      (tl.program_id(0) == 0) & (tl.program_id(1) == 0), ASM)
    c = tl.load(hf32 + o_out + t * H + h + (d - d), mask=m, other=0.0, cache_modifier=".cv")
    tl.store(out_ptr + t * H + h, (ys + c).to(dt), mask=m)


@triton.jit
def _shared_sum(y_ptr, sh_ptr, x_ptr, w_ptr, t, h, m, stride_sh, stride_x, dt,
                H: tl.constexpr, GBLOCK: tl.constexpr, GATE: tl.constexpr):
    """fp32 values h (mask m) of token t's y + gate * sh rounded to dt, as `_gated_add_kernel`
    stores them: gate = `sigmoid_dot` of the token's x and w in chunks of GBLOCK
    (`glu.gate_block`), else 1."""
    y = tl.load(y_ptr + t * H + h, mask=m, other=0.0).to(tl.float32)
    s = tl.load(sh_ptr + t * stride_sh + h, mask=m, other=0.0).to(tl.float32)
    if GATE:
        ys = gated_sum(y, sigmoid_dot(x_ptr + t * stride_x, w_ptr, H, GBLOCK), s)
    else:
        ys = y + s
    return ys.to(dt).to(tl.float32)


@triton.jit
def _receive_shared_norm_kernel(y_ptr, sh_ptr, x_ptr, w_ptr, out_ptr, seq_ptr, hi32, hf32,
                                o_done, o_timeout, o_out, stride_sh, stride_x, timeout_ns,
                                waits_ptr, res_ptr, nw_ptr, ny_ptr, ns_ptr, nq_ptr, stride_r,
                                stride_ny, stride_ns, stride_nq, eps, H: tl.constexpr,
                                GBLOCK: tl.constexpr, GATE: tl.constexpr,
                                QUANT: tl.constexpr, BLOCK: tl.constexpr,
                                ASM: tl.constexpr = True):
    """Program t: token t's row of `_receive_shared_kernel` (out = y + gate * sh, then + the
    CPU's out), then the residual step that takes it next (`kernels/norm.py`: folding) with
    the RMSNorm kernel's arithmetic, as `_receive_norm_kernel` does: the next layer's add +
    RMSNorm (+ codes) in the receive's launch. Launched with GATE_WARPS warps, which are the
    RMSNorm kernel's for this row width (`receive_add` checks), and without FP fusion (the
    codes' arithmetic); the gate's FMAs are explicit (`glu.sigmoid_dot`)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    dt = out_ptr.dtype.element_ty
    ys = _shared_sum(y_ptr, sh_ptr, x_ptr, w_ptr, t, cols, ok, stride_sh, stride_x, dt, H,
                     GBLOCK, GATE)
    d = _await_answer(seq_ptr, hi32, o_done, o_timeout, timeout_ns, waits_ptr,
                      tl.program_id(0) == 0, ASM)
    c = tl.load(hf32 + o_out + t * H + cols + (d - d), mask=ok, other=0.0, cache_modifier=".cv")
    o = (ys + c).to(dt)
    tl.store(out_ptr + t * H + cols, o, mask=ok)
    norm_row(o, res_ptr + t * stride_r, nw_ptr, ny_ptr + t * stride_ny, ns_ptr + t * stride_ns,
             nq_ptr + t * stride_nq, cols, ok, H, eps, True, QUANT, BLOCK)


@triton.jit
def _hint_kernel(ids_ptr, map_ptr, live_ptr, seq_ptr, hi32, o_hint, layer, T, K, E,
                 RB: tl.constexpr, EB: tl.constexpr, HMAX: tl.constexpr, ASM: tl.constexpr):
    """See `post_hint`. Key of expert e: count * EB + (EB - 1 - e), sorted descending (0: not
    a predicted miss)."""
    n = tl.load(seq_ptr)
    rows = tl.minimum(tl.load(live_ptr), T)
    r = tl.arange(0, RB)
    ids = tl.load(ids_ptr + r, mask=r < rows * K, other=-1).to(tl.int32)
    e = tl.arange(0, EB)
    cnt = tl.sum((ids[:, None] == e[None, :]).to(tl.int32), axis=0)
    slot = tl.load(map_ptr + e, mask=e < E, other=0)
    key = tl.where((cnt > 0) & (slot < 0), cnt * EB + (EB - 1 - e), 0)
    ks = tl.sort(key, descending=True)
    misses = tl.sum((key > 0).to(tl.int32), axis=0)
    tl.store(hi32 + o_hint + 4 + e, EB - 1 - ks % EB, mask=(e < HMAX) & (ks > 0))
    tl.store(hi32 + o_hint + 1, layer)
    tl.store(hi32 + o_hint + 2, misses)
    job_post(n, hi32, o_hint, ASM)


# `layer` and `n` are not specialized on (Triton compiles a variant for 1 and for multiples
# of 16): a variant loaded mid-step, while the device waits for the worker's copies, holds
# the driver that the worker's copy calls need (see `post_ahead`)
@triton.jit(do_not_specialize=["n", "layer"])
def _ahead_post_kernel(fetched_ptr, n, seq_ptr, want_ptr, layer, hi32, o_ahead, area_words,
                       NB: tl.constexpr, ASM: tl.constexpr):
    """See `post_ahead`: the valid (expert >= 0) pairs packed in order, their count, the
    layer, then the tag a (area a & 1) after a system-scope fence; want[layer] = a."""
    a = tl.load(seq_ptr) + 1
    tl.store(seq_ptr, a)
    o = o_ahead + (a & 1) * area_words
    i = tl.arange(0, NB)
    e = tl.load(fetched_ptr + i, mask=i < n, other=-1)
    s = tl.load(fetched_ptr + n + i, mask=i < n, other=-1)
    ok = e >= 0
    pos = tl.cumsum(ok.to(tl.int32), axis=0) - 1
    tl.store(hi32 + o + 4 + 2 * pos, e.to(tl.int32), mask=ok)
    tl.store(hi32 + o + 5 + 2 * pos, s.to(tl.int32), mask=ok)
    tl.store(hi32 + o + 1, layer)
    tl.store(hi32 + o + 2, tl.sum(ok.to(tl.int32), axis=0))
    tl.store(want_ptr + layer, a)
    job_post(a, hi32, o, ASM)


@triton.jit(do_not_specialize=["layer"])
def _ahead_wait_kernel(want_ptr, layer, hi32, o_done, o_timeout, timeout_ns,
                       ASM: tl.constexpr):
    """Poll `ahead_done` until it reaches want[layer] (int32 order, wrapping), or give up
    after timeout_ns and set the timeout word."""
    a = tl.load(want_ptr + layer)
    _poll(hi32, o_done, o_timeout, a, False, timeout_ns, ASM)


@triton.jit
def _copy_chunk(pool_ptr, pool_addr, src_addr, e, dst0, nw, c0, CHUNK: tl.constexpr,
                BLOCK: tl.constexpr, VEC: tl.constexpr):
    """Words c0 .. c0 + CHUNK (those below nw) of expert e's part at src_addr into the pool
    from word dst0 on (`_fill_kernel`)."""
    if VEC:
        src0 = tl.multiple_of((src_addr - pool_addr) // 4 + e * nw + c0, 4)
        dst0 = tl.multiple_of(dst0, 4)
        src = pool_ptr + src0
    else:
        src = src_addr.to(tl.pointer_type(tl.int32)) + e * nw + c0
    dst = pool_ptr + dst0
    offs = tl.arange(0, BLOCK)
    for b in tl.static_range(0, CHUNK, BLOCK):
        m = c0 + b + offs < nw
        tl.store(dst + b + offs, tl.load(src + b + offs, mask=m), mask=m)


@triton.jit
def _fill_kernel(fetched_ptr, n, pool_ptr, pool_addr, slot_words, table_ptr, stride,
                 CHUNK: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr,
                 ROUNDS: tl.constexpr = 1):
    """Program (i, part, c): chunks c, c + stride, ... (ROUNDS of them, those inside the part)
    of CHUNK words of fetch i's part from its host bank into its slot: one each where the
    grid has a program per chunk, several in a grid of few programs (which leaves the SMs to
    the kernels beside it). VEC: every address and size is
    a multiple of 16 bytes, told to the compiler by reading the host through `pool_ptr` plus
    a word offset known to be a multiple of 4 (a pointer loaded from the table carries no
    alignment): 16-byte loads and stores, so each PCIe read request carries 4x the bytes, and
    the whole chunk's loads go out at once."""
    i = tl.program_id(0)
    part = tl.program_id(1)
    e = tl.load(fetched_ptr + i)
    s = tl.load(fetched_ptr + n + i)
    src_addr = tl.load(table_ptr + part * 3)
    off = tl.load(table_ptr + part * 3 + 1)
    nw = tl.load(table_ptr + part * 3 + 2)
    for r in range(0, ROUNDS):  # a constant trip count (the largest part's)
        c0 = (tl.program_id(2) + r * stride) * CHUNK
        if (e >= 0) & (c0 < nw):
            _copy_chunk(pool_ptr, pool_addr, src_addr, e, s * slot_words + off + c0, nw, c0,
                        CHUNK, BLOCK, VEC)


def interp_rounds(tokens: int, top_k: int, hidden: int, block: int) -> dict[str, int]:
    """`job_begin`'s constant trip counts under Triton's interpreter (from the call's shapes),
    else none (0: the compiled loops run to the job's own sizes)."""
    if not interpreting():
        return {"ROUNDS_IDS": 0, "ROUNDS_X": 0}
    return {"ROUNDS_IDS": max(1, triton.cdiv(tokens * top_k, block)),
            "ROUNDS_X": max(1, triton.cdiv(tokens * hidden, block))}


def job_args(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, seq: torch.Tensor,
             buf: torch.Tensor, off: dict, layer: int, act: int, xdt: int) -> tuple[tuple, dict]:
    """(`write_job`'s arguments after map_ptr, its constexprs but E) of a layer call's job.
    off: the buffer's byte offsets (moe/handoff.py)."""
    T, H = x.shape
    xs = x.element_size()
    return ((x.contiguous(), ids.contiguous(), w.contiguous(), seq, buf.view(torch.int32),
             buf.view(torch.float32), buf.view(x.dtype), layer, act, xdt, T, off["go"] // 4,
             off["job"] // 4, off["ids"] // 4, off["weights"] // 4, off["map"] // 4,
             off["x"] // xs), {"H": H, "K": ids.shape[1]})


def send(job: tuple[tuple, dict], emap: torch.Tensor) -> None:
    """Write a layer call's job (`job_args`) with the map emap into the pinned buffer and post
    it (see the module docstring)."""
    args, consts = job
    _send_kernel[(1,)](args[0], args[1], args[2], emap, *args[3:], **consts, E=emap.numel(),
                       BLOCK=1024, num_warps=8)


def receive_add(y: torch.Tensor, seq: torch.Tensor, buf: torch.Tensor, off: dict,
                waits: torch.Tensor, shared: tuple | None = None, fold=None) -> torch.Tensor:
    """y [T, H] + the CPU's out (fp32 sum, y's dtype), after waiting for the worker's answer;
    the wait's nanoseconds and one call are added to waits (int64 [2] on the device).

    shared: (sh, x, w_gate) of the layer's shared expert, added in the same launch (one fewer
    than `glu.gated_add_triton` before it): sh, x [T, H] with unit stride in H, sh in y's
    dtype; w_gate [H] the gate's weight row, gate = sigmoid(x . w_gate) per token in fp32
    (`glu.sigmoid_dot`), or None for an ungated expert (gate = 1, x unread). The arithmetic
    of the two launches, bit for bit: y + gate * sh in fp32 rounded to y's dtype (as
    `_gated_add_kernel` stores it, or torch's y + sh), then + out in fp32, rounded again.

    fold (`kernels/norm.py` NormFold): the residual step that takes the sum next, computed
    in the same launch (a program per token holding its row; the output carries it:
    `norm.fold_done`); with `shared`, where the RMSNorm kernel's warps for the row are the
    gate's (`glu.gate_folds`), else ignored."""
    y = y.contiguous()
    out = torch.empty_like(y)
    wait = (seq, buf.view(torch.int32), buf.view(torch.float32), off["done"] // 4,
            off["timeout"] // 4, off["out"] // 4)
    timeout_ns = int(TIMEOUT_S * 1e9)
    T, H = y.shape
    if fold is not None and (shared is None or gate_folds(H)):
        ny, ns, nq = fold_buffers(fold)
        r = fold.residual
        nq_ = nq if nq is not None else ny
        block = triton.next_power_of_2(H)
        norm_args = (r, fold.weight, ny, ns, nq_, r.stride(0), ny.stride(0), ns.stride(0),
                     nq_.stride(0), fold.eps)
        if shared is None:
            _receive_norm_kernel[(T,)](
                y, out, *wait, timeout_ns, waits, *norm_args, H=H, QUANT=nq is not None,
                BLOCK=block, ASM=not interpreting(), num_warps=norm_warps(block),
                enable_fp_fusion=False)  # the codes as the RMSNorm kernel's
        else:
            sh, x, w = shared
            _check_shared(y, sh, x, w)
            _receive_shared_norm_kernel[(T,)](
                y, sh, x, w if w is not None else y, out, *wait, sh.stride(0), x.stride(0),
                timeout_ns, waits, *norm_args, H=H, GBLOCK=gate_block(H), GATE=w is not None,
                QUANT=nq is not None, BLOCK=block, ASM=not interpreting(),
                num_warps=GATE_WARPS, enable_fp_fusion=False)
        return fold_done(out, fold, ny, ns, nq)
    if shared is None:
        N = y.numel()
        BLOCK = 1024
        _receive_kernel[(triton.cdiv(N, BLOCK),)](
            y, out, *wait, N, timeout_ns, waits, BLOCK=BLOCK, ASM=not interpreting(),
            num_warps=4)
        return out
    sh, x, w = shared
    _check_shared(y, sh, x, w)
    block = gate_block(H)
    _receive_shared_kernel[(T, triton.cdiv(H, block))](
        y, sh, x, w if w is not None else y, out, *wait, sh.stride(0),
        x.stride(0), timeout_ns, waits, H=H, BLOCK=block, GATE=w is not None,
        ASM=not interpreting(), num_warps=GATE_WARPS)
    return out


def _check_shared(y: torch.Tensor, sh: torch.Tensor, x: torch.Tensor,
                  w: torch.Tensor | None) -> None:
    T, H = y.shape
    if sh.shape != y.shape or sh.dtype != y.dtype or sh.stride(-1) != 1:
        raise ValueError(f"receive_add: the shared expert's output {list(sh.shape)} "
                         f"{sh.dtype} (last stride {sh.stride(-1)}) is not y's {[T, H]} "
                         f"{y.dtype} with unit stride")
    if w is not None and (x.shape != y.shape or x.stride(-1) != 1 or w.numel() != H
                          or not w.is_contiguous()):
        raise ValueError(f"receive_add: the gate's x {list(x.shape)} (last stride "
                         f"{x.stride(-1)}) and row {list(w.shape)} do not fit y {[T, H]}")


def post_hint(ids: torch.Tensor, emap: torch.Tensor, live: torch.Tensor, seq: torch.Tensor,
              buf: torch.Tensor, off: dict, layer: int) -> None:
    """The hint for MoE layer `layer` (moe/handoff.py `Handoff.hint`): ids [T, k] its
    predicted routes (rows from live[0] on ignored), emap [E] int32 its expert -> slot map;
    tagged with the job number in seq."""
    T, K = ids.shape
    E = emap.numel()
    _hint_kernel[(1,)](ids.contiguous(), emap, live, seq, buf.view(torch.int32),
                       off["hint"] // 4, layer, T, K, E, RB=triton.next_power_of_2(T * K),
                       EB=triton.next_power_of_2(E), HMAX=off["hint_max"],
                       ASM=not interpreting(), num_warps=4)


def post_ahead(fetched: torch.Tensor, seq: torch.Tensor, want: torch.Tensor, buf: torch.Tensor,
               off: dict, layer: int) -> None:
    """The ahead list of MoE layer `layer` (moe/handoff.py `Handoff.post_ahead`): fetched
    int64 [2, n] (expert, slot; -1 = none); seq int32 [1] the lists' counter, want int32 [L]
    the last list of each layer, both on the device.

    One compiled variant for every layer, list width and batch size (`do_not_specialize`,
    NB from the buffer's list size), loaded once by `Handoff.start_copies`: loading a module
    takes the CUDA driver until the device is idle (on an H100, 2026-12-06, the main thread
    sat in Triton's module load for minutes while the device waited for the worker's copies,
    whose driver calls waited for the load), so no variant may load while copies are awaited."""
    n = fetched.shape[1]
    if n > off["ahead_max"]:
        raise ValueError(f"post_ahead: {n} experts, the list holds {off['ahead_max']}")
    _ahead_post_kernel[(1,)](fetched, n, seq, want, layer, buf.view(torch.int32),
                             off["ahead"] // 4, (16 + 8 * off["ahead_max"]) // 4,
                             NB=max(16, triton.next_power_of_2(off["ahead_max"])),
                             ASM=not interpreting(), num_warps=1)


def wait_ahead(want: torch.Tensor, layer: int, buf: torch.Tensor, off: dict) -> None:
    """Wait on the device until the worker's copies of layer `layer`'s last ahead list are
    complete (`_ahead_wait_kernel`)."""
    _ahead_wait_kernel[(1,)](want, layer, buf.view(torch.int32), off["ahead_done"] // 4,
                             off["timeout"] // 4, int(TIMEOUT_S * 1e9), ASM=not interpreting(),
                             num_warps=1)


def fill_table(parts: list[tuple[torch.Tensor, int, int]], device) -> tuple[torch.Tensor, bool]:
    """(int64 [P, 3] on the device: address of the pinned host part, its word offset in a
    slot, words per expert; whether all of them are whole 16-byte units) for `fill`. With
    unified addressing a registered host buffer has the same address on the device."""
    for t, _, nbytes in parts:
        if nbytes % 4 or not t.is_contiguous() or t.data_ptr() % 4:
            raise ValueError(f"fill: a host part of {nbytes} B per expert is not whole 4-byte "
                             "words")
    vec = all(t.data_ptr() % 16 == 0 and off % 16 == 0 and nbytes % 16 == 0
              for t, off, nbytes in parts)
    return torch.tensor([[t.data_ptr(), off // 4, nbytes // 4] for t, off, nbytes in parts],
                        dtype=torch.int64, device=device), vec


def fill(fetched: torch.Tensor, pool: torch.Tensor, table: torch.Tensor, max_words: int,
         vec: bool = False, programs: int | None = None) -> None:
    """Copy fetched experts into slots. fetched int64 [2, n] (expert, slot; -1 = none) on the
    device; pool uint8 [S, slot_bytes] on the device; table, vec: `fill_table` of the layer's
    parts; max_words: its largest part's words per expert. programs: that many programs a
    fetched part, each copying every programs-th chunk (few SMs taken from the kernels that
    run beside the copies: fetching ahead), else one a chunk (the most copies in flight)."""
    n = fetched.shape[1]
    if n == 0:
        return
    vec = vec and pool.data_ptr() % 16 == 0 and pool.shape[1] % 16 == 0
    chunks = triton.cdiv(max_words, FILL_CHUNK)
    stride = chunks if programs is None else min(programs, chunks)
    _fill_kernel[(n, table.shape[0], stride)](
        fetched, n, pool.view(torch.int32), pool.data_ptr(), pool.shape[1] // 4, table, stride,
        CHUNK=FILL_CHUNK, BLOCK=FILL_CHUNK if vec else min(FILL_CHUNK, 1024), VEC=vec,
        ROUNDS=triton.cdiv(chunks, stride), num_warps=4)
