"""The slot cache's tensor-op bookkeeping against a plain-Python LRU model of the same rules,
its byte pool against the banks it copies from, and the cache-size checks.

Rules (DESIGN.md): a layer call marks its hits used; each fetched miss takes the least
recently used slot that this call does not use (empty slots first; among equally old slots
the lower index); misses are fetched most-routed first (then the lower expert id).
"""

from __future__ import annotations

import sys

import pytest
import torch

from freetoken.formats.dequant import dequantize
from freetoken.formats.qweight import QuantWeight
from freetoken.moe.banks import ExpertBank
from freetoken.moe.policy import fetch_policy, num_slots
from freetoken.moe.slot_cache import SlotCache

L, E, H, INTER = 3, 8, 64, 32


def _bank(seed: int, nvfp4: bool) -> ExpertBank:
    g = torch.Generator().manual_seed(seed)
    scales = torch.rand(E, 4, generator=g) + 0.5
    if not nvfp4:
        return ExpertBank(QuantWeight(torch.randn(E, 2 * INTER, H, generator=g), "f32",
                                      (E, 2 * INTER, H)),
                          QuantWeight(torch.randn(E, H, INTER, generator=g), "f32",
                                      (E, H, INTER)), scales)

    def nv(n, k):
        codes = torch.randint(0, 256, (E, n, k // 2), generator=g, dtype=torch.uint8)
        sc = (torch.rand(E, n, k // 16, generator=g) + 0.5).to(torch.float8_e4m3fn)
        return QuantWeight(codes, "nvfp4", (E, n, k), scales=sc)

    return ExpertBank(nv(2 * INTER, H), nv(H, INTER), scales)


class LruModel:
    """The same rules in plain Python."""

    def __init__(self, slots: int):
        self.owner: list[tuple[int, int] | None] = [None] * slots
        self.last = [-1] * slots
        self.clock = 0

    def warm(self) -> None:
        for s in range(min(len(self.owner), L * E)):
            self.owner[s], self.last[s] = (s % L, s // L), 0

    def call(self, layer: int, ids: list[int], limit: int) -> tuple[int, int, int]:
        self.clock += 1
        counts: dict[int, int] = {}
        for e in ids:
            counts[e] = counts.get(e, 0) + 1
        where = {o: s for s, o in enumerate(self.owner) if o is not None}
        hits = [e for e in counts if (layer, e) in where]
        for e in hits:
            self.last[where[(layer, e)]] = self.clock
        misses = sorted((e for e in counts if (layer, e) not in where),
                        key=lambda e: (-counts[e], e))
        free = sorted((s for s in range(len(self.owner)) if self.last[s] != self.clock),
                      key=lambda s: (self.last[s], s))
        f = min(len(misses), len(free), limit)
        for e, s in zip(misses[:f], free[:f]):
            self.owner[s], self.last[s] = (layer, e), self.clock
        return len(hits), len(misses), f

    def table(self) -> dict[tuple[int, int], int]:
        return {o: s for s, o in enumerate(self.owner) if o is not None}


def _table(c: SlotCache) -> dict[tuple[int, int], int]:
    m = c.slot_of[:-1].view(L, E)
    return {(la, e): int(m[la, e]) for la in range(L) for e in range(E) if m[la, e] >= 0}


@pytest.mark.parametrize("slots,limit", [(5, 99), (12, 99), (12, 1), (30, 2)])
def test_lru_matches_python_model(slots, limit):
    banks = [_bank(i, False) for i in range(L)]
    c = SlotCache(banks, slots, "cpu")
    c.warm(banks)
    ref = LruModel(slots)
    ref.warm()
    g = torch.Generator().manual_seed(slots * 100 + limit)
    total = {"hits": 0, "misses": 0, "fetched": 0}
    for step in range(60):
        layer = step % L
        T = 1 + step % 3
        ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
        h, m, f = ref.call(layer, ids.flatten().tolist(), limit)
        fetched = c.plan(layer, ids, limit)
        total["hits"] += h
        total["misses"] += m
        total["fetched"] += f
        assert int((fetched[0] >= 0).sum()) == f
        assert _table(c) == ref.table(), f"step {step}"
    cnt = c.read_counters()
    assert {k: cnt[k] for k in total} == total
    assert cnt["cpu"] == total["misses"] - total["fetched"]


@pytest.mark.parametrize("nvfp4", [False, True], ids=["f32", "nvfp4"])
def test_fill_copies_the_expert_into_its_slot(nvfp4):
    banks = [_bank(10 + i, nvfp4) for i in range(L)]
    c = SlotCache(banks, 4, "cpu")
    ids = torch.tensor([[5, 2]])
    fetched = c.plan(1, ids, 99)
    assert c.fill(1, banks[1], fetched) == 2
    emap = c.expert_map(1)
    view = c.views[1]
    for e in (5, 2):
        s = int(emap[e])
        for got, want in ((view.w13, banks[1].w13), (view.w2, banks[1].w2)):
            one = QuantWeight(got.data[s:s + 1], got.fmt, (1, *got.shape[1:]),
                              scales=None if got.scales is None else got.scales[s:s + 1])
            ref = QuantWeight(want.data[e:e + 1], want.fmt, (1, *want.shape[1:]),
                              scales=None if want.scales is None else want.scales[e:e + 1])
            assert torch.equal(dequantize(one), dequantize(ref))
        assert torch.equal(view.scales[s], banks[1].scales[e])


def test_slots_used_by_the_call_are_not_evicted():
    banks = [_bank(i, False) for i in range(L)]
    c = SlotCache(banks, 2, "cpu")
    c.plan(0, torch.tensor([[0, 1]]), 99)  # both slots now hold layer 0's experts 0 and 1
    fetched = c.plan(0, torch.tensor([[0, 3]]), 99)  # 0 hits: only 1's slot may go
    assert fetched[0].tolist().count(3) == 1
    assert int(c.expert_map(0)[0]) >= 0 and int(c.expert_map(0)[3]) >= 0
    assert int(c.expert_map(0)[1]) == -1


def test_cache_size_checks():
    with pytest.raises(ValueError, match="smaller than one layer's top-k"):
        num_slots(100, 8, 4, None, 1000)
    with pytest.raises(ValueError, match="not both"):
        num_slots(100, 8, 10, 0.5, 1000)
    assert num_slots(100, 8, 500, None, 1000)[0] == 100  # clamped to all experts
    assert num_slots(100, 8, None, 0.25, 1000)[0] == 25
    assert num_slots(100, 8, None, None, 40)[0] == 40  # what fits


def test_fetch_policy():
    m = torch.tensor(10)
    assert int(fetch_policy("offload", None, None)(m)) == 10
    assert int(fetch_policy("cpu", None, None)(m)) == 0
    assert int(fetch_policy("hybrid", 0, {"q_star": 0.4})(m)) == 0
    assert int(fetch_policy("hybrid", -1, {"q_star": 0.4})(m)) == 4
    assert int(fetch_policy("hybrid", 3, {"q_star": 0.4})(m)) == 3
    assert int(fetch_policy("hybrid", None, None)(m)) == 2  # no profile: a small fixed cap
    with pytest.raises(ValueError, match="moe_hybrid_max_fetch"):
        fetch_policy("hybrid", -2, None)


@pytest.mark.parametrize("q", [0.05, 0.27, 0.317, 0.37, 0.5, 0.8])
def test_hybrid_split_finishes_first(q):
    """The hybrid split F of M misses is the integer that minimises the later of the two
    sides: the fetches F (1 - q) and the CPU (M - F) q (time per expert over each link when
    q = B_pcie / (B_pcie + B_cpu)); among equal times the policy may take either."""
    policy = fetch_policy("hybrid", None, {"q_star": q})
    for m in range(0, 65):
        f = int(policy(torch.tensor(m)))
        cost = [max(g * (1 - q), (m - g) * q) for g in range(m + 1)]
        assert 0 <= f <= m and cost[f] <= min(cost) + 1e-12, (m, f, cost)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
