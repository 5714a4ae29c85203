"""The offload, cpu and hybrid backends: routed experts in host banks, a slot cache on the
device, misses fetched into slots or computed by the CPU executor.

One `ExpertCache` serves every MoE layer of a model (one slot pool, one executor); each
layer's FusedExperts calls `LayerBackend`, which has the MoEFn signature of backends.py. Per
layer call, with M missing experts (distinct experts the call routes to that no slot holds):
- offload: F = M (when the misses outnumber the slots the call may evict, the rest are
  fetched and computed in further rounds);
- cpu: F = 0 (every miss to the CPU executor);
- hybrid: F = round(q* M), capped by --moe-hybrid-max-fetch (policy.py);
- a call of PREFILL_TOKENS tokens or more fetches every miss whatever the backend.
The device computes the hits and the fetched experts with the fused MoE kernel reading slots
through the map (`fused_moe(..., expert_map=)`, -1 = not on the device); the CPU computes the
routes of the other misses from the host banks; the two partial sums are added.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch.profiler import record_function

from freetoken.kernels.moe import fused_moe
from freetoken.moe.banks import ExpertBank
from freetoken.moe.host_banks import executor_bank
from freetoken.moe.policy import FetchPolicy
from freetoken.moe.slot_cache import SlotCache

logger = logging.getLogger(__name__)
CACHE_BACKENDS = ("offload", "hybrid", "cpu")
# A layer call with this many tokens (a prefill) fetches every miss on every backend: the
# device computes many tokens per expert byte, the CPU executor few. (The seed streams such
# steps through a double buffer beside the cache; here they go through the slot cache.)
PREFILL_TOKENS = 64


_ALL = FetchPolicy(None, None, "every miss")


class ExpertCache:
    """Slot cache + CPU executor + split policy for all MoE layers of one model.

    hosts: the layers' host banks; fetch_limit(misses) -> how many to fetch (device tensor op).
    """

    def __init__(self, hosts: list[ExpertBank], num_slots: int, device: torch.device,
                 fetch_limit: Callable, cpu_threads: int | None = None):
        self.hosts = hosts
        self.cache = SlotCache(hosts, num_slots, device)
        self.cache.warm(hosts)
        self.fetch_limit = fetch_limit
        self.device = torch.device(device)
        self.fetch_all = getattr(fetch_limit, "q", 0.0) is None  # offload: nothing to the CPU
        self._exec_banks: list[ExpertBank | None] = [executor_bank(h) for h in hosts]
        self._cpu_threads = cpu_threads
        self._executor = None
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # Set by moe/runtime.py when prefill streaming is on: an object whose
        # forward(layer, x, ids, w, activation) -> y computes a call of PREFILL_TOKENS tokens
        # or more (moe/prefill_stream.py); None: such calls go through the slot cache.
        self.prefill = None
        for i, b in enumerate(self._exec_banks):
            if b is None:
                logger.warning("MoE layer %d: the CPU executor has no kernel for experts in %s "
                               "(ggml type %s): its CPU-computed misses run the torch "
                               "reference on the host", i, hosts[i].w13.fmt,
                               hosts[i].w13.ggml_type)

    @property
    def executor(self):
        """The CPU executor, started on first use (a persistent thread pool)."""
        if self._executor is None:
            from freetoken.moe.cpu_executor import CpuMoeExecutor

            self._executor = CpuMoeExecutor(self._cpu_threads)
            logger.info("CPU MoE executor: %s", self._executor)
        return self._executor

    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                activation: str) -> torch.Tensor:
        """One layer call: plan (device); the CPU's share read to the host; the fetches and the
        device kernel (hits + fetched) queued; the CPU executor runs while the device works;
        the two partial sums added. The phases are profiler ranges (moe.*: `ft bench decode
        --profile` sums them per step)."""
        if self.prefill is not None and ids.shape[0] >= PREFILL_TOKENS:
            return self.prefill.forward(layer, x, ids, w, activation)
        c = self.cache
        fetch_all = self.fetch_all or ids.shape[0] >= PREFILL_TOKENS
        with record_function("moe.plan"):
            fetched = c.plan(layer, ids, _ALL if fetch_all else self.fetch_limit)
            emap = c.expert_map(layer)  # the map already names the slots being filled
        job = None
        if not fetch_all:
            with record_function("moe.to_host"):
                fetched, job = self._to_host(x, ids, w, emap, fetched)
        with record_function("moe.fill"):
            self._fill(layer, fetched)
        with record_function("moe.device"):
            y = fused_moe(x, c.views[layer], ids, w, activation, expert_map=emap)
        if fetch_all:
            return self._more_rounds(layer, x, ids, w, emap, y, activation)
        if job is None:
            return y
        with record_function("moe.cpu"):
            cpu = self._cpu_run(layer, x.shape, job, activation)
        with record_function("moe.sum"):
            return (y.float() + cpu.to(y.device)).to(x.dtype)

    def _fill(self, layer: int, fetched: torch.Tensor) -> None:
        """Copy the fetched experts into their slots on the copy stream, which first waits for
        the compute stream (an evicted slot may still be read by a queued kernel); compute
        then waits for the copies."""
        if self.stream is None:
            self.cache.fill(layer, self.hosts[layer], fetched)
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        self.cache.fill(layer, self.hosts[layer], fetched, self.stream)
        compute.wait_stream(self.stream)

    def _more_rounds(self, layer: int, x, ids, w, emap, y, activation: str) -> torch.Tensor:
        """offload when a call's misses outnumber the slots it may evict (a small cache, a
        prefill): fetch and compute the rest round by round; each round may evict the last
        round's slots, whose routes are done. Exact: every route runs the device kernel.

        NOTE: a host loop (one sync a round); a prefill should stream whole banks instead."""
        c = self.cache
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

    def _to_host(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                 emap: torch.Tensor, fetched: torch.Tensor) -> tuple[torch.Tensor, tuple | None]:
        """The fetch list and the CPU's share on the host in one transfer (each read of a
        device tensor is a sync on a GPU: one per tensor cost tens of microseconds a layer):
        int64 fetch list, CPU-route mask and ids, then x and the routing weights as fp32, all
        as bytes. Returns (fetched on the host, (rows, ids, weights, x rows) or None when the
        CPU has no routes).

        NOTE: made before the device work is queued, so that the executor then overlaps it;
        the CUDA-graph hand-off (a host function on the stream) is not built yet."""
        T, k = ids.shape
        H = x.shape[1]
        on_cpu = emap.long()[ids.long()] < 0  # [T, k]
        ints = torch.cat([fetched.reshape(-1), on_cpu.reshape(-1).long(), ids.reshape(-1).long()])
        floats = torch.cat([x.float(), w.float()], dim=1).reshape(-1)  # [T * (H + k)]
        packed = torch.cat([ints.view(torch.uint8), floats.view(torch.uint8)]).cpu()
        ints_h = packed[:ints.numel() * 8].view(torch.int64)
        n = fetched.shape[1]
        fetched_h = ints_h[:2 * n].view(2, n)
        on_cpu_h = ints_h[2 * n:2 * n + T * k].view(T, k).bool()
        if not bool(on_cpu_h.any()):
            return fetched_h, None
        ids_h = ints_h[2 * n + T * k:].view(T, k)
        xw = packed[ints.numel() * 8:].view(torch.float32).view(T, H + k)
        rows, ids_c, w_c = _compact(on_cpu_h, ids_h, xw[:, H:])
        return fetched_h, (rows, ids_c, w_c.contiguous(), xw[rows, :H].contiguous())

    def _cpu_run(self, layer: int, shape: torch.Size, job: tuple, activation: str
                 ) -> torch.Tensor:
        """fp32 [T, H]: the CPU's routes computed from the host bank (zeros elsewhere)."""
        rows, ids_c, w_c, xh = job
        bank = self._exec_banks[layer]
        if bank is None:  # no executor kernel: the torch reference on the host bank
            part = fused_moe(xh, self.hosts[layer], ids_c, w_c, activation).float()
        else:
            part = self.executor.forward(xh, ids_c, w_c, bank.w13, bank.w2, bank.scales,
                                         activation)
        out = torch.zeros(shape[0], shape[1], dtype=torch.float32)
        out[rows] = part
        return out

    def counters(self) -> dict[str, int]:
        """Totals since load: hits, misses, fetched and cpu (distinct experts per layer call)."""
        return self.cache.read_counters()


def _compact(on_cpu: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Only the CPU's routes, for the executor (which computes every route it is given):
    tokens with at least one such route, k' = their most such routes; padding repeats the
    token's first CPU expert with weight 0 (no extra weight bytes read)."""
    rows = on_cpu.any(dim=1).nonzero().flatten()
    m = on_cpu[rows]  # [R, k]
    kk = int(m.sum(dim=1).max())
    order = torch.argsort((~m).to(torch.int8), dim=1, stable=True)[:, :kk]  # CPU routes first
    ids_c = ids[rows].gather(1, order)
    keep = m.gather(1, order)
    first = ids_c[:, :1].expand_as(ids_c)
    ids_c = torch.where(keep, ids_c, first).to(torch.int32).contiguous()
    w_c = torch.where(keep, w[rows].gather(1, order), torch.zeros(()))
    return rows, ids_c, w_c


class LayerBackend:
    """The MoEFn of one layer: (x, bank, ids, w, activation) -> y; `bank` is ignored (the
    layer's experts are in the cache's host bank and slots)."""

    def __init__(self, cache: ExpertCache, layer: int):
        self.cache, self.layer = cache, layer

    def __call__(self, x, bank, topk_ids, topk_weights, activation):
        return self.cache.forward(self.layer, x, topk_ids, topk_weights, activation)
