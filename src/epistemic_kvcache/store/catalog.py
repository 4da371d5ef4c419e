"""Snapshots, branches and epochs: the engine's catalog of internal namespaces.

How it works
------------
- A snapshot is an internal namespace (`snapshot_ns`) whose entries reference (and pin)
  the blobs the tenant's keys held when it was taken, plus a record (creation time,
  optional expiry). A branch is a record naming its snapshot and an overlay namespace
  (`branch_ns`): a branch read looks in the overlay first, then in the snapshot; a
  branch write goes to the overlay (copy-on-write, no bytes copied).
- The records are changed through the engine's sequencer (`Sequencer.snapshot`,
  `drop`, `commit_meta`): applied at once in RAM (memory backend), or made durable
  first (durable backend). Quotas are checked where the change is committed, atomically
  with it.
- An entry written with an epoch scope is tagged `(scope, epoch)`; it is stale once the
  scope's epoch (from the `EpochSource`: `RamEpochs` here, or the shared registry) has
  moved past it. `retire_stale` walks the tags as a ring, resuming where it stopped, and
  retires stale entries and expired snapshots within a time budget.

`Catalog` is a mixin of `TieredEngine` holding these public calls; it adds no hooks:
what differs between backends is the sequencer and the epoch source it calls.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from epistemic_kvcache.errors import NotFoundError, QuotaExceededError
from epistemic_kvcache.store.api import (
    BlockData,
    BranchInfo,
    Buffer,
    PutResult,
    SnapshotInfo,
    validate_namespace,
)
from epistemic_kvcache.store.model import (
    AddKey,
    DelKey,
    Effect,
    MetaDel,
    MetaPut,
    PinDelta,
    _Blob,
    _Counters,
    branch_ns,
    snapshot_ns,
    tenant_of,
    validate_scope,
)
from epistemic_kvcache.store.seams import EpochSource, Sequencer


class RamEpochs:
    """`EpochSource` in RAM (memory backend): (tenant, scope) -> epoch."""

    def __init__(
        self,
        lock: threading.Lock,
        tags: dict[tuple[str, str], tuple[str, int]],
        max_scopes_per_tenant: int,
    ) -> None:
        """`tags`: the engine's (ns, key) -> (scope, epoch) of tagged entries (read under
        `lock`, to prune scopes nothing is tagged with)."""
        self._lock = lock
        self._tags = tags
        self.max_scopes_per_tenant = max_scopes_per_tenant
        self.epochs: dict[tuple[str, str], int] = {}

    def current(self, tenant: str, scope: str) -> int:
        return self.epochs.get((tenant, scope), 0)

    def bump(self, tenant: str, scope: str) -> int:
        with self._lock:
            if (tenant, scope) not in self.epochs:
                self._room(tenant)
            n = self.epochs.get((tenant, scope), 0) + 1
            self.epochs[(tenant, scope)] = n
            return n

    def _room(self, tenant: str) -> None:
        """A tenant at its scope limit first loses the scopes no live entry is tagged
        with (forgetting their epoch cannot make anything fresh). Lock held."""
        mine = [s for (t, s) in self.epochs if t == tenant]
        limit = self.max_scopes_per_tenant
        if len(mine) < limit:
            return
        used = {tag[0] for (ns, _k), tag in self._tags.items() if tenant_of(ns) == tenant}
        for scope in mine:
            if scope not in used:
                del self.epochs[(tenant, scope)]
        if len(mine) - sum(1 for sc in mine if sc not in used) >= limit:
            raise QuotaExceededError(
                f"epoch scope quota exceeded: this tenant has {limit} scopes with live "
                "entries (its limit)",
                resource="epoch_scopes",
            )


class Catalog:
    """Snapshot, branch and epoch calls of `TieredEngine` (a mixin: the engine's state)."""

    _lock: threading.Lock
    _clock: Callable[[], float]
    _index: dict[str, dict[str, _Blob]]
    _sorted: dict[str, Any]
    _ns: dict[str, _Counters]
    _tags: dict[tuple[str, str], tuple[str, int]]
    _snapshots: dict[str, dict[str, dict[str, Any]]]
    _branches: dict[str, dict[str, dict[str, Any]]]
    _retire_pos: int
    _seq: Sequencer
    _epoch_src: EpochSource
    _epoch_current: Callable[[str, str], int]

    def _check_open(self) -> None:
        raise NotImplementedError

    def _validate(self, ns: str, key: str) -> bytes:
        raise NotImplementedError

    def _live(self, ns: str, key: str) -> _Blob | None:
        raise NotImplementedError

    def _stale(self, ns: str, key: str) -> bool:
        raise NotImplementedError

    def _read(self, ns: str, key: str) -> Buffer | None:
        raise NotImplementedError

    def _put_into(
        self, ns: str, ns_raw: bytes, key: str, data: BlockData, tag: tuple[str, int] | None
    ) -> PutResult:
        raise NotImplementedError

    # -- epochs --------------------------------------------------------------------------
    def _tag_for(self, ns: str, epoch_scope: str | None) -> tuple[str, int] | None:
        if epoch_scope is None:
            return None
        validate_scope(epoch_scope)
        with self._lock:
            return (epoch_scope, self._epoch_current(tenant_of(ns), epoch_scope))

    def epoch_get(self, ns: str, scope: str) -> int:
        validate_namespace(ns)
        validate_scope(scope)
        with self._lock:
            return self._epoch_current(ns, scope)

    def epoch_bump(self, ns: str, scope: str) -> int:
        validate_namespace(ns)
        validate_scope(scope)
        self._check_open()
        return self._epoch_src.bump(ns, scope)

    def retire_stale(self, *, max_items: int = 1000, budget_s: float = 0.05) -> int:
        deadline = time.monotonic() + budget_s
        stale: list[tuple[str, str]] = []
        expired: list[tuple[str, str, str]] = []
        now = self._clock()
        with self._lock:
            # resume where the last call stopped: a scan restarting at the top would never
            # get past a long run of fresh tagged entries within its budget
            tags = self._tags
            start = self._retire_pos % len(tags) if tags else 0
            ring = itertools.chain(
                itertools.islice(tags, start, None), itertools.islice(tags, 0, start)
            )
            scanned = 0
            for ns, key in ring:
                if len(stale) >= max_items or (
                    scanned & 255 == 255 and time.monotonic() > deadline
                ):
                    break
                scanned += 1
                if self._stale(ns, key):
                    stale.append((ns, key))
            self._retire_pos = start + scanned - len(stale)  # retired entries leave the ring
            for kind, table in (("snap", self._snapshots), ("branch", self._branches)):
                for tenant, recs in table.items():
                    for rid, rec in recs.items():
                        if rec.get("expires_at") is not None and rec["expires_at"] <= now:
                            expired.append((kind, tenant, rid))
        removed = self._seq.retire(stale) if stale else 0
        for kind, tenant, rid in expired:
            if removed >= max_items or time.monotonic() > deadline:
                break  # the rest next time: each drop is a commit of the snapshot's keys
            if kind == "snap" and self._drop_snapshot(tenant, rid):
                removed += 1
        return removed

    # -- snapshots and branches ----------------------------------------------------------
    def _snapshot_rec(self, ns: str, snapshot_id: str) -> dict[str, Any] | None:
        rec = self._snapshots.get(ns, {}).get(snapshot_id)
        if rec is None:
            return None
        exp = rec.get("expires_at")
        return None if exp is not None and exp <= self._clock() else rec

    def _snapshot_info(self, ns: str, sid: str, rec: dict[str, Any]) -> SnapshotInfo:
        sns = snapshot_ns(ns, sid)
        c = self._ns.get(sns) or _Counters()
        return SnapshotInfo(
            id=sid,
            ns=ns,
            keys=len(self._index.get(sns) or ()),
            logical_bytes=c.logical_bytes,
            created_at=rec["created_at"],
            expires_at=rec.get("expires_at"),
        )

    def _snapshot_create(
        self, ns: str, keys: Sequence[str] | None, prefix: str | None, ttl_s: float | None
    ) -> SnapshotInfo:
        self._check_open()
        # the quotas (snapshots, pinned bytes) are checked where the snapshot is committed,
        # atomically with it: concurrent requests cannot both pass a check made before
        sid = secrets.token_hex(8)
        now = self._clock()
        rec: dict[str, Any] = {
            "created_at": now,
            "expires_at": now + ttl_s if ttl_s is not None else None,
        }
        self._seq.snapshot(ns, sid, list(keys) if keys is not None else None, prefix, rec)
        with self._lock:
            return self._snapshot_info(ns, sid, rec)

    def snapshot_info(self, ns: str, snapshot_id: str) -> SnapshotInfo | None:
        validate_namespace(ns)
        with self._lock:
            rec = self._snapshot_rec(ns, snapshot_id)
            return self._snapshot_info(ns, snapshot_id, rec) if rec is not None else None

    def snapshot_list(self, ns: str) -> list[SnapshotInfo]:
        validate_namespace(ns)
        with self._lock:
            out = [
                self._snapshot_info(ns, sid, rec)
                for sid in list(self._snapshots.get(ns, {}))
                if (rec := self._snapshot_rec(ns, sid)) is not None
            ]
        return sorted(out, key=lambda i: i.created_at)

    def snapshot_delete(self, ns: str, snapshot_id: str) -> bool:
        validate_namespace(ns)
        self._check_open()
        return self._drop_snapshot(ns, snapshot_id)

    def _drop_snapshot(self, ns: str, snapshot_id: str) -> bool:
        with self._lock:
            if snapshot_id not in self._snapshots.get(ns, {}):
                return False
            items = [("snap", snapshot_id)] + [
                ("branch", bid)
                for bid, rec in self._branches.get(ns, {}).items()
                if rec["snapshot_id"] == snapshot_id
            ]
        self._seq.drop(ns, items)
        return True

    def snapshot_get(self, ns: str, snapshot_id: str, key: str) -> Buffer | None:
        self._validate(ns, key)
        with self._lock:
            if self._snapshot_rec(ns, snapshot_id) is None:
                return None
        return self._read(snapshot_ns(ns, snapshot_id), key)

    def _branch_info(self, ns: str, bid: str, rec: dict[str, Any]) -> BranchInfo:
        bns = branch_ns(ns, bid)
        sns = snapshot_ns(ns, rec["snapshot_id"])
        overlay = self._index.get(bns) or {}
        private = 0
        for b in overlay.values():
            if not any(rns == sns for rns, _ in b.key_refs()):
                private += b.size
        sc = self._ns.get(sns) or _Counters()
        return BranchInfo(
            id=bid,
            ns=ns,
            snapshot_id=rec["snapshot_id"],
            created_at=rec["created_at"],
            private_keys=len(overlay),
            private_bytes=private,
            shared_bytes=sc.logical_bytes,
        )

    def branch_create(self, ns: str, snapshot_id: str) -> BranchInfo:
        validate_namespace(ns)
        self._check_open()
        with self._lock:
            if self._snapshot_rec(ns, snapshot_id) is None:
                raise NotFoundError(f"no snapshot {snapshot_id!r}")
        bid = secrets.token_hex(8)
        rec: dict[str, Any] = {"snapshot_id": snapshot_id, "created_at": self._clock()}
        self._seq.commit_meta(MetaPut("branch", ns, bid, rec))
        with self._lock:
            return self._branch_info(ns, bid, rec)

    def _branch_rec(self, ns: str, branch_id: str) -> dict[str, Any] | None:
        rec = self._branches.get(ns, {}).get(branch_id)
        if rec is None or self._snapshot_rec(ns, rec["snapshot_id"]) is None:
            return None
        return rec

    def branch_info(self, ns: str, branch_id: str) -> BranchInfo | None:
        validate_namespace(ns)
        with self._lock:
            rec = self._branch_rec(ns, branch_id)
            return self._branch_info(ns, branch_id, rec) if rec is not None else None

    def branch_list(self, ns: str) -> list[BranchInfo]:
        validate_namespace(ns)
        with self._lock:
            out = [
                self._branch_info(ns, bid, rec)
                for bid in list(self._branches.get(ns, {}))
                if (rec := self._branch_rec(ns, bid)) is not None
            ]
        return sorted(out, key=lambda i: i.created_at)

    def branch_delete(self, ns: str, branch_id: str) -> bool:
        validate_namespace(ns)
        self._check_open()
        with self._lock:
            if branch_id not in self._branches.get(ns, {}):
                return False
        self._seq.drop(ns, [("branch", branch_id)])
        return True

    def _branch_source(self, ns: str, branch_id: str, key: str) -> str | None:
        """The internal namespace a branch read of `key` resolves to (lock held)."""
        rec = self._branch_rec(ns, branch_id)
        if rec is None:
            return None
        bns = branch_ns(ns, branch_id)
        if self._live(bns, key) is not None:
            return bns
        return snapshot_ns(ns, rec["snapshot_id"])

    def branch_get(self, ns: str, branch_id: str, key: str) -> Buffer | None:
        self._validate(ns, key)
        self._check_open()
        with self._lock:
            src = self._branch_source(ns, branch_id, key)
        return self._read(src, key) if src is not None else None

    def branch_size(self, ns: str, branch_id: str, key: str) -> int | None:
        self._validate(ns, key)
        with self._lock:
            src = self._branch_source(ns, branch_id, key)
            b = self._live(src, key) if src is not None else None
            return b.size if b is not None else None

    def _branch_put(self, ns: str, branch_id: str, key: str, data: BlockData) -> PutResult:
        ns_raw = self._validate(ns, key)  # (checked: the namespace's UTF-8, cached)
        self._check_open()
        with self._lock:
            if self._branch_rec(ns, branch_id) is None:
                raise NotFoundError(f"no branch {branch_id!r}")
        return self._put_into(branch_ns(ns, branch_id), ns_raw, key, data, None)

    def _snapshot_effects(
        self, tenant: str, sid: str, keys: list[str] | None, prefix: str | None
    ) -> list[Effect]:
        """Memory backend: effects that reference the live entries (lock held)."""
        idx = self._index.get(tenant) or {}
        names = keys if keys is not None else list(idx)
        sns = snapshot_ns(tenant, sid)
        out: list[Effect] = []
        for key in dict.fromkeys(names):
            if prefix is not None and not key.startswith(prefix):
                continue
            b = self._live(tenant, key)
            if b is None:
                continue
            out.append(AddKey(sns, key, b.sdig, b.size, None, b.seg, b.off))
            out.append(PinDelta(sns, key, +1))
        return out

    def _drop_effects(self, tenant: str, items: list[tuple[str, str]]) -> list[Effect]:
        out: list[Effect] = []
        for kind, rid in items:
            ins = snapshot_ns(tenant, rid) if kind == "snap" else branch_ns(tenant, rid)
            out.extend(DelKey(ins, key) for key in list(self._index.get(ins) or ()))
            out.append(MetaDel(kind, tenant, rid))
        return out

    def _forget_internal(self, tenant: str, items: list[tuple[str, str]]) -> None:
        """Drop the emptied internal namespaces' dicts and counters (lock held)."""
        for kind, rid in items:
            ins = snapshot_ns(tenant, rid) if kind == "snap" else branch_ns(tenant, rid)
            if not self._index.get(ins):
                self._index.pop(ins, None)
                self._sorted.pop(ins, None)
                self._ns.pop(ins, None)
