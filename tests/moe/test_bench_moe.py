"""`ft bench decode --moe-backends ... --moe-cache-rates ...` on the CPU (standing in as the
device) with the tiny dummy MoE: one model load, a row per backend x rate x batch with the
expert-cache counters of its timed steps, and the flags it replaces refused beside it.

Counter truths: the cpu backend never fetches; offload never computes on the CPU; every row's
hit rate is a fraction; with 2 layers of 8 experts top-2 a step routes to between 1 and 2
distinct experts a layer per token, so fetched + cpu per step (the misses) is at most
2 layers x min(8, 2B) experts. No ft bench bw profile with PCIe figures exists here, so the
ceiling is absent rather than invented.
"""

from __future__ import annotations

import json

import pytest
import torch

from freetoken.cli import main


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _no_profile(monkeypatch, tmp_path):
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "cache"))


def _bench(tmp_path, *extra: str) -> int:
    return main(["bench", "decode", "--model", "tiny-qwen3-moe", "--dummy-weights",
                 "--dummy-format", "q4_k", "--no-show-progress", "--torch-threads", "1",
                 "--device", "cpu", "--batch", "1,2", "--tokens", "3", "--prompt-len", "8",
                 "--warmup", "1", "--json", str(tmp_path / "b.json"), *extra])


def test_sweep_rows_and_counters(tmp_path):
    assert _bench(tmp_path, "--moe-backends", "offload,cpu", "--moe-cache-rates", "0.25,0.5") == 0
    rows = json.loads((tmp_path / "b.json").read_text())["decode"]
    assert [(r["moe_backend"], r["moe_cache_rate"], r["batch"]) for r in rows] == [
        (b, rate, n) for b in ("offload", "cpu") for rate in (0.25, 0.5) for n in (1, 2)]
    for r in rows:
        assert 0 <= r["hit_rate"] <= 1
        assert r["fetched_per_step"] + r["cpu_per_step"] <= 2 * min(8, 2 * r["batch"])
        assert r["ceiling_tokens_per_s"] is None
        if r["moe_backend"] == "cpu":
            assert r["fetched_per_step"] == 0
        else:
            assert r["cpu_per_step"] == 0


def test_sweep_stops_each_runs_cpu_threads(tmp_path, monkeypatch):
    """Each run of the sweep stops its hand-off worker and lets its executor go before the next
    run starts its own (on the H200 a cpu run measured after a hybrid one in the same process
    decoded at a quarter of its speed alone): after the sweep no run's worker is left."""
    from freetoken.moe import expert_cache

    made = []
    init = expert_cache.ExpertCache.__init__

    def spy(self, *a, **kw):
        init(self, *a, **kw)
        made.append(self)

    monkeypatch.setattr(expert_cache.ExpertCache, "__init__", spy)
    assert _bench(tmp_path, "--moe-backends", "hybrid,cpu", "--moe-cache-rates", "0.25") == 0
    assert len(made) == 2
    for cache in made:
        assert cache._handoff is None and cache._executor is None


def test_sweep_refuses_the_flags_it_replaces(tmp_path):
    assert _bench(tmp_path, "--moe-backends", "cpu", "--moe-cache-rates", "0.5",
                  "--moe-backend", "hybrid") == 1
    assert _bench(tmp_path, "--moe-backends", "cpu") == 1
    assert _bench(tmp_path, "--moe-backends", "fused", "--moe-cache-rates", "0.5") == 1
