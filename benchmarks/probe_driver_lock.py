"""Which blocking host calls of one thread hold the CUDA driver against another thread's copy.

The hand-off worker's copies ahead (moe/handoff.py) are driver calls from its own thread while
the device waits for them. This puts a kernel on the stream that polls a pinned word
(`wait_ahead`, timeout 4 s), then a helper thread, 0.3 s later, queues a host-to-device copy
of SIZE bytes (the arguments; default 1 MiB) and the stream write that sets the word, while
the main thread blocks in each kind of read of the device. A line per (size, call): how long
the main thread's call took, how long the helper's copy call took, and whether the device's
wait timed out (1: the helper was held until then, so the call must not run while a step
waits for the worker). The calls: reads of the device, then what an engine's start-up does
(allocations and frees of device and pinned memory, host registration, a new stream, the
first launch of a Triton kernel). Needs CUDA.

    python benchmarks/probe_driver_lock.py 16 4096 1048576
"""
import ctypes
import sys
import threading
import time

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton import handoff as K
from freetoken.moe.h2d import copier_entry_points
from freetoken.moe.handoff import layout

K.TIMEOUT_S = 4.0
dev = torch.device("cuda")
off = layout(8, 8, 128, 2048)
buf = torch.zeros(off["size"], dtype=torch.uint8, pin_memory=True)
words = buf.numpy().view("int32")
want = torch.ones(1, dtype=torch.int32, device=dev)
cs = torch.cuda.Stream()
ctx, set_ctx, memcpy, write = copier_entry_points(cs, buf.data_ptr() + off["ahead_done"])
SetCtx = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(set_ctx)
Memcpy = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t,
                          ctypes.c_void_p)(memcpy)
Write = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32,
                         ctypes.c_uint)(write)
src = torch.empty(1 << 20, dtype=torch.uint8).pin_memory()
dst = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
big = torch.randn(1 << 20, device=dev)
pinned_out = torch.empty(1 << 20, pin_memory=True)


SIZE = [src.numel()]


def helper(log, a):
    SetCtx(ctx)
    time.sleep(0.3)
    t0 = time.perf_counter()
    rc = Memcpy(dst.data_ptr(), src.data_ptr(), SIZE[0], cs.cuda_stream)
    t1 = time.perf_counter()
    rc2 = Write(cs.cuda_stream, buf.data_ptr() + off["ahead_done"], a, 0)
    log.append((rc, rc2, t1 - t0, time.perf_counter() - t0))


def pinned_read():
    pinned_out.copy_(big, non_blocking=True)
    e = torch.cuda.Event()
    e.record()
    e.synchronize()


counters = torch.zeros(6, dtype=torch.int64, device=dev)
held = {}


def cached_block():
    """A 256 MiB block freed into torch's cache, for empty_cache to give back (cudaFree)."""
    torch.empty(1 << 28, dtype=torch.uint8, device=dev)


def host_register():
    t = torch.empty(1 << 26, dtype=torch.uint8)
    held["reg"] = t
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0))


def free_pinned():
    held.pop("pinned", None)  # its last reference: cudaFreeHost through the host allocator
    torch._C._host_emptyCache()


@triton.jit
def _touch(p, V: tl.constexpr):
    tl.store(p, V)


def new_kernel():
    """A Triton kernel variant not loaded before (a new constexpr): compiled, then its
    module loaded and launched."""
    held["v"] = held.get("v", 0) + 1
    _touch[(1,)](counters, V=1000 + held["v"])


# (name, setup before the device waits, the call timed while it waits)
cases = [
    ("tolist (pageable D2H)", None, lambda: big[:4].tolist()),
    ("counters tolist", None, lambda: counters.tolist()),
    ("item", None, lambda: big[0].item()),
    ("torch.cuda.synchronize", None, torch.cuda.synchronize),
    ("stream.synchronize", None, lambda: torch.cuda.current_stream().synchronize()),
    ("pinned copy + event.synchronize", None, pinned_read),
    ("big pageable .cpu()", None, lambda: big.cpu()),
    # what an engine's start-up does beside a step: the allocator's cudaMalloc / cudaFree
    # (torch.cuda.graph's capture calls empty_cache), pinned host memory made, registered
    # and freed, a new stream, the free-memory query
    ("cudaMalloc (new 512 MiB block)", None,
     lambda: held.__setitem__("m", torch.empty(1 << 29, dtype=torch.uint8, device=dev))),
    ("empty_cache (cudaFree)", cached_block, torch.cuda.empty_cache),
    ("pin_memory 64 MiB (cudaHostAlloc)", None,
     lambda: held.__setitem__("pinned", torch.empty(1 << 26, dtype=torch.uint8,
                                                    pin_memory=True))),
    ("cudaFreeHost of 64 MiB", None, free_pinned),
    ("cudaHostRegister 64 MiB", None, host_register),
    ("new stream", None, lambda: torch.cuda.Stream()),
    ("mem_get_info", None, torch.cuda.mem_get_info),
    ("Triton kernel first launch (module load)", None, new_kernel),
]
a = 0
K.wait_ahead(want, 0, buf, off)  # compiled before the cases
words[off["ahead_done"] // 4] = 0
torch.cuda.synchronize()
sizes = [int(v) for v in sys.argv[1:]] or [src.numel()]
for size, (name, setup, fn) in [(z, c) for z in sizes for c in cases]:
    SIZE[0] = size
    if setup is not None:
        setup()
    name = f"{size}B {name}"
    a += 1
    words[off["timeout"] // 4] = 0
    want.fill_(a)
    torch.cuda.synchronize()
    log = []
    th = threading.Thread(target=helper, args=(log, a))
    th.start()
    K.wait_ahead(want, 0, buf, off)
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    th.join()
    torch.cuda.synchronize()
    held.pop("m", None)
    if "reg" in held:
        torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(held.pop("reg").data_ptr()))
    print(f"{name:34s} main {dt:6.3f} s  helper memcpy call {log[0][2]*1e3:8.1f} ms  "
          f"timeout {words[off['timeout'] // 4]}  rc {log[0][:2]}", flush=True)
