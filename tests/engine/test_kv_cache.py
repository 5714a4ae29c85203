"""Page pool, radix prefix cache and scheduler bookkeeping, without a model."""

from __future__ import annotations

import sys

import pytest
import torch

from freetoken.engine.kv_cache import NaiveCache, PagePool, RadixCache
from freetoken.engine.request import Request, Status
from freetoken.engine.sampling_params import SamplingParams
from freetoken.engine.scheduler import Scheduler


def test_pool_refcounts_and_free_list():
    pool = PagePool(4, 2)
    a = pool.allocate(3)
    assert pool.allocate(2) is None and pool.num_free == 1  # nothing taken on failure
    pool.incref(a[:1])
    pool.decref(a)
    assert pool.num_free == 3 and pool.refcount[a[0]] == 1
    pool.decref(a[:1])
    assert pool.num_free == 4
    with pytest.raises(AssertionError):
        pool.decref(a[:1])


def test_radix_match_insert_evict():
    pool = PagePool(8, 2)
    cache = RadixCache(pool)
    pages = pool.allocate(3)
    cache.insert([1, 2, 3, 4, 5, 6, 7], pages)  # 3 full pages; token 7 is partial
    assert cache.num_cached_pages == 3
    pool.decref(pages)  # the request ends: the tree alone holds them
    assert pool.num_free == 5
    hit = cache.match([1, 2, 3, 4, 9, 9])
    assert hit == pages[:2] and pool.refcount[pages[0]] == 2
    assert cache.match([2, 1]) == []
    # Only the unreferenced leaf (page 3 of the tree) can go; the matched ones are in use.
    assert cache.evict(3) == 1 and pool.num_free == 6
    pool.decref(hit)
    assert cache.evict(5) == 2 and pool.num_free == 8 and cache.num_cached_pages == 0


def test_radix_keeps_first_copy_of_a_page():
    pool = PagePool(4, 2)
    cache = RadixCache(pool)
    a, b = pool.allocate(1), pool.allocate(1)
    cache.insert([1, 2], a)
    cache.insert([1, 2], b)  # same tokens from another request: not cached twice
    assert cache.match([1, 2, 3]) == a and pool.refcount[b[0]] == 1


def _req(rid: str, n_prompt: int, arrival: int, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens),
                   max_tokens, arrival, detok=None, generator=torch.Generator())


def _sched(num_pages=16, page_size=4, max_running=8, budget=8, cache=NaiveCache):
    pool = PagePool(num_pages, page_size)
    return Scheduler(pool, cache(pool), max_running, budget), pool


def test_chunked_prefill_and_mixed_decode():
    s, _ = _sched(budget=8)
    a, b = _req("a", 3, 0), _req("b", 12, 1)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert [r.request_id for r in batch.requests] == ["a", "b"] and batch.num_new == [3, 5]
    assert batch.samples(0) and not batch.samples(1)
    s.computed(batch)
    a.output_token_ids.append(7)  # a sampled; it now decodes one token per step
    batch = s.schedule()
    assert batch.num_new == [1, 7] and batch.samples(1)  # b's last chunk, mixed with a decode


def test_max_running_limits_admission():
    s, _ = _sched(max_running=2, budget=100)
    for i in range(3):
        s.add(_req(str(i), 2, i))
    assert len(s.schedule()) == 2 and len(s.waiting) == 1


def test_preempts_newest_when_pages_run_out():
    s, pool = _sched(num_pages=4, page_size=2, budget=100)
    old, new = _req("old", 4, 0), _req("new", 4, 1)
    s.add(old)
    s.add(new)
    s.computed(s.schedule())  # 2 pages each: the pool is full
    old.output_token_ids.append(9)
    new.output_token_ids.append(9)
    batch = s.schedule()  # old needs a third page: new is preempted to make room
    assert batch.requests == [old] and batch.preempted == [new]
    assert new.status is Status.WAITING and new.num_computed == 0 and s.waiting[0] is new
    s.finish(old)
    s.finish(old)  # idempotent
    assert pool.num_free == 4


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
