"""One core's CPU MoE dot per expert format, weights in L2: which formats are compute bound.

    python benchmarks/bench_cpu_dot_l2.py [--formats nvfp4,Q4_K,Q6_K,Q8_0] [--isa TIER]

`ft bench cpu-moe` reports this figure for NVFP4 only. One row of about 1 MiB (K = 2048) of
each format against one token, `--iters` dots a run, `--runs` runs; GB/s of weights and block
scales. A format whose figure times the executor's threads is under the host's read ceiling
cannot read at that ceiling: its kernel, not memory, bounds the CPU backend.
"""

from __future__ import annotations

import argparse

import torch

from freetoken.moe import cpu_bench
from freetoken.moe.cpu_executor import CpuMoeExecutor

K = 2048
ROWS_1MIB = {"nvfp4": 896, "Q4_K": 896, "Q6_K": 640, "Q8_0": 480}  # rows of about 1 MiB


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", default="nvfp4,Q4_K,Q6_K,Q8_0")
    p.add_argument("--isa", default=None, help="executor tier (default: the best this CPU has)")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--runs", type=int, default=7)
    a = p.parse_args()
    ex = CpuMoeExecutor(1, isa=a.isa)
    print(f"{'format':8s} {'MiB':>5s} {'best GB/s':>10s} {'median':>8s}   (1 core, L2)")
    for fmt in a.formats.split(","):
        if fmt not in ROWS_1MIB:
            raise SystemExit(f"--formats: {fmt!r} is not one of {', '.join(ROWS_1MIB)}")
        n = ROWS_1MIB[fmt]
        w = cpu_bench.nvfp4_bank(1, n, K, 7) if fmt == "nvfp4" else \
            cpu_bench.make_weights(fmt, 1, n, K, 7)
        x = torch.randn(K)
        bank = cpu_bench.make_bank(w, "w")
        ex._ex.time_dot(bank, 0, x.data_ptr(), 50, 1)  # warm: the row into L2
        runs = sorted(w.nbytes() * a.iters / ex._ex.time_dot(bank, 0, x.data_ptr(), a.iters, 1)
                      / 1e9 for _ in range(a.runs))
        print(f"{fmt:8s} {w.nbytes() / 2**20:5.2f} {runs[-1]:10.1f} {runs[len(runs) // 2]:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
