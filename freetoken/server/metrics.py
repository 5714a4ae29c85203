"""Prometheus metrics of the server (`/metrics`, text format), on a registry of its own.

Counters and histograms are fed by the engine thread as outputs arrive (prometheus-client is
thread-safe); the gauges (running / waiting requests, KV pages) read the engine's latest stats
snapshot when scraped, so a scrape never touches the engine itself.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: N811
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

__all__ = ["CONTENT_TYPE", "Metrics"]


class Metrics:
    """All server metrics; `stats` is a callable returning the engine's latest stats or None."""

    def __init__(self, stats: Callable[[], object | None]) -> None:
        self.registry = r = CollectorRegistry()
        self._stats = stats
        self.requests = Counter(
            "freetoken_requests", "HTTP requests by route and status", ["route", "status"],
            registry=r,
        )
        self.finished = Counter(
            "freetoken_request_finished", "Engine requests finished, by reason", ["reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "freetoken_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.generation_tokens = Counter(
            "freetoken_generation_tokens", "Generated tokens", registry=r
        )
        self.ttft = Histogram(
            "freetoken_time_to_first_token_seconds", "Arrival to first generated token",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "freetoken_inter_token_latency_seconds", "Time between generated tokens",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "freetoken_request_latency_seconds", "Arrival to finish", buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._gauge("num_requests_running", "Requests in the running batch", "num_running")
        self._gauge("num_requests_waiting", "Requests waiting to be scheduled", "num_waiting")
        self._gauge("kv_cache_pages_used", "KV cache pages in use", "kv_pages_used")
        self._gauge("kv_cache_pages_total", "KV cache pages in all", "kv_pages_total")
        self._gauge(
            "kv_cache_pages_cached", "Free pages still holding reusable prefixes",
            "kv_pages_cached",
        )
        self._gauge(
            "prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache (total)",
            "prefix_cache_hit_tokens",
        )
        self._gauge(
            "moe_handoff_failures", "Steps whose CPU MoE hand-off failed (total; the expert "
            "cache was filled again after each)", "moe_handoff_failures",
        )
        # offload / hybrid / cpu backends (moe/slot_cache.py: COUNTERS)
        for name in ("hits", "misses", "fetched", "cpu", "ahead", "ahead_hits"):
            self._expert_gauge(name)
        self.in_flight = Gauge(
            "freetoken_http_requests_in_flight", "Generation requests the server holds",
            registry=r,
        )

    def _gauge(self, name: str, doc: str, field: str) -> None:
        g = Gauge(f"freetoken_{name}", doc, registry=self.registry)
        g.set_function(lambda: float(getattr(self._stats(), field, 0) or 0))

    def _expert_gauge(self, name: str) -> None:
        """Expert-cache total since load (distinct experts per layer call): hits, misses and,
        of the misses, those fetched into slots and those computed by the CPU executor; the
        experts fetched ahead of their layer's call, and those of them it then routed to."""
        g = Gauge(f"freetoken_moe_expert_{name}", f"MoE expert cache: {name} (total)",
                  registry=self.registry)
        g.set_function(lambda: float((getattr(self._stats(), "moe_experts", None) or {})
                                     .get(name, 0)))

    def observe_tokens(self, n_new: int, first: bool, since_last: float) -> None:
        """One output with n_new tokens, `since_last` seconds after arrival / the last output."""
        if n_new <= 0:
            return
        self.generation_tokens.inc(n_new)
        (self.ttft if first else self.itl).observe(since_last)

    def render(self) -> bytes:
        return generate_latest(self.registry)
