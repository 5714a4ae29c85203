"""The CPU MoE executor: a thin, checking wrapper over the C++ extension `freetoken._cpu_moe`.

One `forward` computes a whole MoE layer for a batch of tokens on the CPU:
for each token t and each of its k (expert e, routing weight r),
`y[t] += r * ((glu(x @ Wg[e]^T * s[e,0], x @ Wu[e]^T * s[e,1])) @ Wd[e]^T * s[e,2])`,
with the banks of DESIGN.md (`w13` [E, 2I, H], `w2` [E, H, I], `scales` fp32 [E, 4]).
The C++ side releases the GIL, runs on its own persistent thread pool and gives results that
do not depend on the thread count. The kernel tier comes from cpuid, capped by
FREETOKEN_CPU_MOE_ISA and the FREETOKEN_CPU_MOE_NO_VNNI / _NO_AVX512VNNI switches.
Read by the C++ side: FREETOKEN_CPU_MOE_NO_VBMI=1 (the avx512_vnni tier's vpshufb dot instead
of its vpermb one, which CPUs with AVX-512 VBMI run; results are identical),
FREETOKEN_CPU_MOE_PIN=0 (leave the pool's workers unpinned), FREETOKEN_CPU_MOE_SPIN_US (how
long idle workers poll before sleeping, default 1000) and FREETOKEN_CPU_MOE_SPIN_PAUSE (one
pause instruction every N polls, default 1, 0 = none), FREETOKEN_CPU_MOE_PREFETCH (bytes of
weights the dots prefetch into L1 ahead of their read cursor, default 4096, 0 = off) and
FREETOKEN_CPU_MOE_PREFETCH_L2 (bytes ahead they also prefetch into L2 only, default 16384,
0 = off); results do not depend on either.

Host memory for the executor's weights: `huge_page_empty` allocates a tensor whose memory the
kernel is asked (madvise MADV_HUGEPAGE) to back with 2 MiB transparent huge pages before it is
first written, unless FREETOKEN_CPU_MOE_HUGEPAGES=0. Streaming experts from 4 KiB pages costs
a TLB miss, and a page walk, every 4 KiB; on the GPU machine's host the DRAM dot read 7%
faster from huge pages and the 2048x512 layer 15% (`benchmarks/ab_cpu_moe.py`, 5 rounds).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import gguf
import torch

from freetoken import env
from freetoken.formats.qweight import QuantWeight

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
TIERS = ("avx512_vnni", "avx2_vnni", "avx512_fp32", "avx2_fp32", "scalar")

_Q = gguf.GGMLQuantizationType
# GGUF types the executor runs: name in the extension, values per block, bytes per block.
GGUF_TYPES = {
    int(_Q.Q4_0): ("Q4_0", 32, 18),
    int(_Q.Q4_1): ("Q4_1", 32, 20),
    int(_Q.Q5_0): ("Q5_0", 32, 22),
    int(_Q.Q5_1): ("Q5_1", 32, 24),
    int(_Q.Q8_0): ("Q8_0", 32, 34),
    int(_Q.Q4_K): ("Q4_K", 256, 144),
    int(_Q.Q5_K): ("Q5_K", 256, 176),
    int(_Q.Q6_K): ("Q6_K", 256, 210),
    int(_Q.MXFP4): ("MXFP4", 32, 17),  # ggml's blocks; the extension's "mxfp4" is the HF layout
}
_FLOAT_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _ext():
    try:
        from freetoken import _cpu_moe
    except ImportError as e:  # pragma: no cover - depends on the build
        raise RuntimeError(
            "the CPU MoE extension freetoken._cpu_moe is not built: run "
            "`pip install --no-build-isolation --no-deps -e .` (needs cmake, a C++17 compiler, "
            "nanobind and scikit-build-core)"
        ) from e
    return _cpu_moe


def extension_available() -> bool:
    """Whether the C++ extension is built in this install (the dense CPU kernels fall back to
    the torch reference without it; the MoE backends say what is missing)."""
    try:
        _ext()
    except RuntimeError:
        return False
    return True


_HUGE = 2 << 20
_MADV_HUGEPAGE = 14


def thp_mode() -> str:
    """The kernel's transparent huge page mode: always, madvise, never, or unknown."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    mode = text[text.find("[") + 1:text.find("]")] if "[" in text else ""
    return mode or "unknown"


def advise_huge_pages(t: torch.Tensor) -> int:
    """Ask the kernel to back the whole 2 MiB pages inside t's memory with transparent huge
    pages (takes effect for pages not yet touched). Returns the bytes advised: 0 when the
    switch is off, on non-Linux hosts, or when t spans no whole 2 MiB page."""
    if not env.cpu_moe_hugepages() or not sys.platform.startswith("linux"):  # MADV_HUGEPAGE
        return 0
    import ctypes

    a, n = t.data_ptr(), t.numel() * t.element_size()
    lo, hi = -(-a // _HUGE) * _HUGE, (a + n) // _HUGE * _HUGE
    if hi <= lo:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return hi - lo if libc.madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0 else 0


def huge_page_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """torch.empty on the CPU, advised onto transparent huge pages before anything touches it
    (advise_huge_pages). For expert banks the executor streams: fill it with copy_()."""
    t = torch.empty(shape, dtype=dtype)
    advise_huge_pages(t)
    return t


def physical_cores() -> int:
    """Physical cores this process may run on (hyper-thread siblings counted once)."""
    cpus = sorted(os.sched_getaffinity(0))
    cores = set()
    for c in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
        try:
            pkg = (topo / "physical_package_id").read_text().strip()
            core = (topo / "core_id").read_text().strip()
        except OSError:
            return len(cpus)
        cores.add((pkg, core))
    return max(1, len(cores))


def default_threads(cores: int | None = None) -> int:
    """Physical cores minus one (one is left to the Python / GPU driver thread), at least 1;
    `cores`: that count instead of this machine's."""
    return max(1, (physical_cores() if cores is None else cores) - 1)


def crowding(threads: int | None, cores: int | None = None) -> str | None:
    """Why `threads` executor threads beside a GPU are too many (None: they are not). There the
    hand-off worker spins on its job word and the host thread launches each step, so threads
    on every physical core preempt one another all step long: on an H100 machine's 16-core host
    (30B Q4_K hybrid, cache rate 0.1, batch 1, 2026-12-07) 16 threads ran 2.8 and 41.6 tok/s
    with 100-120 preemptions a step where the default 15 ran 92.1 and 95.8."""
    if threads is None:
        return None
    cores = physical_cores() if cores is None else cores
    if threads < cores:
        return None
    return (f"--moe-cpu-threads {threads}: this machine has {cores} physical cores, so the "
            "CPU MoE executor leaves none to the hand-off worker and the host thread, and they "
            "preempt its threads every step (decode measured 2-30x slower); the default, "
            f"{default_threads(cores)}, leaves one")


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_tensor(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple) -> None:
    _need(isinstance(t, torch.Tensor), f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    _need(t.device.type == "cpu", f"{name}: must be on the CPU, got {t.device}")
    _need(t.dtype == dtype, f"{name}: dtype must be {dtype}, got {t.dtype}")
    _need(tuple(t.shape) == tuple(shape),
          f"{name}: shape must be {list(shape)}, got {list(t.shape)}")
    _need(t.is_contiguous(), f"{name}: must be contiguous")


def _ext_format(w: QuantWeight) -> tuple[str, int, int]:
    """(extension format name, values per block, bytes per row) of a [E, N, K] bank."""
    K = w.shape[-1]
    if w.fmt in _FLOAT_DTYPES:
        return w.fmt, 1, K * _FLOAT_DTYPES[w.fmt].itemsize
    if w.fmt == "nvfp4":
        return "nvfp4", 16, K // 2
    if w.fmt == "mxfp4":
        return "mxfp4", 32, K // 2
    if w.fmt == "fp8_block":
        return "fp8_block", 1, K
    if w.ggml_type not in GGUF_TYPES:
        names = ", ".join(v[0] for v in GGUF_TYPES.values())
        raise ValueError(f"gguf type {w.ggml_type} is not supported by the CPU executor ({names})")
    name, bs, bb = GGUF_TYPES[w.ggml_type]
    return name, bs, K // bs * bb


def make_bank(w: QuantWeight, name: str):
    """Check a [E, N, K] bank and describe it to the extension (raw pointers, no copies)."""
    _need(isinstance(w, QuantWeight), f"{name}: expected a QuantWeight, got {type(w).__name__}")
    _need(len(w.shape) == 3, f"{name}: expected an expert bank [E, N, K], got shape {w.shape}")
    E, N, K = w.shape
    fmt, bs, row_bytes = _ext_format(w)
    _need(K % bs == 0, f"{name}: in_features {K} must be a multiple of {bs} for {fmt}")
    scales_ptr = 0
    if w.fmt in _FLOAT_DTYPES:
        _check_tensor(w.data, f"{name}.data", _FLOAT_DTYPES[w.fmt], (E, N, K))
    elif w.fmt == "fp8_block":
        _check_tensor(w.data, f"{name}.data", torch.float8_e4m3fn, (E, N, K))
        nb = (E, -(-N // 128), -(-K // 128))
        _check_tensor(w.scales, f"{name}.scales", torch.float32, nb)
        scales_ptr = w.scales.data_ptr()
    elif w.fmt in ("nvfp4", "mxfp4"):
        _check_tensor(w.data, f"{name}.data", torch.uint8, (E, N, K // 2))
        sdt = torch.float8_e4m3fn if w.fmt == "nvfp4" else torch.uint8
        _check_tensor(w.scales, f"{name}.scales", sdt, (E, N, K // bs))
        scales_ptr = w.scales.data_ptr()
    else:
        _check_tensor(w.data, f"{name}.data", torch.uint8, (E, N, row_bytes))
    ext = _ext()
    return ext.Bank(ext.FORMATS[fmt], E, N, K, w.data.data_ptr(), row_bytes, scales_ptr)


class CpuMoeExecutor:
    """Whole MoE layers on the CPU with SIMD kernels and a persistent thread pool.

    num_threads: default physical cores minus one (the engine flag is --moe-cpu-threads).
    isa: None reads FREETOKEN_CPU_MOE_ISA (scalar | avx2 | avx512, a cap); a tier name from
    TIERS forces that tier (tests and benchmarks), ValueError if the CPU lacks it.
    """

    def __init__(self, num_threads: int | None = None, *, isa: str | None = None):
        if num_threads is None:
            num_threads = default_threads()
        _need(isinstance(num_threads, int) and num_threads >= 1,
              f"num_threads must be a positive int, got {num_threads!r}")
        env.refuse_removed()
        cap = isa if isa is not None else (env.cpu_moe_isa() or "")
        self._ex = _ext().Executor(num_threads, cap, env.cpu_moe_no_vnni(),
                                   env.cpu_moe_no_avx512vnni())
        self.isa: str = self._ex.isa
        self.num_threads: int = self._ex.num_threads

    def __repr__(self) -> str:
        return f"CpuMoeExecutor(isa={self.isa!r}, num_threads={self.num_threads})"

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, route_weights: torch.Tensor,
                w13: QuantWeight, w2: QuantWeight, scales: torch.Tensor,
                activation: str = "silu", out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """x fp32 [T, H]; expert_ids int32/int64 [T, k]; route_weights fp32 [T, k];
        scales fp32 [E, 4] (gate, up, down, 1). Returns [T, H] in out_dtype (fp32 or bf16)."""
        _need(isinstance(x, torch.Tensor) and x.dim() == 2,
              f"x: expected a [T, H] tensor, got {getattr(x, 'shape', type(x).__name__)}")
        T, H = x.shape
        _check_tensor(x, "x", torch.float32, (T, H))
        _need(isinstance(expert_ids, torch.Tensor) and expert_ids.dim() == 2
              and expert_ids.shape[0] == T,
              f"expert_ids: expected [T={T}, k], got {getattr(expert_ids, 'shape', None)}")
        _need(expert_ids.dtype in (torch.int32, torch.int64),
              f"expert_ids: dtype must be int32 or int64, got {expert_ids.dtype}")
        k = expert_ids.shape[1]
        ids = expert_ids.to(torch.int32).contiguous()
        _check_tensor(route_weights, "route_weights", torch.float32, (T, k))
        b13, b2 = make_bank(w13, "w13"), make_bank(w2, "w2")
        E, I2, H13 = w13.shape
        _need(H13 == H, f"w13: in_features {H13} must equal x's hidden size {H}")
        _need(I2 % 2 == 0, f"w13: out_features {I2} must be 2 * I (gate rows, then up rows)")
        _need(tuple(w2.shape) == (E, H, I2 // 2),
              f"w2: shape must be [E={E}, H={H}, I={I2 // 2}], got {list(w2.shape)}")
        _check_tensor(scales, "scales", torch.float32, (E, 4))
        _need(activation in ACTIVATIONS,
              f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
        _need(out_dtype in (torch.float32, torch.bfloat16),
              f"out_dtype must be torch.float32 or torch.bfloat16, got {out_dtype}")
        out = torch.empty(T, H, dtype=out_dtype)
        if T == 0 or k == 0:
            return out.zero_()
        self._ex.forward(x.data_ptr(), T, k, ids.data_ptr(), route_weights.data_ptr(), b13, b2,
                         scales.data_ptr(), ACTIVATIONS[activation], out.data_ptr(),
                         out_dtype == torch.bfloat16)
        return out

    def profile_layers(self, on: bool = True) -> None:
        """Start (and zero) or stop the per-thread time accounting of forward()."""
        self._ex.set_profiling(bool(on))

    def layer_profile(self) -> dict:
        """Seconds per layer call since profile_layers(True), per thread: start (from the pool
        run's start to its first item: waking, first prefetches, and on the caller the input's
        quantization at small batches), gate_up (dots), glu (GLU + down-input quant of the
        experts it completed), wait (for the input or an expert's GLU output), down (dots),
        reduce (output sums), end (from its last item to the run's end: idle), other (claiming
        work and the profiler's own clock reads: the rest of the pool run), and items (work
        units per call)."""
        raw = self._ex.layer_profile()
        calls = max(1, raw["calls"])
        span = raw["span"] / calls
        threads = []
        for t in raw["threads"]:
            row = {k: t[k] / calls
                   for k in ("start", "gate_up", "glu", "wait", "down", "reduce", "end")}
            row["other"] = span - sum(row.values())
            row["items"] = t["items"] / calls
            threads.append(row)
        return {"calls": raw["calls"], "span": span, "threads": threads}

    # -- hooks for tests and the benchmark -------------------------------------------------
    def expert_matmul(self, w: QuantWeight, expert: int, x: torch.Tensor,
                      threads: int | None = None) -> torch.Tensor:
        """x [T, K] fp32 @ W[expert]^T -> [T, N] with this tier's dot kernel (and its
        activation quantization)."""
        bank = make_bank(w, "w")
        E, N, K = w.shape
        _need(0 <= expert < E, f"expert must be in [0, {E}), got {expert}")
        _check_tensor(x, "x", torch.float32, (x.shape[0], K))
        out = torch.empty(x.shape[0], N, dtype=torch.float32)
        self._ex.dot(bank, expert, x.data_ptr(), x.shape[0], out.data_ptr(),
                     threads or self.num_threads)
        return out

    def dequant_rows(self, w: QuantWeight, expert: int, r0: int, r1: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [r0, r1) of W[expert] as fp32 [r1 - r0, K], decoded on the pool's threads, bit
        for bit gguf-py's dequantize (GGUF types) and the format definitions (the others): the
        prefill path's "decode a tile, torch.mm". `out`: a contiguous fp32 [r1 - r0, K] tensor
        to write into (a reused buffer skips the page faults of a fresh one), else a new one."""
        bank = make_bank(w, "w")
        E, N, K = w.shape
        _need(0 <= expert < E, f"expert must be in [0, {E}), got {expert}")
        _need(0 <= r0 <= r1 <= N, f"rows [r0, r1) must satisfy 0 <= r0 <= r1 <= {N}, got "
              f"[{r0}, {r1})")
        if out is None:
            out = torch.empty(r1 - r0, K, dtype=torch.float32)
        _check_tensor(out, "out", torch.float32, (r1 - r0, K))
        if r1 > r0:
            self._ex.dequant(bank, expert, r0, r1, out.data_ptr())
        return out

    def glu(self, g: torch.Tensor, u: torch.Tensor, s_gate: float = 1.0, s_up: float = 1.0,
            activation: str = "silu") -> torch.Tensor:
        """This tier's GLU, act(g * s_gate) * (u * s_up), of fp32 [n] vectors."""
        _check_tensor(g, "g", torch.float32, (g.shape[0],))
        _check_tensor(u, "u", torch.float32, (g.shape[0],))
        _need(activation in ACTIVATIONS,
              f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
        out = g.clone()
        self._ex.glu(out.data_ptr(), u.data_ptr(), out.shape[0], float(s_gate), float(s_up),
                     ACTIVATIONS[activation])
        return out

    def prepared_activation(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        """This tier's prepared activation of one token x [K] fp32 for an extension format
        ('nvfp4', 'Q8_0', ...), as raw bytes (uint8)."""
        _check_tensor(x, "x", torch.float32, (x.shape[0],))
        ext = _ext()
        _need(fmt in ext.FORMATS, f"fmt must be one of {', '.join(ext.FORMATS)}, got {fmt!r}")
        raw = self._ex.prep(ext.FORMATS[fmt], x.data_ptr(), x.shape[0])
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def nvfp4_q8_reference(x: torch.Tensor, lanes: int) -> torch.Tensor:
    """The scalar NVFP4 W4A8 activation quant, as raw bytes, in the layout of a dot with
    `lanes` int32 lanes: 16 (the 512-bit dot) or 8 (the 256-bit one)."""
    _check_tensor(x, "x", torch.float32, (x.shape[0],))
    _need(lanes in (16, 8), f"lanes must be 16 or 8, got {lanes!r}")
    raw = _ext().nvfp4_q8_prep_reference(x.data_ptr(), x.shape[0], lanes)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)
