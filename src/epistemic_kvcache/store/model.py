"""The engine's data model: blobs, counters, effects, internal namespaces.

How it works
------------
- A `_Blob` is one content-addressed block, keyed by its *scoped digest*: the BLAKE3
  digest of the bytes, prefixed by the namespace in the default `namespace` dedup scope
  (tenants never share or probe each other's blobs) or by nothing in `global` scope.
  Every key holding the same bytes in the same scope points at the same `_Blob`; `refs`
  counts them, `keys` lists them (compactly: most blobs have one key). `_Blob` and the
  `_Counters` records are defined in hotcore.py, which has a compiled twin (core.py
  picks it): the records get C fields there. They are re-exported here.
- Mutations are *effects* (`AddKey`, `DelKey`, `PinDelta`, `MetaPut`, `MetaDel`,
  `Move`); they change RAM in one place (`RamState.apply_locked`, store/effects.py).
- Snapshot and branch entries live in internal namespaces that contain NUL, which a
  tenant's namespace never does, so no client can name them.
- `Ledger` keeps the counters: every blob's footprint (unique block, resident bytes,
  per-tier occupancy, pinned) is added to each namespace that references it and to the
  total, and moved with it, under the RAM lock.

This module imports nothing else of the store but `api` and the hot core (`core`,
`hotcore`): every other store module may import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import blake3

from epistemic_kvcache.errors import InvalidKeyError
from epistemic_kvcache.shared import MAX_SCOPE_BYTES
from epistemic_kvcache.store.api import (
    PUT_CONFLICT,
    PUT_DUPLICATE,
    PUT_NEW,
    PUT_REPLACED,
    Buffer,
    PutOutcome,
)
from epistemic_kvcache.store.api import WOULD_BLOCK as WOULD_BLOCK  # noqa: PLC0414
from epistemic_kvcache.store.api import WouldBlock as WouldBlock  # noqa: PLC0414
from epistemic_kvcache.store.core import _Blob as _Blob  # noqa: PLC0414
from epistemic_kvcache.store.core import _Counters as _Counters  # noqa: PLC0414
from epistemic_kvcache.store.hotcore import DIGEST_BYTES as DIGEST_BYTES  # noqa: PLC0414

# Above this size BLAKE3 hashes with several threads (and releases the GIL).
_PARALLEL_HASH_BYTES = 1 << 20
# Namespaces remembered as valid (tenants, plus snapshot/branch namespaces in use).
_VALID_NS_CACHE = 4096
# How many least-recently-used entries compete when a tier picks a victim.
_VICTIM_WINDOW = 8
INLINE_MAX_BYTES: Final = 256 << 10
"""Largest block `put_nowait` hashes in the caller's thread (BLAKE3 at ~5 GB/s: ~50 us)."""


def validate_scope(scope: str) -> None:
    """An epoch scope is 1..`MAX_SCOPE_BYTES` bytes of UTF-8 without NUL."""
    try:
        raw = scope.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidKeyError("invalid epoch scope: not valid UTF-8") from exc
    if not raw or len(raw) > MAX_SCOPE_BYTES or b"\x00" in raw:
        raise InvalidKeyError(
            f"invalid epoch scope: expected 1..{MAX_SCOPE_BYTES} bytes without NUL "
            f"(got {len(raw)} bytes)"
        )


def digest_of(data: Buffer) -> bytes:
    """BLAKE3-256 of `data` (multi-threaded for large blocks)."""
    if len(data) >= _PARALLEL_HASH_BYTES:
        return blake3.blake3(data, max_threads=blake3.blake3.AUTO).digest()
    return blake3.blake3(data).digest()


# AddKey and DelKey are built once per PUT/DELETE: not frozen, because a frozen
# dataclass's __init__ sets each field through object.__setattr__ (~4x the cost).
# Nothing mutates an effect after it is built.
@dataclass(slots=True)
class AddKey:
    """Effect: `key` now references the blob `sdig` (creating it when `data` is given)."""

    ns: str
    key: str
    sdig: bytes
    size: int
    data: Buffer | None = None  # the block's bytes when the blob is new
    seg: int = -1
    off: int = 0
    tag: tuple[str, int] | None = None  # (epoch scope, epoch) the entry was written in


@dataclass(slots=True)
class DelKey:
    """Effect: `key` no longer exists (its blob goes with its last reference)."""

    ns: str
    key: str
    evicted: bool = False  # removed by the cache (counts as an eviction), not by a client


@dataclass(frozen=True, slots=True)
class PinDelta:
    """Effect: the key's pin count changes by `delta`."""

    ns: str
    key: str
    delta: int


@dataclass(frozen=True, slots=True)
class MetaPut:
    """Effect: a snapshot or branch record is created (`kind` is "snap" or "branch")."""

    kind: str
    tenant: str
    id: str
    record: dict[str, Any]


@dataclass(frozen=True, slots=True)
class MetaDel:
    """Effect: a snapshot or branch record is gone."""

    kind: str
    tenant: str
    id: str


@dataclass(frozen=True, slots=True)
class Move:
    """Effect: compaction copied the blob to a new place on disk."""

    sdig: bytes
    seg: int
    off: int


Effect = AddKey | DelKey | PinDelta | MetaPut | MetaDel | Move

# Internal namespaces (snapshot entries, branch overlays) contain NUL, which a tenant
# namespace never does, so no client can name them.
_SEP = "\x00"


def tenant_of(ns: str) -> str:
    """The tenant namespace an (internal) namespace belongs to."""
    return ns.partition(_SEP)[0]


def snapshot_ns(tenant: str, snapshot_id: str) -> str:
    """The internal namespace holding a snapshot's entries."""
    return f"{tenant}{_SEP}s{_SEP}{snapshot_id}"


def branch_ns(tenant: str, branch_id: str) -> str:
    """The internal namespace holding a branch's overlay entries."""
    return f"{tenant}{_SEP}b{_SEP}{branch_id}"


def parse_internal_ns(ns: str) -> tuple[str, str, str] | None:
    """(tenant, "snap" | "branch", id) for an internal namespace, None for a tenant's."""
    if _SEP not in ns:  # a tenant's namespace: the common case, without a split
        return None
    parts = ns.split(_SEP)
    if len(parts) != 3:
        return None
    return parts[0], "snap" if parts[1] == "s" else "branch", parts[2]


class Ledger:
    """The counters of every namespace and of the store (mutated under the RAM lock)."""

    __slots__ = ("by_ns", "total")

    def __init__(self) -> None:
        self.by_ns: dict[str, _Counters] = {}
        self.total = _Counters()

    def counters(self, ns: str) -> _Counters:
        c = self.by_ns.get(ns)
        if c is None:
            c = self.by_ns[ns] = _Counters()
        return c

    @staticmethod
    def footprint(b: _Blob, c: _Counters, sign: int) -> None:
        """Add (+1) or remove (-1) the blob's footprint from one set of counters."""
        c.unique_blocks += sign
        c.resident_bytes += sign * b.size
        if b.hot is not None:
            c.hot_blocks += sign
            c.hot_bytes += sign * b.size
            c.hot_peak = max(c.hot_peak, c.hot_bytes)
        if b.warm is not None:
            c.warm_blocks += sign
            c.warm_bytes += sign * len(b.warm)
            c.warm_logical += sign * b.size
            c.warm_peak = max(c.warm_peak, c.warm_bytes)
        if b.seg >= 0:
            c.cold_blocks += sign
            c.cold_bytes += sign * b.size
            c.cold_peak = max(c.cold_peak, c.cold_bytes)
        if b.pins:
            c.pinned_blocks += sign
            c.pinned_bytes += sign * b.size

    def account(self, b: _Blob, sign: int) -> None:
        """Add (+1) or remove (-1) the blob's footprint from its owners and the total."""
        self.footprint(b, self.total, sign)
        for ns in b.owners():
            self.footprint(b, self.counters(ns), sign)

    def bump(self, b: _Blob, name: str) -> None:
        """Count one event (`demotions`, `promotions`, ...) on the blob's owners and the
        total."""
        setattr(self.total, name, getattr(self.total, name) + 1)
        for ns in b.owners():
            c = self.counters(ns)
            setattr(c, name, getattr(c, name) + 1)

    def count_put(self, ns: str, outcome: PutOutcome, deduped: bool) -> None:
        """Count one decided PUT on its namespace and the total (every PUT runs this)."""
        c = self.counters(ns)
        t = self.total
        if outcome is PUT_NEW:
            c.put_new += 1
            t.put_new += 1
        elif outcome is PUT_REPLACED:
            c.put_replaced += 1
            t.put_replaced += 1
        elif outcome is PUT_DUPLICATE:
            deduped = True
        elif outcome is PUT_CONFLICT:
            c.put_conflicts += 1
            t.put_conflicts += 1
            return
        else:  # MISSING: nothing to count
            return
        if deduped:
            c.dedup_hits += 1
            t.dedup_hits += 1
