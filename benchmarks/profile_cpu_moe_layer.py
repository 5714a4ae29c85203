"""Where a CPU MoE layer's time goes, per executor thread (the layers of `ft bench cpu-moe`).

    python benchmarks/profile_cpu_moe_layer.py [--shape 2048x512] [--batch 1] [--threads N]

Runs one of the benchmark's layer shapes from DRAM (cycling through enough layers to pass the
last-level cache) with the executor's time accounting on, and prints per thread the
microseconds per layer call from the pool run's start to its first item, in gate/up dots,
GLU + down-input quant, waiting (for the input or an expert's GLU output), down dots, output
reductions, after its last item, and the rest (claiming work, the profiler's clock reads),
plus the GB/s of the run. `--shape 256x64` is a layer whose experts stay in cache: its call
time is the executor's fixed cost per layer (routing, waking the pool, the end of the run).
"""

from __future__ import annotations

import argparse
import sys

import torch

from freetoken.moe import cpu_bench
from freetoken.moe.cpu_executor import CpuMoeExecutor, default_threads


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="2048x512",
                    help="2048x512 | 2560x640 | 2816x704 | 2048x512-Q4_K_M | 256x64")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--isa", default=None, help="a tier name (default: the best)")
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args(argv)
    shapes = {s.label.split()[0] + ("-" + s.label.split()[-1] if s.formats[0] != "nvfp4" else ""): s
              for s in cpu_bench.SHAPES}
    shapes["256x64"] = cpu_bench.FIXED_COST_SHAPE
    if args.shape not in shapes:
        ap.error(f"--shape must be one of {', '.join(shapes)}")
    ex = CpuMoeExecutor(args.threads or default_threads(), isa=args.isa)
    budget = cpu_bench.FIXED_COST_BUDGET if args.shape == "256x64" else cpu_bench.dram_budget()
    lb = cpu_bench.LayerBench(shapes[args.shape], budget)
    T = args.batch
    x, out = torch.randn(T, lb.shape.hidden), torch.empty(T, lb.shape.hidden)
    ids, route, nbytes = lb.routing(args.calls, T, 1)

    def run() -> float:
        return lb.time_forward(ex, x, out, ids, route)

    run()  # warm-up
    ex.profile_layers(True)
    seconds = run()
    prof = ex.layer_profile()
    ex.profile_layers(False)
    us = 1e6
    print(f"{args.shape} bs={T} on {ex.num_threads} threads ({ex.isa}): "
          f"{nbytes / seconds / 1e9:.1f} GB/s, {seconds / args.calls * us:.1f} us per layer call, "
          f"pool run {prof['span'] * us:.1f} us")
    cols = ("start", "gate_up", "glu", "wait", "down", "reduce", "end", "other")
    print(f"{'thread':>6}" + "".join(f"{c:>9}" for c in cols) + f"{'items':>7}")
    for i, t in enumerate(prof["threads"]):
        print(f"{i:>6}" + "".join(f"{t[c] * us:>9.1f}" for c in cols) + f"{t['items']:>7.1f}")
    n = len(prof["threads"])
    mean = {c: sum(t[c] for t in prof["threads"]) / n for c in cols}
    print(f"{'mean':>6}" + "".join(f"{mean[c] * us:>9.1f}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
