"""`ft bench bw` on this machine (no GPU here: the CPU side only) and the profile it leaves
for `--moe-backend auto` / hybrid.

Reference for the byte accounting: the formats' definitions (gguf.GGML_QUANT_SIZES for the
GGUF blocks; NVFP4 = 4-bit codes + one E4M3 byte per 16 values), not our code.
"""

from __future__ import annotations

import json
import sys

import gguf
import pytest
import torch

from freetoken.cli import main as ft_main
from freetoken.moe import bw_bench
from freetoken.moe.policy import find_profile, load_profiles, profile_key

H, INTER = bw_bench.SHAPE[0], bw_bench.SHAPE[1]


def _gguf_bytes(name: str, n: int, k: int) -> int:
    bs, bb = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    return n * k // bs * bb


EXPERT_BYTES = {
    "nvfp4": 3 * H * INTER // 2 + 3 * H * INTER // 16,
    "q4_k_m": _gguf_bytes("Q4_K", 2 * INTER, H) + _gguf_bytes("Q6_K", H, INTER),
}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_cli_writes_json_and_profile(cache, capsys):
    out = cache / "bw.json"
    rc = ft_main(["bench", "bw", "--formats", "nvfp4,q4_k_m", "--budget-mb", "24",
                  "--seconds", "0.05", "--threads", "1", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert set(r["format"] for r in res["profiles"].values()) == {"nvfp4", "q4_k_m"}
    for r in res["profiles"].values():
        assert r["expert_bytes"] == EXPERT_BYTES[r["format"]]
        assert r["cpu_gbps"] > 0
        if sys.platform.startswith("linux"):  # the host's steal during the run
            assert 0.0 <= r["steal_pct"] <= 100.0
        assert r["format"] in printed and "recommended" in printed
    saved = load_profiles()
    assert saved == res["profiles"]
    if torch.cuda.is_available():
        assert find_profile("nvfp4") == saved[profile_key("nvfp4")]
        return
    assert "CPU side only" in printed
    for r in res["profiles"].values():
        assert r["pcie_gbps"] is None and r["q_star"] == 0.0 and r["recommended"] == "fused"
    assert find_profile("nvfp4") is None  # no PCIe figures: no split to take from it


def test_profile_with_pcie_sets_q_star(cache):
    """A profile measured on a GPU machine (the figures of FACTS.md) drives the hybrid split."""
    from freetoken.moe.policy import fetch_policy, save_profiles

    entry = {"format": "nvfp4", "cpu_both_gbps": 95.0, "pcie_both_gbps": 44.0,
             "q_star": 44.0 / 139.0, "recommended": "hybrid"}
    save_profiles({profile_key("nvfp4"): entry})
    prof = find_profile("nvfp4")
    assert prof == entry
    policy = fetch_policy("hybrid", None, prof)
    assert int(policy(torch.tensor(8))) == 2  # floor(0.317 * 9): 2/44 < 5/95 < 3/44
    assert int(fetch_policy("hybrid", 2, prof)(torch.tensor(8))) == 2


def test_rounds_that_disagree_are_reported(monkeypatch):
    """The executor's figure is the median of its rounds; a spread above SPREAD_WARN is said
    (a split measured while the machine's bandwidth moved fits none of its moments)."""
    if torch.cuda.is_available():
        pytest.skip("the PCIe sides would run the executor again (CPU-only check)")
    for figures, warned in (([100.0, 60.0, 100.0], True), ([100.0, 95.0, 104.0], False)):
        left = [1.0, *figures]  # the warm-up round first
        monkeypatch.setattr(bw_bench.CpuSide, "run",
                            lambda self, seconds, stop=None, left=left: left.pop(0))
        logs: list[str] = []
        res = bw_bench.measure("nvfp4", 1, 24 * bw_bench.MiB, 0.03, log=logs.append)
        assert res["cpu_rounds_gbps"] == figures and not left
        assert res["cpu_gbps"] == sorted(figures)[1]
        assert res["cpu_spread"] == pytest.approx((max(figures) - min(figures)) / 100.0)
        said = [m for m in logs if "rounds disagree" in m]
        assert bool(said) == warned
        if warned:
            assert "100.0, 60.0, 100.0 GB/s" in said[0]


def test_both_figures_are_medians_of_rounds(monkeypatch):
    """Each "both" figure (executor and fetch path at once) is the median of ROUNDS runs, so
    one transient run does not set the split; the executor's spread over them is returned
    (the largest of the two job sizes') and the policy names it."""
    from freetoken.moe.policy import fetch_policy

    runs = [(100.0, 40.0), (50.0, 41.0), (98.0, 39.0),  # one-token jobs: one slow run
            (120.0, 38.0), (121.0, 38.5), (119.0, 37.0)]  # four-token jobs
    monkeypatch.setattr(bw_bench, "both", lambda cpu, side, seconds: runs.pop(0))

    class Side:
        closed = False

        def run(self, seconds, stop=None):
            return 44.0

        def close(self):
            Side.closed = True

    (alone, c1, f1, c4, f4), spread = bw_bench._fetch_path(None, Side(), 0.03, cpu4=Side())
    assert not runs and Side.closed
    assert (alone, c1, f1, c4, f4) == (44.0, 98.0, 40.0, 120.0, 38.0)
    assert spread == pytest.approx(50.0 / 98.0)
    why = fetch_policy("hybrid", None, {"q_star": 0.3, "both_spread": spread}).why
    assert "51% apart" in why


def test_a_run_beside_other_guests_is_reported(monkeypatch):
    """CPU time stolen by other guests of the host during a format's run (above STEAL_WARN)
    is said by the bench and kept in the profile, whose policy says it again; below it,
    neither."""
    from freetoken.engine import host_noise
    from freetoken.moe.policy import STEAL_WARN, fetch_policy

    if torch.cuda.is_available():
        pytest.skip("the PCIe sides would run the executor again (CPU-only check)")
    for steal, warned in ((STEAL_WARN * 3, True), (STEAL_WARN / 4, False)):
        monkeypatch.setattr(host_noise, "between",
                            lambda a, b, s=steal: host_noise.HostNoise(s, 0))
        logs: list[str] = []
        res = bw_bench.measure("nvfp4", 1, 24 * bw_bench.MiB, 0.03, log=logs.append)
        assert res["steal_pct"] == steal
        assert any("went to other guests" in m for m in logs) == warned
        why = fetch_policy("hybrid", None, dict(res, q_star=0.3)).why
        assert ("other guests of this host took" in why) == warned


def test_hybrid_policy_names_a_busy_profile():
    """A profile whose executor rounds disagreed (ft bench bw beside other work) still sets
    q*, and the policy's reason, logged when the engine starts, says the profile is suspect;
    a quiet one's does not."""
    from freetoken.moe.policy import SPREAD_WARN, fetch_policy

    quiet = {"q_star": 0.37, "cpu_spread": SPREAD_WARN / 2}
    busy = {"q_star": 0.93, "cpu_spread": 0.32}
    assert "varied" not in fetch_policy("hybrid", None, quiet).why
    why = fetch_policy("hybrid", None, busy).why
    assert "q* = 0.93" in why and "32% apart" in why and "ft bench bw" in why
    assert fetch_policy("hybrid", None, {"q_star": 0.37}).q == 0.37  # older profiles


def test_unknown_format_is_named(cache):
    with pytest.raises(ValueError, match="unknown mxfp9"):
        bw_bench.run("nvfp4,mxfp9", save=False)


def test_recommendation():
    assert bw_bench.recommend(100.0, None)[0] == "fused"
    assert bw_bench.recommend(100.0, 5.0)[0] == "cpu"
    assert bw_bench.recommend(5.0, 100.0)[0] == "offload"
    assert bw_bench.recommend(95.0, 44.0)[0] == "hybrid"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))
