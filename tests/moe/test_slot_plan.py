"""The slot cache's one-launch plan kernel (kernels/triton/slot_plan.py) against the plain-Python
LRU model of test_slot_cache.py: the same hits, misses, fetches, victims and map after every
call of a 60-call sequence over three layers, with int limits, with hybrid's q* policy (whose
rounding, floor((misses + 1) * q) in float64, must match the torch ops' exactly) and with a split
model's table of F by miss count (policy.SplitModel: an executor with a fixed cost a job).
Without CUDA the kernel runs in Triton's interpreter (set before triton is imported).
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from freetoken.moe.policy import FetchPolicy, SplitModel  # noqa: E402
from freetoken.moe.slot_cache import SlotCache  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_slot_cache import E, L, LruModel, _bank, _table  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("slots,limit,pad,scan,ahead", [
    (5, 99, False, None, 0), (12, 1, False, None, 0), (30, 2, False, None, 0),
    (12, 0.3, False, None, 0), (30, 0.5, False, None, 0), (5, 99, True, None, 0),
    (12, 0.3, True, None, 0), (30, 99, False, 8, 0), (12, 0.5, True, 4, 0),
    (12, "model", False, None, 0), (30, "model", True, 8, 0), (12, 1, False, None, 2),
    (12, 0.5, True, None, 1), (20, 1, True, 4, 3), (20, 0.5, False, None, 2),
    (16, "model", False, None, 1)])
def test_plan_kernel_matches_python_model(slots, limit, pad, scan, ahead, monkeypatch):
    """pad: each call also carries two rows of a CUDA graph's padding past `live` (the
    hand-off's word): the plan must ignore them (the model never sees them). scan: chunks of
    that many slots (several a pool: the victim scans read last_use from memory, not from
    the one register chunk). ahead: after each call the ahead kernel gives up to that many
    of the next layer's predicted experts slots (`SlotCache.plan_ahead`), predictions that
    share one route a row with the next call (some used, some evicted unused); with a
    policy's limit the hits on those slots count as fetches."""
    from freetoken.kernels.triton import slot_plan
    from freetoken.kernels.triton.slot_plan import ahead_triton, plan_triton

    if scan is not None:
        monkeypatch.setattr(slot_plan, "SCAN", scan)

    banks = [_bank(i, False) for i in range(L)]
    c = SlotCache(banks, slots, DEV)
    c.warm(banks)
    ref = LruModel(slots)
    ref.warm()
    if limit == "model":  # 30 us a job + 12 an expert against 40 a fetch: F(6) = 2 only
        policy = FetchPolicy(0.3, 2, "test", SplitModel(30.0, 12.0, 8.0, 30.0, 40.0, 40.0))
        assert policy.limits(6) == (0, 1, 1, 1, 1, 1, 2)
    else:
        policy = FetchPolicy(limit, 2, "test") if isinstance(limit, float) else limit
    g = torch.Generator().manual_seed(slots * 100 + (7 if limit == "model" else int(limit * 10))
                                      + ahead)
    total = {"hits": 0, "misses": 0, "fetched": 0, "ahead": 0}
    calls = [torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(1 + step % 3)])
             for step in range(61)]
    ahead_slots: set[int] = set()
    for step in range(60):
        layer = step % L
        T = 1 + step % 3
        ids = calls[step]
        held = ref.table()
        n_miss = len({e for e in ids.flatten().tolist()} - {e for la, e in held if la == layer})
        # a policy's fetches count the hits on slots filled ahead (`SlotCache.plan`): F =
        # min(F(misses + a), cap) - a; an int limit is every miss, capped
        a = sum(held.get((layer, e)) in ref.fresh for e in set(ids.flatten().tolist()))
        if limit == "model":
            lim = max(0, min(2, policy.limits(n_miss + a)[n_miss + a]) - a)
        else:
            lim = (limit if isinstance(limit, int)
                   else max(0, min(2, int((n_miss + a + 1) * limit)) - a))
        h, m, f = ref.call(layer, ids.flatten().tolist(), lim)
        table, cap, ahead_counts = c._limit_cap(policy)
        live = None
        if pad:  # padding rows route anywhere; only the first T rows are real
            junk = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(2)])
            live = torch.tensor([T], dtype=torch.int32, device=DEV)
            ids_dev = torch.cat([ids, junk]).to(DEV)
        else:
            ids_dev = ids.to(DEV)
        fetched = plan_triton(c, layer, ids_dev, table, cap, True, live, None, ahead_counts).cpu()
        for k, v in zip(("hits", "misses", "fetched"), (h, m, f)):
            total[k] += v
        # the slots given ahead for this call may still be copied while it fills its own
        taken = {int(x) for x in fetched[1, fetched[0] >= 0]}
        assert not taken & ahead_slots, f"step {step}: fetched into slots filled ahead"
        ahead_slots = set()
        assert int((fetched[0] >= 0).sum()) == f, f"step {step}"
        assert bool((fetched[:, f:] == -1).all())
        assert _table(c) == ref.table(), f"step {step}"
        where = ref.table()
        for e, s in fetched[:, :f].t().tolist():  # the fetch list names the new owners
            assert where[(layer, e)] == s
        if ahead:
            nxt = calls[step + 1]
            rows = ids.shape[0]  # the prediction: this call's rows (the layer's input)
            pred = torch.stack([nxt[torch.arange(rows) % nxt.shape[0], 0],
                                torch.randint(0, E, (rows,), generator=g)], 1)
            want = ref.ahead((layer + 1) % L, pred.flatten().tolist(), ahead)
            pred_dev = torch.cat([pred, junk]).to(DEV) if pad else pred.to(DEV)
            got = ahead_triton(c, (layer + 1) % L, pred_dev, ahead, live).cpu()
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


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


def test_plan_kernel_posts_the_cpu_share():
    """The plan kernel's SEND path (on a GPU it posts the hand-off's job itself, before the
    victim scan): the same plan as without it, and the pinned buffer's job holds the header,
    ids, weights, x and a map whose negative entries are exactly the routed misses it did not
    fetch (the worker reads only the signs)."""
    from freetoken.kernels.triton.handoff import job_args
    from freetoken.kernels.triton.slot_plan import plan_triton
    from freetoken.moe.handoff import layout

    banks = [_bank(i, False) for i in range(L)]
    plain, sending = SlotCache(banks, 12, DEV), SlotCache(banks, 12, DEV)
    plain.warm(banks)
    sending.warm(banks)
    table, cap, _ = plain._limit_cap(FetchPolicy(0.5, 2, "test"))
    off = layout(4, 2, E, 8)
    buf = torch.zeros(off["size"], dtype=torch.uint8, device=DEV)
    seq = torch.zeros(1, dtype=torch.int32, device=DEV)
    g = torch.Generator().manual_seed(7)
    seen = {"fetched": 0, "cpu": 0}
    for step in range(12):
        layer, T = step % L, 1 + step % 3
        ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)]).to(DEV)
        w = torch.rand(T, 2, generator=g).to(DEV)
        x = torch.randn(T, 8, generator=g).to(DEV)
        held = {e for e in range(E) if int(plain.slot_of[layer * E + e]) >= 0}

        ref = plan_triton(plain, layer, ids, table, cap, True)
        got = plan_triton(sending, layer, ids, table, cap, True,
                          job=job_args(x, ids, w, seq, buf, off, layer, 0, 0))
        assert torch.equal(got, ref), f"step {step}"
        assert _table(sending) == _table(plain)
        words = buf.view(torch.int32)
        assert int(words[off["go"] // 4]) == step + 1 == int(seq)
        assert words[off["job"] // 4:off["job"] // 4 + 4].tolist() == [layer, T, 0, 0]
        n = T * 2
        assert words[off["ids"] // 4:off["ids"] // 4 + n].tolist() == ids.flatten().tolist()
        assert torch.equal(buf.view(torch.float32)[off["weights"] // 4:off["weights"] // 4 + n],
                           w.flatten())
        assert torch.equal(buf.view(torch.float32)[off["x"] // 4:off["x"] // 4 + T * 8],
                           x.flatten())
        jmap = words[off["map"] // 4:off["map"] // 4 + E]
        fetched = set(ref[0][ref[0] >= 0].tolist())
        for e in set(ids.flatten().tolist()):
            cpu = e not in held and e not in fetched
            assert (int(jmap[e]) < 0) == cpu, f"step {step}, expert {e}"
            seen["cpu"] += cpu
        seen["fetched"] += len(fetched)
    assert seen["fetched"] > 0 and seen["cpu"] > 0, seen  # both kinds of miss were posted
