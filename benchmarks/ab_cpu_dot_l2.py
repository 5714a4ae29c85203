"""A/B of the 1-core L2 dot per format (bench_cpu_dot_l2.py's figure), builds alternated.

    python benchmarks/ab_cpu_dot_l2.py HEAD WORKTREE [--formats Q4_K,Q6_K,nvfp4] [--rounds 6]

Builds each variant's extension as ab_cpu_moe.py does (a git revision, or WORKTREE), then runs
one child process per variant per round, the order reversed every other round, each measuring
cpu_bench.dot_l2 (a ~1 MiB matrix, K = 2048, one token, one core) for every format. On a shared
machine figures measured minutes apart differ by 10-20%; alternated rounds compare the builds
under the same conditions. The table: best / median over the rounds of each round's best and
median GB/s.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def child(so_dir: str, formats: list[str], isa: str | None) -> dict:
    import glob
    import importlib.util

    path = glob.glob(os.path.join(so_dir, "_cpu_moe*.so"))[0]
    spec = importlib.util.spec_from_file_location("freetoken._cpu_moe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    import freetoken

    sys.modules["freetoken._cpu_moe"] = mod
    freetoken._cpu_moe = mod
    from freetoken.moe import cpu_bench as cb
    from freetoken.moe.cpu_executor import CpuMoeExecutor

    ex = CpuMoeExecutor(1, isa=isa)
    out = {}
    for fmt in formats:
        best, median = cb.dot_l2(ex, fmt)
        out[f"{fmt} best"], out[f"{fmt} median"] = best, median
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="*", help="REV[:NAME=VALUE...] or WORKTREE[:...]")
    ap.add_argument("--formats", default="Q4_K,Q6_K,nvfp4")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--isa", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    formats = args.formats.split(",")
    if args.child:
        print(json.dumps(child(args.child, formats, args.isa)))
        return 0
    if len(args.variants) < 2:
        ap.error("give at least two variants")
    from ab_cpu_moe import build

    work = Path(tempfile.mkdtemp(prefix="ab_cpu_dot_l2_"))
    dirs = {v: build(v.split(":")[0], work) for v in args.variants}
    res: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    extra = ["--formats", args.formats] + (["--isa", args.isa] if args.isa else [])
    for r in range(args.rounds):
        for v in args.variants if r % 2 == 0 else args.variants[::-1]:
            env = dict(os.environ, **dict(e.split("=", 1) for e in v.split(":")[1:]))
            run = subprocess.run([sys.executable, __file__, "--child", str(dirs[v])] + extra,
                                 capture_output=True, text=True, env=env)
            if run.returncode:
                print(f"{v}: failed\n{run.stderr[-3000:]}")
                return 1
            figs = json.loads(run.stdout.strip().splitlines()[-1])
            for k, g in figs.items():
                res[k][v].append(g)
            print(f"round {r} {v}: " + ", ".join(f"{k} {g:.1f}" for k, g in figs.items()),
                  flush=True)
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
