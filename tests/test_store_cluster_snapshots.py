"""Snapshots and branches in cluster mode: the single-node contract tests
(tests/test_store_snapshots.py) run against a real Redis Cluster, plus the cluster's own
cases (front-ends sharing snapshots, racing writers, interrupted drops, the scrub).

The contract tests run in the default `namespace` dedup scope: in `global` scope a
cluster front-end attributes a shared block's bytes to the tenant that stored it first
(docs/cluster.md), where the single node counts it for every tenant.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from epistemic_kvcache.errors import QuotaExceededError
from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.store import cluster_snapshots as CS
from epistemic_kvcache.store.api import PutOutcome
from epistemic_kvcache.store.cluster import ClusterBackend
from redis_cluster import LocalCluster
from test_store_snapshots import (  # the contract, collected here with this module's store
    NS,
    blob,
    fill,
    test_branch_delete_releases_only_its_overlay,
    test_branch_reads_fall_through_and_writes_stay_in_the_overlay,
    test_deleting_a_snapshot_frees_exactly_the_unreferenced_blocks,
    test_overwrite_and_flush_keep_the_snapshots_bytes,
    test_overwrites_inside_an_overlay_leave_the_snapshot_alone,
    test_retire_stale_drops_expired_snapshots_in_bounded_steps,
    test_snapshot_of_a_prefix,
    test_snapshot_of_explicit_keys_skips_absent_ones,
    test_snapshot_of_the_whole_namespace,
    test_snapshot_reads_survive_delete_and_overwrite,
    test_snapshot_ttl_expires_and_retire_stale_reclaims,
    test_tenants_cannot_see_fork_or_delete_each_others_snapshots,
)

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]

__all__ = [
    "test_branch_delete_releases_only_its_overlay",
    "test_branch_reads_fall_through_and_writes_stay_in_the_overlay",
    "test_deleting_a_snapshot_frees_exactly_the_unreferenced_blocks",
    "test_overwrite_and_flush_keep_the_snapshots_bytes",
    "test_overwrites_inside_an_overlay_leave_the_snapshot_alone",
    "test_retire_stale_drops_expired_snapshots_in_bounded_steps",
    "test_snapshot_of_a_prefix",
    "test_snapshot_of_explicit_keys_skips_absent_ones",
    "test_snapshot_of_the_whole_namespace",
    "test_snapshot_reads_survive_delete_and_overwrite",
    "test_snapshot_ttl_expires_and_retire_stale_reclaims",
    "test_tenants_cannot_see_fork_or_delete_each_others_snapshots",
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("cluster"), masters=3, replicas=0) as c:
        yield c


@pytest.fixture
def scope() -> str:
    return "namespace"


@pytest.fixture
def store(cluster: LocalCluster) -> Iterator[ClusterBackend]:
    """A front-end with a prefix of its own: every test starts from an empty deployment."""
    s = ClusterBackend(
        cluster.url,
        StoreOptions(cluster_key_prefix=f"t{secrets.token_hex(4)}", cluster_scrub_interval_s=0),
    )
    s.release_limit_ms, s.scrub_settle_ms = 300, 600
    yield s
    s.close()


@pytest.fixture
def opener(cluster: LocalCluster) -> Iterator[Callable[..., ClusterBackend]]:
    """Like test_store_snapshots' `opener` (options such as `clock=`): a fresh prefix."""
    opened: list[ClusterBackend] = []

    def open_store(**options: Any) -> ClusterBackend:
        prefix = f"t{secrets.token_hex(4)}"
        opts = StoreOptions(cluster_key_prefix=prefix, cluster_scrub_interval_s=0)
        s = ClusterBackend(cluster.url, opts, **options)
        s.release_limit_ms, s.scrub_settle_ms = 300, 600
        opened.append(s)
        return s

    yield open_store
    for s in opened:
        s.close()


def peer(cluster: LocalCluster, store: ClusterBackend) -> ClusterBackend:
    return ClusterBackend(
        cluster.url, StoreOptions(cluster_key_prefix=store.prefix, cluster_scrub_interval_s=0)
    )


def test_another_front_end_sees_and_forks_the_snapshot(
    cluster: LocalCluster, store: ClusterBackend
) -> None:
    fill(store, NS, {"a": blob("a"), "b": blob("b")})
    sid = store.snapshot_create(NS).id
    other = peer(cluster, store)
    try:
        assert [s.id for s in other.snapshot_list(NS)] == [sid]
        assert bytes(other.snapshot_get(NS, sid, "a") or b"") == blob("a")
        bid = other.branch_create(NS, sid).id
        assert other.branch_put(NS, bid, "a", blob("a2")).outcome is PutOutcome.NEW
        assert bytes(store.branch_get(NS, bid, "a") or b"") == blob("a2")
        assert bytes(store.branch_get(NS, bid, "b") or b"") == blob("b")
        assert store.snapshot_delete(NS, sid)
        assert other.branch_info(NS, bid) is None
        assert other.check(deep=True).ok
    finally:
        other.close()


def test_snapshot_under_concurrent_replacements_is_one_instant(
    cluster: LocalCluster, store: ClusterBackend
) -> None:
    """A writer replaces keys (each replacement frees the old block) while snapshots are
    taken: every snapshot holds, for every key, bytes that key really held, all from one
    instant, and the counts stay right. (Against a writer replacing flat out, a snapshot
    may give up after its retries with a retryable error; docs/cluster.md.)"""
    keys = [f"k{i}" for i in range(20)]
    for k in keys:
        store.put(NS, k, blob(f"{k}-0"))
    stop = threading.Event()
    writer = peer(cluster, store)

    def churn() -> None:
        gen = 1
        while not stop.is_set():
            for k in keys:  # generation `gen` of every key, in order
                writer.put(NS, k, blob(f"{k}-{gen}"))
                time.sleep(0.002)  # steady churn (a writer flat out can starve snapshots)
            gen += 1

    t = threading.Thread(target=churn)
    t.start()
    try:
        for _ in range(8):
            info = store.snapshot_create(NS)
            assert info.keys == len(keys)
            gens = []
            for k in keys:
                data = bytes(store.snapshot_get(NS, info.id, k) or b"")
                found = [g for g in range(10_000) if blob(f"{k}-{g}") == data][:1]
                assert found, f"{k}: bytes the key never held"
                gens.append(found[0])
            # one instant: generations only step down, by at most one, along the keys
            assert all(0 <= a - b <= 1 for a, b in itertools.pairwise(gens)), gens
            assert store.snapshot_delete(NS, info.id)
    finally:
        stop.set()
        t.join(30)
        writer.close()
    assert store.check().ok


def test_an_interrupted_drop_is_finished_by_any_front_end(
    cluster: LocalCluster, store: ClusterBackend
) -> None:
    fill(store, NS, {f"k{i}": blob(f"k{i}") for i in range(10)})
    sid = store.snapshot_create(NS).id
    for i in range(10):
        store.delete(NS, f"k{i}")  # only the snapshot holds the blocks now
    # a front-end died after marking the snapshot dropping and releasing part of it
    rk = CS.snaps_key(store.prefix, NS)
    raw = store._conn.exec(rk, [("HGET", rk, sid)])[0]
    rec = json.loads(raw)
    rec["state"] = "dropping"
    store._conn.exec(rk, [("HSET", rk, sid, json.dumps(rec))])
    ek = CS.snap_entries_key(store.prefix, NS, sid)
    removed_ms, popped = store._conn.script(CS.HASH_POP, [ek], [3])
    for i in range(1, len(popped), 2):
        e = CS.L.parse_entry(bytes(popped[i]))
        store._blocks.unref(NS, e.digest, e.gen, refs=-1, pins=-1, removed_ms=removed_ms)
    assert store.snapshot_info(NS, sid) is None  # invisible at once
    other = peer(cluster, store)
    try:
        other.retire_stale(budget_s=5.0)
        assert store._conn.exec(rk, [("HGET", rk, sid)])[0] is None
        assert store.stats(NS).unique_blocks == 0
        assert other.check().ok
    finally:
        other.close()


def test_snapshot_quota(cluster: LocalCluster) -> None:
    s = ClusterBackend(
        cluster.url,
        StoreOptions(
            cluster_key_prefix="quota", cluster_scrub_interval_s=0, max_snapshots_per_tenant=2
        ),
    )
    try:
        s.put(NS, "a", os.urandom(100))
        s.snapshot_create(NS)
        sid = s.snapshot_create(NS).id
        with pytest.raises(QuotaExceededError):
            s.snapshot_create(NS)
        assert s.snapshot_delete(NS, sid)
        s.snapshot_create(NS)
        assert s.check().ok  # the refused snapshot gave its holds back
    finally:
        s.close()
