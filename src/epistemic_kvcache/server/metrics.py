"""Prometheus metrics: request counters/latency per wire, and store stats read at scrape.

Each `Metrics` owns its own `CollectorRegistry`, so several servers can live in one
process (tests) without clashing in the global registry. Store counters are not mirrored
into prometheus objects: a custom collector calls `store.stats(None)` when scraped and
turns the `StoreStats` into metric families, so the numbers are never stale and the hot
path pays nothing for them. `render()` calls the store: run it off the event loop.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from epistemic_kvcache.store.api import SharedKvBackend, StoreStats

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The classic text format: every scraper reads it (our names are all legacy-valid)."""

LATENCY_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
"""Cache hits take well under a millisecond; a 80 MiB block over a slow link, seconds."""

# StoreStats field -> (metric name without _total, help)
_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("get_hits", "kvcache_get_hits", "GETs that found their block."),
    ("get_misses", "kvcache_get_misses", "GETs that found nothing."),
    ("stale_missed", "kvcache_stale_missed", "GETs that found only a stale-epoch entry."),
    ("dedup_hits", "kvcache_dedup_hits", "PUTs whose bytes were already stored."),
    ("put_new", "kvcache_put_new", "PUTs that created a key."),
    ("put_conflicts", "kvcache_put_conflicts", "PUTs of existing keys with other bytes."),
    ("integrity_failures", "kvcache_integrity_failures", "Blocks failing their digest."),
    ("evictions", "kvcache_evictions", "Blocks evicted."),
    ("promotions", "kvcache_promotions", "Blocks promoted to a faster tier."),
    ("demotions", "kvcache_demotions", "Blocks demoted to a slower tier."),
)
_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("unique_blocks", "kvcache_unique_blocks", "Distinct blobs stored."),
    ("total_refs", "kvcache_total_refs", "Keys referencing blobs."),
    ("logical_bytes", "kvcache_logical_bytes", "Bytes as seen by clients (sum over keys)."),
    ("resident_bytes", "kvcache_resident_bytes", "Bytes physically held."),
    ("dedup_savings_bytes", "kvcache_dedup_savings_bytes", "Bytes not stored thanks to dedup."),
    ("pinned_blocks", "kvcache_pinned_blocks", "Blocks protected from eviction."),
)
_TIER_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("blocks", "kvcache_tier_blocks", "Blocks in the tier."),
    ("bytes", "kvcache_tier_bytes", "Physical bytes in the tier."),
    ("capacity_bytes", "kvcache_tier_capacity_bytes", "Configured capacity of the tier."),
    ("logical_bytes", "kvcache_tier_logical_bytes", "Uncompressed bytes in the tier."),
)
_NAME_OK = re.compile(r"[^a-zA-Z0-9_]")


class _StoreCollector(Collector):
    """Reads `store.stats(None)` at scrape time."""

    def __init__(self, store: SharedKvBackend) -> None:
        self._store = store
        self.connections: Mapping[str, int] | None = None

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("kvcache_store_up", "1 when the store answered its stats.")
        try:
            stats = self._store.stats(None)
        except Exception as exc:  # a closed or failing store must not break /metrics
            log.warning("store stats unavailable for /metrics: %s", exc)
            up.add_metric([], 0)
            yield up
            yield from self._connection_metrics()
            return
        up.add_metric([], 1)
        yield up
        yield from self._stats_metrics(stats)
        yield from self._connection_metrics()

    def describe(self) -> Iterator[Metric]:
        # Collected lazily; describing would call the store at registration time.
        return iter(())

    @staticmethod
    def _stats_metrics(stats: StoreStats) -> Iterator[Metric]:
        for attr, name, doc in _COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(stats, attr))
        for attr, name, doc in _GAUGES:
            yield GaugeMetricFamily(name, doc, value=getattr(stats, attr))
        for attr, name, doc in _TIER_GAUGES:
            fam = GaugeMetricFamily(name, doc, labels=["tier"])
            for tier, ts in sorted(stats.tiers.items()):
                fam.add_metric([tier], getattr(ts, attr))
            yield fam
        ratio = GaugeMetricFamily(
            "kvcache_tier_compression_ratio", "Physical / logical bytes.", labels=["tier"]
        )
        for tier, ts in sorted(stats.tiers.items()):
            ratio.add_metric([tier], ts.compression_ratio)
        yield ratio
        if stats.extra:
            extra = GaugeMetricFamily(
                "kvcache_store_internal", "Store-wide internal counters.", labels=["name"]
            )
            for key, value in sorted(stats.extra.items()):
                extra.add_metric([_NAME_OK.sub("_", key)], value)
            yield extra

    def _connection_metrics(self) -> Iterator[Metric]:
        conns = self.connections
        if conns is None:
            return
        fam = GaugeMetricFamily("kvcache_open_connections", "Open connections.", labels=["wire"])
        for wire, n in sorted(dict(conns).items()):
            fam.add_metric([wire], n)
        yield fam


class Metrics:
    """Request metrics for both wires plus store stats, in a private registry."""

    def __init__(self, store: SharedKvBackend) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._requests = Counter(
            "kvcache_requests",
            "Requests answered, by wire, route and status.",
            ["wire", "route", "status"],
            registry=self.registry,
        )
        self._latency = Histogram(
            "kvcache_request_duration_seconds",
            "Time from a request's first byte to its response being queued for sending.",
            ["wire", "route", "status"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        # (wire, route, status) -> labelled children: `labels()` costs microseconds
        self._children: dict[tuple[str, str, str], tuple[Counter, Histogram]] = {}
        self._store_collector = _StoreCollector(store)
        self.registry.register(self._store_collector)
        self._lock = threading.Lock()

    def observe_request(self, wire: str, route: str, status: str, seconds: float) -> None:
        """Count one answered request. `route` is a template (`/kv/{key}`, `GET`, ...)."""
        children = self._children.get((wire, route, status))
        if children is None:
            children = (
                self._requests.labels(wire, route, status),
                self._latency.labels(wire, route, status),
            )
            self._children[(wire, route, status)] = children
        children[0].inc()
        children[1].observe(max(seconds, 0.0))

    def watch_connections(self, connections: Mapping[str, int]) -> None:
        """Export `connections` (live connections per wire) as `kvcache_open_connections`."""
        self._store_collector.connections = connections

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type. Calls the store: blocking."""
        with self._lock:
            return generate_latest(self.registry), CONTENT_TYPE
