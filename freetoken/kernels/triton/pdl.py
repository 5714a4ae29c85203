"""Programmatic dependent launch (Hopper and later): a decode kernel is launched while the one
before it still runs, so its programs are resident and past their launch when the producer
finishes; `wait` (griddepcontrol.wait) then blocks until that kernel has completed and its
writes are visible, before the first read or write of anything another kernel touches.

At batch 1 a decode step is some 550 small kernels; the gap between two of them (launch and
ramp-up of the next one after the previous one drains) is about a microsecond, a fifth of the
step (profile_decode_step.py). CUDA graphs keep the dependency (a programmatic edge).

Every kernel launched with `launch_pdl=True` must call `wait(PDL)` before its first access to
memory another kernel writes or reads: then any chain of such kernels is ordered as a plain
stream is. Off by default; `FREETOKEN_GPU_PDL=1` (launch as the previous kernel's programs
exit) or `early` (as soon as they have all started) turns it on, on sm_90 and later (not
ROCm, not Triton's interpreter).

Measured on the H200 (ft bench decode, fused, batch 1 / 16, tok/s; 2026-12-01): Qwen3-30B-A3B
shape Q4_K off 341.8 / 1188.4, 1: 340.7 / 1190.4, early: 334.7 / 1115.9; Qwen3.6-35B-A3B
shape NVFP4 off 297.9 / 2059.7, 1: 292.0 / 2082.1, early: 312.3 / 1830.9. Waiting at the top
of each kernel hides little: the next step is to issue a GEMV's weight loads before `wait`
(they do not depend on the previous kernel), which is what this switch exists to try. With
`early`, waiting programs of the next kernel hold SM slots the current one's later waves need
(batch 16 lost 6-11%).
Tried next (2026-12-01): with PDL the dense GEMV asks L2 for its weight rows before `wait`
(`prefetch_l2`), and the fused norm + router loads its router rows before it. 30B Q4_K off
369.0 / 897.8 / 1743.3 and 411.0 / 885.2 / 1829.8, on 392.8 / 866.7 / 1831.4 and 398.2 /
881.7 / 1807.6; 35B NVFP4 off 355.0 / 929.0 / 2017.4, on 326.6 / 865.0 / 2103.9: within the
spread between runs, so still off by default.
Again with decode steps overlapped (the host off the device's path, engine.py; 2026-12-04,
benchmarks/ab_env.py, medians of two rounds, off / 1 / early, batch 1 and 16): 30B Q4_K
448.2 / 444.9 / 465.3 and 1943.3 / 1946.9 / 1943.2; 35B NVFP4 421.0 / 397.0 / 413.4 and
2202.9 / 2182.4 / 2054.7; the 35B NVFP4 hybrid at rate 0.1, batch 1 and 4, off / 1: 155.9 /
155.1 and 208.4 / 198.7. `early` gains 4% on one model at batch 1 and loses elsewhere.
On reads alone it does save time: a batch-1 step of the 30B shape modelled as 288 dependent
kernels that only read each phase's bytes (benchmarks/probe_persistent.py, H200, 2026-12-06)
took 1,260 us a step without, 1,117 with PDL 1 (0.5 us less a boundary), 1,172 early, 1,125
and 1,204 with `prefetch_l2` before `wait`: why the engine's kernels gain nothing of it is not
known yet.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from freetoken import env
from freetoken.kernels.triton import interpreting
from freetoken.kernels.triton.l2 import prefetch_lines


@functools.cache
def _capable(device: int) -> bool:
    import torch

    return torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9


def mode() -> int:
    """0: kernels launch one after the other; 1: programmatically dependent, the next kernel
    launched as this one's programs exit; 2: the next kernel launched as soon as all of this
    one's programs have started (`env.gpu_pdl`)."""
    m = env.gpu_pdl()
    if m == 0 or interpreting():
        return 0
    import torch

    return m if torch.cuda.is_available() and _capable(torch.cuda.current_device()) else 0


@triton.jit
def wait(PDL: tl.constexpr):
    """Block until the kernel before this one has completed (its writes visible); PDL 2 then
    lets the next kernel launch at once."""
    if PDL >= 1:
        gdc_wait()
    if PDL == 2:
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(base, nbytes, PDL: tl.constexpr, LINES: tl.constexpr = 256):
    """Before `wait`, with PDL: ask L2 for the bytes [base, base + nbytes) of something no
    kernel writes (a GEMV's weight rows), one 128-byte line per lane of LINES and step, so
    they stream in while the kernel before finishes and the loads after `wait` hit L2.
    Without PDL the kernel starts after the one before anyway: nothing to overlap, a no-op."""
    if PDL >= 1:  # every line, by this one program
        prefetch_lines(base.to(tl.pointer_type(tl.int8)), nbytes, 0, LINES * 128, LINES, False)


def opts() -> dict:
    """A decode kernel's launch options: its `PDL` constexpr and `launch_pdl`, together."""
    p = mode()
    return {"PDL": p, "launch_pdl": p > 0}
