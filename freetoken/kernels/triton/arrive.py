"""Arrival counters: the last of a group of programs does the group's closing work, without a
launch of its own (the router's top-k after its logits programs, the routes' sum after their
down programs).

Each program stores its share, then `last_to_arrive` counts it in the group's counter; the
program that counts last sees every share (the stores of all threads, a barrier, one
acquire-release atomic) and resets the counter to zero for the next call, so a kernel that
uses it can be replayed from a CUDA graph. `counters` gives the zeroed int32 words, one
buffer per use and device, made on first use (an engine's eager warm-up, before capture).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BUFFERS: dict[tuple[str, torch.device], torch.Tensor] = {}


def counters(use: str, n: int, device: torch.device) -> torch.Tensor:
    """`use`'s n zeroed counters on `device`, the same buffer every call."""
    c = _BUFFERS.get((use, device))
    if c is None:
        c = _BUFFERS[(use, device)] = torch.zeros(n, dtype=torch.int32, device=device)
    return c


@triton.jit
def last_to_arrive(counter, group):
    """Count this program in `counter` after its stores; True for the group's last program
    (of `group`), which has reset the counter and sees every program's stores (read them
    with cache_modifier=".cg": from L2, other SMs wrote them)."""
    # All threads' stores, then one release (cumulative over the barrier): the program that
    # counts last sees every program's stores.
    tl.debug_barrier()
    done = tl.atomic_add(counter, 1, sem="acq_rel")
    last = done == group - 1
    if last:
        tl.store(counter, 0)
    return last


@triton.jit
def sum_when_last(y_ptr, out_ptr, count_ptr, t, rn, n_ok, stride_ym, stride_om,
                  TOPK: tl.constexpr):
    """The fused MoE's decode sum: a program that stored route rows of token t for the row
    block rn counts itself in the token's counter for this block (one per token and
    program_id(1)); the last of the token's TOPK to arrive adds the token's rows of y in
    route order in fp32, as `moe._sum_routes_kernel` does, into out in its dtype. Returns
    whether this program was that one."""
    last = last_to_arrive(count_ptr + t * tl.num_programs(1) + tl.program_id(1), TOPK)
    if last:
        acc = tl.zeros(rn.shape, dtype=tl.float32)
        for j in tl.static_range(TOPK):
            acc += tl.load(y_ptr + (t * TOPK + j).to(tl.int64) * stride_ym + rn, mask=n_ok,
                           other=0.0, cache_modifier=".cg")  # from L2: other SMs wrote them
        tl.store(out_ptr + t.to(tl.int64) * stride_om + rn,
                 acc.to(out_ptr.dtype.element_ty), mask=n_ok)
    return last
