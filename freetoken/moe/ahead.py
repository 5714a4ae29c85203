"""The next MoE layer's experts, predicted while a layer call runs (its router on this call's
input), for two uses that fill the gap between two layer calls (tens of microseconds at
decode, when the device runs attention and the router, the copy engine is idle and the CPU
waits for the next job):

- fetching ahead (--moe-fetch-ahead N, offload / hybrid; default 1 with hybrid, 0 with
  offload: FETCH_AHEAD): up to N of the next layer's predicted misses get slots now and are
  copied in during the gap, so that its call finds them as hits and has fewer misses to split
  (hybrid counts those hits as fetches made early: `SlotCache.plan`). Where a call hands work
  to the CPU, the hand-off's worker copies them once it has answered the call's job, with the
  copy engine (moe/handoff.py: copies ahead) in a CUDA graph's steps; else (eager steps on a GPU, or
  FREETOKEN_MOE_AHEAD_WORKER=0) a fill kernel on a stream of its own, which takes SMs from
  the kernels beside it. The next call fills its own fetches beside those copies (its plan
  does not evict slots given ahead for it: they carry its clock) and waits for them only
  before its device kernel reads the slots;
- warming (FREETOKEN_MOE_PREFETCH=1, cpu / hybrid): the predicted CPU experts are posted to
  the hand-off's worker, which reads their rows into the executor threads' caches until the
  next job comes (moe/handoff.py: warming).

`Ahead` is the part of one `ExpertCache` (moe/expert_cache.py) that does both; the cache's
`_split` calls it at fixed points of a layer call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch.profiler import record_function

from freetoken import env
from freetoken.moe.handoff import HINT_ROUTES, Handoff

if TYPE_CHECKING:
    from freetoken.moe.expert_cache import ExpertCache

# --moe-fetch-ahead's default by backend: the next layer's predicted misses fetched per layer
# call while the device runs the layers in between (`Ahead.plan`). Before hybrid counted the
# hits on them as fetches of its split (SlotCache.plan), they were copies on top of its own
# fetches and measured both ways: on the H200 (35B / 30B NVFP4 hybrid, rate 0.1, batch 1) they
# took 15% of the CPU's experts and the step still ran 11% slower queued behind the call's own
# fill, 6% slower queued after the receive (135.6 -> 128.1 tok/s, 2026-12-03); copied by the
# hand-off worker with the copy engine, 97.3 -> 97.1 (H200), and alternated on H100 hosts
# 98.9 -> 108.5 once, 111.3 -> 102.8 and 115.4 -> 112.5 (30B Q4_K), 111.8 -> 102.1 (NVFP4)
# later (2026-12-06). Counted as fetches (2026-12-07, H100 host, after `ft bench bw`,
# `benchmarks/ab_env.py ... --moe-backend hybrid --moe-cache-rate 0.1 --batch 1 --set
# moe_fetch_ahead=0 --set moe_fetch_ahead=1`, median of 3-4 alternated rounds, every round of
# 1 above every round of 0 but one): 30B Q4_K 85.3 -> 96.5 and 86.6 -> 96.1 (2 ahead: 93.3),
# 30B NVFP4 95.6 -> 104.6, 35B NVFP4 150.7 -> 152.3; at batch 4 30B Q4_K 119.4 -> 116.3 and
# 35B NVFP4 205.6 -> 204.0, inside the rounds' spread. The CPU computes as many experts (213 a
# step); the link carries 47 of the 137 fetches a step in the gap instead of beside the CPU.
# Offload (every miss fetched, nothing counted) is not measured so: off.
FETCH_AHEAD = {"hybrid": 1}
# Programs of an ahead fill per fetched part: its copies run beside the device's critical path
# (attention, router), whose kernels a fill of one program per 16 KiB chunk slowed: on the
# H200 (35B NVFP4 hybrid, batch 1) their GEMVs took 1.63 ms a step instead of 0.93
AHEAD_FILL_PROGRAMS = 8
_WORKER = "worker"  # an ahead fill that is the hand-off worker's copies (`Ahead.events`)


class Ahead:
    """Fetching ahead and warming for the MoE layers of one `ExpertCache`.

    n: --moe-fetch-ahead (0 where the device cannot fill slots without a host sync).
    predictors: set by moe/runtime.py, per MoE layer x -> the routes [T, k] its router gives
    x, or None where the layer's router is not one `gate_topk` computes.
    """

    def __init__(self, owner: ExpertCache, n: int):
        self.ec = owner
        self.predictors: list[Callable | None] = []
        self.prefetch = env.moe_prefetch()
        self.n = max(0, n)
        dev = owner.device
        if dev.type == "cuda" and not owner.cache.device_fill:
            self.n = 0  # the host-side fill syncs: not between two layers
        # on a GPU the plans and fills ahead run on a stream of their own, joined by the
        # layer call they are for (its plan waits for the ahead plan, its kernel for the
        # ahead copies): per layer, (the plan's event, the copies' event or _WORKER)
        self.stream = torch.cuda.Stream(dev) if dev.type == "cuda" and self.n else None
        self.events: dict[int, tuple] = {}

    def take(self, layer: int) -> tuple:
        """This layer's (plan event, copies) given ahead by the last call, forgotten here."""
        return self.events.pop(layer, (None, None))

    def join_before(self, layer: int, split: bool) -> None:
        """Join what was given ahead for earlier layers, and for this one where its call
        does not split (and so never takes it)."""
        for held in [k for k in self.events if k < layer or (k == layer and not split)]:
            self.join(held, *self.events.pop(held))

    def predicted(self, layer: int, x) -> int | None:
        """The next MoE layer, where its router can predict its routes from this call's input
        x (a SparseMoE's, a decode-sized call), else None."""
        nxt = layer + 1
        if (nxt >= len(self.predictors) or self.predictors[nxt] is None
                or x.shape[0] * self.ec.top_k > HINT_ROUTES):
            return None
        return nxt

    def plan(self, layer: int, x, ho: Handoff | None, live: torch.Tensor | None):
        """Slots for the next MoE layer's predicted misses (`SlotCache.plan_ahead`: its router
        on this layer's input x, at most `n`, most-routed first), taken now so that their
        copies run while the device computes this layer's rest and the next layer's
        attention, when the copy engine is idle; that call then finds them as hits (and the
        CPU computes fewer experts). With warming on, the next layer's hint follows them (it
        then names only experts without a slot). On a GPU all of it runs on the ahead stream
        after the job was posted; live: the plan's. Posted to the hand-off's worker where it
        copies them. Returns (the fetch list, the plan's event on a GPU, whether the worker
        copies) for `fill`, or None."""
        nxt = self.predicted(layer, x) if self.n else None
        if nxt is None:
            return None
        c = self.ec.cache
        warm = ho is not None and self.prefetch and not self.ec.fetch_all
        # the worker copies them after this call's job, inside a CUDA graph only: an eager
        # step's host may load a kernel module or free memory, which holds the driver until
        # the device is idle, while the device waits for the worker's copy calls (they then
        # wait for the driver: a 30 s stall a layer, seen at graph capture on an H100 host);
        # eager steps fill their slots ahead with the fill kernel
        worker = (ho is not None and ho.copies
                  and (self.stream is None or torch.cuda.is_current_stream_capturing()))
        with record_function("moe.ahead"):
            if self.stream is None:  # the CPU standing in: in line
                fetched = c.plan_ahead(nxt, self.predictors[nxt](x), self.n)
                if worker:
                    ho.post_ahead(nxt, fetched)
                return fetched, None, worker
            s = self.stream
            s.wait_stream(torch.cuda.current_stream(self.ec.device))
            x.record_stream(s)  # read here after the compute stream may have freed it
            with torch.cuda.stream(s):
                ids = self.predictors[nxt](x)
                fetched = c.plan_ahead(nxt, ids, self.n, live)
                if worker:
                    ho.post_ahead(nxt, fetched)
                if warm:
                    ho.hint(nxt, ids, self.ec.slot_map(nxt))
                # after the hint too: the next call's plan, which waits for this event,
                # rewrites the map the hint reads, and a graph's capture must join all of
                # the stream's work (recorded before the hint, the capture failed with
                # "unjoined work" and the engine decoded eagerly: 7.9 tok/s against 98.4,
                # 30B Q4_K hybrid with warming, H100, 2026-12-07)
                planned = torch.cuda.Event()
                planned.record(s)
        return fetched, planned, worker

    def fill(self, nxt: int, ahead) -> None:
        """Copy the experts `plan` gave slots into them: on a GPU on the ahead stream once
        this call's receive has its answer, so the copies run while the device computes the
        next layer's attention and router, when the link is idle. (Queued after this call's
        own fill instead, they ran while the receive polled the host for the CPU's answer
        over the same link, whose reads then waited behind theirs: the 35B hybrid lost 11%
        at batch 1 on the H200.) The next layer's call fills its own fetches beside them and
        waits for them before its device kernel."""
        c, host = self.ec.cache, self.ec.hosts[nxt]
        fetched, planned, worker = ahead
        if worker:  # copied by the hand-off worker after this call's job: joined by a wait
            self.events[nxt] = (planned, _WORKER)
            return
        if self.stream is None:
            c.fill(nxt, host, fetched)
            return
        s = self.stream
        s.wait_stream(torch.cuda.current_stream(self.ec.device))
        with torch.cuda.stream(s), record_function("moe.ahead_fill"):
            c.fill_on_device(nxt, host, fetched, AHEAD_FILL_PROGRAMS)
            filled = torch.cuda.Event()
            filled.record(s)
        self.events[nxt] = (planned, filled)

    def join(self, layer: int, planned, filled) -> None:
        """Order what comes next after layer `layer`'s ahead plan (planned: an event) and
        after its copies (filled: an event, or _WORKER: wait for the worker's copies)."""
        if planned is not None:
            torch.cuda.current_stream(self.ec.device).wait_event(planned)
        if filled is _WORKER:
            self.ec.handoff.wait_ahead(layer)
        elif filled is not None:
            torch.cuda.current_stream(self.ec.device).wait_event(filled)

    def hint(self, layer: int, x, ho: Handoff, capturing: bool) -> bool:
        """Post the next layer's predicted CPU experts for the worker to warm while this
        call runs (moe/handoff.py: warming): its router on this layer's input x, less what
        its slots hold. Inside a CUDA graph on the side stream (off the device's path to the
        receive); True when it went there (the caller joins it before the receive)."""
        nxt = None if not self.prefetch or self.ec.fetch_all else self.predicted(layer, x)
        if nxt is None:
            return False
        emap = self.ec.slot_map(nxt)
        side = self.ec.side_stream if capturing else None
        with record_function("moe.hint"):
            if side is None:
                ho.hint(nxt, self.predictors[nxt](x), emap)
                return False
            side.wait_stream(torch.cuda.current_stream(self.ec.device))
            with torch.cuda.stream(side):
                ho.hint(nxt, self.predictors[nxt](x), emap)
        return True
