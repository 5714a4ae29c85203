"""Weights read ahead into L2 on a second stream, beside a decode kernel that leaves HBM idle.

At one token a decode layer's kernels each read 0.5-14 MB and take two to four times the time
of a launch that only reads those bytes (README: the floors); the latency-bound ones (decode
attention, the norm + router) read almost nothing. Weights no kernel writes can be asked of L2
before the kernel that reads them starts: a small kernel on a side stream issues
`prefetch.global.L2::evict_last` for every 128-byte line of the next kernel's weight rows
while the kernel before it runs, and the reader then finds them in L2 (an L2-hot GEMV took
3.8 us against 6.2 from HBM on an H100, `bench_gpu_kernels.py --hbm-tiles Q8_0s`).

`FREETOKEN_GPU_L2_AHEAD` names what is read ahead (`env.gpu_l2_ahead`):
- `o`: o_proj's rows during decode attention (layers/attention.py);
- `qkv`: the next layer's qkv rows during the post-attention norm + router (models/llama.py);
- `down`: the routed experts' down rows during gate/up (kernels/triton/moe.py).

A read ahead is a fork of the side stream off the current one (`ahead`) and a join back
(`kernels/l2.py: l2_join`) after the kernel that reads the bytes: the reader never waits for
the prefetch, and a CUDA graph captures both as a branch. Nothing is written, so the results
are the same bits with or without it; only the time changes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken import env
from freetoken.kernels.triton import interpreting

LINES = 128  # 128-byte lines a program asks for per step
PROGRAMS = 64  # programs of a contiguous range's prefetch
ROUTE_PROGRAMS = 8  # programs per routed expert
TOKENS = 16  # decode sizes up to which it runs (prefill reads its weights from HBM anyway)

_side: dict[int, torch.cuda.Stream] = {}


@triton.jit
def prefetch_lines(p, nbytes, start, step, LINES: tl.constexpr, LAST: tl.constexpr):
    """Lines start, start + step, ... of [p, p + nbytes) into L2; LAST: marked evict_last
    (bytes read after other kernels' reads have passed through L2), else evict_normal."""
    offs = tl.arange(0, LINES) * 128
    for i in tl.range(start, nbytes, step):
        o = tl.minimum(i + offs, nbytes - 1)  # past the end: the last line again
        if LAST:
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
                                      "=r,l", [p + o], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
                                      "=r,l", [p + o], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _range_kernel(base, nbytes, LINES: tl.constexpr, LAST: tl.constexpr):
    p = base.to(tl.pointer_type(tl.int8))
    prefetch_lines(p, nbytes, tl.program_id(0) * LINES * 128, tl.num_programs(0) * LINES * 128,
                   LINES, LAST)


@triton.jit
def _experts_kernel(base, ids_ptr, map_ptr, expert_bytes, stride_e, MAP: tl.constexpr,
                    LINES: tl.constexpr):
    """Program (route r, part q): the lines q, q + P, ... of route r's expert (its slot where
    MAP; a route mapped to -1 has no slot: nothing to read)."""
    e = tl.load(ids_ptr + tl.program_id(0)).to(tl.int64)
    if MAP:
        e = tl.load(map_ptr + e).to(tl.int64)
    if e >= 0:
        p = base.to(tl.pointer_type(tl.int8)) + e * stride_e
        prefetch_lines(p, expert_bytes, tl.program_id(1) * LINES * 128,
                       tl.num_programs(1) * LINES * 128, LINES, False)


def wants(what: str, x: torch.Tensor) -> bool:
    """Whether `what` is read ahead for a call on x (rows = tokens): switched on, a CUDA
    tensor of a decode size, a GPU that runs inline PTX."""
    return (x.is_cuda and x.shape[0] <= TOKENS and what in env.gpu_l2_ahead()
            and torch.version.hip is None and not interpreting())


def _fork() -> torch.cuda.Stream:
    cur = torch.cuda.current_stream()
    side = _side.get(cur.device.index)
    if side is None:
        side = _side[cur.device.index] = torch.cuda.Stream(cur.device)
    side.wait_stream(cur)
    return side


def _span(t: torch.Tensor) -> int:
    """Bytes from t's first element to just past its last (strided: the gaps included)."""
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


def ahead(tensors, last: bool = False) -> torch.cuda.Stream:
    """Ask L2 for the bytes of `tensors` (weights no kernel writes) on the side stream,
    forked off the current one; `last`: keep them over other reads (evict_last), for a reader
    that comes after other kernels. Returns the token for `kernels/l2.py: l2_join`."""
    side = _fork()
    with torch.cuda.stream(side):
        for t in tensors:
            n = _span(t)
            grid = (max(1, min(PROGRAMS, triton.cdiv(n, LINES * 128))),)
            _range_kernel[grid](t, n, LINES=LINES, LAST=last, num_warps=4)
    return side


def ahead_experts(w: torch.Tensor, topk_ids: torch.Tensor,
                  expert_map: torch.Tensor | None) -> torch.cuda.Stream:
    """Ask L2 for the rows of every routed expert of bank data `w` ([E or S, ...], an expert's
    bytes contiguous: `stride(0)` apart), `topk_ids` through `expert_map` where given."""
    side = _fork()
    ids = topk_ids.reshape(-1)
    per = _span(w[0])
    with torch.cuda.stream(side):
        _experts_kernel[(ids.numel(), ROUTE_PROGRAMS)](
            w, ids, ids if expert_map is None else expert_map, per, w.stride(0) * w.element_size(),
            MAP=expert_map is not None, LINES=LINES, num_warps=4)
    return side

