"""Snapshots, branches and epochs: the store's catalog of internal namespaces.

How it works
------------
- A snapshot is an internal namespace (`snapshot_ns`) whose entries reference (and pin)
  the blobs the tenant's keys held when it was taken, plus a record (creation time,
  optional expiry). A branch is a record naming its snapshot and an overlay namespace
  (`branch_ns`): a branch read looks in the overlay first, then in the snapshot; a
  branch write goes to the overlay (copy-on-write, no bytes copied).
- The records are changed through the store's sequencer (`Sequencer.snapshot`,
  `drop`, `commit_meta`): applied at once in RAM (memory backend), or made durable
  first (durable backend). Quotas are checked where the change is committed, atomically
  with it.
- An entry written with an epoch scope is tagged `(scope, epoch)`; it is stale once the
  scope's epoch (from the `EpochSource`: RAM, or the shared registry) has moved past
  it. `retire_stale` walks the tags as a ring, resuming where it stopped, and retires
  stale entries and expired snapshots within a time budget.

`Catalog` is a collaborator of the engine (engine.py): it reads RAM through `RamState`'s
public API and reads and writes through the `CatalogHost` it is given (the engine: its
sequencer, its open check, a GET or PUT on an internal namespace).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from typing import Any, Protocol

from epistemic_kvcache.errors import NotFoundError
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
    branch_ns,
    snapshot_ns,
    tenant_of,
    validate_scope,
)
from epistemic_kvcache.store.ram import RamState
from epistemic_kvcache.store.seams import Sequencer

__all__ = ["Catalog", "CatalogHost"]


class CatalogHost(Protocol):
    """What the catalog needs of the store it serves."""

    @property
    def sequencer(self) -> Sequencer: ...

    def check_open(self) -> None: ...

    def read(self, ns: str, key: str) -> Buffer | None:
        """GET on a (possibly internal) namespace, validated."""

    def put_into(
        self, ns: str, ns_raw: bytes, key: str, data: BlockData, tag: tuple[str, int] | None
    ) -> PutResult:
        """A blocking PUT into a (possibly internal) namespace, validated."""


class Catalog:
    """Snapshot, branch and epoch calls over a store's RAM (`ram`) and writes (`host`)."""

    def __init__(self, ram: RamState, host: CatalogHost) -> None:
        self.ram = ram
        self.host = host

    # -- epochs --------------------------------------------------------------------------
    def tag_for(self, ns: str, epoch_scope: str) -> tuple[str, int]:
        """The (scope, epoch) a PUT with `epoch_scope` is tagged with."""
        validate_scope(epoch_scope)
        with self.ram.lock:
            return (epoch_scope, self.ram.epoch(tenant_of(ns), epoch_scope))

    def epoch_get(self, ns: str, scope: str) -> int:
        validate_namespace(ns)
        validate_scope(scope)
        with self.ram.lock:
            return self.ram.epoch(ns, scope)

    def epoch_bump(self, ns: str, scope: str) -> int:
        validate_namespace(ns)
        validate_scope(scope)
        self.host.check_open()
        return self.ram.epochs.bump(ns, scope)

    def retire_stale(self, *, max_items: int = 1000, budget_s: float = 0.05) -> int:
        deadline = time.monotonic() + budget_s
        ram = self.ram
        with ram.lock:
            stale = ram.stale_scan(max_items, deadline)
            expired = ram.expired_locked(ram.clock())
        removed = self.host.sequencer.retire(stale) if stale else 0
        for kind, tenant, rid in expired:
            if removed >= max_items or time.monotonic() > deadline:
                break  # the rest next time: each drop is a commit of the snapshot's keys
            if kind == "snap" and self._drop_snapshot(tenant, rid):
                removed += 1
        return removed

    # -- snapshots and branches ----------------------------------------------------------
    def _snapshot_rec(self, ns: str, snapshot_id: str) -> dict[str, Any] | None:
        rec = self.ram.records_locked("snap", ns).get(snapshot_id)
        if rec is None:
            return None
        exp = rec.get("expires_at")
        return None if exp is not None and exp <= self.ram.clock() else rec

    def _snapshot_info(self, ns: str, sid: str, rec: dict[str, Any]) -> SnapshotInfo:
        sns = snapshot_ns(ns, sid)
        return SnapshotInfo(
            id=sid,
            ns=ns,
            keys=self.ram.ns_len_locked(sns),
            logical_bytes=self.ram.counters_of(sns).logical_bytes,
            created_at=rec["created_at"],
            expires_at=rec.get("expires_at"),
        )

    def snapshot_create(
        self, ns: str, keys: Sequence[str] | None, prefix: str | None, ttl_s: float | None
    ) -> SnapshotInfo:
        self.host.check_open()
        # the quotas (snapshots, pinned bytes) are checked where the snapshot is committed,
        # atomically with it: concurrent requests cannot both pass a check made before
        sid = secrets.token_hex(8)
        now = self.ram.clock()
        rec: dict[str, Any] = {
            "created_at": now,
            "expires_at": now + ttl_s if ttl_s is not None else None,
        }
        self.host.sequencer.snapshot(ns, sid, list(keys) if keys is not None else None, prefix, rec)
        with self.ram.lock:
            return self._snapshot_info(ns, sid, rec)

    def snapshot_info(self, ns: str, snapshot_id: str) -> SnapshotInfo | None:
        validate_namespace(ns)
        with self.ram.lock:
            rec = self._snapshot_rec(ns, snapshot_id)
            return self._snapshot_info(ns, snapshot_id, rec) if rec is not None else None

    def snapshot_list(self, ns: str) -> list[SnapshotInfo]:
        validate_namespace(ns)
        with self.ram.lock:
            out = [
                self._snapshot_info(ns, sid, rec)
                for sid in list(self.ram.records_locked("snap", ns))
                if (rec := self._snapshot_rec(ns, sid)) is not None
            ]
        return sorted(out, key=lambda i: i.created_at)

    def snapshot_delete(self, ns: str, snapshot_id: str) -> bool:
        validate_namespace(ns)
        self.host.check_open()
        return self._drop_snapshot(ns, snapshot_id)

    def _drop_snapshot(self, ns: str, snapshot_id: str) -> bool:
        with self.ram.lock:
            if snapshot_id not in self.ram.records_locked("snap", ns):
                return False
            items = [("snap", snapshot_id)] + [
                ("branch", bid)
                for bid, rec in self.ram.records_locked("branch", ns).items()
                if rec["snapshot_id"] == snapshot_id
            ]
        self.host.sequencer.drop(ns, items)
        return True

    def snapshot_get(self, ns: str, snapshot_id: str, key: str) -> Buffer | None:
        self.ram.validate(ns, key)
        with self.ram.lock:
            if self._snapshot_rec(ns, snapshot_id) is None:
                return None
        return self.host.read(snapshot_ns(ns, snapshot_id), key)

    def _branch_info(self, ns: str, bid: str, rec: dict[str, Any]) -> BranchInfo:
        bns = branch_ns(ns, bid)
        sns = snapshot_ns(ns, rec["snapshot_id"])
        overlay = self.ram.ns_blobs_locked(bns)
        private = 0
        for b in overlay:
            if not any(rns == sns for rns, _ in b.key_refs()):
                private += b.size
        return BranchInfo(
            id=bid,
            ns=ns,
            snapshot_id=rec["snapshot_id"],
            created_at=rec["created_at"],
            private_keys=len(overlay),
            private_bytes=private,
            shared_bytes=self.ram.counters_of(sns).logical_bytes,
        )

    def branch_create(self, ns: str, snapshot_id: str) -> BranchInfo:
        validate_namespace(ns)
        self.host.check_open()
        with self.ram.lock:
            if self._snapshot_rec(ns, snapshot_id) is None:
                raise NotFoundError(f"no snapshot {snapshot_id!r}")
        bid = secrets.token_hex(8)
        rec: dict[str, Any] = {"snapshot_id": snapshot_id, "created_at": self.ram.clock()}
        self.host.sequencer.commit_meta(MetaPut("branch", ns, bid, rec))
        with self.ram.lock:
            return self._branch_info(ns, bid, rec)

    def _branch_rec(self, ns: str, branch_id: str) -> dict[str, Any] | None:
        rec = self.ram.records_locked("branch", ns).get(branch_id)
        if rec is None or self._snapshot_rec(ns, rec["snapshot_id"]) is None:
            return None
        return rec

    def branch_info(self, ns: str, branch_id: str) -> BranchInfo | None:
        validate_namespace(ns)
        with self.ram.lock:
            rec = self._branch_rec(ns, branch_id)
            return self._branch_info(ns, branch_id, rec) if rec is not None else None

    def branch_list(self, ns: str) -> list[BranchInfo]:
        validate_namespace(ns)
        with self.ram.lock:
            out = [
                self._branch_info(ns, bid, rec)
                for bid in list(self.ram.records_locked("branch", ns))
                if (rec := self._branch_rec(ns, bid)) is not None
            ]
        return sorted(out, key=lambda i: i.created_at)

    def branch_delete(self, ns: str, branch_id: str) -> bool:
        validate_namespace(ns)
        self.host.check_open()
        with self.ram.lock:
            if branch_id not in self.ram.records_locked("branch", ns):
                return False
        self.host.sequencer.drop(ns, [("branch", branch_id)])
        return True

    def _branch_source(self, ns: str, branch_id: str, key: str) -> str | None:
        """The internal namespace a branch read of `key` resolves to (lock held)."""
        rec = self._branch_rec(ns, branch_id)
        if rec is None:
            return None
        bns = branch_ns(ns, branch_id)
        if self.ram.live_locked(bns, key) is not None:
            return bns
        return snapshot_ns(ns, rec["snapshot_id"])

    def branch_get(self, ns: str, branch_id: str, key: str) -> Buffer | None:
        self.ram.validate(ns, key)
        self.host.check_open()
        with self.ram.lock:
            src = self._branch_source(ns, branch_id, key)
        return self.host.read(src, key) if src is not None else None

    def branch_size(self, ns: str, branch_id: str, key: str) -> int | None:
        self.ram.validate(ns, key)
        with self.ram.lock:
            src = self._branch_source(ns, branch_id, key)
            b = self.ram.live_locked(src, key) if src is not None else None
            return b.size if b is not None else None

    def branch_put(self, ns: str, branch_id: str, key: str, data: BlockData) -> PutResult:
        ns_raw = self.ram.validate(ns, key)  # (checked: the namespace's UTF-8, cached)
        self.host.check_open()
        with self.ram.lock:
            if self._branch_rec(ns, branch_id) is None:
                raise NotFoundError(f"no branch {branch_id!r}")
        return self.host.put_into(branch_ns(ns, branch_id), ns_raw, key, data, None)

    # -- effects for the memory backend's sequencer (lock held) ---------------------------
    def snapshot_effects_locked(
        self, tenant: str, sid: str, keys: list[str] | None, prefix: str | None
    ) -> list[Effect]:
        """Effects that reference (and pin) the live entries named."""
        names = keys if keys is not None else self.ram.ns_keys_locked(tenant)
        sns = snapshot_ns(tenant, sid)
        out: list[Effect] = []
        for key in dict.fromkeys(names):
            if prefix is not None and not key.startswith(prefix):
                continue
            b = self.ram.live_locked(tenant, key)
            if b is None:
                continue
            out.append(AddKey(sns, key, b.sdig, b.size, None, b.seg, b.off))
            out.append(PinDelta(sns, key, +1))
        return out

    def drop_effects_locked(self, tenant: str, items: list[tuple[str, str]]) -> list[Effect]:
        """Effects that delete the named snapshots' and branches' entries and records."""
        out: list[Effect] = []
        for kind, rid in items:
            ins = snapshot_ns(tenant, rid) if kind == "snap" else branch_ns(tenant, rid)
            out.extend(DelKey(ins, key) for key in self.ram.ns_keys_locked(ins))
            out.append(MetaDel(kind, tenant, rid))
        return out

    def forget_locked(self, tenant: str, items: list[tuple[str, str]]) -> None:
        """Drop the emptied internal namespaces' dicts and counters."""
        for kind, rid in items:
            self.ram.forget_ns_locked(
                snapshot_ns(tenant, rid) if kind == "snap" else branch_ns(tenant, rid)
            )
