"""The durable store's batch decision (`store/plan.py`) on its own: no disk, no threads.

`MemReader` is RAM as a dict model (keys, blobs with reference and pin counts,
snapshot/branch records, epochs); `apply` applies a plan's effects to it the way the
engine does. Table tests per operation kind check the records, effects and answers; a
Hypothesis property checks that deciding a batch at once equals deciding it one
operation at a time (each applied before the next).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from typing import Any

import blake3
import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from epistemic_kvcache.errors import CapacityError, NotFoundError, QuotaExceededError
from epistemic_kvcache.store import records
from epistemic_kvcache.store.api import PutOutcome, PutResult
from epistemic_kvcache.store.engine import (
    AddKey,
    DelKey,
    MetaDel,
    MetaPut,
    PinDelta,
    snapshot_ns,
    tenant_of,
)
from epistemic_kvcache.store.plan import BatchOp, KeyView, Plan, decide_batch, plan_evictions
from epistemic_kvcache.store.records import Op

NOW = 1_700_000_000.0


@dataclasses.dataclass
class MemBlob:
    sdig: bytes
    size: int
    refs: int = 0
    pins: int = 0
    seg: int = 1
    off: int = 0


class MemReader:
    """RAM as a dict model; `apply` is the engine's apply step, in miniature."""

    def __init__(self, *, live: int = 1 << 30, max_keys: int = 0, max_pinned: int = 1 << 30):
        self.live_capacity_bytes = live
        self.cold_capacity_bytes = live * 2
        self.max_keys_per_tenant = max_keys
        self.max_pinned = max_pinned
        self.max_snapshots = 4
        self.keys: dict[tuple[str, str], KeyView] = {}
        self.blobs: dict[bytes, MemBlob] = {}  # least recently used first
        self.metas: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.epochs: dict[tuple[str, str], int] = {}
        self.fww = False
        self.next_off = 0

    # -- the Reader protocol -------------------------------------------------------------
    def key(self, ns: str, key: str) -> KeyView | None:
        ks = self.keys.get((ns, key))
        return dataclasses.replace(ks) if ks is not None else None

    def blob(self, sdig: bytes) -> MemBlob | None:
        return self.blobs.get(sdig)

    def key_refs(self, sdig: bytes) -> list[tuple[str, str]]:
        return [ref for ref, ks in self.keys.items() if ks.sdig == sdig]

    def meta(self, kind: str, tenant: str, rid: str) -> dict[str, Any] | None:
        return self.metas.get((kind, tenant, rid))

    def ns_keys(self, ns: str) -> list[str]:
        return [k for (n, k) in self.keys if n == ns]

    def cold_bytes(self) -> int:
        return sum(b.size for b in self.blobs.values())

    def lru_victims(self, need: int, skip: set[bytes]) -> list[tuple[bytes, int]] | None:
        free = [(b.sdig, b.size) for b in self.blobs.values() if not b.pins and b.sdig not in skip]
        sizes = list(itertools.accumulate(size for _s, size in free))
        n = bisect.bisect_left(sizes, need) + 1 if need > 0 else 0
        return free[:n] if n <= len(free) else None

    def epoch(self, tenant: str, scope: str) -> int:
        return self.epochs.get((tenant, scope), 0)

    def first_write_wins(self, ns: str) -> bool:
        return self.fww

    def check_key_quota(self, ns: str, pending: int) -> None:
        if len(self.ns_keys(ns)) + pending >= self.max_keys_per_tenant:
            raise QuotaExceededError("keys", resource="keys")

    def check_pin_quota(self, tenant: str, extra: int) -> None:
        used = sum(b.size for b in self.blobs.values() if b.pins)
        if used + extra > self.max_pinned:
            raise QuotaExceededError("pins", resource="pins")

    def check_snapshot_quota(self, tenant: str, pending: int) -> None:
        have = sum(1 for (k, t, _r) in self.metas if k == "snap" and t == tenant)
        if have + pending >= self.max_snapshots:
            raise QuotaExceededError("snapshots", resource="snapshots")

    def now(self) -> float:
        return NOW

    # -- the apply step ------------------------------------------------------------------
    def write(self, plan: Plan) -> list[tuple[int, int]]:
        """Positions for the plan's records, as a writer would give them."""
        positions = []
        for hdr, payload in plan.records:
            positions.append((1, self.next_off))
            self.next_off += len(hdr) + (len(payload) if payload is not None else 0)
        return positions

    def apply(self, plan: Plan) -> None:
        plan.resolve(self.write(plan))
        for e in plan.effects:
            if isinstance(e, AddKey):
                b = self.blobs.get(e.sdig)
                if b is None:
                    assert e.data is not None or e.seg >= 0
                    b = self.blobs[e.sdig] = MemBlob(e.sdig, e.size, seg=e.seg, off=e.off)
                b.refs += 1
                self.keys[(e.ns, e.key)] = KeyView(e.sdig, e.size, 0, e.tag)
            elif isinstance(e, DelKey):
                ks = self.keys.pop((e.ns, e.key))
                b = self.blobs[ks.sdig]
                b.refs -= 1
                b.pins -= ks.pins
                if b.refs == 0:
                    del self.blobs[ks.sdig]
            elif isinstance(e, PinDelta):
                ks = self.keys[(e.ns, e.key)]
                ks.pins += e.delta
                self.blobs[ks.sdig].pins += e.delta
            elif isinstance(e, MetaPut):
                self.metas[(e.kind, e.tenant, e.id)] = e.record
            elif isinstance(e, MetaDel):
                del self.metas[(e.kind, e.tenant, e.id)]

    def state(self) -> tuple[Any, ...]:
        """Everything but where the bytes are on disk."""
        keys = {ref: (ks.sdig, ks.size, ks.pins, ks.tag) for ref, ks in self.keys.items()}
        blobs = {s: (b.size, b.refs, b.pins) for s, b in self.blobs.items()}
        return keys, blobs, dict(self.metas)


def sdig_of(data: bytes) -> bytes:
    return blake3.blake3(data).digest()


def put(ns: str, key: str, data: bytes, **kw: Any) -> BatchOp:
    d = sdig_of(data)
    return BatchOp("put", ns, key, sdig=d, digest=d, data=data, **kw)


def ops_of(plan: Plan) -> list[Op]:
    return [records.decode(bytes(hdr)).op for hdr, _payload in plan.records]


def stored(r: MemReader, *items: tuple[str, str, bytes]) -> MemReader:
    for ns, key, data in items:
        r.apply(decide_batch(r, [put(ns, key, data)]))
    return r


# -- table tests, per operation kind -----------------------------------------------------
def test_put_new_writes_blob_then_key_and_places_the_add() -> None:
    r = MemReader()
    p = decide_batch(r, [put("t", "a", b"hello")])
    assert ops_of(p) == [Op.BLOB, Op.KEY]
    assert p.results == [PutResult(PutOutcome.NEW, sdig_of(b"hello"), 5)]
    assert p.deduped == [False]
    assert p.new_data
    (add,) = p.effects
    assert isinstance(add, AddKey)
    assert add.data == b"hello"
    p.resolve([(7, 100), (7, 200)])
    hlen = records.blob_header_length(sdig_of(b"hello"))
    assert (add.seg, add.off) == (7, 100 + hlen)  # where the payload starts
    assert p.key_recs == {("t", "a"): 1}
    assert p.placed == {sdig_of(b"hello"): 0}


def test_put_of_stored_bytes_under_a_new_key_is_deduped() -> None:
    r = stored(MemReader(), ("t", "a", b"hello"))
    blob = r.blobs[sdig_of(b"hello")]
    p = decide_batch(r, [put("t", "b", b"hello")])
    assert ops_of(p) == [Op.KEY]
    assert p.deduped == [True]
    assert not p.new_data
    (add,) = p.effects
    assert isinstance(add, AddKey)
    assert add.data is None
    assert (add.seg, add.off) == (blob.seg, blob.off)
    assert not p.pending_adds


@pytest.mark.parametrize(
    ("cond", "fww", "existing", "outcome"),
    [
        (None, False, b"hello", PutOutcome.DUPLICATE),
        ("nx", False, b"other", PutOutcome.CONFLICT),
        (None, True, b"other", PutOutcome.CONFLICT),  # first write wins
        ("xx", False, None, PutOutcome.MISSING),
    ],
)
def test_put_that_writes_nothing(
    cond: Any, fww: bool, existing: bytes | None, outcome: PutOutcome
) -> None:
    r = MemReader()
    if existing is not None:
        stored(r, ("t", "a", existing))
    r.fww = fww
    before = r.state()
    p = decide_batch(r, [put("t", "a", b"hello", cond=cond)])
    assert p.records == []
    assert p.effects == []
    assert isinstance(p.results[0], PutResult)
    assert p.results[0].outcome is outcome
    r.apply(p)
    assert r.state() == before


def test_put_replacing_keeps_the_keys_pins() -> None:
    r = stored(MemReader(), ("t", "a", b"old"))
    r.apply(decide_batch(r, [BatchOp("pin", "t", "a")]))
    p = decide_batch(r, [put("t", "a", b"new")])
    assert p.results[0].outcome is PutOutcome.REPLACED
    assert [type(e) for e in p.effects] == [DelKey, AddKey, PinDelta]
    assert p.ref_delta == {sdig_of(b"old"): -1, sdig_of(b"new"): 1}
    r.apply(p)
    assert r.keys[("t", "a")].pins == 1
    assert sdig_of(b"old") not in r.blobs


def test_put_over_a_stale_entry_is_new() -> None:
    r = MemReader()
    r.apply(decide_batch(r, [put("t", "a", b"old", tag=("s", 0))]))
    r.epochs[("t", "s")] = 1
    p = decide_batch(r, [put("t", "a", b"new", cond="nx", tag=("s", 1))])
    assert p.results[0].outcome is PutOutcome.NEW


def test_put_past_the_key_quota_is_refused_and_writes_nothing() -> None:
    r = stored(MemReader(max_keys=2), ("t", "a", b"1"))
    p = decide_batch(r, [put("t", "b", b"2"), put("t", "c", b"3"), put("t", "a", b"4")])
    assert p.results[0].outcome is PutOutcome.NEW
    assert isinstance(p.results[1], QuotaExceededError)
    assert p.results[2].outcome is PutOutcome.REPLACED  # not a new key: no quota
    assert ops_of(p) == [Op.BLOB, Op.KEY, Op.BLOB, Op.KEY]


def test_same_new_bytes_twice_in_one_batch_are_written_once() -> None:
    r = MemReader()
    p = decide_batch(r, [put("t", "a", b"x"), put("t", "b", b"x")])
    assert ops_of(p) == [Op.BLOB, Op.KEY, Op.KEY]
    assert p.deduped == [False, True]
    assert [i for _e, i in p.pending_adds] == [0, 0]  # both learn the BLOB's place
    r.apply(p)
    assert r.blobs[sdig_of(b"x")].refs == 2


def test_delete() -> None:
    r = stored(MemReader(), ("t", "a", b"x"))
    p = decide_batch(r, [BatchOp("delete", "t", "a"), BatchOp("delete", "t", "a")])
    assert p.results == [True, False]  # the second sees the first
    assert ops_of(p) == [Op.DEL]
    assert p.tombs == [0]
    assert p.key_recs == {("t", "a"): None}
    r.apply(p)
    assert r.keys == {}
    assert r.blobs == {}


def test_pin_and_unpin() -> None:
    r = stored(MemReader(), ("t", "a", b"x"))
    p = decide_batch(
        r, [BatchOp("unpin", "t", "a"), BatchOp("pin", "t", "a"), BatchOp("unpin", "t", "a")]
    )
    assert p.results == [False, True, True]
    recs = [records.decode(bytes(h)) for h, _p in p.records]
    assert [(x.op, x.pins) for x in recs] == [(Op.KEY, 1), (Op.KEY, 0)]
    assert decide_batch(r, [BatchOp("pin", "t", "nope")]).results == [False]


def test_pin_past_the_quota_is_refused() -> None:
    r = stored(MemReader(max_pinned=3), ("t", "a", b"xy"), ("t", "b", b"zw"))
    p = decide_batch(r, [BatchOp("pin", "t", "a"), BatchOp("pin", "t", "b")])
    assert p.results[0] is True
    assert isinstance(p.results[1], QuotaExceededError)
    assert ops_of(p) == [Op.KEY]


def test_quarantine_drops_every_key_of_the_blob() -> None:
    r = stored(MemReader(), ("t", "a", b"x"), ("u", "b", b"x"))
    b = r.blobs[sdig_of(b"x")]
    p = decide_batch(r, [BatchOp("quarantine", "", "", sdig=b.sdig, loc=(b.seg, b.off))])
    assert ops_of(p) == [Op.QUAR, Op.DEL, Op.DEL]
    assert p.quarantine == {b.sdig: NOW}
    assert p.dropped == {b.sdig}
    dels = [records.decode(bytes(h)) for h, _p in p.records[1:]]
    assert {d.aux for d in dels} == {records.DEL_QUARANTINED}
    # a copy elsewhere (moved, or stored again since) is not the one that failed
    p2 = decide_batch(r, [BatchOp("quarantine", "", "", sdig=b.sdig, loc=(b.seg + 1, b.off))])
    assert p2.records == []


def test_snapshot_then_drop() -> None:
    r = stored(MemReader(), ("t", "a", b"1"), ("t", "b", b"2"), ("t", "c", b"3"))
    rec = {"id": "s1"}
    p = decide_batch(r, [BatchOp("snapshot", "t", "s1", payload=(None, "a", rec))])
    assert p.results == [1]
    assert ops_of(p) == [Op.KEY, Op.META]
    r.apply(p)
    sns = snapshot_ns("t", "s1")
    assert r.keys[(sns, "a")].pins == 1
    assert r.metas[("snap", "t", "s1")] == rec
    p = decide_batch(r, [BatchOp("drop", "t", "", payload=[("snap", "s1"), ("snap", "zz")])])
    assert p.results == [1]
    assert ops_of(p) == [Op.DEL, Op.MDEL]
    r.apply(p)
    assert (sns, "a") not in r.keys
    assert r.metas == {}


def test_branch_record_needs_its_snapshot() -> None:
    r = MemReader()
    e = MetaPut("branch", "t", "b1", {"snapshot_id": "nope"})
    p = decide_batch(r, [BatchOp("meta_put", "t", "", payload=e)])
    assert isinstance(p.results[0], NotFoundError)
    assert p.records == []


def test_flush_and_retire() -> None:
    r = MemReader()
    r.apply(decide_batch(r, [put("t", "a", b"1", tag=("s", 0)), put("t", "b", b"2")]))
    r.epochs[("t", "s")] = 1
    p = decide_batch(r, [BatchOp("retire", "t", "a"), BatchOp("retire", "t", "b")])
    assert p.results == [True, False]
    p = decide_batch(r, [BatchOp("flush", "t", "")])
    assert p.results == [2]
    assert ops_of(p) == [Op.DEL, Op.DEL]


def test_full_cold_tier_evicts_least_recently_used_unpinned() -> None:
    r = stored(MemReader(live=6), ("t", "a", b"aa"), ("t", "b", b"bb"), ("t", "c", b"cc"))
    r.apply(decide_batch(r, [BatchOp("pin", "t", "a")]))
    p = decide_batch(r, [put("t", "d", b"dd")])
    assert p.results[0].outcome is PutOutcome.NEW
    evicted = [records.decode(bytes(h)) for h, _p in p.records if ops_of(p)[0] is Op.DEL]
    assert [(x.op, x.key, x.aux) for x in evicted[:1]] == [(Op.DEL, "b", records.DEL_EVICTED)]
    assert p.dropped == {sdig_of(b"bb")}
    # everything else pinned: no room, a precise error, nothing written
    r.apply(p)
    r.apply(decide_batch(r, [BatchOp("pin", "t", k) for k in ("c", "d")]))
    p = decide_batch(r, [put("t", "e", b"ee")])
    assert isinstance(p.results[0], CapacityError)
    assert p.records == []


def test_plan_evictions_marks_deletes_as_evictions() -> None:
    r = stored(MemReader(), ("t", "a", b"x"), ("t", "b", b"x"))
    p = plan_evictions(r, [sdig_of(b"x")])
    recs = [records.decode(bytes(h)) for h, _p in p.records]
    assert [(x.op, x.aux) for x in recs] == [(Op.DEL, records.DEL_EVICTED)] * 2
    assert all(isinstance(e, DelKey) and e.evicted for e in p.effects)


def test_unknown_operation_is_an_error_for_that_op_only() -> None:
    r = MemReader()
    p = decide_batch(r, [BatchOp("frobnicate", "t", "a"), put("t", "a", b"x")])
    assert "unknown operation" in str(p.results[0])
    assert p.results[1].outcome is PutOutcome.NEW


# -- the property: a batch decides as its operations one by one --------------------------
NS = ["t", "u"]
KEYS = ["a", "b", "c"]
DATA = [b"1", b"22", b"333"]

op_st = st.one_of(
    st.builds(
        put,
        st.sampled_from(NS),
        st.sampled_from(KEYS),
        st.sampled_from(DATA),
        cond=st.sampled_from([None, None, "nx", "xx"]),
    ),
    st.builds(
        BatchOp,
        st.sampled_from(["delete", "pin", "unpin", "rewrite"]),
        st.sampled_from(NS),
        st.sampled_from(KEYS),
    ),
    st.builds(lambda ns: BatchOp("flush", ns, ""), st.sampled_from(NS)),
    st.builds(
        lambda sid, prefix: BatchOp("snapshot", "t", sid, payload=(None, prefix, {"id": sid})),
        st.sampled_from(["s1", "s2"]),
        st.sampled_from([None, "a"]),
    ),
    st.builds(
        lambda sid: BatchOp("drop", "t", "", payload=[("snap", sid)]), st.sampled_from(["s1", "s2"])
    ),
)


def _answer(x: Any) -> Any:
    return (type(x).__name__, str(x)) if isinstance(x, Exception) else x


@settings(max_examples=150, deadline=None)
@given(
    setup=st.lists(op_st, max_size=8),
    batch=st.lists(op_st, min_size=1, max_size=12),
    fww=st.booleans(),
)
def test_batch_equals_op_by_op(setup: list[BatchOp], batch: list[BatchOp], fww: bool) -> None:
    # quotas are left out: within a batch they are counted conservatively (what the
    # batch pins or snapshots adds up, an unpin or drop in the same batch gives nothing back)
    at_once, one_by_one = MemReader(), MemReader()
    for r in (at_once, one_by_one):
        r.fww = fww
        r.max_snapshots = 1 << 30
        for op in setup:
            r.apply(decide_batch(r, [dataclasses.replace(op)]))
    assert at_once.state() == one_by_one.state()
    plan = decide_batch(at_once, batch)
    at_once.apply(plan)
    answers = []
    for op in batch:
        p = decide_batch(one_by_one, [op])
        one_by_one.apply(p)
        answers.append(_answer(p.results[0]))
    assert [_answer(x) for x in plan.results] == answers
    assert at_once.state() == one_by_one.state()
    for ns, _key in at_once.keys:  # every key's tenant namespace is one we wrote
        assert tenant_of(ns) in NS
