"""The executor's per-thread time accounting: it changes no result, accounts every work unit
once, and never accounts more time to a thread than its layers' pool runs lasted."""

from __future__ import annotations

import sys

import pytest
import torch
from cpu_moe_cases import random_nvfp4

from freetoken.moe.cpu_executor import CpuMoeExecutor


def test_profile_accounts_every_unit_and_changes_nothing():
    gen = torch.Generator().manual_seed(0)
    E, H, inter, T, k = 8, 256, 128, 3, 4
    w13, w2 = random_nvfp4(gen, E, 2 * inter, H), random_nvfp4(gen, E, H, inter)
    scales = torch.ones(E, 4)
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    route = torch.full((T, k), 1.0 / k)
    ex = CpuMoeExecutor(3)
    plain = ex.forward(x, ids, route, w13, w2, scales)
    ex.profile_layers(True)
    calls = 5
    for _ in range(calls):
        assert torch.equal(ex.forward(x, ids, route, w13, w2, scales), plain)
    prof = ex.layer_profile()
    ex.profile_layers(False)
    assert prof["calls"] == calls and len(prof["threads"]) == 3 and prof["span"] > 0
    # items (executor.cpp, slot_split): per phase, one slot per thread of every active
    # expert's rows, each slot cut into units of ~32 KiB; these slots (85 rows of 144 B
    # gate/up, of 72 B down) are one unit each
    active = len(torch.unique(ids))
    units = 2 * 3 * active
    assert sum(t["items"] for t in prof["threads"]) == pytest.approx(units)
    for t in prof["threads"]:
        parts = [t[f] for f in ("start", "gate_up", "glu", "wait", "down", "reduce", "end")]
        assert min(parts) >= 0 and sum(parts) <= prof["span"] * 1.01
        assert t["start"] > 0 and t["end"] > 0  # every run has a first item and an end
    assert sum(t["gate_up"] + t["down"] for t in prof["threads"]) > 0


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
