"""Continuous batching with chunked prefill, a paged KV cache, prefix reuse and preemption.

Each step the scheduler picks, oldest request first:
1. every running request: a decode token, or its next prefill chunk while the step's prefill
   budget (`max_prefill_tokens`) lasts; each gets KV pages for what it will write. When pages
   run out, unreferenced prefix-cache pages are evicted; then the newest running request is
   preempted (its pages freed, its tokens recomputed later), never the older ones.
2. waiting requests join (up to `max_running_requests`) while budget and pages last; a
   request first takes the pages of its longest cached prefix.
A step may thus mix prefill chunks of several requests with decodes of others.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from freetoken.engine.kv_cache import NaiveCache, PagePool, RadixCache
from freetoken.engine.request import Request, Status


@dataclass
class ScheduledBatch:
    """Requests of one step and how many of their uncomputed tokens each feeds."""

    requests: list[Request] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    def add(self, req: Request, n: int) -> None:
        self.requests.append(req)
        self.num_new.append(n)

    def samples(self, i: int) -> bool:
        """Whether request i samples a token after this step (all its tokens computed)."""
        return self.requests[i].num_computed + self.num_new[i] == self.requests[i].num_tokens

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(
        self,
        pool: PagePool,
        cache: RadixCache | NaiveCache,
        max_running: int,
        max_prefill_tokens: int,
    ) -> None:
        self.pool = pool
        self.cache = cache
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_prefill_tokens
        for req in list(self.running):
            if req.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = 1 if req.num_uncomputed == 1 else min(req.num_uncomputed, budget)
            if n == 0:
                continue  # prefill budget spent; it continues next step
            if not self._reserve_or_preempt(req, n, batch):
                break  # it was the newest and got preempted itself
            batch.add(req, n)
            budget -= n if n > 1 else 0  # decodes ride along outside the prefill budget
        self._admit(batch, budget)
        return batch

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and len(self.running) < self.max_running and budget > 0:
            req = self.waiting[0]
            self._take_cached_prefix(req)
            n = min(req.num_uncomputed, budget)
            if not self._reserve(req, n):
                self._release(req)
                break  # wait for pages to come back
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            batch.add(req, n)
            budget -= n

    def _take_cached_prefix(self, req: Request) -> None:
        # Leave at least the last token to compute: its logits are needed to sample.
        pages = self.cache.match(req.all_token_ids[: req.num_tokens - 1])
        req.pages = pages
        req.num_computed = len(pages) * self.pool.page_size
        if not req.output_token_ids:
            req.num_cached_tokens = req.num_computed

    def pages_needed(self, req: Request, n: int) -> int:
        """Pages req lacks to cover its first num_computed + n tokens."""
        ps = self.pool.page_size
        return max(0, -(-(req.num_computed + n) // ps) - len(req.pages))

    def _reserve(self, req: Request, n: int) -> bool:
        """Make sure req's pages cover its first num_computed + n tokens."""
        need = self.pages_needed(req, n)
        if need == 0:
            return True
        if self.pool.num_free < need:
            self.cache.evict(need - self.pool.num_free)
        pages = self.pool.allocate(need)
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    def _reserve_or_preempt(self, req: Request, n: int, batch: ScheduledBatch) -> bool:
        while not self._reserve(req, n):
            newer = [r for r in self.running if r.arrival > req.arrival]
            victim = max(newer, key=lambda r: r.arrival) if newer else req
            self.preempt(victim)
            batch.preempted.append(victim)
            if victim is req:
                return False
        return True

    def preempt(self, req: Request) -> None:
        """Back to the front of the queue; its KV is recomputed (or found in the cache)."""
        self._release(req)
        self.running.remove(req)
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    def computed(self, batch: ScheduledBatch) -> None:
        """After the forward: advance num_computed; cache prefill chunks' full pages."""
        for req, n in zip(batch.requests, batch.num_new):
            req.num_computed += n
            if n > 1:
                self.cache.insert(req.all_token_ids[: req.num_computed], req.pages)

    def finish(self, req: Request) -> None:
        """Drop a request wherever it is and give back its pages (idempotent)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status = Status.FINISHED

    def _release(self, req: Request) -> None:
        if req.pages:
            self.cache.insert(req.all_token_ids[: req.num_computed], req.pages)
            self.pool.decref(req.pages)
        req.pages = []
        req.num_computed = 0
