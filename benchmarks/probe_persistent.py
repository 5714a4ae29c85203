"""What a batch-1 decode step's launches cost against one persistent kernel: the floor of each.

A batch-1 step of the Qwen3-30B-A3B shape is 48 layers of six dependent phases, each a read
of weight bytes (qkv 11.1 MB, attention's keys 0.1 MB, o_proj 8.9 MB, router 0.5 MB, the
eight experts' gate/up 14.2 MB and down 7.1 MB); the real kernels add their arithmetic on
top, so this measures only the part that launches and synchronisation decide. Each phase
here reads its bytes (int32 sums) and stores one partial a program; the next phase first
reads the partials of the one before (the dependency), then its bytes. Three ways, each
timed as a whole step replayed from a CUDA graph:
- launches: one kernel a phase (288 a step), as the engine runs today, with many small
  programs (16 KB each) or with one program per SM slot; and the small programs launched
  programmatically dependent (pdl.py: at the previous kernel's exit or early), with or
  without their bytes asked of L2 before they wait;
- persistent: one kernel for the step, one program per SM slot, a grid barrier between
  phases (a counter every program adds to and polls);
- persistent + prefetch: the same, each program asking L2 for its next phase's bytes before
  it waits at the barrier (`pdl.prefetch_l2`), except the experts' gate/up, whose bytes the
  router decides (they cannot be known before it).
The table: us a step, us a phase boundary over the bytes' time at the measured read rate.
First, the floor of one kernel: a read of N MB as one graphed launch (the decode kernels'
sizes), us and TB/s.

    python benchmarks/probe_persistent.py [--layers 48] [--per-sm 1,2]
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton.pdl import prefetch_l2, wait

# (name, MB, may prefetch before the barrier in front of it)
PHASES = [("qkv", 11.14, True), ("attention", 0.13, True), ("o_proj", 8.91, True),
          ("router", 0.52, True), ("gate_up", 14.16, False), ("down", 7.08, True)]
BLOCK = 4096  # int32 a load round


@triton.jit
def _slice(n, pid, nprog, BLOCK: tl.constexpr):
    """[lo, hi): program pid's share of n values, whole BLOCKs (empty past the end)."""
    per = tl.cdiv(tl.cdiv(n, nprog), BLOCK) * BLOCK
    lo = tl.minimum(pid * per, n)
    return lo, tl.minimum(lo + per, n)


@triton.jit
def _prefetch_slice(buf, n, pid, nprog, BLOCK: tl.constexpr):
    """Ask L2 for program pid's share of buf (n int32)."""
    lo, hi = _slice(n, pid, nprog, BLOCK)
    if hi > lo:
        prefetch_l2(buf + lo, (hi - lo) * 4, 1)


@triton.jit
def _phase_body(buf, n, prev, P_PREV, part, pid, nprog, BLOCK: tl.constexpr):
    """Program pid of nprog: read the previous phase's partials, then its slice of buf
    (n int32), store its partial."""
    dep = tl.load(prev + tl.arange(0, 1024), mask=tl.arange(0, 1024) < P_PREV, other=0,
                  cache_modifier=".cg")
    acc = tl.sum(dep, axis=0) & 1
    lo, hi = _slice(n, pid, nprog, BLOCK)
    for i in range(lo, hi, BLOCK):
        o = i + tl.arange(0, BLOCK)
        acc += tl.sum(tl.load(buf + o, mask=o < hi, other=0), axis=0)
    tl.store(part + pid, acc)


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """The floor of one kernel: each program sums BLOCK int32 and stores the sum."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.load(x_ptr + i, mask=i < n, other=0), axis=0))


@triton.jit
def _phase_kernel(buf, n, prev, P_PREV, part, BLOCK: tl.constexpr):
    _phase_body(buf, n, prev, P_PREV, part, tl.program_id(0), tl.num_programs(0), BLOCK)


@triton.jit
def _phase_pdl_kernel(buf, n, prev, P_PREV, part, BLOCK: tl.constexpr, PDL: tl.constexpr,
                      PF: tl.constexpr):
    """A phase launched programmatically dependent (pdl.py): with PF its slice is asked of
    L2 before it waits for the kernel before."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if PF:
        _prefetch_slice(buf, n, pid, nprog, BLOCK)
    wait(PDL)
    _phase_body(buf, n, prev, P_PREV, part, pid, nprog, BLOCK)


@triton.jit
def _persistent_kernel(bufs, sizes, may, parts, bar, NPH: tl.constexpr, PREFETCH: tl.constexpr,
                       BLOCK: tl.constexpr):
    """bufs / sizes / may: int64 addresses, int32 lengths and prefetch flags of the phases;
    parts: [NPH + 1, 1024] partials (row 0 stays zero)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for ph in range(NPH):
        buf = tl.load(bufs + ph).to(tl.pointer_type(tl.int32))
        n = tl.load(sizes + ph)
        prev_p = tl.where(ph == 0, 1, nprog)
        _phase_body(buf, n, parts + ph * 1024, prev_p, parts + (ph + 1) * 1024, pid, nprog,
                    BLOCK)
        if PREFETCH:
            if ph + 1 < NPH:
                if tl.load(may + ph + 1) != 0:
                    _prefetch_slice(tl.load(bufs + ph + 1).to(tl.pointer_type(tl.int32)),
                                    tl.load(sizes + ph + 1), pid, nprog, BLOCK)
        # grid barrier: count in, wait until every program of this phase has
        tl.debug_barrier()
        tl.atomic_add(bar, 1, sem="release")
        target = (ph + 1) * nprog
        seen = tl.load(bar, volatile=True)
        while seen < target:
            seen = tl.load(bar, volatile=True)
        tl.atomic_add(bar, 0, sem="acquire")


def main() -> None:
    from bench_gpu_kernels import graph_ms  # this script's folder (as profile_decode_step.py)

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--per-sm", default="1,2", help="programs per SM of the persistent kernel")
    a = ap.parse_args()
    per_sms = [int(x) for x in a.per_sm.split(",") if x.strip().isdigit() and int(x) > 0]
    if a.layers < 1 or not per_sms or len(per_sms) != len(a.per_sm.split(",")):
        ap.error(f"--layers takes 1 or more and --per-sm positive integers, got {a.layers} and "
                 f"{a.per_sm!r}")
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    phases = PHASES * a.layers
    # each layer its own buffers (a step reads every layer's weights once: no L2 reuse)
    bufs = [torch.ones(int(mb * 1e6) // 4, dtype=torch.int32, device=dev) for _, mb, _ in phases]
    total = sum(b.numel() * 4 for b in bufs)
    big = torch.ones(1 << 28, dtype=torch.int32, device=dev)
    out = torch.empty(triton.cdiv(big.numel(), BLOCK), dtype=torch.int32, device=dev)
    read_ms = graph_ms(lambda: _phase_kernel[(out.numel(),)](big, big.numel(), out, 1, out,
                                                              BLOCK=BLOCK, num_warps=8))
    rate = big.numel() * 4 / read_ms / 1e6  # GB/s
    print(f"{torch.cuda.get_device_name()}, {sms} SMs; one 1 GiB read: {rate:,.0f} GB/s; "
          f"a step: {len(phases)} phases, {total / 1e9:.2f} GB ({total / rate / 1e3:.0f} us "
          f"at that rate)")
    print(f"{'one read, MB':>12s} {'us':>7s} {'TB/s':>6s}")
    for mb in (1, 4, 7, 11, 14, 22, 330):
        b = big[:mb * (1 << 20) // 4]
        us = 1e3 * graph_ms(lambda b=b: _read_kernel[(triton.cdiv(b.numel(), BLOCK),)](
            b, out, b.numel(), BLOCK=BLOCK, num_warps=4))
        print(f"{mb:12d} {us:7.2f} {b.numel() * 4 / us / 1e6:6.2f}")
    parts = torch.zeros(len(phases) + 1, 1024, dtype=torch.int32, device=dev)

    def launches(grid_of):
        def fn():
            for i, b in enumerate(bufs):
                p = 1 if i == 0 else grid_of(bufs[i - 1])
                _phase_kernel[(grid_of(b),)](b, b.numel(), parts[i], p, parts[i + 1],
                                             BLOCK=BLOCK, num_warps=8)
        return fn

    chunks = lambda b: min(1024, triton.cdiv(b.numel(), BLOCK))  # noqa: E731
    rows = [("launches, 16 KB a program", graph_ms(launches(chunks)))]
    for pdl in (1, 2):  # as the previous kernel's programs exit / as soon as they start
        for pf in (0, 1):
            def fn(pdl=pdl, pf=pf):
                for i, b in enumerate(bufs):
                    p = 1 if i == 0 else chunks(bufs[i - 1])
                    _phase_pdl_kernel[(chunks(b),)](b, b.numel(), parts[i], p, parts[i + 1],
                                                    BLOCK=BLOCK, PDL=pdl,
                                                    PF=bool(pf and phases[i][2]), num_warps=8,
                                                    launch_pdl=True)
            rows.append((f"launches, PDL {'early' if pdl == 2 else 'at exit'}"
                         + (", prefetch" if pf else ""), graph_ms(fn)))
    addr = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=dev)
    sizes = torch.tensor([b.numel() for b in bufs], dtype=torch.int32, device=dev)
    may = torch.tensor([int(m) for _, _, m in phases], dtype=torch.int32, device=dev)
    bar = torch.zeros(1, dtype=torch.int32, device=dev)
    for per_sm in per_sms:
        nprog = sms * per_sm
        rows.append((f"launches, {nprog} programs",
                     graph_ms(launches(lambda b, n=nprog: n))))
        for pf in (0, 1):
            def fn(pf=pf, nprog=nprog):
                bar.zero_()
                _persistent_kernel[(nprog,)](addr, sizes, may, parts, bar, NPH=len(phases),
                                             PREFETCH=pf, BLOCK=BLOCK, num_warps=8)
            rows.append((f"persistent, {nprog} programs" + (", prefetch" if pf else ""),
                         graph_ms(fn)))
    floor = total / rate / 1e3  # us
    print(f"{'way':40s} {'us a step':>10s} {'us a phase over the bytes':>26s} {'x floor':>8s}")
    for name, ms in rows:
        us = ms * 1e3
        print(f"{name:40s} {us:10.0f} {(us - floor) / len(phases):26.2f} {us / floor:8.2f}")


if __name__ == "__main__":
    main()
