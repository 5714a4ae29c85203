"""`ft bench bw`: the two ways a missing expert reaches a result, measured on this machine.

Per expert format, in one run (a layer shape of the seed's headline model, 2048x512 top-8):
- cpu: the CPU executor's expert GB/s (whole layers at batch 1, random routing, experts cycled
  from a host pool larger than the last-level cache; bytes of the experts touched / time), the
  median of ROUNDS rounds; rounds that disagree by more than SPREAD_WARN are reported: a
  machine whose memory bandwidth moves during the run gives a split that fits none of its
  moments (three back-to-back runs on one H200 host agreed within 15%). A machine slow for the
  whole run is not caught this way (one H200 host measured its executor at 44 GB/s throughout,
  then decoded at the speed of 77);
- pcie: the GB/s of expert-sized host-to-device copies (each expert's w13, w2 and block
  scales, from pinned host banks into random slots of a device pool) on a copy stream;
- fill: the same experts fetched by the slot-fill kernel, as decode steps fetch them inside a
  CUDA graph (the GPU's threads read the pinned banks; no copy engine);
- both: each of the two fetch paths and the executor at once (the executor in a thread, it
  releases the GIL; copies on the main thread), since they share the host's memory bandwidth;
  the medians of ROUNDS rounds too (`both_rounds`), their executor spread reported alike;
- the CPU time other guests of the host took during each format's run (steal,
  engine/host_noise.py), kept in the profile and reported above policy.STEAL_WARN.
q* = B_fetch / (B_fetch + B_cpu) from the fill kernel's "both" figures (the copy engine's
where no fill was measured) is what the hybrid backend fetches of its misses; the fill is also
measured beside the executor's jobs of four tokens (about 30 experts, which it reads faster
than the 8 of one token), and from both job sizes the hybrid backend fits its split by miss
count (policy.SplitModel). The figures go
to a profile (policy.profile_path(), keyed by expert format, GPU and CPU model) that
`--moe-backend auto` and hybrid read. Without a GPU only the CPU side is
measured, and the output says so.
"""

from __future__ import annotations

import json
import statistics
import threading
import time

import torch

from freetoken.engine import host_noise
from freetoken.moe.cpu_bench import LayerBench, LayerShape
from freetoken.moe.cpu_executor import CpuMoeExecutor, default_threads
from freetoken.moe.policy import (
    SPREAD_WARN,
    STEAL_WARN,
    cpu_model,
    gpu_model,
    profile_key,
    save_profiles,
)
from freetoken.moe.slot_cache import ALIGN

# --formats names -> (gate/up, down) as cpu_bench.make_weights takes them
FORMATS = {"nvfp4": ("nvfp4", "nvfp4"), "q4_k": ("Q4_K", "Q4_K"), "q4_k_m": ("Q4_K", "Q6_K"),
           "q8_0": ("Q8_0", "Q8_0")}
SHAPE = (2048, 512, 8, 256)  # hidden, expert FFN, top-k, experts: Qwen3.6-35B-A3B's layers
MiB = 1 << 20
ROUNDS = 3  # of the executor alone


def _parse_formats(text: str) -> list[str]:
    out = [f.strip().lower() for f in text.split(",") if f.strip()]
    bad = [f for f in out if f not in FORMATS]
    if bad or not out:
        raise ValueError(f"--formats: unknown {', '.join(bad) or '(none)'}; choose from "
                         f"{', '.join(FORMATS)}")
    return out


class CpuSide:
    """The executor on a LayerBench pool, layer calls of `tokens` tokens: GB/s of experts over
    `seconds`; `experts` the mean distinct experts of a call so far."""

    def __init__(self, lb: LayerBench, ex: CpuMoeExecutor, tokens: int = 1):
        self.lb, self.ex, self.tokens = lb, ex, tokens
        self.x = torch.randn(tokens, lb.shape.hidden)
        self.out = torch.empty(tokens, lb.shape.hidden)
        self.seed = 0
        self._calls = self._touched = 0

    @property
    def experts(self) -> float:
        return self._touched / max(self._calls, 1)

    def run(self, seconds: float, stop: threading.Event | None = None) -> float:
        done, t_all, iters = 0, 0.0, 16
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end and not (stop is not None and stop.is_set()):
            self.seed += 1
            ids, route, nbytes = self.lb.routing(iters, self.tokens, self.seed)
            t_all += self.lb.time_forward(self.ex, self.x, self.out, ids, route)
            done += nbytes
            self._calls += iters
            self._touched += nbytes // self.lb.expert_bytes
        return done / max(t_all, 1e-9) / 1e9


class PcieSide:
    """Expert-sized copies from the LayerBench's host banks (registered as pinned) into a
    device pool of slots, on a copy stream."""

    def __init__(self, lb: LayerBench, slots: int = 64):
        self.parts = [t for t in (lb.w13.data, lb.w13.scales, lb.w2.data, lb.w2.scales)
                      if t is not None]
        cudart = torch.cuda.cudart()
        for t in self.parts:  # the executor's own huge-page memory, as host banks are
            cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        self.part_bytes = [t[0].numel() * t.element_size() for t in self.parts]  # per expert
        self.expert_bytes = sum(self.part_bytes)
        self.n = lb.w13.data.shape[0]
        self.stream = torch.cuda.Stream()
        self.gen = torch.Generator().manual_seed(1)
        self._make_pool(slots)

    def _make_pool(self, slots: int) -> None:
        """The device slots: one tensor per part."""
        self.pool = [torch.empty((slots, *t.shape[1:]), dtype=t.dtype, device="cuda")
                     for t in self.parts]

    def run(self, seconds: float, stop: threading.Event | None = None) -> float:
        copies, t0 = 0, time.perf_counter()
        with torch.cuda.stream(self.stream):
            while time.perf_counter() - t0 < seconds:
                experts = torch.randint(0, self.n, (32,), generator=self.gen).tolist()
                for i, e in enumerate(experts):
                    for src, dst in zip(self.parts, self.pool):
                        dst[i % dst.shape[0]].copy_(src[e], non_blocking=True)
                copies += len(experts)
                self.stream.synchronize()
        t = time.perf_counter() - t0
        if stop is not None:
            stop.set()
        return copies * self.expert_bytes / t / 1e9

    def close(self) -> None:
        cudart = torch.cuda.cudart()
        for t in self.parts:
            cudart.cudaHostUnregister(t.data_ptr())


class FillSide(PcieSide):
    """The same experts fetched the way a decode step fetches them inside a CUDA graph: the
    slot fill kernel (kernels/triton/handoff.py), the GPU's own threads reading the pinned
    banks, 32 experts per launch into a pool of whole slots."""

    def _make_pool(self, slots: int) -> None:
        """Whole slots as the slot cache lays them out: each part at an ALIGN boundary."""
        from freetoken.kernels.triton.handoff import fill_table

        offs, o = [], 0
        for nbytes in self.part_bytes:
            offs.append(o)
            o += -(-nbytes // ALIGN) * ALIGN
        self.pool = torch.empty(slots, o, dtype=torch.uint8, device="cuda")
        self.table, self.vec = fill_table(list(zip(self.parts, offs, self.part_bytes)), "cuda")
        self.max_words = max(self.part_bytes) // 4
        self.slots = torch.arange(32, device="cuda") % slots

    def run(self, seconds: float, stop: threading.Event | None = None) -> float:
        from freetoken.kernels.triton.handoff import fill

        copies, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            experts = torch.randint(0, self.n, (32,), generator=self.gen).cuda()
            fill(torch.stack([experts, self.slots]), self.pool, self.table, self.max_words,
                 self.vec)
            torch.cuda.synchronize()
            copies += 32
        t = time.perf_counter() - t0
        if stop is not None:
            stop.set()
        return copies * self.expert_bytes / t / 1e9


def both(cpu: CpuSide, pcie: PcieSide, seconds: float) -> tuple[float, float]:
    """(cpu GB/s, pcie GB/s) while both run for `seconds`."""
    res: dict[str, float] = {}
    stop = threading.Event()
    th = threading.Thread(target=lambda: res.setdefault("cpu", cpu.run(seconds * 2, stop)))
    th.start()
    res["pcie"] = pcie.run(seconds, stop)
    th.join()
    return res["cpu"], res["pcie"]


def both_rounds(cpu: CpuSide, side: PcieSide, seconds: float) -> tuple[float, float, float]:
    """(cpu GB/s, side GB/s, spread): the medians of ROUNDS runs of `both` over `seconds` in
    all, and the spread of the executor's figures ((max - min) / median). One run of a second
    measured a transient: on an H200 host (2026-12-03) the executor beside the fill read 49
    GB/s on one-token Q4_K jobs and 85 on four-token ones, where it read 84 alone and the
    NVFP4 jobs beside the fill 97 and 112; fitted as a job's fixed cost (policy.SplitModel)
    that was 163 us against 26 for NVFP4, and the 30B Q4_K hybrid fetched 3 of 7 misses."""
    runs = [both(cpu, side, seconds / ROUNDS) for _ in range(ROUNDS)]
    c, spread = _median_spread([r[0] for r in runs])
    return c, statistics.median(r[1] for r in runs), spread


def _median_spread(figures: list[float]) -> tuple[float, float]:
    """(median, (max - min) / median) of rounds' GB/s (spread 0 where the median is 0)."""
    mid = statistics.median(figures)
    return mid, (max(figures) - min(figures)) / mid if mid > 0 else 0.0


def _fetch_path(cpu: CpuSide, side: PcieSide, seconds: float,
                cpu4: CpuSide | None = None) -> tuple[tuple[float, ...], float]:
    """((side alone, cpu while both run, side while both run) GB/s of one fetch path (after a
    short warm-up), and with cpu4 the last two again with cpu4's jobs; the largest spread of
    the executor's rounds beside the side (`both_rounds`)); the side is closed afterwards."""
    try:
        side.run(min(0.1, seconds))
        alone = side.run(seconds)
        c, s, spread = both_rounds(cpu, side, seconds)
        res = (alone, c, s)
        if cpu4 is not None:
            cpu4.run(min(0.1, seconds))
            c4, s4, spread4 = both_rounds(cpu4, side, seconds)
            res += (c4, s4)
            spread = max(spread, spread4)
        return res, spread
    finally:
        side.close()


def recommend(cpu: float, pcie: float | None) -> tuple[str, str]:
    if pcie is None:
        return "fused", ("no GPU: the CPU is the device, every expert is resident in host "
                         "memory (offload / hybrid / cpu would only add copies)")
    if pcie < 0.1 * cpu:
        return "cpu", "PCIe is a tenth of the CPU's expert bandwidth: compute misses on the CPU"
    if cpu < 0.1 * pcie:
        return "offload", "the CPU reads a tenth of PCIe's bandwidth: fetch every miss"
    return "hybrid", "both sides are useful: fetch q* of the misses, compute the rest on the CPU"


def measure(fmt: str, threads: int, budget: int, seconds: float, log=print) -> dict:
    H, inter, k, E = SHAPE
    shape = LayerShape(f"{H}x{inter} top{k} {fmt}", H, inter, k, E, "Qwen3.6-35B-A3B",
                       FORMATS[fmt])
    lb = LayerBench(shape, budget)
    h0 = host_noise.sample()
    cpu = CpuSide(lb, CpuMoeExecutor(threads))
    cpu.run(min(0.1, seconds))  # warm-up: pool wake-up, first touches
    rounds = [cpu.run(seconds / ROUNDS) for _ in range(ROUNDS)]
    mid, spread = _median_spread(rounds)
    if spread > SPREAD_WARN:
        log(f"  {fmt}: the executor's rounds disagree by {spread:.0%} "
            f"({', '.join(f'{r:.1f}' for r in rounds)} GB/s): this machine's memory bandwidth "
            "varied during the run, so q* and the ceilings may not fit it; run `ft bench bw` "
            "again on a quiet machine")
    res = {"format": fmt, "shape": shape.label, "expert_bytes": lb.expert_bytes,
           "threads": threads, "host_pool_bytes": lb.expert_bytes * lb.layers * lb.experts,
           "cpu_gbps": mid, "cpu_rounds_gbps": rounds, "cpu_spread": spread,
           "pcie_gbps": None, "cpu_both_gbps": None, "pcie_both_gbps": None}
    if torch.cuda.is_available():
        (res["pcie_gbps"], res["cpu_both_gbps"], res["pcie_both_gbps"]), spread_pcie = \
            _fetch_path(cpu, PcieSide(lb), seconds)
        # the fill again with the executor's jobs of a batch of four (policy.SplitModel: the
        # executor reads faster on larger jobs, which moves the split)
        cpu4 = CpuSide(lb, cpu.ex, 4)
        (res["fill_gbps"], res["cpu_fill_both_gbps"], res["fill_both_gbps"],
         res["cpu_fill_both_b4_gbps"], res["fill_both_b4_gbps"]), spread_fill = \
            _fetch_path(cpu, FillSide(lb), seconds, cpu4)
        res["cpu_experts_b1"], res["cpu_experts_b4"] = cpu.experts, cpu4.experts
        res["both_spread"] = max(spread_pcie, spread_fill)
        if res["both_spread"] > SPREAD_WARN:
            log(f"  {fmt}: the executor's rounds beside the copies disagree by "
                f"{res['both_spread']:.0%}: this machine's memory bandwidth varied during the "
                "run, so q* and the split may not fit it; run `ft bench bw` again on a quiet "
                "machine")
    noise = host_noise.between(h0, host_noise.sample())
    if noise is not None:
        res["steal_pct"] = noise.steal_pct
        if noise.steal_pct > STEAL_WARN:
            log(f"  {fmt}: {noise.steal_pct:.1f}% of the CPUs' time went to other guests of "
                "this host during the run (steal), so q* and the split may not fit it; run "
                "`ft bench bw` again on a quiet machine")
    # q*: decode steps fetch with the fill kernel (inside CUDA graphs), so its figure with
    # the executor running decides the split where it was measured
    b_cpu = res.get("cpu_fill_both_gbps") or res["cpu_both_gbps"] or res["cpu_gbps"]
    b_pcie = res.get("fill_both_gbps") or res["pcie_both_gbps"]
    res["q_star"] = 0.0 if b_pcie is None else b_pcie / (b_pcie + b_cpu)
    res["recommended"], res["why"] = recommend(b_cpu, b_pcie)
    log(f"  {fmt}: done")
    return res


def split_text(r: dict) -> str:
    """F of 7 and of 27 misses (a layer call at batch 1 and 4 at cache rate 0.1) under the
    profile's split (policy.SplitModel where both job sizes were measured, else q*)."""
    from freetoken.moe.policy import fetch_policy

    if r.get("pcie_both_gbps") is None:
        return "-"
    f = fetch_policy("hybrid", None, r).limits(27)
    return f"{f[7]}/{f[27]}"


def format_table(rows: list[dict]) -> str:
    def g(v):
        return f"{v:>9.1f}" if v is not None else f"{'-':>9}"

    head = (f"{'format':<8}{'expert MB':>10}{'cpu GB/s':>9}{'pcie':>9}{'cpu|both':>9}"
            f"{'pcie|both':>10}{'fill':>9}{'cpu|both':>9}{'fill|both':>10}{'cpu4|both':>10}"
            f"{'fill|cpu4':>10}{'q*':>6}{'F(7/27)':>8}  recommended")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['format']:<8}{r['expert_bytes'] / 1e6:>10.2f}{g(r['cpu_gbps'])}"
                     f"{g(r['pcie_gbps'])}{g(r['cpu_both_gbps'])} {g(r['pcie_both_gbps'])}"
                     f"{g(r.get('fill_gbps'))}{g(r.get('cpu_fill_both_gbps'))} "
                     f"{g(r.get('fill_both_gbps'))} {g(r.get('cpu_fill_both_b4_gbps'))} "
                     f"{g(r.get('fill_both_b4_gbps'))}"
                     f"{r['q_star']:>6.2f}{split_text(r):>8}  {r['recommended']}: {r['why']}")
    lines.append("pcie: copy-engine copies (prefill streaming); fill: the slot-fill kernel "
                 "(decode steps, inside CUDA graphs); cpu|both: the executor while the one "
                 "before it runs; cpu4: the executor on jobs of 4 tokens; q* from the fill "
                 "figures where measured; F(7/27): experts fetched of 7 and of 27 misses")
    return "\n".join(lines)


def run(formats: str = "nvfp4,q4_k", threads: int | None = None, budget_mb: int = 2048,
        seconds: float = 1.0, json_path: str | None = None, save: bool = True,
        log=print) -> dict:
    fmts = _parse_formats(formats)
    threads = threads or default_threads()
    gpu = gpu_model()
    log(f"ft bench bw: CPU {cpu_model()} ({threads} executor threads), GPU {gpu}; layer "
        f"{SHAPE[0]}x{SHAPE[1]} top-{SHAPE[2]} at batch 1, host pool {budget_mb} MiB per format")
    if not torch.cuda.is_available():
        log("no GPU: measuring the CPU side only (no PCIe figures; q* = 0)")
    rows = [measure(f, threads, budget_mb * MiB, seconds, log) for f in fmts]
    out = {"cpu": cpu_model(), "gpu": gpu, "threads": threads,
           "profiles": {profile_key(r["format"], gpu): r for r in rows}}
    print(format_table(rows))
    if save:
        path = save_profiles(out["profiles"])
        log(f"profile written to {path}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)
    return out
