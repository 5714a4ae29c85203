"""The slot cache's one-launch plan kernel (kernels/triton/slot_plan.py) against the plain-Python
LRU model of test_slot_cache.py: the same hits, misses, fetches, victims and map after every
call of a 60-call sequence over three layers, with int limits and with hybrid's q* policy
(whose rounding, floor((misses + 1) * q) in float64, must match the torch ops' exactly).
Without CUDA the kernel runs in Triton's interpreter (set before triton is imported).
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from freetoken.moe.policy import FetchPolicy  # noqa: E402
from freetoken.moe.slot_cache import SlotCache  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_slot_cache import E, L, LruModel, _bank, _table  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("slots,limit,pad,scan", [
    (5, 99, False, None), (12, 1, False, None), (30, 2, False, None), (12, 0.3, False, None),
    (30, 0.5, False, None), (5, 99, True, None), (12, 0.3, True, None), (30, 99, False, 8),
    (12, 0.5, True, 4)])
def test_plan_kernel_matches_python_model(slots, limit, pad, scan, monkeypatch):
    """pad: each call also carries two rows of a CUDA graph's padding past `live` (the
    hand-off's word): the plan must ignore them (the model never sees them). scan: chunks of
    that many slots (several a pool: the victim scans read last_use from memory, not from
    the one register chunk)."""
    from freetoken.kernels.triton import slot_plan
    from freetoken.kernels.triton.slot_plan import plan_triton

    if scan is not None:
        monkeypatch.setattr(slot_plan, "SCAN", scan)

    banks = [_bank(i, False) for i in range(L)]
    c = SlotCache(banks, slots, DEV)
    c.warm(banks)
    ref = LruModel(slots)
    ref.warm()
    policy = FetchPolicy(limit, 2, "test") if isinstance(limit, float) else limit
    g = torch.Generator().manual_seed(slots * 100 + int(limit * 10))
    total = {"hits": 0, "misses": 0, "fetched": 0}
    for step in range(60):
        layer = step % L
        T = 1 + step % 3
        ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
        n_miss = len({e for e in ids.flatten().tolist()} - {e for la, e in ref.table()
                                                             if la == layer})
        lim = limit if isinstance(limit, int) else min(2, int((n_miss + 1) * limit))
        h, m, f = ref.call(layer, ids.flatten().tolist(), lim)
        q, cap = c._q_cap(policy)
        live = None
        if pad:  # padding rows route anywhere; only the first T rows are real
            junk = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(2)])
            live = torch.tensor([T], dtype=torch.int32, device=DEV)
            ids_dev = torch.cat([ids, junk]).to(DEV)
        else:
            ids_dev = ids.to(DEV)
        fetched = plan_triton(c, layer, ids_dev, q, cap, True, live).cpu()
        for k, v in zip(("hits", "misses", "fetched"), (h, m, f)):
            total[k] += v
        assert int((fetched[0] >= 0).sum()) == f, f"step {step}"
        assert bool((fetched[:, f:] == -1).all())
        assert _table(c) == ref.table(), f"step {step}"
        where = ref.table()
        for e, s in fetched[:, :f].t().tolist():  # the fetch list names the new owners
            assert where[(layer, e)] == s
    cnt = c.read_counters()
    assert {k: cnt[k] for k in total} == total
    assert cnt["cpu"] == total["misses"] - total["fetched"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
