"""Cluster mode's background work: the probe, counter flushes, scrubs, stale entries.

How it works
------------
`Maintenance` is one daemon thread per front-end that wakes every second: it probes the
cluster (`ClusterConnection.probe`: a front-end marked down clears the state by itself),
flushes this front-end's counters into the tenants' shared counters, and every
`scrub_interval_s` (first at a random point of the first interval, so front-ends
started together do not all try at once) starts a scrub in a thread of its own (a scrub
waits minutes before it corrects anything); one scrub at a time per front-end, one per
cluster by the scrub's lease. `StaleRetirer` removes, in bounded steps, entries whose
epoch scope moved on and expired snapshots; any front-end may run it at once as another
(removals are compare-and-delete), and each resumes its HSCAN where it stopped.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from epistemic_kvcache.errors import StoreError
from epistemic_kvcache.store import cluster_lua as L
from epistemic_kvcache.store.api import ConsistencyReport
from epistemic_kvcache.store.cluster_conn import ClusterConnection
from epistemic_kvcache.store.cluster_counters import SharedCounters
from epistemic_kvcache.store.cluster_entries import ClusterEntries

log = logging.getLogger(__name__)

__all__ = ["Maintenance", "StaleRetirer"]


class Maintenance:
    """The maintenance thread of one front-end."""

    def __init__(
        self,
        conn: ClusterConnection,
        counters: SharedCounters,
        scrub: Callable[[], ConsistencyReport],
        stop: threading.Event,
        *,
        scrub_interval_s: float,
    ) -> None:
        """`scrub_interval_s`: 0 never scrubs. `stop`: ends the thread."""
        self.conn = conn
        self.counters = counters
        self.scrub = scrub
        self.stop = stop
        self.scrub_interval_s = scrub_interval_s
        self.thread = threading.Thread(target=self._loop, name="kvcache-cluster-maint", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)

    def _loop(self) -> None:
        next_scrub = time.monotonic() + self.scrub_interval_s * random.uniform(0.5, 1.0)
        scrubber: threading.Thread | None = None
        while not self.stop.wait(1.0):
            try:
                self.conn.probe()
                self.counters.flush()
                if (
                    self.scrub_interval_s > 0
                    and time.monotonic() >= next_scrub
                    and (scrubber is None or not scrubber.is_alive())
                ):
                    next_scrub = time.monotonic() + self.scrub_interval_s
                    # its own thread: a scrub waits minutes before it corrects anything
                    scrubber = threading.Thread(
                        target=self._scrub_quietly, name="kvcache-cluster-scrub", daemon=True
                    )
                    scrubber.start()
            except Exception:
                log.exception("cluster maintenance failed")
        if scrubber is not None:
            scrubber.join(5.0)

    def _scrub_quietly(self) -> None:
        try:
            report = self.scrub()
            if not report.ok:
                log.info(
                    "scrub: %d blocks with leaked references, %d orphan blocks, %d keys "
                    "whose block the cluster lost",
                    len(report.refcount_mismatches),
                    len(report.orphan_blobs),
                    len(report.orphan_index_entries),
                )
        except Exception:
            log.exception("cluster scrub failed")


@dataclass(eq=False)
class StaleRetirer:
    """Bounded removal of stale entries and expired snapshots, resumable per tenant.

    `retire_snapshots(ns, budget)`: drop up to `budget` of `ns`'s expired snapshots,
    finish interrupted drops -> how many expired ones it dropped."""

    conn: ClusterConnection
    entries: ClusterEntries
    counters: SharedCounters
    retire_snapshots: Callable[[str, int], int]
    _cursor: dict[str, int] = field(default_factory=dict)

    def retire(self, *, max_items: int, budget_s: float) -> int:
        deadline = time.monotonic() + budget_s
        removed = 0
        try:
            tenants = self.counters.tenants()
        except StoreError:
            return 0
        random.shuffle(tenants)
        for ns in tenants:
            if removed >= max_items or (removed and time.monotonic() > deadline):
                break
            # expired snapshots, interrupted drops (every front-end may finish them)
            removed += self.retire_snapshots(ns, max_items - removed)
            if removed >= max_items or time.monotonic() > deadline:
                continue
            removed += self._retire_entries(ns, max_items - removed, deadline)
        return removed

    def _retire_entries(self, ns: str, budget: int, deadline: float) -> int:
        tk = self.entries.keys_of(ns)
        epochs = self.conn.exec(tk.epochs, [("HGETALL", tk.epochs)])[0]
        if not epochs:
            return 0
        current = {bytes(k).decode(): int(v) for k, v in dict(epochs).items()}
        removed = 0
        cursor = self._cursor.get(ns, 0)  # resume where the last call stopped
        while True:
            cursor, page = self.conn.hscan(tk.entries, cursor)
            for k, v in page.items():
                e = L.parse_entry(v)
                if (
                    e.epoch is not None
                    and e.epoch < current.get(e.scope, 0)
                    and self.entries.remove(ns, k, e.raw) is not None
                ):
                    removed += 1
            if cursor == 0 or removed >= budget or time.monotonic() > deadline:
                self._cursor[ns] = cursor
                return removed
