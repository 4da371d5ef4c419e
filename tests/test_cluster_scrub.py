"""store/cluster_scrub.py on its own, against a real Redis Cluster: the walk over
entries, the lease, what the check reports and what the scrub repairs."""

from __future__ import annotations

import os
import threading

import redis_cluster as rc
from epistemic_kvcache.store import cluster_lua as L
from epistemic_kvcache.store.cluster_scrub import ClusterScrub, hash_entries
from epistemic_kvcache.store.engine import digest_of

pytestmark = rc.redis_marks()


cluster = rc.module_cluster()
parts = rc.parts_fixture("s")


def scrubber(p: rc.Parts, extra: dict[str, list[bytes]] | None = None) -> ClusterScrub:
    s = ClusterScrub(
        p.conn,
        p.counters,
        lambda ns: (extra or {}).get(ns, []),
        p.blocks,
        p.entries,
        threading.Event(),
        prefix=p.prefix,
    )
    s.settle_ms = 0  # nothing else writes under this prefix
    return s


def put(p: rc.Parts, key: str, data: bytes) -> None:
    p.counters.register("t")
    p.entries.put_to("t", p.entries.keys_of("t"), key, data, None, None, 0, memo=False)


def test_hash_entries_walks_every_page(parts: rc.Parts) -> None:
    h = f"{{{parts.prefix}}}:many".encode()
    fields = {f"f{i}".encode(): b"v" for i in range(1100)}
    parts.conn.exec(h, [("HSET", h, *[x for kv in fields.items() for x in kv])])
    assert dict(hash_entries(parts.conn, h)) == fields
    assert list(hash_entries(parts.conn, h + b"-absent")) == []


def test_check_reports_and_scrub_repairs(parts: rc.Parts) -> None:
    a = os.urandom(2000)
    put(parts, "k", a)
    put(parts, "k2", a)
    scrub = scrubber(parts)
    report = scrub.scrub(fix=False, deep=True)
    assert report.ok
    assert (report.keys, report.blocks) == (2, 1)
    bkey = parts.blocks.key("t", digest_of(a))
    gen = parts.conn.exec(bkey, [("HGET", bkey, "g")])[0]
    parts.conn.script(L.BLOB_REF, [bkey], [os.urandom(8), 0])  # a leaked reference
    parts.conn.exec(bkey, [("HSET", bkey, "t", 1)])  # ... from long ago
    lost = os.urandom(1000)
    put(parts, "lost", lost)
    lkey = parts.blocks.key("t", digest_of(lost))
    parts.conn.exec(lkey, [("DEL", lkey)])  # evicted by the cluster
    report = scrub.scrub(fix=False)
    assert report.refcount_mismatches == [f"{bkey.decode()}: 3 != 2"]
    assert report.orphan_index_entries == ["t/lost"]
    report = scrub.scrub(fix=True)
    # a check counts as a scrub too
    assert scrub.counts == {"scrubs": 3, "scrub_fixed_blocks": 1, "scrub_removed_entries": 1}
    assert parts.conn.exec(bkey, [("HMGET", bkey, "r", "g")])[0] == [b"2", gen]
    assert parts.entries.read("t", ["lost"]) == [None]
    assert scrub.scrub(fix=False).ok


def test_snapshot_hashes_hold_references_too(parts: rc.Parts) -> None:
    a = os.urandom(500)
    put(parts, "k", a)
    f = parts.entries.read("t", ["k"])[0]
    assert f is not None
    h = L.tenant_tag(parts.prefix, "t") + b":s:test"
    parts.conn.exec(h, [("HSET", h, b"k", f[1].raw)])  # as if a snapshot held the key
    assert scrubber(parts).scrub(fix=False).ok  # unaware of that hash: 1 and 1
    assert scrubber(parts, {"t": [h]}).scrub(fix=False).refcount_mismatches == [
        f"{parts.blocks.key('t', digest_of(a)).decode()}: 1 != 2"
    ]


def test_one_scrub_at_a_time(parts: rc.Parts) -> None:
    lock = L.lock_key(parts.prefix)
    parts.conn.exec(lock, [("SET", lock, "another front-end", "PX", 60_000)])
    put(parts, "k", b"x" * 100)
    scrub = scrubber(parts)
    assert scrub.scrub(fix=True).keys == 0  # the lease is taken: nothing done
    assert scrub.counts["scrubs"] == 0
    assert parts.conn.exec(lock, [("GET", lock)])[0] == b"another front-end"
    assert scrub.scrub(fix=False).keys == 1  # a check needs no lease
