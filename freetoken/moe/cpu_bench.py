"""`ft bench cpu-moe`: the CPU MoE executor's GB/s per ISA tier, next to the machine's ceiling.

Measured in one run, per tier:
- one NVFP4 dot at K = 2048 on one core with its weights in L2 (a ~1 MiB matrix): the best and
  the median of L2_TRIALS runs of about a millisecond (on a shared virtual machine a neighbour
  on the same physical core slows some runs; the best is the kernel's own speed), also in
  bytes per cycle of the core's clock, measured by the same tool;
- one NVFP4 dot on all threads from DRAM (a matrix several times larger than the last-level
  cache), PASSES runs of one sweep each;
- whole layers (bytes of the experts touched, block scales included, / time) for three NVFP4
  shapes, Qwen3-30B-A3B's with every expert Q4_K, and the first one as a GGUF Q4_K_M file
  stores its experts (Q4_K gate/up, Q6_K down) at batch 1, 2, 4, 8, cycling through enough
  layers that the weights come from DRAM, LAYER_RUNS runs of MIN_SECONDS each with fresh
  routing;
- the streaming-read ceiling: AVX-512 streaming loads (AVX2 where absent) on all threads over
  the DRAM buffer, with each software-prefetch setting of CEILING_PREFETCH (the dots' own
  included), the best of PASSES sweeps each, at the start.
The host's read bandwidth moves during a run (a shared machine: on the GPU host, sweeps of one
run ranged 96-144 GB/s), so a ratio against a ceiling measured at another moment is noise.
Each run of a DRAM figure is therefore paired: a ceiling sweep (the best setting of the start,
ADJ_PASSES passes) right before and right after it, and the run's share is its GB/s over the
higher of the two. A figure's GB/s is its best run, its % the best paired share. The 1-core L2
dot is compared with one core's streaming read.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass

import gguf
import torch

from freetoken import env
from freetoken.formats.qweight import QuantWeight
from freetoken.moe.cpu_executor import (
    TIERS,
    CpuMoeExecutor,
    default_threads,
    huge_page_empty,
    make_bank,
    thp_mode,
)


@dataclass(frozen=True)
class LayerShape:
    label: str
    hidden: int
    inter: int
    top_k: int
    experts: int  # the real model's expert count (routing draws from it)
    model: str
    formats: tuple[str, str] = ("nvfp4", "nvfp4")  # gate/up, down: "nvfp4" or a GGUF type name


SHAPES = (
    LayerShape("2048x512 top8", 2048, 512, 8, 256, "Qwen3.6-35B-A3B"),
    LayerShape("2560x640 top10", 2560, 640, 10, 512, "Qwen3-Next-like (Qwen3.8-Flash-Next)"),
    LayerShape("2816x704 top8", 2816, 704, 8, 128, "Gemma-4-26B-A4B"),
    # every expert Q4_K (the dummy q4_k model of the 30B bars; llama.cpp's Q4_K_S)
    LayerShape("2048x768 top8 Q4_K", 2048, 768, 8, 128, "Qwen3-30B-A3B, GGUF Q4_K",
               ("Q4_K", "Q4_K")),
    # the experts of a llama.cpp Q4_K_M file: Q4_K gate/up, Q6_K down (kept last: the tests'
    # small run takes the first shape and this one)
    LayerShape("2048x512 top8 Q4_K_M", 2048, 512, 8, 256, "Qwen3.6-35B-A3B, GGUF Q4_K_M",
               ("Q4_K", "Q6_K")),
)
# A layer whose experts stay in cache (a 1 MiB bank): its speed is set by the executor's fixed
# cost per call (routing, waking the pool, the phases' hand-offs, the end of the run). Used by
# benchmarks/profile_cpu_moe_layer.py and ab_cpu_moe.py.
FIXED_COST_SHAPE = LayerShape("256x64 top8", 256, 64, 8, 16, "fixed cost")
FIXED_COST_BUDGET = 1 << 20
BATCHES = (1, 2, 4, 8)
GiB = 1 << 30
MIN_SECONDS = 0.25  # each layer run: repeat until at least this long
PASSES = 5  # DRAM: the start's ceiling is the best of this many sweeps; the dot runs this often
ADJ_PASSES = 2  # the paired ceiling sweeps around each run: the best of this many
LAYER_RUNS = 3  # whole layers: this many runs of MIN_SECONDS each
L2_TRIALS = 300  # the 1-core L2 dot: runs of about L2_RUN_SECONDS
L2_RUN_SECONDS = 0.001


# ---------------------------------------------------------------------------
# machine
# ---------------------------------------------------------------------------
def llc_bytes() -> int:
    best = 32 << 20
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for idx in os.listdir(base):
            if not idx.startswith("index"):
                continue
            size = open(f"{base}/{idx}/size").read().strip()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": GiB}.get(size[-1], 1)
            best = max(best, int(size.rstrip("KMG")) * mult)
    except OSError:
        pass
    return best


def available_bytes() -> int:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * GiB


def dram_budget() -> int:
    """Bytes of weights per DRAM measurement: 8 GiB (at least 4x the LLC), never more than a
    quarter of the available memory."""
    want = max(8 * GiB, 4 * llc_bytes())
    return max(256 << 20, min(want, available_bytes() // 4))


def _fill(buf: torch.Tensor, seed: int) -> None:
    """Touch every page with random-looking bytes, cheaply (a 1 MiB pattern tiled). The
    buffers come from huge_page_empty, as the executor's weights would: on huge pages where
    the kernel grants them (the ceiling's buffer too, so both sides of a ratio read alike)."""
    flat = buf.view(-1)
    pat = torch.randint(0, 256, (1 << 20,), generator=torch.Generator().manual_seed(seed),
                        dtype=torch.int32).to(torch.uint8)
    n = flat.numel() // pat.numel() * pat.numel()
    flat[:n].view(-1, pat.numel()).copy_(pat)
    flat[n:] = pat[: flat.numel() - n]


def gguf_bank(qtype: str, E: int, N: int, K: int, seed: int) -> QuantWeight:
    """Random GGUF blocks with sane fp16 scales (2^-7, and 2^-9 for Q4_K's / Q5_K's dmin): no
    NaN, infinity or subnormal products to slow the float paths."""
    t = gguf.GGMLQuantizationType[qtype]
    bs, bb = gguf.GGML_QUANT_SIZES[t]
    data = huge_page_empty((E, N, K // bs, bb), torch.uint8)
    _fill(data, seed)
    for off, half in {"Q4_K": ((0, 0x2000), (2, 0x1800)), "Q5_K": ((0, 0x2000), (2, 0x1800)),
                      "Q6_K": ((208, 0x2000),),
                      "Q8_0": ((0, 0x2000),), "Q4_0": ((0, 0x2000),)}[qtype]:
        data[..., off] = half & 0xFF
        data[..., off + 1] = half >> 8
    return QuantWeight(data.view(E, N, -1), "gguf", (E, N, K), ggml_type=int(t))


def make_weights(fmt: str, E: int, N: int, K: int, seed: int) -> QuantWeight:
    return nvfp4_bank(E, N, K, seed) if fmt == "nvfp4" else gguf_bank(fmt, E, N, K, seed)


def nvfp4_bank(E: int, N: int, K: int, seed: int) -> QuantWeight:
    data = huge_page_empty((E, N, K // 2), torch.uint8)
    _fill(data, seed)
    # Scales: E4M3 0.5..2 (no NaN, no subnormals, so no slow float paths).
    scales = huge_page_empty((E, N, K // 16), torch.uint8)
    _fill(scales, seed + 1)
    scales = scales.bitwise_and_(0x0F).bitwise_or_(0x30).view(torch.float8_e4m3fn)
    return QuantWeight(data, "nvfp4", (E, N, K), scales=scales)


def _repeat(fn, min_seconds: float = MIN_SECONDS) -> tuple[float, int]:
    """Call fn(iters) -> seconds with growing iters until it runs min_seconds."""
    iters = 1
    while True:
        t = fn(iters)
        if t >= min_seconds or iters >= 1 << 20:
            return t, iters
        iters = max(iters * 2, int(iters * min_seconds / max(t, 1e-6) * 1.2))


# ---------------------------------------------------------------------------
# measurements
# ---------------------------------------------------------------------------
# Software-prefetch settings tried by the ceiling: (bytes ahead into L1, bytes ahead into L2),
# 0 = none. The dots prefetch both ways (FREETOKEN_CPU_MOE_PREFETCH, _PREFETCH_L2; defaults
# 4096 and 16384): a ceiling measured without that can sit below what the dots read, and a low
# ceiling flatters every ratio. The ceiling is the best over all of them.
CEILING_PREFETCH = ((0, 0), (2048, 0), (4096, 0), (8192, 0), (16384, 0), (2048, 16384),
                    (4096, 16384), (4096, 32768))


def ceiling(ex: CpuMoeExecutor, buf: torch.Tensor, threads: int,
            settings: tuple[tuple[int, int], ...] = CEILING_PREFETCH,
            passes: int | None = None) -> float:
    """Streaming-read GB/s: best of `passes` sweeps of the whole buffer on `threads` threads,
    over every prefetch setting in `settings`."""

    def sweep(d: tuple[int, int]) -> float:
        t, nbytes = ex._ex.time_stream(buf.data_ptr(), buf.numel(), 1, threads, *d)
        return nbytes / t / 1e9

    best = 0.0
    for d in settings:
        sweep(d)  # warm-up
        best = max(best, max(sweep(d) for _ in range(passes or PASSES)))
    return best


class Ceiling:
    """The streaming-read ceiling of the DRAM buffer on `threads` threads: measured in full at
    the start (every setting, PASSES sweeps), then swept around each run of a DRAM figure."""

    def __init__(self, ex: CpuMoeExecutor, buf: torch.Tensor, threads: int):
        self.ex, self.buf, self.threads = ex, buf, threads
        per = {d: ceiling(ex, buf, threads, (d,)) for d in CEILING_PREFETCH}
        self.setting = max(per, key=per.get)
        self.start = per[self.setting]
        self.sweeps: list[float] = []

    def sweep(self) -> float:
        c = ceiling(self.ex, self.buf, self.threads, (self.setting,), ADJ_PASSES)
        self.sweeps.append(c)
        return c


@dataclass
class Figure:
    gbps: float  # the best run
    pct: float  # the best run's share of the higher of its two adjacent sweeps, in %


def paired(run, ceil: Ceiling, runs: int) -> Figure:
    """`runs` calls of run() -> GB/s, each between two ceiling sweeps (shared by neighbours)."""
    before = ceil.sweep()
    best, pct = 0.0, 0.0
    for _ in range(runs):
        g = run()
        after = ceil.sweep()
        best, pct = max(best, g), max(pct, 100 * g / max(before, after))
        before = after
    return Figure(best, pct)


# rows of about 1 MiB at K = 2048 (fits a 2 MiB L2) for the 1-core L2 dot, per format
L2_ROWS = {"nvfp4": 896, "Q4_K": 896, "Q5_K": 768, "Q6_K": 640, "Q8_0": 480}


def check_l2_k(K: int) -> None:
    """A row length dot_l2 takes: whole super-blocks of 256 (every format's block tiles it)."""
    if K <= 0 or K % 256:
        raise ValueError(f"dot_l2: K must be a positive multiple of 256, got {K}")


def dot_l2(ex: CpuMoeExecutor, fmt: str = "nvfp4", K: int = 2048) -> tuple[float, float]:
    """(best, median) GB/s of the 1-core L2 dot of one `fmt` matrix over L2_TRIALS short runs:
    rows of K values (a multiple of 256), as many as make L2_ROWS' bytes at K = 2048 (short rows
    show a kernel's cost per row: K = 768 is the 30B shape's down)."""
    if fmt not in L2_ROWS:
        raise ValueError(f"dot_l2: fmt must be one of {', '.join(L2_ROWS)}, got {fmt!r}")
    check_l2_k(K)
    w = make_weights(fmt, 1, L2_ROWS[fmt] * 2048 // K, K, 7)
    x = torch.randn(K)
    bank = make_bank(w, "w")
    _, it = _repeat(lambda i: ex._ex.time_dot(bank, 0, x.data_ptr(), i, 1), L2_RUN_SECONDS)
    runs = sorted(w.nbytes() * it / ex._ex.time_dot(bank, 0, x.data_ptr(), it, 1) / 1e9
                  for _ in range(L2_TRIALS))
    return runs[-1], runs[len(runs) // 2]


def dot_dram(ex: CpuMoeExecutor, w: QuantWeight, ceil: Ceiling) -> Figure:
    """One token against the whole DRAM matrix on all threads: PASSES runs of one pass."""
    x = torch.randn(w.shape[-1])
    bank = make_bank(w, "w")
    ex._ex.time_dot(bank, 0, x.data_ptr(), 1, ex.num_threads)  # warm-up
    return paired(lambda: w.nbytes() / ex._ex.time_dot(bank, 0, x.data_ptr(), 1, ex.num_threads)
                  / 1e9, ceil, PASSES)


class LayerBench:
    """L layers of one shape in a pool; call i runs layer i % L with random top-k routing."""

    def __init__(self, shape: LayerShape, budget: int):
        H, inter = shape.hidden, shape.inter
        f13, f2 = shape.formats
        # bytes of one expert (block scales included): from a one-expert bank of each format
        per_expert = (make_weights(f13, 1, 2 * inter, H, 0).nbytes()
                      + make_weights(f2, 1, H, inter, 0).nbytes())
        pool = max(budget // per_expert, 2 * shape.top_k)
        self.layers = max(1, pool // shape.experts)
        self.experts = min(shape.experts, pool)  # experts per layer actually allocated
        E = self.layers * self.experts
        self.shape, self.expert_bytes = shape, per_expert
        self.w13 = make_weights(f13, E, 2 * inter, H, 11)
        self.w2 = make_weights(f2, E, H, inter, 13)
        self.scales = torch.ones(E, 4)
        self.banks = (make_bank(self.w13, "w13"), make_bank(self.w2, "w2"))

    def routing(self, iters: int, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        g = torch.Generator().manual_seed(seed)
        k = self.shape.top_k
        ids = torch.rand(iters * T, self.experts, generator=g).argsort(dim=1)[:, :k]
        ids = ids.view(iters, T, k) + (torch.arange(iters) % self.layers).view(-1, 1, 1) * \
            self.experts
        touched = sum(len(torch.unique(ids[i])) for i in range(iters))
        route = torch.full((iters, T, k), 1.0 / k)
        return ids.to(torch.int32).contiguous(), route, touched * self.expert_bytes

    def time_forward(self, ex: CpuMoeExecutor, x: torch.Tensor, out: torch.Tensor,
                     ids: torch.Tensor, route: torch.Tensor) -> float:
        """Seconds for ids.shape[0] silu layer calls on x [T, H] (routing from routing())."""
        iters, T, k = ids.shape
        return ex._ex.time_forward(x.data_ptr(), T, k, ids.data_ptr(), route.data_ptr(),
                                   *self.banks, self.scales.data_ptr(), 0, out.data_ptr(), iters)

    def gbps(self, ex: CpuMoeExecutor, T: int, ceil: Ceiling) -> Figure:
        x = torch.randn(T, self.shape.hidden)
        out = torch.empty(T, self.shape.hidden)

        def run(iters: int, seed: int) -> tuple[float, int]:
            ids, route, nbytes = self.routing(iters, T, seed)
            return self.time_forward(ex, x, out, ids, route), nbytes

        t, _ = run(4, 0)  # warm-up and an estimate of one call
        iters = max(8, min(4000, int(MIN_SECONDS / max(t / 4, 1e-6))))
        seeds = iter(range(1, 1 + LAYER_RUNS))

        def one() -> float:  # fresh routing each run
            t, nbytes = run(iters, next(seeds))
            return nbytes / t / 1e9

        return paired(one, ceil, LAYER_RUNS)


# ---------------------------------------------------------------------------
# the whole benchmark
# ---------------------------------------------------------------------------
def host_tiers(requested: str | None) -> list[str]:
    from freetoken import _cpu_moe

    have = [t.strip() for t in _cpu_moe.supported_tiers().split(",")]
    if not requested:
        return [t for t in TIERS if t in have]
    out = []
    for name in requested.split(","):
        tier = CpuMoeExecutor(1, isa=name.strip()).isa  # a cap name resolves to its tier
        if tier not in out:
            out.append(tier)
    return out


def run_bench(threads: int | None = None, isa: str | None = None, log=print) -> dict:
    threads = threads or default_threads()
    tiers = host_tiers(isa)
    budget = dram_budget()
    huge = thp_mode() if env.cpu_moe_hugepages() else "off (FREETOKEN_CPU_MOE_HUGEPAGES=0)"
    log(f"CPU MoE bench: {platform.processor() or platform.machine()}, {threads} threads, "
        f"tiers {', '.join(tiers)}; DRAM buffers {budget / GiB:.2f} GiB (LLC "
        f"{llc_bytes() / (1 << 20):.0f} MiB), transparent huge pages: {huge}")
    t0 = time.time()
    big = nvfp4_bank(1, budget // 1152, 2048, 3)  # K = 2048 rows of 1152 B
    best = CpuMoeExecutor(threads, isa=tiers[0])
    ceil = Ceiling(best, big.data, threads)
    from freetoken import _cpu_moe

    res = {"threads": threads, "tiers": tiers, "dram_bytes": big.nbytes(), "huge_pages": huge,
           "ceiling_gbps": ceil.start, "ceiling_prefetch": list(ceil.setting),
           "ceiling_1thread_gbps": ceiling(best, big.data, 1),
           "core_clock_ghz": _cpu_moe.core_clock_ghz(0.2), "figures": {}, "percent": {}}
    log(f"read ceiling ({best.isa} stream loads): {res['ceiling_gbps']:.1f} GB/s on {threads} "
        f"threads, {res['ceiling_1thread_gbps']:.1f} GB/s on one; core clock "
        f"{res['core_clock_ghz']:.2f} GHz")
    figs, pcts = res["figures"], res["percent"]

    def put(name: str, tier: str, gbps: float, pct: float) -> None:
        figs.setdefault(name, {})[tier] = gbps
        pcts.setdefault(name, {})[tier] = pct

    for tier in tiers:
        ex = CpuMoeExecutor(threads, isa=tier)
        top, median = dot_l2(ex)
        one = res["ceiling_1thread_gbps"]
        put("dot K=2048, 1 core, L2", tier, top, 100 * top / one)
        put("  (median of the runs)", tier, median, 100 * median / one)
        f = dot_dram(ex, big, ceil)
        put(f"dot K=2048, {threads} thr, DRAM", tier, f.gbps, f.pct)
        log(f"  {tier}: dots done ({time.time() - t0:.0f} s)")
    for shape in SHAPES:
        lb = LayerBench(shape, budget)
        res.setdefault("layers", {})[shape.label] = {
            "model": shape.model, "experts": shape.experts, "layers_cycled": lb.layers,
            "experts_allocated_per_layer": lb.experts}
        for tier in tiers:
            ex = CpuMoeExecutor(threads, isa=tier)
            for T in BATCHES:
                f = lb.gbps(ex, T, ceil)
                put(f"{shape.label} bs={T}", tier, f.gbps, f.pct)
        log(f"  {shape.label} ({shape.model}, {lb.layers} layers x {lb.experts} experts): done "
            f"({time.time() - t0:.0f} s)")
        del lb
    res["ceiling_sweeps_gbps"] = ceil.sweeps
    res["seconds"] = time.time() - t0
    return res


def format_table(res: dict) -> str:
    tiers = res["tiers"]
    head = f"{'GB/s (% of ceiling)':<28}" + "".join(f"{t:>18}" for t in tiers)
    lines = [head, "-" * len(head)]
    for name, row in res["figures"].items():
        pct = res["percent"][name]
        cells = "".join(f"{row[t]:>9.1f} ({pct[t]:>4.0f}%)" for t in tiers)
        lines.append(f"{name:<28}{cells}")
    sw = res["ceiling_sweeps_gbps"] or [res["ceiling_gbps"]]
    ghz = res["core_clock_ghz"]
    l2 = res["figures"]["dot K=2048, 1 core, L2"]
    per_cycle = ", ".join(f"{t} {l2[t] / ghz:.1f}" for t in tiers)
    lines += [
        f"1-core L2 rows: best and median of {L2_TRIALS} runs of ~{L2_RUN_SECONDS * 1e3:.0f} ms, "
        f"% of one core's streaming read ({res['ceiling_1thread_gbps']:.1f} GB/s); "
        f"B/cycle at the measured {ghz:.2f} GHz: {per_cycle}",
        f"other rows: best run, % = best run / the higher of the ceiling sweeps just before and "
        f"after it; read ceiling on {res['threads']} threads: {res['ceiling_gbps']:.1f} GB/s at "
        f"the start (prefetch {res['ceiling_prefetch'][0]} B into L1, "
        f"{res['ceiling_prefetch'][1]} B into L2), {len(sw)} paired sweeps "
        f"{min(sw):.0f}-{max(sw):.0f} GB/s (median {sorted(sw)[len(sw) // 2]:.0f}); "
        f"{res['seconds']:.0f} s",
    ]
    return "\n".join(lines)


def main(threads: int | None, isa: str | None, json_path: str | None) -> int:
    res = run_bench(threads, isa)
    print(format_table(res))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)
    return 0
