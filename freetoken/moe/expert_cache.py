"""The offload, cpu and hybrid backends: routed experts in host banks, a slot cache on the
device, misses fetched into slots or computed by the CPU executor.

One `ExpertCache` serves every MoE layer of a model (one slot pool, one executor); each
layer's FusedExperts calls `LayerBackend`, which has the MoEFn signature of backends.py. Per
layer call, with M missing experts (distinct experts the call routes to that no slot holds):
- offload: F = M (when the misses outnumber the slots the call may evict, the rest are
  fetched and computed in further rounds; inside a CUDA graph, which cannot loop on the
  host, the CPU computes them);
- cpu: F = 0 (every miss to the CPU executor);
- hybrid: F = floor(q* (M + 1)) (the integer split that finishes first, policy.py), capped
  by --moe-hybrid-max-fetch;
- a call of PREFILL_TOKENS tokens or more is streamed (moe/prefill_stream.py) or fetches
  every miss, whatever the backend.
The device computes the hits and the fetched experts with the fused MoE kernel reading slots
through the map (`fused_moe(..., expert_map=)`, -1 = not on the device); the CPU computes the
routes of the other misses from the host banks, handed over through pinned memory with no
host sync (moe/handoff.py), while the device fetches and computes; the two partial sums are
added. On a GPU every decision, fill and hand-off of a decode step is a kernel, so the step
is one CUDA graph.

Fetching ahead (--moe-fetch-ahead N) and warming (FREETOKEN_MOE_PREFETCH=1) use the next
layer's experts as this layer's input predicts them: moe/ahead.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch.profiler import record_function

from freetoken import env
from freetoken.kernels.moe import fused_moe
from freetoken.kernels.norm import take_fold
from freetoken.moe.ahead import Ahead
from freetoken.moe.banks import ExpertBank
from freetoken.moe.handoff import HINT_ROUTES, WAIT_TIMEOUT_S, Handoff
from freetoken.moe.host_banks import executor_bank
from freetoken.moe.policy import FetchPolicy, ahead_counts, prepare_limit_tables
from freetoken.moe.slot_cache import SlotCache

logger = logging.getLogger(__name__)
CACHE_BACKENDS = ("offload", "hybrid", "cpu")
# A layer call with this many tokens (a prefill) runs every expert on the device, whatever the
# backend: the device computes many tokens per expert byte, the CPU executor few.
PREFILL_TOKENS = 64

_ALL = FetchPolicy(None, None, "every miss")


class ExpertCache:
    """Slot cache + CPU executor + split policy for all MoE layers of one model.

    hosts: the layers' host banks; fetch_limit(misses) -> how many to fetch (device tensor op).
    """

    def __init__(self, hosts: list[ExpertBank], num_slots: int, device: torch.device,
                 fetch_limit: Callable, cpu_threads: int | None = None, top_k: int = 1,
                 fetch_ahead: int = 0):
        self.hosts = hosts
        self.cache = SlotCache(hosts, num_slots, device)
        self.cache.warm(hosts)
        self.fetch_limit = fetch_limit
        self.device = torch.device(device)
        if self.device.type == "cuda":  # its device tables, before any graph is captured
            prepare_limit_tables(fetch_limit, self.device)
        self.top_k = top_k
        self.fetch_all = getattr(fetch_limit, "q", 0.0) is None  # offload: nothing to the CPU
        self.never_fetches = getattr(fetch_limit, "cap", None) == 0  # cpu, or a hybrid cap of 0
        self._exec_banks: list[ExpertBank | None] = [executor_bank(h) for h in hosts]
        self._cpu_threads = cpu_threads
        self._executor = None
        self._handoff: Handoff | None = None
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # the shared expert's stream, beside the plan, the fills and the routed experts
        self.side_stream = (torch.cuda.Stream(self.device)
                            if self.device.type == "cuda" and env.gpu_side_stream() else None)
        # Set by moe/runtime.py when prefill streaming is on: an object whose
        # forward(layer, x, ids, w, activation) -> y computes a call of PREFILL_TOKENS tokens
        # or more (moe/prefill_stream.py); None: such calls go through the slot cache.
        self.prefill = None
        missing = [(i, h) for i, (h, b) in enumerate(zip(hosts, self._exec_banks)) if b is None]
        if missing and not self.fetch_all:
            i, h = missing[0]
            raise ValueError(f"MoE layer {i}: the CPU executor has no kernel for experts in "
                             f"{h.w13.fmt} (ggml type {h.w13.ggml_type}), so the "
                             f"{'cpu' if fetch_limit.q == 0 else 'hybrid'} backend cannot "
                             "compute its misses: use --moe-backend offload")
        self.cpu_capable = not missing
        # the next layer's predicted experts: fetched ahead, warmed (moe/ahead.py)
        self.ahead = Ahead(self, fetch_ahead)
        self.failures = 0  # hand-off failures recovered from (`after_step`)

    @property
    def executor(self):
        """The CPU executor, started on first use (a persistent thread pool)."""
        if self._executor is None:
            from freetoken.moe.cpu_executor import CpuMoeExecutor, crowding

            why = crowding(self._cpu_threads) if self.device.type == "cuda" else None
            if why:
                logger.warning(why)
            self._executor = CpuMoeExecutor(self._cpu_threads)
            logger.info("CPU MoE executor: %s", self._executor)
        return self._executor

    @property
    def handoff(self) -> Handoff:
        """The CPU hand-off (its worker thread started on first use)."""
        if self._handoff is None:
            self._handoff = Handoff(self.executor, self._exec_banks, self.top_k, self.device,
                                    PREFILL_TOKENS)
            if self.ahead.prefetch and not self.fetch_all:
                self._handoff.set_prefetch(True, _fetch_table(self.fetch_limit, HINT_ROUTES),
                                           ahead_counts(self.fetch_limit))
            if self.ahead.n and env.moe_ahead_worker():
                why = self._start_copies(self._handoff)
                if why is not None:
                    logger.info("fetching ahead: the slots are filled by a device kernel, "
                                "not the hand-off worker's copies: %s", why)
        return self._handoff

    def _start_copies(self, ho: Handoff) -> str | None:
        """The hand-off worker copies the ahead lists (`Handoff.start_copies`); None, or why
        not."""
        c = self.cache
        layers = [c.copy_parts(i, host) for i, host in enumerate(self.hosts)]
        why = next((p for p in layers if isinstance(p, str)), None)
        return why or ho.start_copies(c.pool, c.slot_bytes, layers)

    def close(self) -> None:
        """Stop the hand-off's worker thread and let the executor's pool go (the next engine
        on the same model starts its own): idle, they still hold CPUs and poll."""
        if self._handoff is not None:
            self._handoff.close()
            self._handoff = None
        self._executor = None

    def graph_max_bs(self, max_bs: int) -> int:
        """The largest decode batch a CUDA graph may hold: any, when the CPU can take what
        the slots cannot (offload's leftovers inside a graph go to the CPU); else as many
        tokens as never overflow the slots (offload without an executor kernel)."""
        if self.cpu_capable:
            return min(max_bs, PREFILL_TOKENS - 1)
        return min(max_bs, self.cache.num_slots // self.top_k)

    def begin_step(self, num_tokens: int) -> None:
        """Before a step (a graph replay included): its real token count for the hand-off."""
        if self._handoff is not None:
            self._handoff.set_live(num_tokens)

    def after_step(self) -> None:
        """Raise what the hand-off's worker or wait reported during the step (or a step
        before it: a GPU's step may still run). After a failure the cache recovers first:
        the device finishes, the worker's late answers and copies land (`Handoff.drain`), and
        every slot is filled again as at load, so that no later step reads a slot a late copy
        overwrote."""
        ho = self._handoff
        if ho is None:
            return
        try:
            ho.check()
        finally:
            if ho.failed:
                self._recover(ho)

    def _recover(self, ho: Handoff) -> None:
        ho.failed = False
        self.failures += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # nothing more posted while it drains
        drained = ho.drain()
        with torch.inference_mode():  # the tables may be inference tensors (made under it)
            self.cache.clear()
            self.cache.warm(self.hosts)
        if drained:
            logger.warning("CPU MoE hand-off failed: the expert cache was filled again as at "
                           "load (late copies may have written its slots)")
        else:
            logger.error("CPU MoE hand-off failed and its worker did not finish within %.0f "
                         "s: the expert cache was filled again, but a copy still in flight "
                         "may write a slot later", WAIT_TIMEOUT_S)

    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                activation: str, side: Callable | None = None):
        """One layer call. Prefill-sized calls: the streamer, or every miss fetched. Eager
        offload: every miss fetched, in rounds when they outnumber the free slots. Otherwise
        (cpu, hybrid, and offload inside a CUDA graph) the hand-off path, which has no host
        sync. The phases are profiler ranges (moe.*: `ft bench decode --profile` sums them).

        side: the layer's other device work as y -> y + terms that do not depend on y (the
        shared expert); it is applied to the device's partial sum while the CPU computes its
        share (the CPU's part is added after it), and side(y) is returned (side(y, fold)
        where its add writes the output last: its kernel may take the next residual step).
        A side with `prepare()` / `finish(y, terms, fold)` (layers/moe.py: SharedSide) has
        its terms computed on
        a second stream on a GPU, beside the plan, the slot fills and the routed experts."""
        T = ids.shape[0]
        split = not (T >= PREFILL_TOKENS or (self.fetch_all and not _capturing()))
        self.ahead.join_before(layer, split)
        # the residual step after this call (kernels/norm.py: folding), for the kernel that
        # writes the output last: the receive of the CPU's answer, or the device's kernel
        fold = take_fold(x)
        if split:
            return self._split(layer, x, ids, w, activation, side, fold)
        if self.prefill is not None and T >= PREFILL_TOKENS:
            y = self.prefill.forward(layer, x, ids, w, activation)
        else:
            y = self._fetch_all(layer, x, ids, w, activation)
        return y if side is None else side(y, fold)

    def _split(self, layer: int, x, ids, w, activation: str, side: Callable | None = None,
               fold=None):
        """Plan (hits, fetches, the CPU's misses) on the device; the CPU's job posted; the
        fetches copied into their slots; the device kernel over hits and fetched experts;
        the CPU's answer added. Offload (graphs only) posts a job only when a call's misses
        can outnumber the slots: their leftovers are the CPU's. fold: the residual step
        after the call (`kernels/norm.py` NormFold), for the last kernel to compute where it
        can (the receive, or the device kernel where no receive or side follows it)."""
        c = self.cache
        T = ids.shape[0]
        capturing = _capturing()
        to_cpu = not self.fetch_all or c.num_slots < T * self.top_k
        terms = self._side_terms(side)
        ho = self.handoff if to_cpu else None
        if ho is not None and not capturing:
            ho.set_live(T)  # an eager call's rows are all real
        on_gpu = self.device.type == "cuda"
        # this layer's slots given ahead by the last call: its plan after their plan, the
        # kernel reading them after their copies (its own fill, into other slots, beside them)
        ahead_plan, ahead_fill = self.ahead.take(layer)
        self.ahead.join(layer, ahead_plan, None)
        with record_function("moe.plan"):
            live = ho.live if ho is not None and on_gpu else None
            # on a GPU the plan kernel also posts the CPU's job, with the map it writes
            job = (ho.job(layer, x, ids, w, activation)
                   if ho is not None and c.plans_in_one_launch(ids) else None)
            fetched = c.plan(layer, ids, _ALL if self.fetch_all else self.fetch_limit,
                             live=live, job=job)
            emap = self.slot_map(layer)  # hits and fetched: a slot; else -1
        # the next layer's slots given ahead (and its hint, after them): on a GPU on the
        # ahead stream after the job; with the CPU standing in, before the hint
        ahead = self.ahead.plan(layer, x, ho, live)
        # the next layer's hint: after the job on a GPU (tagged by the job counter the plan or
        # send kernel advanced), before it with the CPU standing in (tagged with the number
        # the job will get, so the worker finds it when it is done)
        if ho is not None and not on_gpu:
            self.ahead.hint(layer, x, ho, capturing)
        if ho is not None and job is None:
            with record_function("moe.to_host"):
                ho.send(layer, x, ids, w, emap, activation)
        hinted = (ho is not None and on_gpu and self.ahead.stream is None
                  and self.ahead.hint(layer, x, ho, capturing))
        with record_function("moe.fill"):
            if self.never_fetches:
                pass  # the cpu backend: nothing to fill (no empty launch per layer)
            elif c.device_fill:
                c.fill_on_device(layer, self.hosts[layer], fetched)
            elif capturing:
                raise RuntimeError("the slot cache cannot be filled inside a CUDA graph "
                                   "(a part's bytes are not a multiple of 4)")
            else:
                self._fill(layer, fetched)
        self.ahead.join(layer, None, ahead_fill)
        last = fold if ho is None and side is None else None  # the device kernel's
        with record_function("moe.device"):
            y = fused_moe(x, c.views[layer], ids, w, activation, expert_map=emap,
                          norm_fold=last)
        shared = None
        if hinted or terms is not None:  # the side stream's work, joined before the wait
            torch.cuda.current_stream(self.device).wait_stream(self.side_stream)
        side_fold = fold if ho is None else None  # the side's add writes the output last
        if terms is not None:
            shared = _fold(side, terms, ho)
            if shared is None:
                y = side.finish(y, terms, side_fold)
        elif side is not None:  # before the wait: off the critical path when the CPU is
            y = side(y, side_fold)
        if ho is not None:
            with record_function("moe.cpu"):
                y = ho.receive(y, shared, fold)
        if ahead is not None:
            self.ahead.fill(layer + 1, ahead)
        return y

    def slot_map(self, layer: int) -> torch.Tensor:
        """The layer's expert -> slot map, a view of the cache's (read when a kernel runs)."""
        E = self.cache.num_experts
        return self.cache.slot_of[layer * E:(layer + 1) * E]

    def _side_terms(self, side: Callable | None):
        """The side work's terms started on the side stream (after what the compute stream
        has queued: x), or None where it runs in one piece. Their tensors are made on the side
        stream and read on the compute stream after the join; the allocator hands their
        memory again only to the side stream, whose next work waits for the compute stream
        (the next call's fork), so no kernel overwrites them early (a graph's replay keeps
        the captured order)."""
        if side is None or self.side_stream is None or not hasattr(side, "prepare"):
            return None
        self.side_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side_stream), record_function("moe.side"):
            return side.prepare()

    def _fetch_all(self, layer: int, x, ids, w, activation: str) -> torch.Tensor:
        """Every miss fetched and computed on the device, in rounds when the misses outnumber
        the slots the call may evict (a small cache, a prefill); each round may evict the
        last round's slots, whose routes are done. Exact: every route runs the device kernel.

        NOTE: a host loop (one sync a round): eager steps only."""
        c = self.cache
        with record_function("moe.plan"):
            fetched = c.plan(layer, ids, _ALL)
            emap = c.expert_map(layer)  # the map already names the slots being filled
        with record_function("moe.fill"):
            self._fill(layer, fetched)
        with record_function("moe.device"):
            y = fused_moe(x, c.views[layer], ids, w, activation, expert_map=emap)
        left = emap.long()[ids.long()] < 0  # [T, k] routes not computed yet
        y = y.float()
        while bool(left.any()):
            sub = ids[left].reshape(-1, 1)
            self._fill(layer, c.plan(layer, sub, _ALL, count=False))
            mine = torch.zeros(c.num_experts, dtype=torch.bool, device=ids.device)
            mine[sub.flatten().long()] = True
            emap = torch.where(mine, c.expert_map(layer), -1).to(torch.int32)
            y += fused_moe(x, c.views[layer], ids, w, activation, expert_map=emap).float()
            left &= emap.long()[ids.long()] < 0
        return y.to(x.dtype)

    def _fill(self, layer: int, fetched: torch.Tensor) -> None:
        """Copy the fetched experts into their slots on the copy stream, which first waits for
        the compute stream (an evicted slot may still be read by a queued kernel); compute
        then waits for the copies. (Reads the fetch list on the host: eager only.)"""
        if self.stream is None:
            self.cache.fill(layer, self.hosts[layer], fetched)
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        self.cache.fill(layer, self.hosts[layer], fetched, self.stream)
        compute.wait_stream(self.stream)

    def counters(self) -> dict[str, int]:
        """Totals since load: hits, misses, fetched and cpu (distinct experts per layer call)."""
        return self.cache.read_counters()

    def prefetch_stats(self) -> dict[str, int] | None:
        """The hand-off worker's warming totals (`Handoff.prefetch_stats`), None before it
        started or with warming off."""
        if self._handoff is None or not self.ahead.prefetch:
            return None
        return self._handoff.prefetch_stats()


def _fetch_table(fetch_limit, n: int) -> list[int]:
    """F for M = 0 .. n misses as the plan applies `fetch_limit` (a FetchPolicy, capped, or
    an int: at most that many), for the hand-off worker's warming."""
    if isinstance(fetch_limit, int):
        return [min(m, fetch_limit) for m in range(n + 1)]
    cap = fetch_limit.cap
    return [f if cap is None else min(f, cap) for f in fetch_limit.limits(n)]


def _fold(side, terms, ho: Handoff | None) -> tuple | None:
    """The side's terms as the receive kernel adds them to the device's partial sum in its
    own launch (layers/moe.py: SharedSide.fold, the shared expert and its gate; one launch
    fewer on the device path, the longer side of a layer at batch 1), else None: no receive,
    a side it cannot fold, or FREETOKEN_GPU_RECEIVE_SHARED=0."""
    if ho is None or not hasattr(side, "fold") or not env.gpu_receive_shared():
        return None
    return side.fold(terms)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class LayerBackend:
    """The MoEFn of one layer: (x, bank, ids, w, activation) -> y; `bank` is ignored (the
    layer's experts are in the cache's host bank and slots)."""

    def __init__(self, cache: ExpertCache, layer: int):
        self.cache, self.layer = cache, layer

    def __call__(self, x, bank, topk_ids, topk_weights, activation):
        return self.cache.forward(self.layer, x, topk_ids, topk_weights, activation)

    def with_side(self, x, topk_ids, topk_weights, activation, side: Callable):
        """side(y): `side` (y -> y + the shared expert) runs on the device's partial sum while
        the CPU computes its share of the routed experts."""
        return self.cache.forward(self.layer, x, topk_ids, topk_weights, activation, side)
