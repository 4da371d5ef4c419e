"""Prometheus metrics: request counters/latency per wire, and store stats read at scrape.

Each `Metrics` owns its own `CollectorRegistry`, so several servers can live in one
process (tests) without clashing in the global registry. Store counters are not mirrored
into prometheus objects: a custom collector calls `store.stats(None)` when scraped and
turns the `StoreStats` into metric families, so the numbers are never stale and the hot
path pays nothing for them. `render()` calls the store: run it off the event loop.

Request metrics are plain per-series counters (`RequestSeries`: a count, a sum and one
count per latency bucket) that the event loop bumps and a collector turns into the
`kvcache_requests_total` counter and the `kvcache_request_duration_seconds` histogram
at scrape time. prometheus_client's own `Counter.inc` + `Histogram.observe` took three
locks and ~3.5 us per request, more than a whole small GET costs elsewhere; every
observation happens on the event loop thread, so no lock is needed, and a scrape (on the
thread pool) copies each series' list before summing it. With several event loops
(`event_loops`) each loop counts into its own series table (`Metrics.loop_view`: the same
registry, its own table), and the scrape merges the tables: same labels, summed. The
`kvcache_loop_*` gauges give the per-loop view (connections, requests, busy fraction).
"""

from __future__ import annotations

import bisect
import copy
import logging
import platform
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Final

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    Info,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from epistemic_kvcache._version import __version__
from epistemic_kvcache.buffers import prefault_stats
from epistemic_kvcache.shared import STATS_FIELDS, TIER_FIELDS
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
_FIRST_BUCKET_S: Final = LATENCY_BUCKETS_S[0]

_STORE_INTERNAL: dict[str, tuple[str, str]] = {
    "fsyncs": ("counter", "fsync/fdatasync calls made by the group committer."),
    "commit_batches": ("counter", "Group commits (one sync each)."),
    "committed_ops": ("counter", "Operations made durable by group commits."),
    "write_failures": ("counter", "Segment writes or syncs that failed (never acknowledged)."),
    "compactions": ("counter", "Segments compacted."),
    "compacted_bytes": ("counter", "Bytes rewritten by compaction."),
    "segments": ("gauge", "Segment files on disk."),
    "segment_bytes": ("gauge", "Bytes in segment files on disk."),
    "namespaces": ("gauge", "Namespaces holding at least one key."),
    "live_log_bytes": ("gauge", "Bytes of segment files still referenced by the index."),
    "disk_bytes": ("gauge", "Bytes the durable store occupies on disk (segments and index)."),
    "segments_deleted": ("counter", "Dead segment files deleted."),
    "punched_bytes": (
        "counter",
        "Bytes of dead blocks' payloads handed back to the file system (hole punching).",
    ),
    "index_repairs": (
        "counter",
        "Index rows found wrong on a read and repaired from the log (the block was intact).",
    ),
    "checkpoints": ("counter", "Index checkpoints written (the log replayed at start ends here)."),
    "checkpoint_failures": (
        "counter",
        "Index checkpoints that failed; writes slow down once the log runs ahead of the index.",
    ),
    "checkpoint_lag_bytes": (
        "gauge",
        "Log bytes written since the last index checkpoint (replayed after a crash); writes "
        "wait above max_checkpoint_lag_bytes.",
    ),
    # data loss: each non-zero value is data the store could not serve, found at start-up
    # or on read; `epistemic-kvcache store check` lists what it is
    "lost_keys": (
        "gauge",
        "Keys whose bytes are gone (segment deleted or cut short by hand): misses since start.",
    ),
    "quarantined_blocks": (
        "gauge",
        "Blocks that failed their digest check and are set aside (read as misses).",
    ),
    "damaged_log_regions": (
        "gauge",
        "Damaged regions of the log skipped at start-up (records in them are lost).",
    ),
    "missing_segments": (
        "gauge",
        "Segment files missing from the log's sequence at start-up (their keys are lost).",
    ),
    # the persist dir's file system (statvfs at scrape time), whatever the cold capacity
    "fs_free_bytes": (
        "gauge",
        "Free bytes of the persist dir's file system (what the server may write: f_bavail).",
    ),
    "fs_total_bytes": ("gauge", "Size of the persist dir's file system in bytes."),
}
"""`StoreStats.extra` keys -> (type, help): exported as `kvcache_store_<key>` (counters with
`_total`). Keys not listed here are exported as `kvcache_store_internal{name=...}`: today
`store_fault` and `disk_full` (the same as `kvcache_store_committer_alive` and
`kvcache_store_disk_full`) and the cluster front-end's own counters (docs/cluster.md)."""

_HEALTH_GAUGES: tuple[tuple[str, str], ...] = (
    ("ready", "1 when the store serves reads and writes (what /readyz reports)."),
    ("writable", "0 when the store refuses writes (disk full, fault, recovering)."),
    ("committer_alive", "0 when the durable store's group committer has died (store fault)."),
    (
        "disk_full",
        "1 from a write refused for want of space until the space it needed is free.",
    ),
    ("recovering", "1 while the store rebuilds its index at start-up."),
)
_NAME_OK = re.compile(r"[^a-zA-Z0-9_]")


HTTP_OK_CODES = frozenset({"404", "409", "412"})
"""HTTP answers that are outcomes, not failures: a miss (404), a refused conditional or
first-write-wins PUT (409/412). RESP answers them without an error too (nil, 0)."""


def status_label(status: str) -> str:
    """`ok` or `error`, the same on both wires: HTTP < 400 (and the outcomes in
    `HTTP_OK_CODES`) are `ok`; RESP passes `ok` / `error` through."""
    if status.isdigit():
        return "ok" if int(status) < 400 or status in HTTP_OK_CODES else "error"
    return "ok" if status == "ok" else "error"


class _StoreCollector(Collector):
    """Reads `store.stats(None)` at scrape time."""

    def __init__(self, store: SharedKvBackend) -> None:
        self._store = store
        self.connections: Mapping[str, int] | None = None
        self.auth_failures: Mapping[str, int] | None = None

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
        yield from self._health_metrics()
        yield from self._connection_metrics()
        yield from self._prefault_metrics()

    def describe(self) -> Iterator[Metric]:
        # Collected lazily; describing would call the store at registration time.
        return iter(())

    @staticmethod
    def _stats_metrics(stats: StoreStats) -> Iterator[Metric]:
        for f in STATS_FIELDS:
            value = getattr(stats, f.name)
            if f.kind == "counter":
                yield CounterMetricFamily(f"kvcache_{f.name}", f.help, value=value)
            else:
                yield GaugeMetricFamily(f"kvcache_{f.name}", f.help, value=value)
        for f in TIER_FIELDS:
            fam = GaugeMetricFamily(f"kvcache_tier_{f.name}", f.help, labels=["tier"])
            for tier, ts in sorted(stats.tiers.items()):
                fam.add_metric([tier], getattr(ts, f.name))
            yield fam
        ratio = GaugeMetricFamily(
            "kvcache_tier_compression_ratio", "Physical / logical bytes.", labels=["tier"]
        )
        for tier, ts in sorted(stats.tiers.items()):
            ratio.add_metric([tier], ts.compression_ratio)
        yield ratio
        unknown = GaugeMetricFamily(
            "kvcache_store_internal", "Other store-wide internal values.", labels=["name"]
        )
        for key, value in sorted(stats.extra.items()):
            known = _STORE_INTERNAL.get(key)
            if known is None:
                unknown.add_metric([_NAME_OK.sub("_", key)], value)
            elif known[0] == "counter":
                yield CounterMetricFamily(f"kvcache_store_{key}", known[1], value=value)
            else:
                yield GaugeMetricFamily(f"kvcache_store_{key}", known[1], value=value)
        if unknown.samples:
            yield unknown

    def _health_metrics(self) -> Iterator[Metric]:
        """`store.health()` as 0/1 gauges (stores that offer it)."""
        health_of = getattr(self._store, "health", None)
        if health_of is None:
            return
        try:
            health = health_of()
        except Exception as exc:
            log.warning("store health unavailable for /metrics: %s", exc)
            return
        for attr, doc in _HEALTH_GAUGES:
            value = getattr(health, attr, None)
            if isinstance(value, bool):
                yield GaugeMetricFamily(f"kvcache_store_{attr}", doc, value=int(value))

    def _connection_metrics(self) -> Iterator[Metric]:
        conns = self.connections
        if conns is not None:
            fam = GaugeMetricFamily(
                "kvcache_open_connections", "Open connections.", labels=["wire"]
            )
            for wire, n in sorted(dict(conns).items()):
                fam.add_metric([wire], n)
            yield fam
        if self.auth_failures is not None:
            failed = dict(self.auth_failures)
            fails = CounterMetricFamily(
                "kvcache_auth_failures",
                "Failed authentications: a bad or missing credential, a RESP command "
                "refused with NOAUTH.",
                labels=["wire"],
            )
            for wire in sorted({"http", "resp", *failed}):
                fails.add_metric([wire], failed.get(wire, 0))
            yield fails

    @staticmethod
    def _prefault_metrics() -> Iterator[Metric]:
        """The receive-buffer prefault pool (buffers.py), process-wide."""
        p = prefault_stats()
        yield GaugeMetricFamily(
            "kvcache_prefault_ready_bytes",
            "Receive memory faulted in ahead of need, not yet handed out.",
            value=p.ready_bytes,
        )
        yield CounterMetricFamily(
            "kvcache_prefault_hits",
            "Large receive buffers handed out already faulted in.",
            value=p.hits,
        )
        yield CounterMetricFamily(
            "kvcache_prefault_misses",
            "Large receive buffers of a pooled size faulted on the event loop (none ready).",
            value=p.misses,
        )
        yield CounterMetricFamily(
            "kvcache_prefault_failures",
            "Prefaults that failed (no memory); the pool backs off.",
            value=p.failures,
        )


class RequestSeries:
    """One labelled series of request metrics: how many, their total seconds, and how
    many fell into each latency bucket (not cumulative; the last one is +Inf)."""

    __slots__ = ("buckets", "count", "created", "labels", "total_s")

    def __init__(self, labels: tuple[str, str, str, str]) -> None:
        self.labels = labels
        self.count = 0
        self.total_s = 0.0
        self.buckets = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self.created = time.time()

    def observe(self, seconds: float) -> None:
        """Count one request that took `seconds` (event loop only)."""
        self.count += 1
        if seconds > 0.0:
            self.total_s += seconds
            if seconds <= _FIRST_BUCKET_S:  # (most requests: no search)
                self.buckets[0] += 1
            else:
                self.buckets[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        else:
            self.buckets[0] += 1


class _RequestCollector(Collector):
    """Turns the `RequestSeries` into the request counter and latency histogram.

    The counter keeps the HTTP `code`; the histogram does not: a latency histogram is
    19 series a label set (17 buckets, +Inf, sum; plus count and created), and one per
    HTTP code multiplied them for no question an operator asks of latencies (after a
    few minutes of traffic 700 of a server's 852 series were latency series split by
    code). Latencies are by wire, route and ok/error; what failed how is the counter's
    `code`."""

    _COUNTER_LABELS = ("wire", "route", "status", "code")
    _LATENCY_LABELS = ("wire", "route", "status")

    def __init__(self, tables: list[dict[tuple[str, str, str], RequestSeries]]) -> None:
        self._tables = tables
        """One series table per event loop (the list grows as loops start)."""

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "kvcache_requests",
            "Requests answered, by wire, route, status (ok/error) and HTTP code.",
            labels=self._COUNTER_LABELS,
        )
        latency = HistogramMetricFamily(
            "kvcache_request_duration_seconds",
            "Time from a request's first byte (RESP: its dispatch) to its response being "
            "queued for sending, by wire, route and status (ok/error).",
            labels=self._LATENCY_LABELS,
        )
        counts: dict[tuple[str, ...], tuple[int, float]] = {}
        latencies: dict[tuple[str, ...], tuple[float, list[int]]] = {}
        for s in [s for table in list(self._tables) for s in list(table.values())]:
            buckets = list(s.buckets)  # a copy: the event loop keeps counting
            n, total = s.count, s.total_s
            # two raw statuses may share labels (e.g. RESP "ok" via fast and slow paths)
            have_n, have_created = counts.get(s.labels, (0, s.created))
            counts[s.labels] = (have_n + n, min(have_created, s.created))
            key = s.labels[:3]
            have = latencies.get(key)
            if have is not None:
                total += have[0]
                buckets = [a + b for a, b in zip(buckets, have[1], strict=True)]
            latencies[key] = (total, buckets)
        for labels, (n, created) in sorted(counts.items()):
            requests.add_metric(list(labels), n, created=created)
        for labels, (total, buckets) in sorted(latencies.items()):
            cumulative, running = [], 0
            for bound, c in zip((*LATENCY_BUCKETS_S, float("inf")), buckets, strict=True):
                running += c
                cumulative.append((_bound_text(bound), running))
            latency.add_metric(list(labels), cumulative, total)
        yield requests
        yield latency

    def describe(self) -> Iterator[Metric]:
        return iter(())


def _bound_text(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


class _LoopCollector(Collector):
    """The per-loop view (`ServerContext.loop_view`) as `kvcache_loop_*` gauges."""

    def __init__(self) -> None:
        self.view: Callable[[], list[dict[str, object]]] | None = None

    def collect(self) -> Iterator[Metric]:
        if self.view is None:
            return
        rows = self.view()
        for name, kind, doc in (
            ("connections", "gauge", "Open connections served by this event loop."),
            ("requests", "counter", "Requests answered by this event loop."),
            ("busy", "gauge", "Fraction of the last second this event loop's thread ran on a CPU."),
            ("cpu_seconds", "counter", "CPU time of this event loop's thread."),
        ):
            fam: GaugeMetricFamily | CounterMetricFamily
            if kind == "counter":
                fam = CounterMetricFamily(f"kvcache_loop_{name}", doc, labels=["loop"])
            else:
                fam = GaugeMetricFamily(f"kvcache_loop_{name}", doc, labels=["loop"])
            for row in rows:
                value = row[name]
                number = float(value) if isinstance(value, int | float) else 0.0
                fam.add_metric([str(row["loop"])], number)
            yield fam

    def describe(self) -> Iterator[Metric]:
        return iter(())


class Metrics:
    """Request metrics for both wires plus store stats, in a private registry."""

    def __init__(self, store: SharedKvBackend) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        # (wire, route, status) -> its series (event loop only; a scrape copies them)
        self._series: dict[tuple[str, str, str], RequestSeries] = {}
        self._tables = [self._series]
        self.registry.register(_RequestCollector(self._tables))
        self._loop_collector = _LoopCollector()
        self.registry.register(self._loop_collector)
        self._store_collector = _StoreCollector(store)
        self.registry.register(self._store_collector)
        build = Info("kvcache_build", "The running server's version.", registry=self.registry)
        build.info({"version": __version__, "python": platform.python_version()})
        # process_* (CPU, RSS, open fds, start time), python_info, python_gc_*.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self._lock = threading.Lock()

    def observe_request(self, wire: str, route: str, status: str, seconds: float) -> None:
        """Count one answered request. `route` is a template (`/kv/{key}`, `GET`, ...).

        `status` is what the wire reports: an HTTP status code (`"201"`) or a RESP
        outcome (`"ok"` / `"error"`); the exported label is `status_label(status)`, the
        same two values on both wires, and HTTP keeps its code in the counter's `code`
        label (the latency histogram has no `code`). `seconds` comes from a monotonic
        high-resolution clock (`time.perf_counter`), never `loop.time()` (1 ms steps
        under uvloop: every sub-millisecond request fell into one bucket).
        """
        self.series(wire, route, status).observe(seconds)

    def series(self, wire: str, route: str, status: str) -> RequestSeries:
        """The series `observe_request` counts into (a hot path may keep it)."""
        key = (wire, route, status)
        found = self._series.get(key)
        if found is None:
            labels = (wire, route, status_label(status), status if status.isdigit() else "")
            found = self._series[key] = RequestSeries(labels)
        return found

    def loop_view(self) -> Metrics:
        """The metrics another event loop counts into: this registry, its own series
        table (merged with the others' at scrape time)."""
        other = copy.copy(self)
        other._series = {}
        self._tables.append(other._series)
        return other

    def requests(self) -> int:
        """Requests counted into this loop's table so far."""
        return sum(s.count for s in list(self._series.values()))

    def watch_loops(self, view: Callable[[], list[dict[str, object]]]) -> None:
        """Export `view()` (`ServerContext.loop_view`) as the `kvcache_loop_*` gauges."""
        self._loop_collector.view = view

    def watch_connections(self, connections: Mapping[str, int]) -> None:
        """Export `connections` (live connections per wire) as `kvcache_open_connections`."""
        self._store_collector.connections = connections

    def watch_auth_failures(self, by_wire: Mapping[str, int]) -> None:
        """Export `by_wire` (`AuthFailureLog.by_wire`) as `kvcache_auth_failures_total`."""
        self._store_collector.auth_failures = by_wire

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type. Calls the store: blocking."""
        with self._lock:
            return generate_latest(self.registry), CONTENT_TYPE
