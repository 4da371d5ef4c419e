"""store/cluster_maint.py on its own, against a real Redis Cluster: stale entries
retired in bounded, resumable steps; the maintenance thread's flush and probe."""

from __future__ import annotations

import threading

import redis_cluster as rc
from epistemic_kvcache.store import cluster_epochs as E
from epistemic_kvcache.store.api import ConsistencyReport
from epistemic_kvcache.store.cluster_counters import SharedCounters
from epistemic_kvcache.store.cluster_maint import Maintenance, StaleRetirer
from helpers import eventually

pytestmark = rc.redis_marks()


cluster = rc.module_cluster()
parts = rc.parts_fixture("m")


def test_stale_entries_are_retired_in_bounded_resumable_steps(parts: rc.Parts) -> None:
    tk = parts.entries.keys_of("t")
    parts.counters.register("t")
    for i in range(30):
        parts.entries.put_to("t", tk, f"s{i}", b"%d" % i, "doc", None, 0, memo=False)
    parts.entries.put_to("t", tk, "plain", b"kept", None, None, 0, memo=False)
    E.bump(parts.conn, parts.prefix, "t", "doc", 10)
    snapshots: list[tuple[str, int]] = []

    def retire_snapshots(ns: str, budget: int) -> int:
        snapshots.append((ns, budget))
        return 0

    retirer = StaleRetirer(parts.conn, parts.entries, parts.counters, retire_snapshots)
    first = retirer.retire(max_items=10, budget_s=5.0)
    assert 10 <= first < 31
    assert snapshots == [("t", 10)]
    rest = 0
    while (n := retirer.retire(max_items=10, budget_s=5.0)) > 0:
        rest += n
    assert first + rest == 30
    z = tk.order
    assert parts.conn.exec(z, [("ZRANGE", z, 0, -1)])[0] == [b"plain"]
    assert parts.counters.shared("t")["keys"] == 1


def test_the_thread_flushes_counters_and_probes(parts: rc.Parts) -> None:
    stop = threading.Event()
    scrubs: list[int] = []

    def scrub() -> ConsistencyReport:
        scrubs.append(1)
        return ConsistencyReport()

    maint = Maintenance(parts.conn, parts.counters, scrub, stop, scrub_interval_s=1.0)
    parts.counters.count("t", "get_hits", 5)
    parts.conn.mark_down("test: as if lost")
    maint.start()
    try:
        other = SharedCounters(parts.conn, parts.prefix)
        eventually(lambda: other.shared("t").get("get_hits") == 5, timeout=30, interval=0.1)
        eventually(lambda: parts.conn.down_since is None, timeout=30, interval=0.1)
        eventually(lambda: scrubs, timeout=30, interval=0.1, what="a scheduled scrub")
    finally:
        stop.set()
        maint.join(10)
    assert not maint.thread.is_alive()
