"""Every FREETOKEN_* environment switch, typed, in one place.

Read through the functions below (at call time, so tests can monkeypatch the environment).
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path


@functools.cache
def _names() -> frozenset[str]:
    """The switch names this module quotes."""
    return frozenset(re.findall(r'"(FREETOKEN_[A-Z0-9_]+)"', Path(__file__).read_text()))


def known(name: str) -> bool:
    """Whether `name` is a switch FreeToken reads: every one is named here, quoted, by the
    function that reads it (or in CPU_MOE_NATIVE_SWITCHES). For tools that set switches by
    name (benchmarks/ab_env.py --set), so that a misspelt one is refused, not ignored."""
    return name in _names()


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def _unless_off(name: str) -> bool:
    """A switch that is on unless set to 0 / false / no / off; unset or 1 / true / yes / on is
    on, any other value an error (a typo must not silently keep the default)."""
    return _choice(name, _OFF + _ON) not in _OFF


def _choice(name: str, choices: tuple[str, ...]) -> str | None:
    v = os.environ.get(name, "").strip().lower()
    if not v:
        return None
    if v not in choices:
        raise ValueError(f"{name}={v!r} is not one of {', '.join(choices)}")
    return v


def _int(name: str, lo: int, hi: int | None, why: str) -> int | None:
    """An integer switch: None when unset or empty, else an int in lo .. hi (hi None: no
    bound); anything else an error naming the switch (`why` says the range)."""
    v = os.environ.get(name, "").strip()
    if not v:
        return None
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"{name}={v!r} is not an integer") from None
    if n < lo or (hi is not None and n > hi):
        raise ValueError(f"{name}={v!r}: {why}")
    return n


def cpu_moe_isa() -> str | None:
    """FREETOKEN_CPU_MOE_ISA=scalar|avx2|avx512: cap the CPU MoE kernel tier."""
    return _choice("FREETOKEN_CPU_MOE_ISA", ("scalar", "avx2", "avx512"))


def cpu_moe_no_vnni() -> bool:
    """FREETOKEN_CPU_MOE_NO_VNNI=1: never use a VNNI (int8 dot) kernel."""
    return _flag("FREETOKEN_CPU_MOE_NO_VNNI")


def cpu_moe_no_avx512vnni() -> bool:
    """FREETOKEN_CPU_MOE_NO_AVX512VNNI=1: never use the 512-bit VNNI kernel."""
    return _flag("FREETOKEN_CPU_MOE_NO_AVX512VNNI")


# Switches that were removed, and why: set, they are refused, not ignored (a switch that does
# nothing would make an A/B compare a build with itself).
REMOVED_SWITCHES = {
    "FREETOKEN_CPU_MOE_NO_GFNI": "the Q4_K dot no longer uses GFNI (its kernel of a lane per "
                                 "half sub-block has no nibble transform to switch); unset it",
}


def refuse_removed() -> None:
    """ValueError naming the first removed switch (REMOVED_SWITCHES) that is set."""
    for name, why in REMOVED_SWITCHES.items():
        if os.environ.get(name):
            raise ValueError(f"{name} was removed: {why}")


def cpu_moe_hugepages() -> bool:
    """FREETOKEN_CPU_MOE_HUGEPAGES=0: do not ask for transparent huge pages for host weights."""
    return _unless_off("FREETOKEN_CPU_MOE_HUGEPAGES")


def cpu_float() -> bool:
    """FREETOKEN_CPU_FLOAT=1: quantized linears and MoE layers on the CPU in float math at every
    batch size (fp32 tiles decoded from the weights, torch's GEMM; transformers' numbers), not
    the executor's int8 dots at decode sizes (llama.cpp's numbers, several times faster)."""
    v = os.environ.get("FREETOKEN_CPU_FLOAT")  # read on every CPU linear: the fast path first
    return v is not None and _flag("FREETOKEN_CPU_FLOAT")


def gpu_int8_dot() -> bool:
    """FREETOKEN_GPU_INT8_DOT=0: the GPU's decode GEMVs (NVFP4, Q4_K, split Q8_0 at bf16 / f16)
    multiply in fp32 from decoded weights instead of int8 dot products over activations
    quantized per 32 values (`kernels/triton/gemv_i8.py`; llama.cpp's numbers, faster)."""
    return _unless_off("FREETOKEN_GPU_INT8_DOT")


def gpu_linear_mt() -> int | None:
    """FREETOKEN_GPU_LINEAR_MT=N: a dense linear's int8 GEMV takes up to N tokens a program,
    each weight chunk expanded once for all of them (`kernels/triton/linear.py: _i8_tokens`),
    for every int8 format (NVFP4, Q4_K, split Q8_0); 0: never (once per token up to
    `I8_TOKENS`, then tl.dot tiles). Unset: the measured default (`I8_MULTI_TOKENS`). For
    measuring the choice end to end (benchmarks/ab_env.py)."""
    return _int("FREETOKEN_GPU_LINEAR_MT", 0, 16, "tokens a program must be 0 (off) to 16")


def gpu_norm_route() -> bool:
    """FREETOKEN_GPU_NORM_ROUTE=0: the post-attention RMSNorm and the MoE router run as two
    launches at decode sizes instead of one (`kernels.route.add_rms_norm_route`)."""
    return _unless_off("FREETOKEN_GPU_NORM_ROUTE")


def gpu_rope_attn() -> bool:
    """FREETOKEN_GPU_ROPE_ATTN=0: at decode the q/k norm, rotary and KV store run in a launch of
    their own before decode attention instead of inside it (`kernels.attention.
    qk_rope_attention`)."""
    return _unless_off("FREETOKEN_GPU_ROPE_ATTN")


def gpu_gdn_fused() -> bool:
    """FREETOKEN_GPU_GDN_FUSED=0: a GDN layer's decode step runs as three launches (conv, delta
    rule, gated norm) instead of one (`kernels/triton/gdn.py: _fused_kernel`)."""
    return _unless_off("FREETOKEN_GPU_GDN_FUSED")


def gpu_down_arrive_sum() -> bool:
    """FREETOKEN_GPU_DOWN_SUM=0: at decode sizes the fused MoE sums each token's routes in a
    launch of its own instead of in the down kernel's last-arriving program
    (`kernels/triton/moe.py: _arrive_and_sum`)."""
    return _unless_off("FREETOKEN_GPU_DOWN_SUM")


def gpu_norm_fold() -> bool:
    """FREETOKEN_GPU_NORM_FOLD=0: at decode on a GPU, the next layer's residual add and input
    RMSNorm run as a launch of their own instead of in the MoE's last kernel (the down
    kernel's last-arriving program, or the receive of the CPU's answer; `kernels/norm.py`:
    folding)."""
    return _unless_off("FREETOKEN_GPU_NORM_FOLD")


def gpu_side_stream() -> bool:
    """FREETOKEN_GPU_SIDE_STREAM=0: with the offload, cpu and hybrid backends on a GPU, the
    shared expert runs after the routed experts' device kernel on the compute stream instead
    of on a second stream beside the slot fills (`moe/expert_cache.py: ExpertCache._split`)."""
    return _unless_off("FREETOKEN_GPU_SIDE_STREAM")


def _if_on(name: str) -> bool:
    """A switch that is off unless set to 1 / true / yes / on; 0 / false / no / off is off,
    any other value an error."""
    return _choice(name, _OFF + _ON) in _ON


def moe_ahead_worker() -> bool:
    """FREETOKEN_MOE_AHEAD_WORKER=0: with --moe-fetch-ahead, the experts given slots ahead are
    copied by a GPU fill kernel beside the device's attention and router, instead of by the
    CPU hand-off's worker with the copy engine after its job (`moe/ahead.py`). Also off
    where no hand-off runs (offload without CPU routes)."""
    return _unless_off("FREETOKEN_MOE_AHEAD_WORKER")


def moe_ahead_delay_us() -> int:
    """FREETOKEN_MOE_AHEAD_DELAY_US=N (0-1000, default 0): the hand-off's worker queues the
    copies ahead no sooner than N microseconds after its answer, for measuring whether they
    slow the device's read of that answer over the same link (`moe/handoff.py`)."""
    return _int("FREETOKEN_MOE_AHEAD_DELAY_US", 0, 1000, "microseconds from 0 to 1000") or 0


def moe_prefetch() -> bool:
    """FREETOKEN_MOE_PREFETCH=1: with the cpu and hybrid backends, the CPU hand-off's worker
    warms the next layer's predicted CPU experts into the executor threads' caches between
    jobs (`moe/handoff.py`: warming). Off by default: on the H200's shared host it measured
    within the spread between runs (and slower while the host's memory was busy)."""
    return _if_on("FREETOKEN_MOE_PREFETCH")


def gpu_receive_shared() -> bool:
    """FREETOKEN_GPU_RECEIVE_SHARED=0: with the offload, cpu and hybrid backends on a GPU, where
    a layer call receives the CPU's answer, the shared expert computed on its side stream is
    added (with its gate) in a launch of its own before the receive instead of inside the
    receive kernel (`kernels/triton/handoff.py: receive_add`; the same bits either way)."""
    return _unless_off("FREETOKEN_GPU_RECEIVE_SHARED")


def gpu_pdl() -> int:
    """FREETOKEN_GPU_PDL=1: the GPU's decode kernels launch programmatically dependent
    (`kernels/triton/pdl.py`: the next kernel launched while the one before it finishes,
    waiting for its results; Hopper and later); `early`: launched as soon as all programs of
    the one before have started (2). Default 0 (off): neither mode measured faster yet."""
    v = _choice("FREETOKEN_GPU_PDL", ("0", "false", "no", "off", "1", "true", "yes", "on",
                                      "early"))
    if v == "early":
        return 2
    return 1 if v in ("1", "true", "yes", "on") else 0


_L2_AHEAD = ("o", "qkv", "down")


def gpu_l2_ahead() -> frozenset[str]:
    """FREETOKEN_GPU_L2_AHEAD=o,qkv,down (any of them, `,` or `+` between; `all`; 0 or unset:
    none): the decode weights a side stream asks L2 for while the kernel before their reader
    runs (`kernels/triton/l2.py`): o_proj's during attention, the next layer's qkv during
    the norm + router, the routed experts' down rows during gate/up. Off until measured
    faster."""
    v = os.environ.get("FREETOKEN_GPU_L2_AHEAD", "").strip().lower()
    if v in ("", "0", "off", "none"):
        return frozenset()
    if v == "all":
        return frozenset(_L2_AHEAD)
    names = frozenset(n.strip() for n in re.split(r"[,+]", v))  # `+`: for ab_env.py --set
    if not names <= frozenset(_L2_AHEAD):
        raise ValueError(f"FREETOKEN_GPU_L2_AHEAD={v!r}: expected a list (`,` or `+` between) of "
                         f"{', '.join(_L2_AHEAD)}, or all, or 0")
    return names


def gpu_moe_route_tiles() -> tuple[int, int, int] | None:
    """FREETOKEN_GPU_MOE_ROUTE_TILES=BNxBKxWARPS (32x1024x8, say): the tiles of the fused
    MoE's per-route int8 GEMVs at decode steps of 2 to 16 tokens (`kernels/triton/moe.py:
    _i8_tiles`; BK at most, halved until it tiles K), for measuring tile choices end to end
    (benchmarks/ab_env.py). Unset: the measured default. BN and BK powers of two (BN 1-256,
    BK 32-4096), WARPS 1, 2, 4 or 8."""
    return _tiles("FREETOKEN_GPU_MOE_ROUTE_TILES")


def gpu_linear_tiles() -> tuple[int, int, int] | None:
    """FREETOKEN_GPU_LINEAR_TILES=BNxBKxWARPS: the tiles of the dense int8 GEMV at one token
    (`kernels/triton/linear.py: _i8_blocks`; BK at most, halved until it tiles K; not the
    lm_head's), for measuring end to end (benchmarks/ab_env.py). Unset: the measured default.
    The same form and bounds as FREETOKEN_GPU_MOE_ROUTE_TILES."""
    return _tiles("FREETOKEN_GPU_LINEAR_TILES")


def gpu_moe_one_tiles() -> tuple[int, int, int] | None:
    """FREETOKEN_GPU_MOE_ONE_TILES=BNxBKxWARPS: the tiles of the fused MoE's per-route int8
    GEMVs at one token (gate / up and down; BK at most, halved until it tiles K), for
    measuring end to end (benchmarks/ab_env.py). Unset: the measured default. The same form
    and bounds as FREETOKEN_GPU_MOE_ROUTE_TILES."""
    return _tiles("FREETOKEN_GPU_MOE_ONE_TILES")


def gpu_moe_maxnreg() -> int | None:
    """FREETOKEN_GPU_MOE_MAXNREG=N: the fused MoE's per-route decode kernels (gate / up, down,
    down-and-sum; 1 to 16 tokens) compiled with at most N registers a thread (PTX .maxnreg,
    Triton's `maxnreg`), for measuring occupancy against spills (benchmarks/ab_env.py,
    bench_gpu_kernels.py --moe-switch). Unset or 0: the compiler's choice.
    N a multiple of 8 in 32-255; NVIDIA GPUs only (set on ROCm, the launch is refused)."""
    name = "FREETOKEN_GPU_MOE_MAXNREG"
    why = "a multiple of 8 in 32-255 (or 0: the compiler's choice)"
    n = _int(name, 0, 255, why)
    if n and (n < 32 or n % 8):
        raise ValueError(f"{name}={os.environ[name].strip()!r}: {why}")
    return n or None


def gpu_moe_down_tiles() -> tuple[int, int, int] | None:
    """FREETOKEN_GPU_MOE_DOWN_TILES=BNxBKxWARPS: the tiles of the fused MoE's per-route int8
    down GEMV at every decode size (1 to 16 tokens), over the default and
    FREETOKEN_GPU_MOE_ROUTE_TILES (gate / up keep theirs), for measuring end to end. The
    same form and bounds as FREETOKEN_GPU_MOE_ROUTE_TILES."""
    return _tiles("FREETOKEN_GPU_MOE_DOWN_TILES")


def _tiles(name: str) -> tuple[int, int, int] | None:
    v = os.environ.get(name, "").strip()
    if not v:
        return None
    try:
        bn, bk, warps = (int(p) for p in v.lower().split("x"))
    except ValueError:
        raise ValueError(f"{name}={v!r} is not BNxBKxWARPS (three integers)") from None

    def pow2(n: int, lo: int, hi: int) -> bool:
        return lo <= n <= hi and n & (n - 1) == 0

    if not (pow2(bn, 1, 256) and pow2(bk, 32, 4096) and warps in (1, 2, 4, 8)):
        raise ValueError(f"{name}={v!r}: BN must be a power of two in 1-256, BK one in "
                         "32-4096, WARPS 1, 2, 4 or 8")
    return bn, bk, warps


def gpu_norm_route_tiles() -> tuple[int, int] | None:
    """FREETOKEN_GPU_NORM_ROUTE_TILES=BExWARPS (4x2, say): experts per program and warps per
    program of the fused post-attention RMSNorm + MoE router at decode sizes
    (`kernels/triton/route.py: norm_gate_route_triton`), for measuring end to end
    (benchmarks/ab_env.py), where FREETOKEN_GPU_NORM_ROUTE_SPLIT=0 (else the programs split
    the hidden size). Unset: the measured default. BE a power of two in 1-64, WARPS 1, 2, 4
    or 8."""
    return _size_warps("FREETOKEN_GPU_NORM_ROUTE_TILES", "BE", 1, 64)


def gpu_norm_route_split() -> tuple[int, int] | None:
    """FREETOKEN_GPU_NORM_ROUTE_SPLIT=BHxWARPS (128x4, say): the fused post-attention RMSNorm +
    MoE router split by hidden slices of BH values a program instead of by experts
    (`kernels/triton/route.py: _norm_gate_route_split_kernel`), for measuring end to end; 0:
    the expert split (FREETOKEN_GPU_NORM_ROUTE_TILES), read as (0, 1). Unset: the measured
    default (`route.NORM_ROUTE_SPLIT`, a split by slices). BH a power of two in 32-4096,
    WARPS 1, 2, 4 or 8."""
    name = "FREETOKEN_GPU_NORM_ROUTE_SPLIT"
    if os.environ.get(name, "").strip() == "0":
        return 0, 1
    return _size_warps(name, "BH", 32, 4096, " or 0")


def _size_warps(name: str, size: str, lo: int, hi: int, alt: str = "") -> tuple[int, int] | None:
    """SIZExWARPS from the variable `name`: SIZE a power of two in lo-hi, WARPS 1, 2, 4 or 8;
    None where unset or empty."""
    v = os.environ.get(name, "").strip()
    if not v:
        return None
    try:
        n, warps = (int(p) for p in v.lower().split("x"))
    except ValueError:
        raise ValueError(f"{name}={v!r} is not {size}xWARPS (two integers){alt}") from None
    if not (lo <= n <= hi and n & (n - 1) == 0 and warps in (1, 2, 4, 8)):
        raise ValueError(f"{name}={v!r}: {size} must be a power of two in {lo}-{hi}, WARPS 1, "
                         "2, 4 or 8")
    return n, warps


def gpu_moe_grouped() -> tuple[int, int] | None:
    """FREETOKEN_GPU_MOE_GROUPED=LO-HI (5-16, say): the decode steps of LO to HI tokens at
    which the fused MoE runs its grouped int8 kernels (routes grouped by expert, each expert's
    rows read once for all of its routes: `kernels/triton/moe_grouped.py`) instead of one
    GEMV per route; 0: never, read as the empty span (0, 0). Unset or empty: None, the
    measured default (`kernels/triton/moe.py: GROUPED_TOKENS`). 1 <= LO <= HI."""
    return _span("FREETOKEN_GPU_MOE_GROUPED", "5-16")


def gpu_moe_mma() -> tuple[int, int] | None:
    """FREETOKEN_GPU_MOE_MMA=LO-HI (2-16, say): the steps of LO to HI tokens at which the fused
    MoE runs the tensor-core kernels for Q4_K banks (routes grouped by expert in blocks, each
    expert's codes multiplied by tl.dot as int8 or decoded to fp16, FREETOKEN_GPU_MOE_MMA_FORM:
    `kernels/triton/moe_mma.py`) instead of its other paths, where both banks are Q4_K and x
    is one the form takes; 0: never, read as the
    empty span (0, 0). Unset or empty: None, off (an opt-in until measured). 1 <= LO <= HI."""
    return _span("FREETOKEN_GPU_MOE_MMA", "2-16")


def gpu_moe_mma_form() -> str | None:
    """FREETOKEN_GPU_MOE_MMA_FORM=i8|f16: how those kernels multiply (`moe_mma.FORMS`): the
    4-bit codes as int8 against x's int8 codes, or decoded to fp16 against x in fp16. Unset or
    empty: None (`moe_mma.MMA_FORM`)."""
    v = os.environ.get("FREETOKEN_GPU_MOE_MMA_FORM", "").strip()
    if v and v not in ("i8", "f16"):
        raise ValueError(f"FREETOKEN_GPU_MOE_MMA_FORM={v!r}: expected i8 or f16")
    return v or None


def _span(name: str, example: str) -> tuple[int, int] | None:
    """A token span switch LO-HI: (LO, HI), (0, 0) for 0 (never), None unset or empty."""
    v = os.environ.get(name, "").strip()
    if not v:
        return None
    if v == "0":
        return 0, 0
    try:
        lo, hi = (int(p) for p in v.split("-"))
    except ValueError:
        raise ValueError(f"{name}={v!r} is not LO-HI (two token counts: {example}, say) or 0 "
                         "(never)") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"{name}={v!r}: LO must be 1 or more and HI at least LO")
    return lo, hi


def gpu_attn_merge_splits() -> int | None:
    """FREETOKEN_GPU_ATTN_MERGE_SPLITS=N: decode attention's split-K partials are merged by
    the last split of each (sequence, KV head) to arrive up to N splits, by a launch of
    `_merge_kernel` above (`kernels/triton/attention.py: MERGE_MAX_SPLITS`), for measuring
    the choice end to end (benchmarks/ab_env.py). Unset: the measured default. N from 1 on
    (1: every split count gets the merge launch)."""
    return _int("FREETOKEN_GPU_ATTN_MERGE_SPLITS", 1, None, "the split count must be 1 or more")


def cache_dir() -> str | None:
    """FREETOKEN_CACHE: where assembled packaged models live (default ~/.cache/freetoken)."""
    return os.environ.get("FREETOKEN_CACHE") or None


# Read by the C++ executor itself (once per process); listed here so every switch is in one place.
CPU_MOE_NATIVE_SWITCHES = {
    "FREETOKEN_CPU_MOE_NO_VBMI": "1: use the vpshufb 512-bit kernel, not the vpermb (VBMI) one",
    "FREETOKEN_CPU_MOE_PIN": "0: do not pin executor threads to CPUs",
    "FREETOKEN_CPU_MOE_SPIN_US": "microseconds an idle worker spins before sleeping (1000)",
    "FREETOKEN_CPU_MOE_SPIN_PAUSE": "one pause instruction every N polls while spinning (0: none)",
    "FREETOKEN_CPU_MOE_PREFETCH": "CPU MoE dot prefetch distance in bytes (4096; 0: off)",
    "FREETOKEN_CPU_MOE_PREFETCH_L2": "CPU MoE dot prefetch into L2, bytes ahead (16384; 0: off)",
}
