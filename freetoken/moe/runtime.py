"""Applying a MoE backend to a loaded model (gpt-fast style: the model file never chooses).

`configure_moe(model, config, device)` resolves `auto`, sizes the slot cache, builds the host
banks and sets each FusedExperts module's backend. It returns a `MoERuntime` (None for fused)
whose counters feed /metrics and the decode log line.
"""

from __future__ import annotations

import logging
import resource
import time

import torch

from freetoken.kernels.route import gate_topk
from freetoken.layers.moe import FusedExperts, SparseMoE
from freetoken.moe.ahead import FETCH_AHEAD
from freetoken.moe.expert_cache import CACHE_BACKENDS, ExpertCache, LayerBackend
from freetoken.moe.host_banks import bank_bytes, host_bank
from freetoken.moe.policy import expert_format, fetch_policy, find_profile, num_slots
from freetoken.moe.prefill_stream import PrefillStreamer
from freetoken.moe.slot_cache import slot_bytes

logger = logging.getLogger(__name__)
GiB = 1 << 30
DEVICE_RESERVE = 2 * GiB  # left free on a GPU beside the slots (activations, graphs)


def expert_modules(model) -> list[FusedExperts]:
    return [m for m in model.modules() if isinstance(m, FusedExperts)]


def _free_device_bytes(device: torch.device, kv_bytes: int) -> int | None:
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return max(0, free - kv_bytes - DEVICE_RESERVE)


def choose_backend(config, mods: list[FusedExperts], device: torch.device) -> tuple[str, str]:
    """(backend, why) for config.moe_backend, resolving auto and the no-GPU case."""
    name = config.moe_backend
    if name != "auto":
        return name, f"--moe-backend {name}"
    if device.type != "cuda":
        return "fused", "auto: every expert fits (the device is the CPU: host memory)"
    need = sum(bank_bytes(m.bank) for m in mods)
    free = _free_device_bytes(device, config.kv_cache_mb << 20) or 0
    if need <= free:
        return "fused", f"auto: every expert fits ({need / GiB:.1f} GiB of {free / GiB:.1f} free)"
    prof = find_profile(expert_format(mods[0].bank))
    if prof is None:
        return "hybrid", (f"auto: experts ({need / GiB:.1f} GiB) exceed the device's "
                          f"{free / GiB:.1f} GiB and no ft bench bw profile exists: hybrid "
                          "with a small fixed fetch cap")
    rec = prof.get("recommended", "hybrid")
    return rec, f"auto: experts exceed the device; the ft bench bw profile recommends {rec}"


def unused_moe_flags(config, backend: str | None) -> list[str]:
    """The expert-cache flags set in `config` that `backend` does not use (None: a model
    without MoE layers uses none of them)."""
    cache = backend in CACHE_BACKENDS
    given = {"--moe-cache-size": config.moe_cache_size is not None and not cache,
             "--moe-cache-rate": config.moe_cache_rate is not None and not cache,
             "--moe-prefill-hit-d2d": config.moe_prefill_hit_d2d and not cache,
             "--disable-moe-prefill-overlap": config.disable_moe_prefill_overlap and not cache,
             "--moe-hybrid-max-fetch": config.moe_hybrid_max_fetch is not None
             and backend != "hybrid",
             "--moe-fetch-ahead": config.moe_fetch_ahead is not None
             and backend not in ("offload", "hybrid")}
    return [flag for flag, unused in given.items() if unused]


def configure_moe(model, config, device: torch.device):
    """Set every FusedExperts' backend from `config`; returns a MoERuntime or None (fused).
    Expert-cache flags the backend does not use are refused when the backend was asked for,
    and logged as unused when auto chose it or the model has no MoE layers."""
    mods = expert_modules(model)
    if not mods:
        unused = unused_moe_flags(config, None)
        if unused:
            logger.warning("%s: unused, the model has no MoE layers", ", ".join(unused))
        return None
    device = torch.device(device)
    backend, why = choose_backend(config, mods, device)
    logger.info("MoE backend %s (%s)", backend, why)
    unused = unused_moe_flags(config, backend)
    if unused and config.moe_backend != "auto":
        raise ValueError(f"{', '.join(unused)}: not used by --moe-backend {backend} (the "
                         "expert-cache flags go with offload, hybrid or cpu; "
                         "--moe-hybrid-max-fetch with hybrid, --moe-fetch-ahead with "
                         "offload or hybrid)")
    if unused:
        logger.warning("%s: unused, auto chose the %s MoE backend", ", ".join(unused), backend)
    if backend == "fused":
        _to_device(mods, device)
        return None
    if device.type != "cuda":
        logger.info("MoE backend %s without a GPU: the CPU stands in as the device (the slot "
                    "cache lives in host memory, fetches are host copies)", backend)
    return MoERuntime(model, mods, config, device, backend)


def _to_device(mods: list[FusedExperts], device: torch.device) -> None:
    """fused after a host-bank load (auto chose it): move the banks onto the device."""
    for m in mods:
        if m.bank.w13.data.device != device:
            w = m.bank.w13
            m.bank = m.bank.to(w.data.dtype if w.is_float else torch.float32, device)


def _predictors(model, mods: list[FusedExperts]) -> list:
    """Per MoE layer, x -> the expert ids [T, k] its router picks for x (SparseMoE layers:
    `gate_topk`), or None (a router of its own, such as gemma4's)."""
    owner = {id(m.experts): m for m in model.modules() if isinstance(m, SparseMoE)}

    def predictor(moe):
        return lambda x: gate_topk(x, *moe.router)[0]

    return [predictor(owner[id(m)]) if id(m) in owner else None for m in mods]


class MoERuntime:
    """The cache backends of one model, their counters and the decode log line."""

    def __init__(self, model, mods: list[FusedExperts], config, device: torch.device,
                 backend: str):
        assert backend in CACHE_BACKENDS, backend
        self.backend = backend
        pin = device.type == "cuda"
        hosts = []
        for m in mods:  # one layer at a time: the loaded bank is freed as its copy is made
            m.bank = host_bank(m.bank, pin)
            hosts.append(m.bank)
        spec = mods[0].spec
        total = len(mods) * spec.num_experts
        per_slot = max(slot_bytes(h) for h in hosts)
        # the prefill buffers first: the slots are sized from what is free after them
        self.prefill = PrefillStreamer(hosts, device, not config.disable_moe_prefill_overlap,
                                       config.moe_prefill_hit_d2d)
        free = _free_device_bytes(device, config.kv_cache_mb << 20)
        fits = total if free is None else free // per_slot
        self.num_slots, sizing = num_slots(total, spec.top_k, config.moe_cache_size,
                                           config.moe_cache_rate, fits)
        prof = find_profile(expert_format(hosts[0])) if backend == "hybrid" else None
        # routed experts and their mean bytes (host banks), for the split and the benches
        self.experts, self.host_bytes = total, sum(bank_bytes(h) for h in hosts)
        self.expert_bytes = self.host_bytes / total
        self.policy = fetch_policy(backend, config.moe_hybrid_max_fetch, prof,
                                   self.expert_bytes)
        ahead = config.moe_fetch_ahead
        if ahead is None:  # the default, where the backend fetches at all
            ahead = 0 if self.policy.cap == 0 else FETCH_AHEAD.get(backend, 0)
        self.cache = ExpertCache(hosts, self.num_slots, device, self.policy,
                                 config.moe_cpu_threads, spec.top_k, ahead)
        self.prefill.attach(self.cache.cache)
        self.cache.prefill = self.prefill
        for i, m in enumerate(mods):
            m.backend = LayerBackend(self.cache, i)
        self.cache.ahead.predictors = _predictors(model, mods)
        self.ahead_why = self._ahead_why(ahead, config.moe_fetch_ahead)
        self._report(total, sizing, device)
        self.log_interval = getattr(config, "decode_log_interval", 0) or 0
        self._steps, self._tokens = 0, 0
        self._t0: float | None = None
        self._last = self.counters()
        self._last_warm: dict[str, int] | None = None

    def _ahead_why(self, asked: int, given: int | None) -> str:
        """The fetch-ahead setting as the load log line says it."""
        n = self.cache.ahead.n
        if not n:
            if asked:
                return "fetch ahead off (a slot part is not whole 4-byte words: no device fill)"
            return "fetch ahead off" + (" (--moe-fetch-ahead 0)" if given == 0 else
                                        " (the backend fetches no misses)"
                                        if self.policy.cap == 0 else " (the default)")
        if not any(p is not None for p in self.cache.ahead.predictors[1:]):
            return "fetch ahead off (no layer's router predicts from the layer before)"
        return (f"fetch ahead: up to {n} of the next layer's predicted misses per layer call"
                + ("" if given is not None else " (the default)")
                + ("; its hits on them count as fetches of the split"
                   if self.backend == "hybrid" else ""))

    def _report(self, total: int, sizing: str, device: torch.device) -> None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)  # KiB -> GiB
        dev = (f", device memory {torch.cuda.memory_allocated(device) / GiB:.2f} GiB allocated"
               if device.type == "cuda" else "")
        pre = self.prefill
        logger.info("MoE %s: %d of %d experts in %d slots of %.2f MiB (%s): slot cache %.2f GiB "
                    "on %s; prefill stream buffers %d x %.2f GiB%s%s; host banks %.2f GiB, peak "
                    "host memory %.2f GiB%s; %s; %s", self.backend, self.num_slots, total,
                    self.num_slots, self.cache.cache.slot_bytes / 2**20, sizing,
                    self.cache.cache.nbytes / GiB, device, len(pre.buffers),
                    pre.buffer_bytes / GiB, "" if pre.overlap else " (no overlap)",
                    ", hits copied from slots" if pre.hit_d2d else "",
                    self.host_bytes / GiB, peak, dev, self.policy.why, self.ahead_why)

    def counters(self) -> dict[str, int]:
        return self.cache.counters()

    def close(self) -> None:
        """Stop the CPU side's threads (`ExpertCache.close`): before another engine takes the
        model (`ft bench decode --moe-backends`), not left to the garbage collector."""
        self.cache.close()

    def graph_max_bs(self, max_bs: int) -> int:
        """The largest decode batch captured as a CUDA graph with this backend."""
        return self.cache.graph_max_bs(max_bs)

    def begin_step(self, num_tokens: int) -> None:
        """Called before every forward (a graph replay runs no Python in the model): the
        step's real tokens, which the hand-off's worker and the plan kernel read."""
        self.cache.begin_step(num_tokens)

    def after_step(self, num_tokens: int, decode: bool) -> None:
        """Count an engine step (called by the engine: a CUDA graph replay runs no Python in
        the model), raise what the CPU hand-off reported in it, and every log_interval decode
        steps log speed and the expert cache."""
        self.cache.after_step()
        if not decode or self.log_interval <= 0:
            return
        if self._t0 is None:  # the first decode step starts the clock (not the load)
            self._t0, self._last = time.perf_counter(), self.counters()
            self._last_warm = self.cache.prefetch_stats()
            return
        self._steps += 1
        self._tokens += num_tokens
        if self._steps % self.log_interval:
            return
        now, c = time.perf_counter(), self.counters()
        d = {k: c[k] - self._last[k] for k in c}
        seen = d["hits"] + d["misses"]
        warm, wd = self.cache.prefetch_stats(), ""
        if warm is not None and self._last_warm is not None:
            w = {k: warm[k] - self._last_warm[k] for k in warm}
            wd = (f"; warmed {w['warmed'] / self.log_interval:.1f} per step ahead of the CPU, "
                  f"{w['used'] / max(1, w['warmed']):.0%} of them used")
        ahead = (f"; fetched ahead {d['ahead']}, {d['ahead_hits'] / max(1, d['ahead']):.0%} of "
                 "them hits" if d["ahead"] else "")
        logger.info("decode: %.1f tokens/s over %d steps; experts: hit rate %.2f (%d of %d), "
                    "fetched %d, CPU %d (%.1f / %.1f per step)%s%s",
                    self._tokens / (now - self._t0), self.log_interval, d["hits"] / max(1, seen),
                    d["hits"], seen, d["fetched"], d["cpu"], d["fetched"] / self.log_interval,
                    d["cpu"] / self.log_interval, ahead, wd)
        self._tokens, self._t0, self._last, self._last_warm = 0, now, c, warm
