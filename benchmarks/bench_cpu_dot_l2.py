"""One core's CPU MoE dot per expert format, weights in L2: which formats are compute bound.

    python benchmarks/bench_cpu_dot_l2.py [--formats nvfp4,Q4_K,Q5_K,Q6_K,Q8_0] [--isa TIER] \
        [--k 768]

`ft bench cpu-moe` reports this figure (`cpu_bench.dot_l2`) for NVFP4 only; this runs it for
each format: a matrix of about 1 MiB (K = 2048, or --k) against one token, best and median GB/s of
weights and block scales over the short runs. A format whose figure times the executor's
threads is under the host's read ceiling cannot read at that ceiling: its kernel, not memory,
bounds the CPU backend.
"""

from __future__ import annotations

import argparse

from freetoken.moe import cpu_bench
from freetoken.moe.cpu_executor import CpuMoeExecutor


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", default=",".join(cpu_bench.L2_ROWS),
                   help=f"comma-separated, of {', '.join(cpu_bench.L2_ROWS)}")
    p.add_argument("--isa", default=None, help="executor tier (default: the best this CPU has)")
    p.add_argument("--k", type=int, default=2048, help="values a row (a multiple of 256)")
    a = p.parse_args()
    try:
        cpu_bench.check_l2_k(a.k)
    except ValueError as e:
        p.error(f"--k: {e}")
    formats = a.formats.split(",")
    for fmt in formats:
        if fmt not in cpu_bench.L2_ROWS:
            p.error(f"--formats: {fmt!r} is not one of {', '.join(cpu_bench.L2_ROWS)}")
    ex = CpuMoeExecutor(1, isa=a.isa)
    print(f"{'format':8s} {'best GB/s':>10s} {'median':>8s}   (1 core, L2, "
          f"{cpu_bench.L2_TRIALS} runs, K = {a.k}, tier {ex.isa})")
    for fmt in formats:
        best, median = cpu_bench.dot_l2(ex, fmt, a.k)
        print(f"{fmt:8s} {best:10.1f} {median:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
