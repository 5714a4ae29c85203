"""The expert slot cache (DESIGN.md): one pool of slots on the device for every MoE layer.

A slot holds one expert: its `w13` rows, its `w2` rows (and their block scales) and its
`scales` row. Layers may differ in format (a Q4_K_M file keeps some layers' down experts in
Q6_K; the tiny test GGUFs mix Q4_K and MXFP4), so the pool is raw bytes, `uint8 [S, slot]`,
`slot` the largest layer's expert, and each layer views it through its own layout: a pool
`ExpertBank` whose weights are strided views `[S, ...]` of the same bytes.

The bookkeeping lives on the device as tensors, updated by tensor ops only, so that a decode
step needs no host sync to decide hits, victims and the map (a CUDA graph can hold it):
- `slot_of` int32 `[L*E + 1]`: (layer, expert) -> slot or -1; the last entry is a sink that
  masked writes go to (fixed shapes instead of data-dependent ones);
- `owner` int64 `[S + 1]`: slot -> layer * E + expert or -1 (last entry: sink);
- `last_use` int64 `[S + 1]`: the clock of the slot's last use (LRU); -1 = empty;
- `clock` int64 `[1]`: advanced once per layer call. A slot whose last_use is the clock (or
  after it) is used by the current call and is never evicted by it; `plan_ahead` stamps its
  slots with the next call's clock, so that call's fetches do not take them while their
  copies may still be in flight.
- `fresh` int32 `[S + 1]`: 1 where a slot was filled ahead of its layer's call (`plan_ahead`)
  and that call has not used it yet.
Counters (int64 `[6]`: hits, misses, fetched, cpu, distinct experts per layer call; ahead, the
experts fetched ahead, and ahead_hits, those of them that their layer's next call then
routed to) are read by the host only when it logs or serves /metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.formats.qweight import QuantWeight
from freetoken.moe.banks import ExpertBank
from freetoken.moe.policy import LIMIT_TABLE, ahead_counts, limit_table

ALIGN = 256  # bytes: every part of a slot starts on a 256-byte boundary (GPU loads, dtype views)
COUNTERS = ("hits", "misses", "fetched", "cpu", "ahead", "ahead_hits")
_NEVER = torch.iinfo(torch.int64).max


def plan_kernel_routes() -> int:
    """The most routes (T * k) a layer call plans in one kernel launch on a GPU (the torch
    ops above that: prefill)."""
    from freetoken.kernels.triton.slot_plan import MAX_ROUTES

    return MAX_ROUTES


def _round(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class Part:
    """One tensor of an expert inside a slot: bytes [offset, offset + nbytes)."""

    name: str  # w13.data | w13.scales | w2.data | w2.scales | scales
    offset: int
    shape: tuple[int, ...]  # one expert's shape
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def bank_tensors(bank: ExpertBank) -> dict[str, torch.Tensor]:
    """The bank's per-expert tensors `[E, ...]` by part name (block scales where present)."""
    out = {"w13.data": bank.w13.data, "w2.data": bank.w2.data, "scales": bank.scales}
    if bank.w13.scales is not None:
        out["w13.scales"] = bank.w13.scales
    if bank.w2.scales is not None:
        out["w2.scales"] = bank.w2.scales
    return out


def layout(bank: ExpertBank) -> list[Part]:
    """Where each of one expert's tensors sits in a slot."""
    parts, off = [], 0
    for name, t in bank_tensors(bank).items():
        p = Part(name, off, tuple(t.shape[1:]), t.dtype)
        parts.append(p)
        off = _round(off + p.nbytes)
    return parts


def slot_bytes(bank: ExpertBank) -> int:
    last = layout(bank)[-1]
    return _round(last.offset + last.nbytes)


def _view(pool: torch.Tensor, p: Part) -> torch.Tensor:
    """[S, *p.shape] view of part p in every slot of the byte pool [S, slot]."""
    raw = pool[:, p.offset:p.offset + p.nbytes]
    return raw.view(p.dtype).view(pool.shape[0], *p.shape)


class SlotCache:
    """Slots for the experts of every layer; see the module docstring.

    banks: one host ExpertBank per MoE layer (the layout of each layer's slots comes from it);
    num_slots: the pool size; device: where the pool and the bookkeeping live.
    """

    def __init__(self, banks: list[ExpertBank], num_slots: int, device: torch.device):
        self.device = torch.device(device)
        self.num_layers = len(banks)
        self.num_experts = banks[0].num_experts
        if any(b.num_experts != self.num_experts for b in banks):
            raise ValueError("slot cache: every MoE layer must have the same expert count, got "
                             f"{sorted({b.num_experts for b in banks})}")
        self.num_slots = num_slots
        self.layouts = [layout(b) for b in banks]
        self.slot_bytes = max(slot_bytes(b) for b in banks)
        # Zeros: a slot that was never filled still decodes to finite weights (0 * weight = 0).
        self.pool = torch.zeros(num_slots, self.slot_bytes, dtype=torch.uint8, device=device)
        self.views = [self._pool_bank(b, lay) for b, lay in zip(banks, self.layouts)]
        L, E, S = self.num_layers, self.num_experts, num_slots
        self.slot_of = torch.full((L * E + 1,), -1, dtype=torch.int32, device=device)
        self.owner = torch.full((S + 1,), -1, dtype=torch.int64, device=device)
        self.last_use = torch.full((S + 1,), -1, dtype=torch.int64, device=device)
        self.clock = torch.zeros(1, dtype=torch.int64, device=device)
        self.fresh = torch.zeros(S + 1, dtype=torch.int32, device=device)
        self.counters = torch.zeros(len(COUNTERS), dtype=torch.int64, device=device)
        self._fill_tables: dict = {}  # (layer, bank address) -> fill_on_device's part table
        # whether fill_on_device can copy every layer's parts (whole 4-byte words)
        self.device_fill = self.pool.is_cuda and all(
            p.nbytes % 4 == 0 for lay in self.layouts for p in lay)

    @property
    def nbytes(self) -> int:
        return self.pool.numel()

    def _pool_bank(self, bank: ExpertBank, lay: list[Part]) -> ExpertBank:
        """The layer's view of the pool as an ExpertBank of S experts."""
        v = {p.name: _view(self.pool, p) for p in lay}
        S = self.num_slots

        def qw(w: QuantWeight, key: str) -> QuantWeight:
            return QuantWeight(v[f"{key}.data"], w.fmt, (S, *w.shape[1:]),
                               scales=v.get(f"{key}.scales"), ggml_type=w.ggml_type,
                               source=w.source)

        return ExpertBank(qw(bank.w13, "w13"), qw(bank.w2, "w2"), v["scales"])

    # -- decisions (device tensor ops, no host sync) -----------------------------------------
    def plans_in_one_launch(self, ids: torch.Tensor) -> bool:
        """Whether `plan` of these ids is the one-launch kernel (which can also post a job)."""
        return self.device.type == "cuda" and ids.numel() <= plan_kernel_routes()

    def plan(self, layer: int, ids: torch.Tensor, fetch_limit, count: bool = True,
             live: torch.Tensor | None = None, job=None) -> torch.Tensor:
        """Look up layer `layer`'s experts of `ids` [T, k], mark the hits used, and give slots
        to up to `fetch_limit` missing experts (an int, or a policy.FetchPolicy: a 0-dim
        device tensor computed from the miss count), evicting the least recently used slots
        that this call does not use. On a GPU a call of up to plan_kernel_routes() routes is
        one kernel launch (kernels/triton/slot_plan.py) with the same results.

        Returns `fetched` int64 [2, n] (expert, slot) rows with -1 where nothing is fetched
        (fixed n = min(E, T*k)); the map (layer's experts -> slot or -1) is `expert_map(layer)`.
        count=False: a later round of the same call (offload's, when its misses outnumber the
        slots): its fetches move experts from the cpu counter to the fetched one.
        job: the hand-off's job of this call (`Handoff.job`), posted by the same kernel once
        the map is written; only where `plans_in_one_launch`.
        """
        E, S = self.num_experts, self.num_slots
        if self.plans_in_one_launch(ids):
            from freetoken.kernels.triton.slot_plan import plan_triton

            table, cap, counts = self._limit_cap(fetch_limit)
            return plan_triton(self, layer, ids, table, cap, count, live, job, counts)
        if job is not None:
            raise ValueError("SlotCache.plan: a job is posted by the one-launch plan only")
        base = layer * E
        self.clock += 1
        flat = ids.reshape(-1).long()
        counts = torch.zeros(E, dtype=torch.int64, device=ids.device)
        counts.index_add_(0, flat, torch.ones_like(flat))
        used = counts > 0
        cur = self.slot_of[base:base + E].long()
        hit, miss = used & (cur >= 0), used & (cur < 0)
        # touch the hits: last_use = clock (masked rows write to the sink S); hits on slots
        # filled ahead are counted, and those slots are no longer fresh
        hit_slot = torch.where(hit, cur, S)
        self.last_use.index_put_((hit_slot,), self.clock.expand(E))
        ahead_hits = (self.fresh[hit_slot].long() * hit).sum()
        self.fresh.index_put_((hit_slot,), torch.zeros_like(hit_slot, dtype=torch.int32))
        n = min(E, flat.numel())
        # misses first, the most-routed first, then the lower expert id (ties broken in the
        # score itself: topk's order among equal values is not specified)
        arange_e = torch.arange(E, device=ids.device)
        score = torch.where(miss, counts * E + (E - 1 - arange_e), -1)
        cand_score, cand = torch.topk(score, n)
        n_miss = (cand_score >= 0).sum()
        # victims: the oldest slots this call does not use (hits were just stamped)
        vict, free, nv = self._victims(n)
        if ahead_counts(fetch_limit):  # the slots filled ahead count as fetches
            limit = (fetch_limit(n_miss + ahead_hits) - ahead_hits).clamp(min=0)
        else:
            limit = fetch_limit(n_miss) if callable(fetch_limit) else fetch_limit
        f = torch.minimum(torch.minimum(n_miss, free),
                          torch.as_tensor(limit, device=ids.device).clamp(0, nv))
        fetch = torch.arange(n, device=ids.device) < f
        self._assign(base + cand, vict, fetch)
        zero = torch.zeros_like(f)
        if count:
            self.counters += torch.stack([hit.sum(), miss.sum(), f, n_miss - f, zero,
                                          ahead_hits])
        else:
            self.counters += torch.stack([zero, zero, f, -f, zero, zero])
        return torch.stack([torch.where(fetch, cand, -1), torch.where(fetch, vict, -1)])

    def plan_ahead(self, layer: int, ids: torch.Tensor, limit: int,
                   live: torch.Tensor | None = None) -> torch.Tensor:
        """Slots for up to `limit` of layer `layer`'s predicted experts (`ids` [T, k], the
        routes its router gives the previous layer's input) that no slot holds, taken before
        that layer's call (ExpertCache: fetching ahead, while the device runs the layers in
        between): most-routed first, then the first predicted. The clock does not move: the
        slots the current call uses stay protected; the new ones are marked fresh and stamped
        with the next call's clock, so that call's fetches do not evict them (it fills its own
        slots while these copies may still run) and counts them as used by it; hits are not
        touched.
        Returns `fetched` int64 [2, n] like `plan` (n = min(E, T*k)). On a GPU, one launch
        (`slot_plan.ahead_triton`; live as for `plan`).
        """
        E, S = self.num_experts, self.num_slots
        if self.plans_in_one_launch(ids):
            from freetoken.kernels.triton.slot_plan import ahead_triton

            return ahead_triton(self, layer, ids, limit, live)
        base = layer * E
        flat = ids.reshape(-1).long()
        R = flat.numel()
        counts = torch.zeros(E, dtype=torch.int64, device=ids.device)
        counts.index_add_(0, flat, torch.ones_like(flat))
        first = torch.full((E,), R, dtype=torch.int64, device=ids.device)
        first.scatter_reduce_(0, flat, torch.arange(R, device=ids.device), "amin")
        want = (counts > 0) & (self.slot_of[base:base + E] < 0)
        n = min(E, R)
        cand_score, cand = torch.topk(torch.where(want, counts * R + (R - 1 - first), -1), n)
        vict, free, nv = self._victims(n)
        f = torch.minimum(torch.minimum((cand_score >= 0).sum(), free),
                          torch.as_tensor(max(0, min(limit, nv)), device=ids.device))
        fetch = torch.arange(n, device=ids.device) < f
        self._assign(base + cand, vict, fetch, self.clock + 1)
        self.fresh.index_put_((torch.where(fetch, vict, S),),
                              torch.ones_like(vict, dtype=torch.int32))
        zero = torch.zeros_like(f)
        self.counters += torch.stack([zero, zero, zero, zero, f, zero])
        return torch.stack([torch.where(fetch, cand, -1), torch.where(fetch, vict, -1)])

    def _victims(self, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(the n slots fetches take in turn: the oldest stamped before the clock, among
        equally old ones the lower index, the last repeated past nv; how many slots are
        stamped before it, a 0-dim tensor; nv = min(n, S))."""
        S = self.num_slots
        protected = self.last_use[:S] >= self.clock
        order = self.last_use[:S] * (S + 1) + torch.arange(S, device=self.device)
        nv = min(n, S)
        victims = torch.topk(torch.where(protected, _NEVER, order), nv, largest=False).indices
        return (victims[torch.arange(n, device=self.device).clamp(max=nv - 1)],
                (~protected).sum(), nv)

    def _limit_cap(self, fetch_limit) -> tuple[torch.Tensor, int, bool]:
        """(the plan kernel's table of F for 0 .. LIMIT_TABLE - 1 misses, an int32 device
        tensor; cap; whether hits on slots filled ahead count as fetches) of an int limit
        (every miss, capped) or a policy.FetchPolicy (they count: see `plan`)."""
        if isinstance(fetch_limit, int):
            policy, cap = None, fetch_limit
        else:
            policy, cap = fetch_limit, fetch_limit.cap
        table = limit_table(policy, LIMIT_TABLE, self.device)
        return table, self.num_experts if cap is None else cap, ahead_counts(fetch_limit)

    def _assign(self, keys: torch.Tensor, slots: torch.Tensor, fetch: torch.Tensor,
                stamp: torch.Tensor | None = None) -> None:
        """slot_of[keys] = slots where fetch, evicting the slots' old owners (a fresh slot
        evicted before its call used it is no longer fresh); their last_use = stamp (a [1]
        tensor, default the clock)."""
        S, sink = self.num_slots, self.slot_of.numel() - 1
        self.fresh.index_put_((torch.where(fetch, slots, S),),
                              torch.zeros_like(slots, dtype=torch.int32))
        old = self.owner[torch.where(fetch, slots, S)]
        gone = torch.where(fetch & (old >= 0), old, sink)
        self.slot_of.index_put_((gone,), torch.full_like(gone, -1, dtype=torch.int32))
        self.owner.index_put_((torch.where(fetch, slots, S),), keys)
        self.slot_of.index_put_((torch.where(fetch, keys, sink),), slots.to(torch.int32))
        stamp = self.clock if stamp is None else stamp
        self.last_use.index_put_((torch.where(fetch, slots, S),), stamp.expand_as(slots))

    def warm(self, hosts: list[ExpertBank]) -> None:
        """Fill every slot at load, spread evenly over the layers (expert j of layer l in slot
        j * L + l), so the first steps and the cpu backend, which never fetches, start with
        hits."""
        L, E = self.num_layers, self.num_experts
        n = min(self.num_slots, L * E)
        slots = torch.arange(n, device=self.device)
        keys = (slots % L) * E + slots // L
        self._assign(keys, slots, torch.ones(n, dtype=torch.bool, device=self.device))
        for layer in range(L):
            mine = slots[slots % L == layer]
            self.fill(layer, hosts[layer], torch.stack([mine // L, mine]))
            if self.device_fill:  # its part table now: a CUDA graph capture cannot make it
                self._fill_table(layer, hosts[layer])

    def clear(self) -> None:
        """Forget every slot's expert (all empty; the counters stay): after a failed hand-off
        whose late copies may have written slots given to other experts since (ExpertCache
        `after_step`). In place, so CUDA graphs keep their addresses; ordered on the current
        stream."""
        self.slot_of.fill_(-1)
        self.owner.fill_(-1)
        self.last_use.fill_(-1)
        self.fresh.zero_()

    def expert_map(self, layer: int) -> torch.Tensor:
        """int32 [E]: the layer's expert -> slot, -1 where not cached (a copy)."""
        E = self.num_experts
        return self.slot_of[layer * E:(layer + 1) * E].clone()

    # -- data ----------------------------------------------------------------------------------
    def fill(self, layer: int, host: ExpertBank, fetched: torch.Tensor,
             stream: torch.cuda.Stream | None = None) -> int:
        """Copy the fetched (expert, slot) rows' tensors from the host bank into their slots
        (on a GPU: one driver copy per part from the pinned bank, on `stream`). Returns the
        number of experts copied.

        NOTE: this reads the fetched list on the host (a sync unless it is there already); a
        GPU gather kernel reading the pinned host bank through the map would keep it inside a
        graph."""
        rows = fetched[:, fetched[0] >= 0].cpu()
        if rows.shape[1] == 0:
            return 0
        src = bank_tensors(host)
        if self.pool.is_cuda:
            from freetoken.moe.h2d import copy_ranges

            base, sb = self.pool.data_ptr(), self.slot_bytes
            parts = [(p.offset, src[p.name].data_ptr(), p.nbytes) for p in self.layouts[layer]]
            copy_ranges([(base + s * sb + off, ptr + e * n, n) for e, s in rows.t().tolist()
                         for off, ptr, n in parts],
                        stream or torch.cuda.current_stream(self.device))
            return rows.shape[1]
        dst = {p.name: _view(self.pool, p) for p in self.layouts[layer]}
        for e, s in rows.t().tolist():
            for name, t in src.items():
                dst[name][s].copy_(t[e])
        return rows.shape[1]

    def copy_parts(self, layer: int, host: ExpertBank) -> list[tuple[int, int, int]] | str:
        """The layer's parts as the hand-off worker copies them (moe/handoff.py: copies
        ahead): (host address of expert 0's part, its bytes per expert, its offset in a
        slot), or why it cannot (a part that is not one contiguous host tensor)."""
        src = bank_tensors(host)
        parts = []
        for p in self.layouts[layer]:
            t = src[p.name]
            if not t.is_contiguous() or t.device.type != "cpu":
                return f"MoE layer {layer}'s {p.name} is not one contiguous host tensor"
            parts.append((t.data_ptr(), p.nbytes, p.offset))
        return parts

    def fill_on_device(self, layer: int, host: ExpertBank, fetched: torch.Tensor,
                       programs: int | None = None) -> None:
        """`fill` by a GPU kernel that reads the pinned host bank directly (kernels/triton/
        handoff.py): no host sync, so it can be captured in a CUDA graph. Needs every part's
        bytes per expert to be a multiple of 4 (`device_fill`). programs: per fetched part
        (handoff.fill), None: one per chunk."""
        from freetoken.kernels.triton.handoff import fill

        table, max_words, vec = self._fill_table(layer, host)
        fill(fetched, self.pool, table, max_words, vec, programs)

    def _fill_table(self, layer: int, host: ExpertBank) -> tuple[torch.Tensor, int, bool]:
        """(the layer's part table on the device, its largest part's words, whether all are
        whole 16-byte units) for the fill kernel; made once per bank (warm() makes them before
        any graph capture)."""
        from freetoken.kernels.triton.handoff import fill_table

        key = (layer, host.w13.data.data_ptr())
        if key not in self._fill_tables:
            src = bank_tensors(host)
            parts = [(src[p.name], p.offset, p.nbytes) for p in self.layouts[layer]]
            table, vec = fill_table(parts, self.device)
            self._fill_tables[key] = (table, max(p.nbytes for p in self.layouts[layer]) // 4,
                                      vec)
        return self._fill_tables[key]

    def read_counters(self) -> dict[str, int]:
        """The counters, read through pinned memory and an event (`sampler.read_ids`): a
        pageable copy would hold the CUDA driver while it waits for the device, and a step in
        flight may wait for the hand-off worker's copies (moe/handoff.py: copies ahead), which
        need the driver too."""
        from freetoken.engine.sampler import read_ids

        return dict(zip(COUNTERS, read_ids(self.counters)))

