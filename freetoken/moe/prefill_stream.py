"""Prefill streaming (issue 16): a layer call of PREFILL_TOKENS tokens or more computes from
the layer's WHOLE bank, streamed from the host banks into a device buffer.

A prefill routes to nearly every expert of a layer, so the slot cache's round-by-round fetch
(one host sync per round) only adds latency to what is a full bank copy anyway. Here each part
of a layer's host bank (w13 / w2 data, their block scales, the `[E, 4]` scales rows; each a
contiguous `[E, ...]` tensor) is one big copy into a buffer, and the layer is the plain fused
MoE kernel on that buffer (no expert_map: the buffer IS the layer's bank).

Double buffering: two buffers, layer l in buffer l % 2. When layer l is called, layer l + 1's
copy is queued on the copy stream; it waits on the event recorded after the compute that last
read its buffer (layer l - 1); the compute of layer l waits on its own copy's event. MoE
layers are called 0..L-1 within a step; a layer whose copy the previous call did not start
(the first MoE layer of a step: there is no prefetch across steps, the next step may decode)
starts its own copy, after everything queued on the compute stream so far (slot fills of
earlier decode steps included, which `--moe-prefill-hit-d2d` reads).

Buffer layout: part-major per layer (each part `[E, ...]` contiguous from a 256-byte aligned
offset), so that a part is one copy and its view has the host bank's strides; each buffer is
sized by the largest layer (layers may differ in format: Q4_K / Q6_K / MXFP4) and viewed per
layer, as SlotCache views its pool.

`--moe-prefill-hit-d2d`: experts that the slot cache holds are copied device to device from
their slots (one gather per part) and only the others cross PCIe (one copy per run of
consecutive experts). `--disable-moe-prefill-overlap`: one buffer, every copy waits for the
compute queued before it and the compute for the copy (copy, wait, compute), to measure what
the overlap gives.

On a CPU-only machine (the CPU standing in as the device) the copies are plain tensor copies
and there are no streams: the same code paths, tested in CI.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.profiler import record_function

from freetoken.kernels.moe import fused_moe
from freetoken.moe.banks import ExpertBank
from freetoken.moe.slot_cache import ALIGN, COUNTERS, Part, SlotCache, _view, bank_tensors, layout


def buffer_layout(bank: ExpertBank) -> list[Part]:
    """Where each part `[E, ...]` of the bank sits in a buffer (Part.offset: the part's
    first byte; Part.shape / nbytes: one expert's, as in slot_cache.layout)."""
    E, parts, off = bank.num_experts, [], 0
    for p in layout(bank):
        parts.append(dataclasses.replace(p, offset=off))
        off = -(-(off + E * p.nbytes) // ALIGN) * ALIGN
    return parts


def buffer_bytes(bank: ExpertBank) -> int:
    last = buffer_layout(bank)[-1]
    return last.offset + bank.num_experts * last.nbytes


def stream_bytes(hosts: list[ExpertBank], overlap: bool = True) -> int:
    """Device bytes of the streamer's buffers for these banks (2 buffers, 1 without overlap)."""
    return (2 if overlap else 1) * max(buffer_bytes(h) for h in hosts)


def _rows(buf: torch.Tensor, p: Part, E: int) -> torch.Tensor:
    """uint8 [E, p.nbytes]: part p's bytes in the buffer, one row per expert."""
    return buf[p.offset:p.offset + E * p.nbytes].view(E, p.nbytes)


def _host_rows(t: torch.Tensor) -> torch.Tensor:
    """uint8 [E, bytes of one expert] of a contiguous host bank tensor [E, ...]."""
    return t.reshape(t.shape[0], -1).view(torch.uint8)


def _runs(mask: list[bool]) -> list[tuple[int, int]]:
    """[start, end) runs of consecutive True entries."""
    runs, start = [], None
    for i, m in enumerate([*mask, False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


class PrefillStreamer:
    """Computes MoE layer calls of PREFILL_TOKENS tokens or more from whole streamed banks.

    hosts: the layers' host banks (pinned on a GPU); device: where the buffers live;
    overlap: two buffers and the next layer's copy during this layer's compute (False: one
    buffer, copy then compute); hit_d2d: experts in the slot cache copied from their slots.
    `attach(slots)` gives it the slot cache (its counters, and its slots for hit_d2d).
    """

    def __init__(self, hosts: list[ExpertBank], device: torch.device, overlap: bool = True,
                 hit_d2d: bool = False):
        self.hosts = hosts
        self.device = torch.device(device)
        self.overlap, self.hit_d2d = overlap, hit_d2d
        self.layouts = [buffer_layout(h) for h in hosts]
        self.buffer_bytes = max(buffer_bytes(h) for h in hosts)
        n = 2 if overlap else 1
        self.buffers = [torch.empty(self.buffer_bytes, dtype=torch.uint8, device=self.device)
                        for _ in range(n)]
        # views[b][l]: layer l's bank in buffer b
        self.views = [[self._bank_view(buf, h, lay) for h, lay in zip(hosts, self.layouts)]
                      for buf in self.buffers]
        self.slots: SlotCache | None = None
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self._ready: list = [None] * n  # per buffer: event after its last copy (copy stream)
        self._free: list = [None] * n  # per buffer: event after its last read (compute stream)
        self._next: int | None = None  # the layer whose copy the previous call started
        self._map: list[int] | None = None  # the slot map (every layer) read at a step's start

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def attach(self, slots: SlotCache) -> None:
        self.slots = slots

    def _bank_view(self, buf: torch.Tensor, host: ExpertBank, lay: list[Part]) -> ExpertBank:
        """The host bank's weights with their storage replaced by views of the buffer."""
        E = host.num_experts
        v = {p.name: _view(_rows(buf, p, E), dataclasses.replace(p, offset=0)) for p in lay}
        return ExpertBank(
            dataclasses.replace(host.w13, data=v["w13.data"], scales=v.get("w13.scales")),
            dataclasses.replace(host.w2, data=v["w2.data"], scales=v.get("w2.scales")),
            v["scales"])

    # -- the layer call ------------------------------------------------------------------------
    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                activation: str) -> torch.Tensor:
        """x [T, H], ids / w [T, k] -> y [T, H]: layer `layer` on its streamed bank."""
        b = layer % len(self.buffers)
        if self._next != layer:
            self._start(layer, first=True)
        self._next = None
        if self.overlap and layer + 1 < len(self.hosts):
            self._start(layer + 1, first=False)
            self._next = layer + 1
        compute = None if self.stream is None else torch.cuda.current_stream(self.device)
        if compute is not None:
            compute.wait_event(self._ready[b])
        with record_function("moe.device"):
            y = fused_moe(x, self.views[b][layer], ids, w, activation)
        if compute is not None:
            self._free[b] = compute.record_event()
        self._count(layer, ids)
        return y

    def _count(self, layer: int, ids: torch.Tensor) -> None:
        """The slot cache's counters (device ops, no sync): the call's distinct routed experts
        are hits where hit_d2d copied them from a slot, else misses, all of those fetched."""
        if self.slots is None:
            return
        c = self.slots
        E = c.num_experts
        used = torch.zeros(E, dtype=torch.bool, device=ids.device)
        used[ids.reshape(-1).long()] = True
        routed = used.sum()
        hits = (used & (c.slot_of[layer * E:(layer + 1) * E] >= 0)).sum() if self.hit_d2d \
            else torch.zeros_like(routed)
        vals = {"hits": hits, "misses": routed - hits, "fetched": routed - hits}
        c.counters += torch.stack([vals.get(k, torch.zeros_like(routed)) for k in COUNTERS])

    # -- the copies ----------------------------------------------------------------------------
    def _start(self, layer: int, first: bool) -> None:
        """Queue the copy of layer's bank into its buffer. first: after everything on the
        compute stream (the step's first copy: the buffer's last reader and earlier slot fills
        are there); else after the compute that last read the buffer."""
        b = layer % len(self.buffers)
        if first:
            self._map = self._read_map() if self.hit_d2d else None
        slot_of = None
        if self._map is not None:
            E = self.hosts[layer].num_experts
            slot_of = self._map[layer * E:(layer + 1) * E]
        with record_function("moe.stream_copy"):
            if self.stream is None:
                self._copy(layer, b, slot_of)
                return
            if first:
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
            elif self._free[b] is not None:
                self.stream.wait_event(self._free[b])
            with torch.cuda.stream(self.stream):
                self._copy(layer, b, slot_of)
            self._ready[b] = self.stream.record_event()

    def _read_map(self) -> list[int] | None:
        """(layer, expert) -> slot of every layer, on the host (a sync: once per step)."""
        if self.slots is None:
            return None
        return self.slots.slot_of[:-1].tolist()

    def _copy(self, layer: int, b: int, slot_of: list[int] | None) -> None:
        """Layer's bank into buffer b: every part in runs of experts over PCIe; experts with a
        slot (slot_of[e] >= 0, hit_d2d only) by a gather from the slot pool."""
        host, buf = self.hosts[layer], self.buffers[b]
        E = host.num_experts
        src = bank_tensors(host)
        held = [] if slot_of is None else [e for e in range(E) if slot_of[e] >= 0]
        runs = _runs([slot_of is None or slot_of[e] < 0 for e in range(E)])
        pool_parts = {p.name: p for p in self.slots.layouts[layer]} if held else {}
        if held:
            experts = torch.tensor(held, device=self.device)
            slots = torch.tensor([slot_of[e] for e in held], device=self.device)
        for p in self.layouts[layer]:
            dst = _rows(buf, p, E)
            self._h2d(dst, src[p.name], runs, p.nbytes)
            if held:
                q = pool_parts[p.name]
                pool = self.slots.pool[:, q.offset:q.offset + q.nbytes]  # [S, bytes] strided
                dst.index_copy_(0, experts, pool.index_select(0, slots))

    def _h2d(self, dst: torch.Tensor, src: torch.Tensor, runs: list[tuple[int, int]],
             n: int) -> None:
        """Rows [a, z) of the host tensor src [E, ...] into dst uint8 [E, n], for each run."""
        if self.stream is None:
            rows = _host_rows(src)
            for a, z in runs:
                dst[a:z].copy_(rows[a:z])
            return
        from freetoken.moe.h2d import copy_ranges

        d, s = dst.data_ptr(), src.data_ptr()
        copy_ranges([(d + a * n, s + a * n, (z - a) * n) for a, z in runs], self.stream)
