"""store/cluster_blocks.py on its own, against a real Redis Cluster: references taken
with and without the bytes, released once, refused when late; verified reads."""

from __future__ import annotations

import os

import redis_cluster as rc
from epistemic_kvcache.store import cluster_lua as L
from epistemic_kvcache.store.engine import digest_of

pytestmark = rc.redis_marks()


cluster = rc.module_cluster()
parts = rc.parts_fixture("b")


def block_hash(p: rc.Parts, ns: str, data: bytes) -> dict[bytes, bytes]:
    bkey = p.blocks.key(ns, digest_of(data))
    return dict(p.conn.exec(bkey, [("HGETALL", bkey)])[0])


def entry(digest: bytes, gen: bytes, size: int) -> L.Entry:
    return L.parse_entry(digest + gen + b"\0" * L.OP_LEN + f"{size},0,,".encode())


def test_references_are_counted_and_the_last_release_frees(parts: rc.Parts) -> None:
    data = os.urandom(5000)
    d = digest_of(data)
    gen, _ms, created = parts.blocks.ref("t", d, data)
    assert created
    assert parts.counters.shared("t")["unique_blocks"] == 1
    parts.ram.cache.admit("t", d, data)  # cached: the next reference sends no bytes
    gen2, _ms, created2 = parts.blocks.ref("t", d, data)
    assert (gen2, created2) == (gen, False)
    assert block_hash(parts, "t", data)[b"r"] == b"2"
    parts.blocks.unref("t", d, gen)
    assert block_hash(parts, "t", data)[b"r"] == b"1"
    parts.blocks.unref("t", d, gen)
    assert block_hash(parts, "t", data) == {}
    shared = parts.counters.shared("t")
    assert (shared["unique_blocks"], shared["resident_bytes"]) == (0, 0)


def test_a_cached_digest_whose_block_is_gone_is_stored_again(parts: rc.Parts) -> None:
    data = os.urandom(3000)
    d = digest_of(data)
    parts.ram.cache.admit("t", d, data)  # RAM says "probably stored": it is not
    gen, _ms, created = parts.blocks.ref("t", d, data)
    assert created
    assert block_hash(parts, "t", data)[b"d"] == data
    assert block_hash(parts, "t", data)[b"g"] == gen


def test_a_late_release_is_refused_and_counted_as_a_leak(parts: rc.Parts) -> None:
    data = os.urandom(1000)
    d = digest_of(data)
    gen, t_ms, _ = parts.blocks.ref("t", d, data)
    parts.blocks.release_limit_ms = 1000
    parts.blocks.unref("t", d, gen, removed_ms=t_ms - 10_000)
    assert parts.blocks.counts["leaked_refs"] == 1
    assert block_hash(parts, "t", data)[b"r"] == b"1"  # never low
    parts.blocks.unref("t", d, gen, refs=-1, removed_ms=0)  # unchecked: released
    assert block_hash(parts, "t", data) == {}


def test_reads_are_verified(parts: rc.Parts) -> None:
    data = os.urandom(4000)
    d = digest_of(data)
    gen, _ms, _ = parts.blocks.ref("t", d, data)
    e = entry(d, gen, len(data))
    assert bytes(parts.blocks.fetch("t", e) or b"") == data
    assert parts.ram.cache.has("t", d)  # a verified read is cached
    assert parts.blocks.live("t", e)
    parts.ram.cache.flush("t")
    other_gen = entry(d, b"\x01" * L.GEN_LEN, len(data))
    assert parts.blocks.fetch("t", other_gen) is None  # another generation: evicted
    assert parts.blocks.live_many("t", [e, other_gen]) == [True, False]
    assert parts.counters.shared("t")["evictions"] == 1
    bkey = parts.blocks.key("t", d)
    parts.conn.exec(bkey, [("HSET", bkey, "d", b"!" + data[1:])])  # damaged in place
    assert parts.blocks.fetch_many("t", [e, e]) == [None, None]
    assert parts.counters.shared("t")["integrity_failures"] == 2
    assert block_hash(parts, "t", data) == {}  # deleted, never served
    assert not parts.ram.cache.has("t", d)
    assert parts.blocks.read("t", e) is None
