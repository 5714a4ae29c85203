"""benchmarks/ab_cpu_moe.py's measuring child, run on the installed extension with tiny buffers:
it loads the extension from a folder and reports every figure as a positive GB/s."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from freetoken import _cpu_moe
from freetoken.moe import cpu_bench

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "ab_cpu_moe.py"


def test_ab_child_measures_with_the_extension_it_is_given():
    ext_dir = str(Path(_cpu_moe.__file__).parent)
    run = subprocess.run([sys.executable, str(SCRIPT), "--child", ext_dir, "--budget-mib", "48",
                          "--calls", "4", "--threads", "2", "--batches", "1,2", "--l2"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    figs = json.loads(run.stdout.strip().splitlines()[-1])
    layers = {f"{s.label} bs={T}" for s in cpu_bench.SHAPES for T in (1, 2)}
    fixed = {"256x64 top8 in cache bs=1"}  # the fixed cost per call
    l2 = {"dot 1 core L2", "dot 1 core L2 median"}
    assert set(figs) == {"ceiling", "dram dot", "ceiling after"} | layers | fixed | l2
    assert all(g > 0 for g in figs.values()), figs


def test_ab_needs_two_variants():
    run = subprocess.run([sys.executable, str(SCRIPT), "HEAD"], capture_output=True, text=True)
    assert run.returncode == 2 and "two variants" in run.stderr
