"""store/cluster_entries.py on its own, against a real Redis Cluster: the outcomes of
the PUT protocol and what each does to references, pins, removals."""

from __future__ import annotations

import pytest

import redis_cluster as rc
from epistemic_kvcache.errors import QuotaExceededError
from epistemic_kvcache.store.api import PutOutcome
from epistemic_kvcache.store.engine import digest_of

pytestmark = rc.redis_marks()


cluster = rc.module_cluster()
parts = rc.parts_fixture("e")


def put(p: rc.Parts, key: str, data: bytes, cond: str | None = None, quota: int = 0) -> PutOutcome:
    tk = p.entries.keys_of("t")
    return p.entries.put_to("t", tk, key, data, None, cond, quota, memo=True).outcome  # type: ignore[arg-type]


def refs(p: rc.Parts, data: bytes) -> int | None:
    bkey = p.blocks.key("t", digest_of(data))
    r = p.conn.exec(bkey, [("HGET", bkey, "r")])[0]
    return int(r) if r is not None else None


def test_outcomes_and_references(parts: rc.Parts) -> None:
    a, b = b"a" * 700, b"b" * 900
    assert put(parts, "k", a) is PutOutcome.NEW
    assert put(parts, "k", a) is PutOutcome.DUPLICATE
    assert refs(parts, a) == 1  # the duplicate's reference was given back
    assert put(parts, "k", b, cond="nx") is PutOutcome.CONFLICT
    assert put(parts, "absent", b, cond="xx") is PutOutcome.MISSING
    assert refs(parts, b) is None  # refused: the block went with its only reference
    assert put(parts, "k2", a) is PutOutcome.NEW
    assert refs(parts, a) == 2
    assert put(parts, "k", b) is PutOutcome.REPLACED
    assert (refs(parts, a), refs(parts, b)) == (1, 1)
    assert parts.ram.memo.digest("t", "k") == digest_of(b)
    found = parts.entries.read("t", ["k", "k2", "nope"])
    assert [f[1].digest if f else None for f in found] == [digest_of(b), digest_of(a), None]
    c = parts.counters.shared("t")
    assert (c["keys"], c["logical_bytes"], c["put_new"], c["put_replaced"]) == (2, 1600, 2, 1)
    assert (c["put_conflicts"], c["dedup_hits"]) == (1, 2)


def test_first_write_wins_and_the_key_quota(cluster: rc.LocalCluster) -> None:
    p = rc.cluster_parts(cluster.url, "efww", first_write_wins=frozenset({"t"}))
    try:
        assert put(p, "k", b"one") is PutOutcome.NEW
        assert put(p, "k", b"two") is PutOutcome.CONFLICT
        assert put(p, "k", b"one", quota=1) is PutOutcome.DUPLICATE  # no new key: allowed
        with pytest.raises(QuotaExceededError):
            put(p, "k2", b"two", quota=1)
        assert refs(p, b"two") is None
    finally:
        p.close()


def test_pins_move_with_a_replacement_and_count_against_the_limit(parts: rc.Parts) -> None:
    a, b = b"p" * 1000, b"q" * 1000
    put(parts, "k", a)
    assert parts.entries.pin("t", "k", +1, limit=1500) is True
    assert parts.entries.pin("absent", "k", +1, limit=0) is False
    put(parts, "k2", b)
    assert parts.entries.pin("t", "k2", +1, limit=1500) is None  # 2000 > 1500
    put(parts, "k", b)  # the pin moves to b's block
    bkey_b = parts.blocks.key("t", digest_of(b))
    assert parts.conn.exec(bkey_b, [("HGET", bkey_b, "p")])[0] == b"1"
    assert refs(parts, a) is None
    assert parts.entries.pin("t", "k", -1, limit=0) is True
    assert parts.entries.pin("t", "k", -1, limit=0) is False  # not pinned any more


def test_removals_release_once(parts: rc.Parts) -> None:
    a = b"r" * 800
    put(parts, "k1", a)
    put(parts, "k2", a)
    f = parts.entries.read("t", ["k1"])[0]
    assert f is not None
    assert parts.entries.remove("t", b"k1", b"not-the-entry") is None  # compare-and-delete
    parts.entries.drop("t", "k1", f[1])  # a lost block's entry: removed, nothing released
    assert refs(parts, a) == 2
    assert parts.entries.remove("t", b"k2") is not None
    assert refs(parts, a) == 1
    for i in range(7):
        put(parts, f"m{i}", bytes([i]) * 100)
    assert parts.entries.pop("t") == 7
    assert parts.entries.read("t", ["m0"]) == [None]
    assert refs(parts, bytes([3]) * 100) is None
