"""The durable store's per-batch decision, as a pure function: `decide_batch(reader, ops)`.

How it works
------------
The committer takes a batch of queued operations (`BatchOp`) and asks `decide_batch`
what they do, given RAM as a `Reader` shows it. Each operation is decided against RAM
*as the earlier operations of the same batch left it* (nothing is applied while a batch
is decided): the decider keeps the batch's own view of keys, reference counts and
snapshot/branch records on top of the reader. The answer is a `Plan`:

- `records`: the log records to write, in order (header, payload), encoded already;
- `effects`: what to apply to RAM once those records are durable (`store.engine`'s
  AddKey/DelKey/PinDelta/MetaPut/MetaDel); an AddKey of a block whose BLOB record is in
  this batch learns its place on disk from the written positions (`pending_adds`);
- `results`: the answer of each operation (a value, or the `StoreError` to raise);
- the bookkeeping the apply step needs: which key/meta records were written (their
  record index), which records are tombstones, which blobs may die.

Nothing here writes, locks or reads a clock but through the reader: the same reader
and operations give the same plan, which is what `tests/test_store_plan.py` checks
operation by operation. The committer then writes `records` (one sync), resolves the
positions (`Plan.placed_at`, `Plan.key_locs`, ...) and applies `effects`.
"""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from epistemic_kvcache.errors import CapacityError, NotFoundError, StoreError
from epistemic_kvcache.store import records
from epistemic_kvcache.store.api import (
    PUT_CONFLICT,
    PUT_DUPLICATE,
    PUT_MISSING,
    Buffer,
    PutCond,
    PutResult,
    decide_put,
)
from epistemic_kvcache.store.model import (
    AddKey,
    DelKey,
    Effect,
    MetaDel,
    MetaPut,
    PinDelta,
    branch_ns,
    parse_internal_ns,
    snapshot_ns,
    tenant_of,
)
from epistemic_kvcache.store.records import Op
from epistemic_kvcache.store.recovery import META_CODES

__all__ = ["BatchOp", "BlobView", "KeyView", "Plan", "Reader", "decide_batch", "plan_evictions"]


@dataclass(slots=True)
class BatchOp:
    """One queued operation (the committer's unit of work)."""

    kind: str  # put | delete | pin | unpin | quarantine | snapshot | drop | meta_put |
    #            retire | rewrite | flush
    ns: str
    key: str
    sdig: bytes = b""
    digest: bytes = b""
    data: Buffer | None = None
    loc: tuple[int, int] = (-1, 0)  # quarantine: (segment, offset) of the copy that failed
    tag: tuple[str, int] | None = None  # put: the epoch tag to write with the entry
    payload: Any = None  # snapshot / drop / meta_put arguments
    cond: PutCond = None
    future: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)

    @property
    def nbytes(self) -> int:
        return len(self.data) if self.data is not None else 0


@dataclass(slots=True)
class KeyView:
    """A key's state: its blob, the blob's size, the key's pins, its epoch tag."""

    sdig: bytes
    size: int
    pins: int
    tag: tuple[str, int] | None


class BlobView(Protocol):
    """What the decision reads of a stored blob (`store.engine._Blob` is one)."""

    @property
    def sdig(self) -> bytes: ...
    @property
    def size(self) -> int: ...
    @property
    def refs(self) -> int: ...
    @property
    def pins(self) -> int: ...
    @property
    def seg(self) -> int: ...
    @property
    def off(self) -> int: ...


class Reader(Protocol):
    """RAM as the decision sees it (read-only; each call is consistent on its own)."""

    live_capacity_bytes: int
    cold_capacity_bytes: int
    max_keys_per_tenant: int

    def key(self, ns: str, key: str) -> KeyView | None:
        """The key's state in RAM (stale or not), None when absent."""

    def blob(self, sdig: bytes) -> BlobView | None: ...

    def key_refs(self, sdig: bytes) -> list[tuple[str, str]]:
        """The keys that reference blob `sdig` in RAM."""

    def meta(self, kind: str, tenant: str, rid: str) -> dict[str, Any] | None: ...

    def ns_keys(self, ns: str) -> list[str]: ...

    def cold_bytes(self) -> int:
        """Live block bytes stored (what `live_capacity_bytes` bounds)."""

    def lru_victims(self, need: int, skip: set[bytes]) -> list[tuple[bytes, int]] | None:
        """(sdig, size) of the least recently used unpinned blobs not in `skip`, until
        their sizes reach `need`; None when they cannot."""

    def epoch(self, tenant: str, scope: str) -> int: ...

    def first_write_wins(self, ns: str) -> bool: ...

    def check_key_quota(self, ns: str, pending: int) -> None:
        """Raise `QuotaExceededError` when `pending` more keys pass the tenant's count."""

    def check_pin_quota(self, tenant: str, extra: int) -> None:
        """Raise `QuotaExceededError` when `extra` pinned bytes pass the tenant's share."""

    def check_snapshot_quota(self, tenant: str, pending: int) -> None: ...

    def now(self) -> float: ...


_Loc = tuple[int, int, int, int]
"""Where a blob's bytes are, as the batch sees them: (size, segment, payload offset,
BLOB record index in this batch or -1)."""


@dataclass(slots=True)
class Plan:
    """What a batch does: records to write, effects to apply, an answer per operation."""

    records: list[tuple[bytearray, Buffer | None]] = field(default_factory=list)
    effects: list[Effect] = field(default_factory=list)
    results: list[Any] = field(default_factory=list)
    deduped: list[bool] = field(default_factory=list)  # per put: its bytes were stored
    pending_adds: list[tuple[AddKey, int]] = field(default_factory=list)
    key_recs: dict[tuple[str, str], int | None] = field(default_factory=dict)
    meta_recs: dict[tuple[str, str, str], tuple[int, int] | None] = field(default_factory=dict)
    tombs: list[int] = field(default_factory=list)  # record indexes of tombstones
    placed: dict[bytes, int] = field(default_factory=dict)  # blob -> its BLOB record index
    ref_delta: dict[bytes, int] = field(default_factory=dict)
    dropped: set[bytes] = field(default_factory=set)
    quarantine: dict[bytes, float] = field(default_factory=dict)
    new_data: bool = False  # the batch stores new blocks (it may not use the delete reserve)

    def resolve(self, positions: Sequence[tuple[int, int]]) -> None:
        """Give the AddKey effects of blocks stored by this batch their place on disk,
        once `positions` (segment, record offset of each record) are known."""
        recs = self.records
        for eff, i in self.pending_adds:
            sid, off = positions[i]
            eff.seg, eff.off = sid, off + len(recs[i][0])

    def rec_len(self, i: int) -> int:
        hdr, payload = self.records[i]
        return len(hdr) + (len(payload) if payload is not None else 0)


class _Decider:
    """The batch's own view of RAM on top of the reader (nothing applied yet)."""

    def __init__(self, reader: Reader) -> None:
        self.r = reader
        self.p = Plan()
        self.keys: dict[tuple[str, str], KeyView | None] = {}
        self.metas: dict[tuple[str, str, str], dict[str, Any] | None] = {}
        self.added: dict[bytes, list[tuple[str, str]]] = {}
        self.locs: dict[bytes, _Loc] = {}
        self.touched: set[bytes] = set()
        self.pinned_extra: dict[str, int] = {}
        self.new_bytes = 0
        self.freed = 0

    # -- the batch's view ----------------------------------------------------------------
    def key(self, ns: str, key: str) -> KeyView | None:
        ref = (ns, key)
        if ref in self.keys:
            return self.keys[ref]
        return self.r.key(ns, key)

    def refs(self, sdig: bytes) -> int:
        b = self.r.blob(sdig)
        return (b.refs if b is not None else 0) + self.p.ref_delta.get(sdig, 0)

    def blob_loc(self, sdig: bytes) -> _Loc | None:
        """Where a blob that exists after the batch so far is."""
        if self.refs(sdig) <= 0:
            return None
        if sdig in self.locs:
            return self.locs[sdig]
        b = self.r.blob(sdig)
        if b is None:
            return None
        return b.size, b.seg, b.off, -1

    def incref(self, sdig: bytes, ref: tuple[str, str]) -> None:
        self.p.ref_delta[sdig] = self.p.ref_delta.get(sdig, 0) + 1
        self.added.setdefault(sdig, []).append(ref)
        self.touched.add(sdig)

    def decref(self, sdig: bytes) -> None:
        self.p.ref_delta[sdig] = self.p.ref_delta.get(sdig, 0) - 1

    def meta(self, kind: str, tenant: str, rid: str) -> dict[str, Any] | None:
        k = (kind, tenant, rid)
        if k in self.metas:
            return self.metas[k]
        return self.r.meta(kind, tenant, rid)

    def ns_keys(self, ns: str) -> list[str]:
        """Keys of `ns` as this batch sees them (RAM's, plus this batch's additions)."""
        names = self.r.ns_keys(ns)
        extra = [k for (n, k), st in self.keys.items() if n == ns and st is not None]
        return list(dict.fromkeys([*names, *extra]))

    def is_stale(self, ns: str, ks: KeyView) -> bool:
        return ks.tag is not None and ks.tag[1] < self.r.epoch(tenant_of(ns), ks.tag[0])

    def blob_pinned(self, sdig: bytes) -> bool:
        b = self.r.blob(sdig)
        if b is not None and b.pins:
            return True
        return any(st is not None and st.sdig == sdig and st.pins for st in self.keys.values())

    def keys_of_blob(self, sdig: bytes) -> list[tuple[str, str]]:
        """Keys that reference `sdig` after the batch so far."""
        out = []
        for ns, key in dict.fromkeys([*self.r.key_refs(sdig), *self.added.get(sdig, ())]):
            st = self.key(ns, key)
            if st is not None and st.sdig == sdig:
                out.append((ns, key))
        return out

    # -- records -------------------------------------------------------------------------
    def emit(self, header: bytearray, payload: Buffer | None = None) -> int:
        self.p.records.append((header, payload))
        return len(self.p.records) - 1

    def emit_key(self, ns: str, key: str, ks: KeyView) -> None:
        hdr = records.encode(Op.KEY, ns=ns, key=key, sdig=ks.sdig, pins=ks.pins, tag=ks.tag)
        self.p.key_recs[(ns, key)] = self.emit(hdr)
        self.keys[(ns, key)] = ks

    def emit_tomb(self, header: bytearray) -> None:
        self.p.tombs.append(self.emit(header))

    def emit_del(self, ns: str, key: str, *, evicted: bool = False, aux: int = 0) -> None:
        cur = self.key(ns, key)
        self.emit_tomb(
            records.encode(Op.DEL, ns=ns, key=key, aux=records.DEL_EVICTED if evicted else aux)
        )
        self.p.key_recs[(ns, key)] = None
        self.keys[(ns, key)] = None
        self.p.effects.append(DelKey(ns, key, evicted=evicted))
        if cur is not None:
            self.decref(cur.sdig)

    def emit_meta(self, kind: str, tenant: str, rid: str, rec: dict[str, Any]) -> None:
        body = json.dumps(rec).encode()
        hdr = records.encode(
            Op.META,
            ns=tenant,
            key=rid,
            aux=META_CODES[kind],
            plen=len(body),
            pcrc=records.payload_crc(body),
        )
        i = self.emit(hdr, body)
        self.p.meta_recs[(kind, tenant, rid)] = (i, len(hdr) + len(body))
        self.metas[(kind, tenant, rid)] = rec
        self.p.effects.append(MetaPut(kind, tenant, rid, rec))

    def emit_mdel(self, kind: str, tenant: str, rid: str) -> None:
        self.emit_tomb(records.encode(Op.MDEL, ns=tenant, key=rid, aux=META_CODES[kind]))
        self.p.meta_recs[(kind, tenant, rid)] = None
        self.metas[(kind, tenant, rid)] = None
        self.p.effects.append(MetaDel(kind, tenant, rid))

    def add_key(self, ns: str, key: str, ks: KeyView, data: Buffer | None, loc: _Loc) -> None:
        eff = AddKey(ns, key, ks.sdig, ks.size, data, loc[1], loc[2], ks.tag)
        self.p.effects.append(eff)
        if loc[3] >= 0:
            self.p.pending_adds.append((eff, loc[3]))

    # -- decisions -----------------------------------------------------------------------
    def decide(self, op: BatchOp) -> Any:
        kind = op.kind
        if kind == "put":
            return self.put(op)
        if kind == "delete":
            if self.key(op.ns, op.key) is None:
                return False
            self.emit_del(op.ns, op.key)
            return True
        if kind in ("pin", "unpin"):
            return self.pin(op)
        if kind == "quarantine":
            return self.quarantine(op)
        if kind == "snapshot":
            return self.snapshot(op)
        if kind == "drop":
            return self.drop(op)
        if kind == "meta_put":
            e: MetaPut = op.payload
            if e.kind == "branch" and self.meta("snap", e.tenant, e.record["snapshot_id"]) is None:
                raise NotFoundError(f"no snapshot {e.record['snapshot_id']!r}")
            self.emit_meta(e.kind, e.tenant, e.id, e.record)
            return None
        if kind == "retire":
            cur = self.key(op.ns, op.key)
            if cur is None or not self.is_stale(op.ns, cur):
                return False
            self.emit_del(op.ns, op.key)
            return True
        if kind == "rewrite":
            cur = self.key(op.ns, op.key)
            if cur is None:
                return False
            self.emit_key(op.ns, op.key, cur)
            return True
        if kind == "flush":
            n = 0
            for key in self.ns_keys(op.ns):
                if self.key(op.ns, key) is not None:
                    self.emit_del(op.ns, key)
                    n += 1
            return n
        raise StoreError(f"unknown operation {kind!r}")

    def put(self, op: BatchOp) -> PutResult:
        assert op.data is not None
        ns, key = op.ns, op.key
        internal = parse_internal_ns(ns)
        if internal is not None and self.meta(internal[1], internal[0], internal[2]) is None:
            # the branch was deleted while this PUT was being hashed or queued
            raise NotFoundError(f"no {internal[1]} {internal[2]!r}")
        cur = self.key(ns, key)
        stale = cur is not None and self.is_stale(ns, cur)
        live = None if cur is None or stale else cur
        outcome = decide_put(
            live.sdig if live else None, op.sdig, op.cond, self.r.first_write_wins(ns)
        )
        if outcome is PUT_MISSING:
            return PutResult(outcome, op.digest, len(op.data))
        if outcome is PUT_DUPLICATE or outcome is PUT_CONFLICT:
            assert live is not None
            return PutResult(outcome, live.sdig[-32:], live.size)
        if cur is None and self.r.max_keys_per_tenant and internal is None:
            self.key_quota(ns)
        pins = live.pins if live is not None else 0
        loc = self.blob_loc(op.sdig)
        data: Buffer | None = None
        if loc is None:
            size = len(op.data)
            self.make_room(size)
            hdr = records.encode(Op.BLOB, sdig=op.sdig, plen=size)
            i = self.emit(hdr, op.data)
            loc = self.locs[op.sdig] = (size, -1, 0, i)
            self.p.placed[op.sdig] = i
            self.new_bytes += size
            self.p.new_data = True
            data = op.data  # enters hot when applied if the tier has room
        else:
            self.p.deduped[-1] = True
        if cur is not None:
            self.p.effects.append(DelKey(ns, key))
            self.decref(cur.sdig)
        ks = KeyView(op.sdig, loc[0], pins, op.tag)
        self.emit_key(ns, key, ks)
        self.incref(op.sdig, (ns, key))
        self.add_key(ns, key, ks, data, loc)
        if pins:
            self.p.effects.append(PinDelta(ns, key, pins))  # pins belong to the key: they stay
        return PutResult(outcome, op.digest, loc[0])

    def key_quota(self, ns: str) -> None:
        """The tenant's key count as RAM and this batch have it, against its quota."""
        added = sum(
            1
            for (n, k), st in self.keys.items()
            if n == ns and st is not None and self.r.key(n, k) is None
        )
        self.r.check_key_quota(ns, added)

    def pin_room(self, tenant: str, extra: int) -> None:
        """Atomic pin quota: RAM's pinned bytes plus what this batch pins."""
        if extra <= 0:
            return
        pending = self.pinned_extra.get(tenant, 0)
        self.r.check_pin_quota(tenant, pending + extra)
        self.pinned_extra[tenant] = pending + extra

    def pin(self, op: BatchOp) -> bool:
        cur = self.key(op.ns, op.key)
        if cur is None:
            return False
        if op.kind == "pin":
            if not self.blob_pinned(cur.sdig):
                self.pin_room(tenant_of(op.ns), cur.size)
            new = KeyView(cur.sdig, cur.size, cur.pins + 1, cur.tag)
            delta = 1
        else:
            if cur.pins == 0:
                return False
            new = KeyView(cur.sdig, cur.size, cur.pins - 1, cur.tag)
            delta = -1
        self.emit_key(op.ns, op.key, new)
        self.p.effects.append(PinDelta(op.ns, op.key, delta))
        return True

    def quarantine(self, op: BatchOp) -> None:
        b = self.r.blob(op.sdig)
        if b is None or (b.seg, b.off) != op.loc or op.sdig in self.p.placed:
            return  # gone, or stored again since: a fresh copy, not the one that failed
        now = self.r.now()
        self.emit_tomb(records.encode(Op.QUAR, sdig=op.sdig, aux=int(now * 1000)))
        self.p.quarantine[op.sdig] = now
        for ns, key in self.keys_of_blob(op.sdig):
            self.emit_del(ns, key, aux=records.DEL_QUARANTINED)
        self.p.dropped.add(op.sdig)

    def make_room(self, size: int) -> None:
        """Evict the least valuable unpinned blocks until `size` more live bytes fit."""
        need = self.r.cold_bytes() - self.freed + self.new_bytes + size
        need -= self.r.live_capacity_bytes
        if need <= 0:
            return
        victims = self.r.lru_victims(need, self.touched | self.p.dropped)
        if victims is None:
            raise CapacityError(
                f"no room for a {size}-byte block: the cold tier "
                f"({self.r.cold_capacity_bytes} bytes) is full of pinned or in-flight blocks"
            )
        self.evict(victims)

    def evict(self, victims: Iterable[tuple[bytes, int]]) -> None:
        for sdig, size in victims:
            self.p.dropped.add(sdig)
            for ns, key in self.keys_of_blob(sdig):
                self.emit_del(ns, key, evicted=True)
            self.freed += size

    def snapshot(self, op: BatchOp) -> int:
        """Reference and pin the tenant's live entries under the snapshot namespace."""
        keys, prefix, rec = op.payload
        tenant, sid = op.ns, op.key
        pending = sum(
            1 for (k, t, _r), m in self.metas.items() if k == "snap" and t == tenant and m
        )
        self.r.check_snapshot_quota(tenant, pending)
        names = list(dict.fromkeys(keys)) if keys is not None else self.ns_keys(tenant)
        entries: list[tuple[str, KeyView]] = []
        for key in names:
            if prefix is not None and not key.startswith(prefix):
                continue
            cur = self.key(tenant, key)
            if cur is None or self.is_stale(tenant, cur):
                continue  # stale entries are not captured
            entries.append((key, cur))
        newly = {st.sdig: st.size for _k, st in entries if not self.blob_pinned(st.sdig)}
        self.pin_room(tenant, sum(newly.values()))
        sns = snapshot_ns(tenant, sid)
        for key, cur in entries:
            loc = self.blob_loc(cur.sdig)
            assert loc is not None
            ks = KeyView(cur.sdig, cur.size, 1, None)
            self.emit_key(sns, key, ks)
            self.incref(cur.sdig, (sns, key))
            self.add_key(sns, key, ks, None, loc)
            self.p.effects.append(PinDelta(sns, key, +1))
        self.emit_meta("snap", tenant, sid, rec)
        return len(entries)

    def drop(self, op: BatchOp) -> int:
        """Delete every entry of the named snapshots / branches, and their records."""
        tenant = op.ns
        n = 0
        for kind, rid in op.payload:
            if self.meta(kind, tenant, rid) is None:
                continue
            ins = snapshot_ns(tenant, rid) if kind == "snap" else branch_ns(tenant, rid)
            for key in self.ns_keys(ins):
                if self.key(ins, key) is not None:
                    self.emit_del(ins, key)
                    n += 1
            self.emit_mdel(kind, tenant, rid)
        return n


def decide_batch(reader: Reader, ops: Sequence[BatchOp]) -> Plan:
    """Decide `ops` in order against `reader` (see the module docstring). An operation
    that fails answers its `StoreError` and writes nothing; the others go on."""
    d = _Decider(reader)
    results = d.p.results
    deduped = d.p.deduped
    for op in ops:
        deduped.append(False)
        try:
            results.append(d.decide(op))
        except StoreError as exc:
            results.append(exc)
    return d.p


def plan_room(reader: Reader, incoming: int) -> Plan | None:
    """The evictions `incoming` new bytes need, as a plan of their own (None: none
    needed, or no room can be made: the batch itself then says so, per PUT)."""
    d = _Decider(reader)
    try:
        d.make_room(incoming)
    except CapacityError:
        return None
    return d.p if d.p.records else None


def plan_evictions(reader: Reader, victims: Iterable[bytes]) -> Plan:
    """Evict the blobs `victims` (all their keys: DEL records marked evicted)."""
    d = _Decider(reader)
    for sdig in victims:
        d.p.dropped.add(sdig)
        for ns, key in d.keys_of_blob(sdig):
            d.emit_del(ns, key, evicted=True)
    return d.p
