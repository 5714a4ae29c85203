"""A/B of CPU MoE executor builds: the same measurements, builds alternated in one session.

    python benchmarks/ab_cpu_moe.py HEAD~1 HEAD [--rounds 3] [--batches 1,4] [--threads N]
    python benchmarks/ab_cpu_moe.py HEAD HEAD:FREETOKEN_CPU_MOE_PREFETCH_L2=0

On a shared machine the read bandwidth moves by 20-30% between runs, so figures of two builds
measured minutes apart say little. This builds each variant's `csrc` (a git revision, or
WORKTREE for the files as they are) with cmake into its own extension, then runs one child
process per variant per round, the order reversed every other round. Each child loads its
variant's extension and measures the streaming-read ceiling, one NVFP4 dot on all threads from
DRAM and the layers of `ft bench cpu-moe` at the given batches; the table gives best / median /
worst GB/s per variant. A variant `REV:NAME=VALUE:...` runs REV's build with those environment
variables. Needs cmake, a C++17 compiler and nanobind (the build tools of the extension).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build(rev: str, work: Path) -> Path:
    """The extension of `rev` (WORKTREE: the working tree) built into work/<rev>/; its folder."""
    name = rev.replace("/", "_").replace("~", "-").replace("^", "-")
    src, bld, out = work / f"src_{name}", work / f"build_{name}", work / f"so_{name}"
    if out.exists():
        return out
    src.mkdir(parents=True)
    if rev == "WORKTREE":
        shutil.copy(ROOT / "CMakeLists.txt", src)
        shutil.copytree(ROOT / "csrc", src / "csrc")
    else:
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "CMakeLists.txt", "csrc"],
                             check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=tar, check=True)
    nb = subprocess.run([sys.executable, "-m", "nanobind", "--cmake_dir"], check=True,
                        capture_output=True, text=True).stdout.strip()
    subprocess.run(["cmake", "-S", str(src), "-B", str(bld), "-DCMAKE_BUILD_TYPE=Release",
                    f"-DPython_EXECUTABLE={sys.executable}", f"-Dnanobind_DIR={nb}"],
                   check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(bld), "-j", str(os.cpu_count() or 2)], check=True,
                   capture_output=True)
    out.mkdir()
    for so in glob.glob(str(bld / "**" / "_cpu_moe*.so"), recursive=True):
        shutil.copy(so, out)
    return out


def use_build(so_dir: str) -> None:
    """Load the extension built in so_dir as freetoken._cpu_moe (a child process's first
    step, before anything imports the installed one)."""
    import importlib.util

    path = glob.glob(os.path.join(so_dir, "_cpu_moe*.so"))[0]
    spec = importlib.util.spec_from_file_location("freetoken._cpu_moe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    import freetoken

    sys.modules["freetoken._cpu_moe"] = mod
    freetoken._cpu_moe = mod


def child(so_dir: str, threads: int | None, batches: list[int], budget: int, calls: int,
          isa: str | None, l2: bool = False) -> dict:
    """Measurements with the extension in so_dir (loaded as freetoken._cpu_moe)."""
    use_build(so_dir)
    import torch

    from freetoken.moe import cpu_bench as cb
    from freetoken.moe.cpu_executor import CpuMoeExecutor, default_threads, make_bank

    th = threads or default_threads()
    ex = CpuMoeExecutor(th, isa=isa)

    def dram() -> dict:  # the ceiling (the dots' prefetch setting) around the DRAM dot
        big = cb.nvfp4_bank(1, budget // 1152, 2048, 3)
        bank, x = make_bank(big, "w"), torch.randn(2048)

        def dot() -> float:
            return big.nbytes() / ex._ex.time_dot(bank, 0, x.data_ptr(), 1, th) / 1e9

        def ceiling() -> float:
            return cb.ceiling(ex, big.data, th, ((4096, 16384),), passes=3)

        dot()
        res = {"ceiling": ceiling(), "dram dot": max(dot() for _ in range(3))}
        res["ceiling after"] = ceiling()
        return res

    out = {}
    if l2:  # the 1-core L2 dot: best and median of its short runs
        best, median = cb.dot_l2(CpuMoeExecutor(1, isa=isa))
        out["dot 1 core L2"], out["dot 1 core L2 median"] = best, median
    out.update(dram())
    for shape in cb.SHAPES:
        lb = cb.LayerBench(shape, budget)
        for T in batches:
            xs, o = torch.randn(T, shape.hidden), torch.empty(T, shape.hidden)
            best = 0.0
            for seed in range(3):
                ids, route, nbytes = lb.routing(calls, T, seed)
                best = max(best, nbytes / lb.time_forward(ex, xs, o, ids, route) / 1e9)
            out[f"{shape.label} bs={T}"] = best
        del lb
    # the layer in cache: the fixed cost of a call
    lb = cb.LayerBench(cb.FIXED_COST_SHAPE, cb.FIXED_COST_BUDGET)
    H = cb.FIXED_COST_SHAPE.hidden
    xs, o = torch.randn(1, H), torch.empty(1, H)
    ids, route, nbytes = lb.routing(calls * 4, 1, 0)
    lb.time_forward(ex, xs, o, ids, route)
    out[f"{cb.FIXED_COST_SHAPE.label} in cache bs=1"] = max(
        nbytes / lb.time_forward(ex, xs, o, ids, route) / 1e9 for _ in range(3))
    return out


def alternated(script: str, variants: list[str], dirs: dict, extra: list[str],
               rounds: int) -> dict | None:
    """`script --child DIR extra` once per variant per round (its build's directory; the
    variant's NAME=VALUE switches in its environment), the order reversed every other round;
    each run prints a JSON {figure: value} last. {figure: {variant: [values]}}, or None after
    a run that failed (its stderr printed)."""
    res: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in range(rounds):
        for v in variants if r % 2 == 0 else variants[::-1]:
            env = dict(os.environ, **dict(e.split("=", 1) for e in v.split(":")[1:]))
            run = subprocess.run([sys.executable, script, "--child", str(dirs[v])] + extra,
                                 capture_output=True, text=True, env=env)
            if run.returncode:
                print(f"{v}: failed\n{run.stderr[-3000:]}")
                return None
            figs = json.loads(run.stdout.strip().splitlines()[-1])
            for k, g in figs.items():
                res[k][v].append(g)
            print(f"round {r} {v}: " + ", ".join(f"{k} {g:.1f}" for k, g in figs.items()),
                  flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="*", help="REV[:NAME=VALUE...] or WORKTREE[:...]")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1", help="comma-separated layer batch sizes")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--isa", default=None, help="a tier name (default: the best)")
    ap.add_argument("--budget-mib", type=int, default=2048, help="DRAM bytes per measurement")
    ap.add_argument("--calls", type=int, default=600, help="layer calls per run")
    ap.add_argument("--l2", action="store_true", help="also the 1-core L2 dot (best, median)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        print(json.dumps(child(args.child, args.threads, batches, args.budget_mib << 20,
                               args.calls, args.isa, args.l2)))
        return 0
    if len(args.variants) < 2:
        ap.error("give at least two variants")
    work = Path(tempfile.mkdtemp(prefix="ab_cpu_moe_"))
    dirs = {v: build(v.split(":")[0], work) for v in args.variants}
    passthrough = ["--batches", args.batches, "--budget-mib", str(args.budget_mib), "--calls",
                   str(args.calls)] + (["--threads", str(args.threads)] if args.threads else []) \
        + (["--isa", args.isa] if args.isa else []) + (["--l2"] if args.l2 else [])
    res = alternated(__file__, args.variants, dirs, passthrough, args.rounds)
    if res is None:
        return 1
    width = max(24, *(len(v) + 2 for v in args.variants))
    print("\nGB/s best / median / worst".ljust(30) + "".join(v.rjust(width) for v in args.variants))
    for k, row in res.items():
        cells = "".join(f"{max(row[v]):.1f} / {sorted(row[v])[len(row[v]) // 2]:.1f} / "
                        f"{min(row[v]):.1f}".rjust(width) for v in args.variants)
        print(k.ljust(30) + cells)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
