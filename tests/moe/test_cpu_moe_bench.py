"""`ft bench cpu-moe` end to end on tiny buffers: every figure is a positive GB/s and the
table prints each tier with its share of the measured ceiling."""

from __future__ import annotations

import json
import sys

import pytest

from freetoken import cli
from freetoken.moe import cpu_bench


def test_bench_cpu_moe_small(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cpu_bench, "dram_budget", lambda: 48 << 20)
    monkeypatch.setattr(cpu_bench, "SHAPES", (cpu_bench.SHAPES[0], cpu_bench.SHAPES[-1]))
    monkeypatch.setattr(cpu_bench, "BATCHES", (1, 3))
    monkeypatch.setattr(cpu_bench, "MIN_SECONDS", 0.02)
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", "cpu-moe", "--threads", "2", "--isa", "avx2,scalar",
                   "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["tiers"][-1] == "scalar" and len(res["tiers"]) == 2
    assert res["ceiling_gbps"] > 0 and res["core_clock_ghz"] > 0
    # every DRAM run is bracketed by ceiling sweeps: 2 tiers' dots (PASSES runs) + 2 shapes x
    # 2 layer batches x LAYER_RUNS per tier, one sweep more per figure than runs
    figures = 2 * (cpu_bench.PASSES + 1) + 2 * 2 * 2 * (cpu_bench.LAYER_RUNS + 1)
    assert len(res["ceiling_sweeps_gbps"]) == figures
    assert set(res["percent"]) == set(res["figures"])
    for name, row in res["figures"].items():
        for tier in res["tiers"]:
            assert row[tier] > 0 and res["percent"][name][tier] > 0, (name, tier)
    assert set(res["figures"]) >= {"2048x512 top8 bs=1", "2048x512 top8 bs=3",
                                   "2048x512 top8 Q4_K_M bs=1", "2048x512 top8 Q4_K_M bs=3"}
    text = capsys.readouterr().out
    assert "read ceiling" in text and "%)" in text and "B/cycle" in text


def test_dot_l2_per_format(monkeypatch):
    """cpu_bench.dot_l2 (benchmarks/bench_cpu_dot_l2.py) for every format it sizes, at K = 2048
    and at short rows (K = 768): best >= median > 0; another format, or a K that is not whole
    super-blocks, is refused by name."""
    from freetoken.moe.cpu_executor import CpuMoeExecutor

    monkeypatch.setattr(cpu_bench, "L2_TRIALS", 5)
    ex = CpuMoeExecutor(1)
    for fmt in cpu_bench.L2_ROWS:
        for K in (2048, 768):
            best, median = cpu_bench.dot_l2(ex, fmt, K)
            assert best >= median > 0, (fmt, K)
    with pytest.raises(ValueError, match="Q2_K"):
        cpu_bench.dot_l2(ex, "Q2_K")
    with pytest.raises(ValueError, match="K must be a positive multiple of 256, got 300"):
        cpu_bench.dot_l2(ex, "Q4_K", 300)


def test_bench_needs_a_name(capsys):
    assert cli.main(["bench"]) == 2


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
