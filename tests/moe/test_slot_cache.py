"""The slot cache's tensor-op bookkeeping against a plain-Python LRU model of the same rules,
its byte pool against the banks it copies from, and the cache-size checks.

Rules (DESIGN.md): a layer call marks its hits used; each fetched miss takes the least
recently used slot that this call does not use (empty slots first; among equally old slots
the lower index); misses are fetched most-routed first (then the lower expert id). Slots
given ahead to the next call's layer are stamped with that call's clock: its fetches never
take them (their copies may still be in flight while it fills its own).
"""

from __future__ import annotations

import math
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
        self.fresh: set[int] = set()  # slots filled ahead, not yet used by their layer
        self.ahead_hits = 0

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
        free = sorted((s for s in range(len(self.owner)) if self.last[s] < self.clock),
                      key=lambda s: (self.last[s], s))
        f = min(len(misses), len(free), limit)
        self.ahead_hits += sum(where[(layer, e)] in self.fresh for e in hits)
        self.fresh -= {where[(layer, e)] for e in hits}
        for e, s in zip(misses[:f], free[:f]):
            self.owner[s], self.last[s] = (layer, e), self.clock
            self.fresh.discard(s)
        return len(hits), len(misses), f

    def ahead(self, layer: int, ids: list[int], limit: int) -> list[tuple[int, int]]:
        """Slots for up to `limit` predicted experts of `layer` before its call: the clock
        stays, the new slots are stamped with the next call's clock (so that call does not
        evict them) and fresh. Returns the (expert, slot) pairs."""
        counts: dict[int, int] = {}
        for e in ids:
            counts[e] = counts.get(e, 0) + 1
        where = {o: s for s, o in enumerate(self.owner) if o is not None}
        want = sorted((e for e in counts if (layer, e) not in where),
                      key=lambda e: (-counts[e], ids.index(e)))
        free = sorted((s for s in range(len(self.owner)) if self.last[s] < self.clock),
                      key=lambda s: (self.last[s], s))
        f = min(len(want), len(free), limit)
        for e, s in zip(want[:f], free[:f]):
            self.owner[s], self.last[s] = (layer, e), self.clock + 1
            self.fresh.add(s)
        return list(zip(want[:f], free[:f]))

    def table(self) -> dict[tuple[int, int], int]:
        return {o: s for s, o in enumerate(self.owner) if o is not None}


def _table(c: SlotCache) -> dict[tuple[int, int], int]:
    m = c.slot_of[:-1].view(L, E)
    return {(la, e): int(m[la, e]) for la in range(L) for e in range(E) if m[la, e] >= 0}


@pytest.mark.parametrize("slots,limit,ahead", [(5, 99, 0), (12, 99, 0), (12, 1, 0), (30, 2, 0),
                                               (5, 1, 2), (12, 1, 1), (20, 2, 3), (12, 0.5, 0),
                                               (12, 0.5, 1), (20, 0.5, 2)])
def test_lru_matches_python_model(slots, limit, ahead):
    """ahead: after each call, up to that many of the next layer's experts are given slots
    ahead of its call (`plan_ahead`), predicted from a route list that shares some of that
    call's experts (so some fetched ahead are used, others evicted unused). A float limit is
    hybrid's q* policy (at most 2): its fetches count the call's hits on slots filled ahead,
    F = min(floor((misses + a + 1) q), 2) - a for a such hits."""
    from freetoken.moe.policy import FetchPolicy

    banks = [_bank(i, False) for i in range(L)]
    c = SlotCache(banks, slots, "cpu")
    c.warm(banks)
    ref = LruModel(slots)
    ref.warm()
    g = torch.Generator().manual_seed(int(slots * 100 + limit + 10 * ahead))
    total = {"hits": 0, "misses": 0, "fetched": 0, "ahead": 0}
    calls = [torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(1 + step % 3)])
             for step in range(61)]
    ahead_slots: set[int] = set()
    for step in range(60):
        layer = step % L
        ids = calls[step]
        lim, arg = limit, limit
        if isinstance(limit, float):
            held = ref.table()
            routed = set(ids.flatten().tolist())
            n_miss = len({e for e in routed if (layer, e) not in held})
            a = sum(held.get((layer, e)) in ref.fresh for e in routed)
            lim = max(0, min(2, int((n_miss + a + 1) * limit)) - a)
            arg = FetchPolicy(limit, 2, "test")
        h, m, f = ref.call(layer, ids.flatten().tolist(), lim)
        fetched = c.plan(layer, ids, arg)
        total["hits"] += h
        total["misses"] += m
        total["fetched"] += f
        # the slots given ahead for this call may still be copied while it fills its own
        taken = {int(x) for x in fetched[1, fetched[0] >= 0]}
        assert not taken & ahead_slots, f"step {step}: fetched into slots filled ahead"
        ahead_slots = set()
        assert int((fetched[0] >= 0).sum()) == f
        assert _table(c) == ref.table(), f"step {step}"
        if ahead:
            nxt = calls[step + 1]  # a route of the next call's rows right, one random
            rows = ids.shape[0]  # the prediction: this call's rows (the layer's input)
            pred = torch.stack([nxt[torch.arange(rows) % nxt.shape[0], 0],
                                torch.randint(0, E, (rows,), generator=g)], 1)
            want = ref.ahead((layer + 1) % L, pred.flatten().tolist(), ahead)
            got = c.plan_ahead((layer + 1) % L, pred, ahead)
            ahead_slots = {sl for _, sl in want}
            total["ahead"] += len(want)
            assert got[:, :len(want)].t().tolist() == [list(p) for p in want], f"step {step}"
            assert bool((got[:, len(want):] == -1).all())
            assert _table(c) == ref.table(), f"step {step} ahead"
            assert {int(s) for s in c.fresh[:slots].nonzero()} == ref.fresh
    cnt = c.read_counters()
    assert {k: cnt[k] for k in total} == total
    assert cnt["cpu"] == total["misses"] - total["fetched"]
    assert cnt["ahead_hits"] == ref.ahead_hits
    if ahead:
        assert 0 < cnt["ahead_hits"] < cnt["ahead"], cnt  # some used, some not


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


def _profile(c1: float, c4: float, f1: float = 38.7, f4: float = 38.7) -> dict:
    """A bw profile with both job sizes (GB/s of the executor beside the fill, and of the fill
    beside it), 1.77 MB experts, jobs of 8 and 30 experts."""
    return {"q_star": f1 / (f1 + c1), "expert_bytes": 1.77e6, "cpu_experts_b1": 8.0,
            "cpu_experts_b4": 30.0, "cpu_fill_both_gbps": c1, "cpu_fill_both_b4_gbps": c4,
            "fill_both_gbps": f1, "fill_both_b4_gbps": f4}


def test_split_model_fits_the_two_job_sizes():
    """t0 + n t_e through both measured jobs (float64 against the figures' own times); a
    profile without the four-token figures (an older one) has no model and keeps floor(q*
    (M + 1)); equal figures at both sizes give t0 = 0 and the same table as that rule."""
    from freetoken.moe.policy import SplitModel

    m = SplitModel.from_profile(_profile(109.4, 135.0))
    us = 1.77e6 / 1e3
    assert m.cpu_time(8) == pytest.approx(8 * us / 109.4, rel=1e-12)
    assert m.cpu_time(30) == pytest.approx(30 * us / 135.0, rel=1e-12)
    assert m.t0 > 0 and m.fill_time(5) == pytest.approx(us / 38.7)
    old = {k: v for k, v in _profile(109.4, 135.0).items() if "b4" not in k}
    assert SplitModel.from_profile(old) is None and fetch_policy("hybrid", None, old).model is None
    flat = fetch_policy("hybrid", None, _profile(109.4, 109.4))
    assert flat.model is not None and flat.model.t0 == pytest.approx(0.0, abs=1e-9)
    q = flat.q
    assert flat.limits(64) == tuple(int(math.floor((k + 1) * q)) for k in range(65))
    # a larger job reading slower (noise): one figure, no negative fixed cost
    assert SplitModel.from_profile(_profile(109.4, 90.0)).t0 == 0.0
    # a fixed cost above half the one-token job (an H200 host's Q4_K figures during a
    # transient, 2026-12-03: 8 experts at 49.2 GB/s, 30.5 at 84.7, t0 would be 163 us of 288):
    # one figure as well
    busy = dict(_profile(49.2, 84.7, 40.7, 38.9), cpu_experts_b4=30.5)
    t1 = 8 * us / 49.2
    t_e = (30.5 * us / 84.7 - t1) / 22.5
    assert t1 - 8 * t_e > t1 / 2  # the fit the guard refuses
    m = SplitModel.from_profile(busy)
    assert m.t0 == 0.0 and m.t_e == pytest.approx(us / 49.2, rel=1e-12)


def test_split_model_finishes_first():
    """With the executor's fixed cost a job (the H200 host's figures: 109 GB/s on 8-expert jobs,
    135 on 30-expert ones), F(M) minimises the later side's time (brute force over every F),
    fetches fewer than floor(q* (M + 1)) at batch 4's 27 misses and as many at batch 1's 7;
    the torch rule reads the same table, under the cap."""
    prof = _profile(109.4, 135.0)
    policy = fetch_policy("hybrid", None, prof)
    m = policy.model
    for k in range(65):
        f = policy.limits(k)[k]
        cost = [max(g * m.fill_time(k - g), m.cpu_time(k - g)) for g in range(k + 1)]
        assert cost[f] <= min(cost) * (1 + 1e-9), (k, f, cost)
        assert int(policy(torch.tensor(k))) == f
    q = prof["q_star"]
    assert policy.limits(7)[7] == int(8 * q) == 2
    assert policy.limits(27)[27] == 6 < int(28 * q) == 7
    assert int(fetch_policy("hybrid", 3, prof)(torch.tensor(27))) == 3
    assert "F(7) = 2, F(27) = 6" in policy.why


def test_split_model_scales_to_the_model_experts():
    """`ft bench bw` measures 1.77 MB experts (the 2048x512 layer); a model of 2.65 MB experts
    (Qwen3-30B-A3B: 2048x768) reads and fetches each expert 1.5 times as long, while a job's
    fixed cost t0 stays. F(M) is then the brute-force best under those scaled times (float64),
    differs from the unscaled table where t0's weight matters, and experts of the profile's
    own size give the unscaled model."""
    from freetoken.moe.policy import SplitModel

    prof = _profile(89.7, 122.0, 42.6, 40.2)  # the NVFP4 figures of an H200 host (12-03)
    base = SplitModel.from_profile(prof)
    assert SplitModel.from_profile(prof, 1.77e6) == base
    big = SplitModel.from_profile(prof, 2.65e6)
    r = 2.65e6 / 1.77e6
    assert big.t0 == base.t0 > 0
    assert big.t_e == pytest.approx(base.t_e * r, rel=1e-12)
    assert big.fill_time(3) == pytest.approx(base.fill_time(3) * r, rel=1e-12)
    assert big.fill_time(40) == pytest.approx(base.fill_time(40) * r, rel=1e-12)
    policy = fetch_policy("hybrid", None, prof, 2.65e6)
    assert policy.model == big and "2.65 MB experts" in policy.why
    # the module doc's times, written out in float64: the fit on the bench's experts, then
    # the per-expert times scaled by r
    n1, n4 = 8.0, 30.0
    t1, t4 = n1 * 1.77e3 / 89.7, n4 * 1.77e3 / 122.0
    t_e = (t4 - t1) / (n4 - n1)
    t0 = t1 - n1 * t_e
    for k in range(65):
        f = policy.limits(k)[k]
        cost = []
        for g in range(k + 1):
            n = k - g
            a = min(1.0, max(0.0, (n - n1) / (n4 - n1)))
            fill = 2.65e3 * ((1 - a) / 42.6 + a / 40.2)
            cpu = 0.0 if n == 0 else t0 + n * t_e * r
            cost.append(max(g * fill, cpu))
        assert cost[f] <= min(cost) * (1 + 1e-9), (k, f, cost)
    assert policy.limits(64) != fetch_policy("hybrid", None, prof).limits(64)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
