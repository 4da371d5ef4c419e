"""store/cluster_counters.py on its own, against a real Redis Cluster: deltas flushed
into the tenants' shared counters, kept when a flush surely failed; the tenants set;
`stats_of`."""

from __future__ import annotations

import redis_cluster as rc
from epistemic_kvcache.store.api import StoreStats, TierStats
from epistemic_kvcache.store.cluster_counters import SharedCounters, stats_of

pytestmark = rc.redis_marks()


cluster = rc.module_cluster()
parts = rc.parts_fixture("n")


def test_deltas_are_seen_at_once_and_flushed_once(
    parts: rc.Parts, cluster: rc.LocalCluster
) -> None:
    c = parts.counters
    other = SharedCounters(parts.conn, parts.prefix)  # another front-end's counters
    c.count("t", "get_hits", 3)
    c.count("t", "get_hits")
    c.count("t", "evictions", 0)
    assert c.shared("t")["get_hits"] == 4  # this front-end sees its own work
    assert "get_hits" not in other.shared("t")
    c.flush()
    c.flush()  # nothing pending: nothing added
    assert other.shared("t") == {"get_hits": 4}  # a zero delta is not written
    assert c.shared("t") == {"get_hits": 4}


def test_a_flush_that_failed_is_kept_for_the_next(cluster: rc.LocalCluster) -> None:
    p = rc.cluster_parts(cluster.url, "nkeep")
    p.counters.count("t", "put_new", 2)
    p.conn.closed = True  # the cluster refuses: StoreClosedError, surely not added
    p.counters.flush()
    p.conn.closed = False
    p.counters.flush()
    try:
        assert SharedCounters(p.conn, "nkeep").shared("t") == {"put_new": 2}
    finally:
        p.close()


def test_tenants_and_the_fleet_sum(parts: rc.Parts) -> None:
    c = parts.counters
    for ns in ("b", "a/é", "b"):
        c.register(ns)
        c.count(ns, "dedup_hits")
    assert c.tenants() == ["a/é", "b"]
    assert c.fleet() == {"dedup_hits": 3}


def test_stats_of() -> None:
    local = StoreStats(promotions=2, demotions=1)
    local.tiers["hot"] = TierStats(1, 10, 100, 10, 10)
    local.tiers["warm"] = TierStats(0, 0, 0, 0, 0)
    c = {"keys": 5, "logical_bytes": 900, "resident_bytes": 300, "unique_blocks": 2}
    s = stats_of({**c, "get_hits": 7, "pinned_keys": 1}, local, capacity_bytes=1000)
    assert (s.total_refs, s.logical_bytes, s.dedup_savings_bytes) == (5, 900, 600)
    assert (s.get_hits, s.pinned_blocks, s.promotions, s.demotions) == (7, 1, 2, 1)
    assert s.tiers["hot"].bytes == 10
    cl = s.tiers["cluster"]
    assert (cl.blocks, cl.bytes, cl.capacity_bytes) == (2, 300, 1000)
