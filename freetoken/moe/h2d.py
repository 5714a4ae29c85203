"""Host-to-device copies by address, for expert fetches.

A fetched expert is a few byte ranges (its w13 and w2 rows, their block scales, its scales
row) copied from pinned host banks into one slot. Through torch each range is a view of the
bank, a view of the slot and a `copy_`: about 10 us of host time each, so a layer fetching
seven experts spent more time queueing copies than PCIe spent moving them. Here each range is
one call of the CUDA driver's `cuMemcpyHtoDAsync` on the copy stream (about 1 us), addresses
computed in Python. libcuda is the driver library every CUDA program loads; the runtime that
torch uses made the device's primary context current on this thread.
"""

from __future__ import annotations

import ctypes

import torch

_lib = None


def _driver():
    global _lib
    if _lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuMemcpyHtoDAsync_v2
        fn.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        _lib = fn
    return _lib


def copy_ranges(ranges: list[tuple[int, int, int]], stream: torch.cuda.Stream) -> None:
    """Queue (device address, pinned host address, bytes) copies on `stream`."""
    fn, s = _driver(), ctypes.c_void_p(stream.cuda_stream)
    for dst, src, n in ranges:
        rc = fn(dst, src, n, s)
        if rc != 0:
            raise RuntimeError(f"cuMemcpyHtoDAsync of {n} B to a slot failed (CUresult {rc})")


def copier_entry_points(stream: torch.cuda.Stream, probe: int) -> tuple[int, ...] | str:
    """(the current context, cuCtxSetCurrent, cuMemcpyHtoDAsync_v2, cuStreamWriteValue32_v2)
    as addresses, for the hand-off worker's copies (csrc/cpu_moe/handoff.h), or why not: the
    stream write is tried once on `stream` at probe (a device-visible word, set to 0)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        names = ("cuCtxGetCurrent", "cuCtxSetCurrent", "cuMemcpyHtoDAsync_v2",
                 "cuStreamWriteValue32_v2")
        fns = {n: getattr(lib, n) for n in names}
    except (OSError, AttributeError) as e:
        return f"the CUDA driver lacks an entry point the worker's copies need ({e})"
    ctx = ctypes.c_void_p()
    rc = fns["cuCtxGetCurrent"](ctypes.byref(ctx))
    if rc != 0 or not ctx.value:
        return f"no current CUDA context on this thread (cuCtxGetCurrent: CUresult {rc})"
    write = fns["cuStreamWriteValue32_v2"]
    write.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    write.restype = ctypes.c_int
    rc = write(stream.cuda_stream, probe, 0, 0)
    if rc != 0:
        return f"stream memory operations are not available (cuStreamWriteValue32: CUresult {rc})"
    stream.synchronize()

    def addr(fn) -> int:
        return ctypes.cast(fn, ctypes.c_void_p).value

    return (ctx.value, addr(fns["cuCtxSetCurrent"]), addr(fns["cuMemcpyHtoDAsync_v2"]),
            addr(write))
