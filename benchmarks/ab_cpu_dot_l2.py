"""A/B of the 1-core L2 dot per format (bench_cpu_dot_l2.py's figure), builds alternated.

    python benchmarks/ab_cpu_dot_l2.py HEAD WORKTREE [--formats Q4_K,Q6_K,nvfp4] [--rounds 6] \
        [--k 2048,768]

Builds each variant's extension as ab_cpu_moe.py does (a git revision, or WORKTREE), then runs
one child process per variant per round, the order reversed every other round, each measuring
cpu_bench.dot_l2 (a ~1 MiB matrix, K = 2048 or each of --k, one token, one core) for every
format. On a shared machine figures measured minutes apart differ by 10-20%; alternated rounds
compare the builds under the same conditions. The table: best / median over the rounds of each
round's best and median GB/s.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def child(so_dir: str, formats: list[str], isa: str | None, ks: list[int]) -> dict:
    from ab_cpu_moe import use_build

    use_build(so_dir)
    from freetoken.moe import cpu_bench as cb
    from freetoken.moe.cpu_executor import CpuMoeExecutor

    ex = CpuMoeExecutor(1, isa=isa)
    out = {}
    for fmt in formats:
        for k in ks:
            best, median = cb.dot_l2(ex, fmt, k)
            name = fmt if ks == [2048] else f"{fmt} K={k}"
            out[f"{name} best"], out[f"{name} median"] = best, median
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="*", help="REV[:NAME=VALUE...] or WORKTREE[:...]")
    ap.add_argument("--formats", default="Q4_K,Q6_K,nvfp4")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--isa", default=None)
    ap.add_argument("--k", default="2048", help="comma-separated row lengths (multiples of 256)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    formats = args.formats.split(",")
    from freetoken.moe.cpu_bench import check_l2_k

    try:
        ks = [int(k) for k in args.k.split(",")]
        for k in ks:
            check_l2_k(k)
    except ValueError as e:
        ap.error(f"--k {args.k!r}: comma-separated multiples of 256 ({e})")
    if args.child:
        print(json.dumps(child(args.child, formats, args.isa, ks)))
        return 0
    if len(args.variants) < 2:
        ap.error("give at least two variants")
    from ab_cpu_moe import alternated, build

    work = Path(tempfile.mkdtemp(prefix="ab_cpu_dot_l2_"))
    dirs = {v: build(v.split(":")[0], work) for v in args.variants}
    extra = (["--formats", args.formats, "--k", args.k]
             + (["--isa", args.isa] if args.isa else []))
    res = alternated(__file__, args.variants, dirs, extra, args.rounds)
    if res is None:
        return 1
    width = max(18, *(len(v) + 2 for v in args.variants))
    print("\nGB/s (1 core, L2) best / median".ljust(34)
          + "".join(v.rjust(width) for v in args.variants))
    for k, row in res.items():
        cells = "".join(f"{max(row[v]):.1f} / {sorted(row[v])[len(row[v]) // 2]:.1f}".rjust(width)
                        for v in args.variants)
        print(k.ljust(34) + cells)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
