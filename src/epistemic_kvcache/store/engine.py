"""The tiered, content-addressed engine shared by both backends.

How it works
------------
- `(namespace, key) -> blob` is the index (a dict per namespace); a `_Blob` is one
  content-addressed block, keyed by its *scoped digest*: the BLAKE3 digest of the bytes,
  prefixed by the namespace in the default `namespace` dedup scope (so tenants never
  share or probe each other's blobs) or by nothing in `global` scope. Every key holding
  the same bytes in the same scope points at the same `_Blob`; `refs` counts them.
- Mutations are expressed as *effects* (`AddKey`, `DelKey`, `PinDelta`) and applied to
  RAM by one function, `_apply`. The memory backend decides effects from RAM and applies
  them at once; the durable backend decides them inside an LMDB write transaction, makes
  them durable, and only then applies them (so nothing unacknowledged is ever visible).
- Tiers: `hot` holds uncompressed bytes (an LRU `OrderedDict`), `warm` compressed bytes
  (also LRU). A block enters hot only through `_hot_room` and warm only through
  `_warm_room` (lock held), so neither ever holds more than its capacity, whatever the
  path (single or batch PUT, a read that promotes). To make room, `_rebalance` picks a
  victim among the least recently used few, blending recency with value (hits, external
  importance); pinned blocks are never chosen. The victim is compressed *outside* the
  lock and moved to warm; a block that does not compress below the codec's ratio is kept
  raw (memory backend) or just dropped from RAM (durable backend: it is on disk). When
  warm has no room for a copy, its victims leave RAM: dropped (durable) or evicted with
  all their keys (memory).
- Every read from warm (and from disk, in the durable backend) is verified against the
  digest and counts `integrity_failures` on a mismatch. A bad disk copy (or, in the
  memory backend, a bad warm copy: the only one) quarantines the blob and is a miss; a bad
  warm copy in the durable backend is dropped and the verified disk copy is served.
- Stats are exact: every blob's footprint (unique block, resident bytes, per-tier
  occupancy, pinned) is added to each namespace that references it and to the store
  total, and moved with it between tiers, under the one lock.
"""

from __future__ import annotations

import abc
import concurrent.futures
import itertools
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, overload

import blake3
from sortedcontainers import SortedList

from epistemic_kvcache.errors import (
    BlockTooLargeError,
    CapacityError,
    ConfigurationError,
    InvalidKeyError,
    NotFoundError,
    QuotaExceededError,
    StoreClosedError,
)
from epistemic_kvcache.shared import MAX_SCOPE_BYTES
from epistemic_kvcache.store.api import WOULD_BLOCK as WOULD_BLOCK  # noqa: PLC0414
from epistemic_kvcache.store.api import (
    BlockData,
    BranchInfo,
    Buffer,
    ConsistencyReport,
    PutCond,
    PutOutcome,
    PutResult,
    SharedKvBackend,
    SnapshotInfo,
    StoreStats,
    TierStats,
    read_only,
    validate_key,
    validate_namespace,
)
from epistemic_kvcache.store.api import WouldBlock as WouldBlock  # noqa: PLC0414
from epistemic_kvcache.store.codec import WarmCodec

DedupScope = Literal["namespace", "global"]

DIGEST_BYTES = 32
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


class _Blob:
    """One stored block. `seg >= 0` means it is on disk (durable backend)."""

    __slots__ = (
        "busy",
        "hits",
        "hot",
        "importance",
        "keys",
        "off",
        "owner",
        "pins",
        "refs",
        "sdig",
        "seg",
        "size",
        "warm",
    )

    def __init__(self, sdig: bytes, size: int) -> None:
        self.sdig = sdig
        self.size = size
        self.refs = 0
        self.pins = 0
        self.hits = 0
        self.importance = 0.0
        self.hot: Buffer | None = None
        self.warm: bytes | None = None
        self.seg = -1
        self.off = 0
        # namespace scope: the one owning namespace; global scope: {ns: refs}
        self.owner: str | dict[str, int] = ""
        # The keys referencing the blob: None; one key of the owning namespace as its bare
        # name (the common case: no tuple per block); one (ns, key); or a list of them.
        self.keys: str | tuple[str, str] | list[tuple[str, str]] | None = None
        self.busy = False

    @property
    def digest(self) -> bytes:
        return self.sdig[-DIGEST_BYTES:]

    def key_refs(self) -> list[tuple[str, str]]:
        k = self.keys
        if k is None:
            return []
        if isinstance(k, str):
            return [(self.owner, k)]  # type: ignore[list-item]  # owner is a str then
        return [k] if isinstance(k, tuple) else list(k)

    def add_keyref(self, ref: tuple[str, str]) -> None:
        k = self.keys
        if k is None:
            self.keys = ref[1] if ref[0] == self.owner else ref
        elif isinstance(k, list):
            k.append(ref)
        else:
            self.keys = [*self.key_refs(), ref]

    def remove_keyref(self, ref: tuple[str, str]) -> None:
        k = self.keys
        if isinstance(k, list):
            k.remove(ref)
            if len(k) == 1:
                self.keys = None
                self.add_keyref(k[0])
        elif k is not None and self.key_refs()[0] == ref:
            self.keys = None

    def owners(self) -> Iterable[str]:
        o = self.owner
        return (o,) if isinstance(o, str) else tuple(o)


@dataclass(slots=True)
class _Counters:
    """Per-namespace counters and gauges (gauges are kept exact under the lock)."""

    cold_blocks: int = 0
    cold_bytes: int = 0
    cold_peak: int = 0
    dedup_hits: int = 0
    demotions: int = 0
    evictions: int = 0
    get_hits: int = 0
    get_misses: int = 0
    hot_blocks: int = 0
    hot_bytes: int = 0
    hot_peak: int = 0
    integrity_failures: int = 0
    logical_bytes: int = 0
    pinned_blocks: int = 0
    pinned_bytes: int = 0
    promotions: int = 0
    put_conflicts: int = 0
    put_new: int = 0
    put_replaced: int = 0
    resident_bytes: int = 0
    stale_missed: int = 0
    total_refs: int = 0
    unique_blocks: int = 0
    warm_blocks: int = 0
    warm_bytes: int = 0
    warm_logical: int = 0
    warm_peak: int = 0


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


class TieredEngine(SharedKvBackend):
    """RAM tiers, index, refcounts and stats; subclasses add (or omit) the disk."""

    index_in_ram = True

    def __init__(
        self,
        *,
        hot_capacity_bytes: int,
        warm_capacity_bytes: int,
        max_block_bytes: int,
        dedup_scope: DedupScope,
        codec: WarmCodec | None,
        max_pinned_fraction: float = 0.5,
        max_snapshots_per_tenant: int = 256,
        max_keys_per_tenant: int = 0,
        first_write_wins: bool | frozenset[str] = False,
        max_epoch_scopes_per_tenant: int = 10_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`clock`: wall-clock seconds for snapshot TTLs and creation times (tests pass a
        fake clock they advance)."""
        self._clock = clock
        if max_epoch_scopes_per_tenant < 1:
            raise ConfigurationError(
                "invalid max_epoch_scopes_per_tenant: expected a positive integer "
                f"(got {max_epoch_scopes_per_tenant!r})"
            )
        self.max_epoch_scopes_per_tenant = max_epoch_scopes_per_tenant
        if not isinstance(max_keys_per_tenant, int) or max_keys_per_tenant < 0:
            raise ConfigurationError(
                "invalid max_keys_per_tenant: expected 0 (no limit) or a positive integer "
                f"(got {max_keys_per_tenant!r})"
            )
        self.max_keys_per_tenant = max_keys_per_tenant
        for name, value in (
            ("hot_capacity_bytes", hot_capacity_bytes),
            ("warm_capacity_bytes", warm_capacity_bytes),
        ):
            if not isinstance(value, int) or value < 0:
                raise ConfigurationError(
                    f"invalid {name}: expected a non-negative integer (got {value!r})"
                )
        if not isinstance(max_block_bytes, int) or max_block_bytes <= 0:
            raise ConfigurationError(
                f"invalid max_block_bytes: expected a positive integer (got {max_block_bytes!r})"
            )
        if dedup_scope not in ("namespace", "global"):
            raise ConfigurationError(
                f"invalid dedup_scope: expected namespace or global (got {dedup_scope!r})"
            )
        self.hot_capacity_bytes = hot_capacity_bytes
        self.warm_capacity_bytes = warm_capacity_bytes
        self.max_block_bytes = max_block_bytes
        self.dedup_scope: DedupScope = dedup_scope
        if not 0.0 < max_pinned_fraction <= 1.0:
            raise ConfigurationError(
                f"invalid max_pinned_fraction: expected (0, 1] (got {max_pinned_fraction!r})"
            )
        if max_snapshots_per_tenant < 1:
            raise ConfigurationError(
                "invalid max_snapshots_per_tenant: expected a positive integer "
                f"(got {max_snapshots_per_tenant!r})"
            )
        # Per-tenant quotas, so one tenant cannot pin (or snapshot) the store full and
        # leave every other tenant's PUTs without room.
        self.max_pinned_fraction = max_pinned_fraction
        self.max_snapshots_per_tenant = max_snapshots_per_tenant
        if not isinstance(first_write_wins, bool | frozenset):
            raise ConfigurationError(
                "invalid first_write_wins: expected a bool or a frozenset of tenants "
                f"(got {first_write_wins!r})"
            )
        self.first_write_wins = first_write_wins
        self._codec = codec if codec is not None else WarmCodec()
        self._lock = threading.Lock()
        self._closed = False
        self._index: dict[str, dict[str, _Blob]] = {}
        # the same keys in order, per namespace: listing (SCAN) walks a page of it under
        # the lock in O(log n + page), never sorting a whole namespace
        self._sorted: dict[str, SortedList] = {}
        self._blobs: dict[bytes, _Blob] = {}  # insertion order = least recently used first
        self._hot: OrderedDict[bytes, _Blob] = OrderedDict()
        self._warm: OrderedDict[bytes, _Blob] = OrderedDict()
        self._pins: dict[tuple[str, str], int] = {}
        self._ns: dict[str, _Counters] = {}
        self._total = _Counters()
        self._hot_leaving = 0  # bytes of hot blobs being demoted right now
        self._pinned_bytes = 0  # bytes of blobs with at least one pin
        # (ns, key) -> (epoch scope, epoch) for entries written with an epoch scope
        self._tags: dict[tuple[str, str], tuple[str, int]] = {}
        # tenant -> id -> record
        self._snapshots: dict[str, dict[str, dict[str, Any]]] = {}
        self._branches: dict[str, dict[str, dict[str, Any]]] = {}
        self._epochs: dict[tuple[str, str], int] = {}  # (tenant, scope) -> epoch (memory)
        self._retire_pos = 0  # where retire_stale's scan of _tags resumes
        self._valid_ns: dict[str, bytes] = {}  # namespace -> its UTF-8 (validated)

    # -- helpers -------------------------------------------------------------------------
    def _scoped(self, ns_raw: bytes, digest: bytes) -> bytes:
        if self.dedup_scope == "global":
            return digest
        return ns_raw + b"\x00" + digest

    def _counters(self, ns: str) -> _Counters:
        c = self._ns.get(ns)
        if c is None:
            c = self._ns[ns] = _Counters()
        return c

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the store is closed")

    def _validate(self, ns: str, key: str) -> bytes:
        validate_key(key)
        raw = self._valid_ns.get(ns)
        if raw is None:  # validated once per namespace (the set of names is bounded)
            raw = validate_namespace(ns)
            if len(self._valid_ns) >= _VALID_NS_CACHE:
                self._valid_ns.clear()
            self._valid_ns[ns] = raw
        return raw

    def _check_size(self, data: BlockData) -> None:
        if len(data) > self.max_block_bytes:
            raise BlockTooLargeError(
                f"block of {len(data)} bytes exceeds max_block_bytes={self.max_block_bytes}"
            )

    def _fww(self, ns: str) -> bool:
        """Whether `ns`'s tenant keeps first-write-wins (a plain PUT never replaces)."""
        f = self.first_write_wins
        return f if isinstance(f, bool) else tenant_of(ns) in f

    def _lookup(self, ns: str, key: str) -> _Blob | None:
        idx = self._index.get(ns)
        return idx.get(key) if idx is not None else None

    def _footprint(self, b: _Blob, c: _Counters, sign: int) -> None:
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

    def _account(self, b: _Blob, sign: int) -> None:
        """Add (+1) or remove (-1) the blob's footprint from its owners and the total."""
        self._footprint(b, self._total, sign)
        for ns in b.owners():
            self._footprint(b, self._counters(ns), sign)

    def _set_hot(self, b: _Blob, data: Buffer | None) -> None:
        """Put `data` (owned by the store: nobody else writes it) in hot, or take `b` out.
        The hot copy is what a GET hands out, so it is kept read-only."""
        if data is not None:
            data = read_only(data)
        self._account(b, -1)
        if b.hot is not None:
            self._hot.pop(b.sdig, None)
        b.hot = data
        if data is not None:
            self._hot[b.sdig] = b
        self._account(b, +1)

    def _set_warm(self, b: _Blob, data: bytes | None) -> None:
        self._account(b, -1)
        if b.warm is not None:
            self._warm.pop(b.sdig, None)
        b.warm = data
        if data is not None:
            self._warm[b.sdig] = b
        self._account(b, +1)

    # -- effects: the only code that changes the index and refcounts ---------------------
    def _apply(self, effects: Sequence[Effect]) -> None:
        """Apply decided (and, for the durable backend, committed) effects to RAM."""
        for e in effects:
            if isinstance(e, AddKey):
                self._apply_add(e)
            elif isinstance(e, DelKey):
                self._apply_del(e)
            elif isinstance(e, PinDelta):
                self._apply_pin(e)
            elif isinstance(e, MetaPut):
                self._meta(e.kind).setdefault(e.tenant, {})[e.id] = e.record
            elif isinstance(e, Move):
                b = self._blobs.get(e.sdig)
                if b is not None:
                    self._on_blob_destroyed(b)
                    b.seg, b.off = e.seg, e.off
                    self._on_blob_created(b)
            else:
                recs = self._meta(e.kind).get(e.tenant)
                if recs is not None:
                    recs.pop(e.id, None)

    def _load(
        self,
        entries: Iterable[tuple[str, str, bytes, int, int, int, tuple[str, int] | None, int]],
    ) -> None:
        """Fill an empty engine in bulk (opening a store): the same state as applying
        `AddKey` (+ `PinDelta`) per entry, built in a few passes (lock held).

        `entries`: (ns, key, scoped digest, size, segment, offset, epoch tag, pins)."""
        blobs = self._blobs
        glob = self.dedup_scope == "global"
        pins_of = self._pins
        by_ns: dict[str, dict[str, _Blob]] = {}
        for ns, key, sdig, size, seg, off, tag, pins in entries:
            b = blobs.get(sdig)
            if b is None:
                b = blobs[sdig] = _Blob(sdig, size)
                b.seg, b.off = seg, off
                b.owner = {} if glob else tenant_of(ns)
            b.refs += 1
            b.add_keyref((ns, key))
            if isinstance(b.owner, dict):
                t = tenant_of(ns)
                b.owner[t] = b.owner.get(t, 0) + 1
            idx = by_ns.get(ns)
            if idx is None:
                idx = by_ns[ns] = self._index.setdefault(ns, {})
            idx[key] = b
            if tag is not None:
                self._tags[(ns, key)] = tag
            if pins:
                pins_of[(ns, key)] = pins
                b.pins += pins
            c = self._counters(ns)
            c.total_refs += 1
            c.logical_bytes += b.size
        total = self._total
        for ns in by_ns:
            c = self._counters(ns)
            total.total_refs += c.total_refs
            total.logical_bytes += c.logical_bytes
            self._sorted[ns] = SortedList(self._index[ns])
        for b in blobs.values():
            self._footprint(b, total, +1)
            for o in b.owners():
                self._footprint(b, self._counters(o), +1)
            if b.pins:
                self._pinned_bytes += b.size
            self._on_blob_created(b)

    def _meta(self, kind: str) -> dict[str, dict[str, dict[str, Any]]]:
        return self._snapshots if kind == "snap" else self._branches

    def _apply_add(self, e: AddKey) -> None:
        b = self._blobs.get(e.sdig)
        c = self._counters(e.ns)
        tenant = tenant_of(e.ns)
        oc = c if tenant == e.ns else self._counters(tenant)
        if b is None:
            b = _Blob(e.sdig, e.size)
            b.seg, b.off = e.seg, e.off
            b.owner = {} if self.dedup_scope == "global" else tenant
            self._blobs[e.sdig] = b
            if e.data is not None and self._hot_room(e.size):
                b.hot = read_only(e.data)  # counted hot by the footprints below
                self._hot[e.sdig] = b
            self._footprint(b, self._total, +1)
            if isinstance(b.owner, str):
                self._footprint(b, oc, +1)
            self._on_blob_created(b)
        b.refs += 1
        b.add_keyref((e.ns, e.key))
        if isinstance(b.owner, dict):
            n = b.owner.get(tenant, 0)
            b.owner[tenant] = n + 1
            if n == 0:
                self._footprint(b, oc, +1)
        idx = self._index.get(e.ns)
        if idx is None:
            idx = self._index[e.ns] = {}
        if e.key not in idx:
            sl = self._sorted.get(e.ns)
            if sl is None:
                sl = self._sorted[e.ns] = SortedList()
            sl.add(e.key)
        idx[e.key] = b
        if e.tag is not None:
            self._tags[(e.ns, e.key)] = e.tag
        c.total_refs += 1
        c.logical_bytes += b.size
        self._total.total_refs += 1
        self._total.logical_bytes += b.size

    def _apply_del(self, e: DelKey) -> None:
        idx = self._index.get(e.ns)
        b = idx.pop(e.key, None) if idx is not None else None
        if b is None:
            return
        sl = self._sorted.get(e.ns)
        if sl is not None:
            sl.discard(e.key)
        c = self._counters(e.ns)
        tenant = tenant_of(e.ns)
        oc = c if tenant == e.ns else self._counters(tenant)
        self._tags.pop((e.ns, e.key), None)
        pins = self._pins.pop((e.ns, e.key), 0)
        if pins:
            self._change_pins(b, -pins)
        b.refs -= 1
        b.remove_keyref((e.ns, e.key))
        c.total_refs -= 1
        c.logical_bytes -= b.size
        self._total.total_refs -= 1
        self._total.logical_bytes -= b.size
        if e.evicted:
            c.evictions += 1
            self._total.evictions += 1
        if isinstance(b.owner, dict):
            n = b.owner[tenant] - 1
            if n == 0:
                self._footprint(b, oc, -1)
                del b.owner[tenant]
            else:
                b.owner[tenant] = n
        if b.refs == 0:
            if isinstance(b.owner, str):
                self._footprint(b, oc, -1)
            self._footprint(b, self._total, -1)
            del self._blobs[b.sdig]
            if b.hot is not None:
                self._hot.pop(b.sdig, None)
            if b.warm is not None:
                self._warm.pop(b.sdig, None)
            b.hot = b.warm = None
            self._on_blob_destroyed(b)

    def _apply_pin(self, e: PinDelta) -> None:
        b = self._lookup(e.ns, e.key)
        if b is None:
            return
        ref = (e.ns, e.key)
        n = self._pins.get(ref, 0) + e.delta
        if n > 0:
            self._pins[ref] = n
        else:
            self._pins.pop(ref, None)
        self._change_pins(b, e.delta)

    def _change_pins(self, b: _Blob, delta: int) -> None:
        was = b.pins > 0
        self._account(b, -1)
        b.pins += delta
        self._account(b, +1)
        if was != (b.pins > 0):
            self._pinned_bytes += b.size if b.pins > 0 else -b.size

    def _hot_room(self, size: int) -> bool:
        """Whether `size` more bytes fit in the hot tier now (lock held): the one
        admission test of the tier, so it never holds more than its capacity.

        Victims that leave hot without codec work (no warm copy to make: the warm tier is
        off or too small for them) are demoted here, under the lock. A victim that needs
        compressing is not: the block is refused (`_hot_full`), and the caller keeps it
        where it is (the durable backend: on disk) or places it itself; blocking callers
        make room beforehand with `_make_hot_room`, the codec work outside the lock."""
        cap = self.hot_capacity_bytes
        if size > cap:
            return False
        while self._total.hot_bytes + size > cap:
            victim = self._pick_victim(self._hot)
            if victim is None or 0 < victim.size <= self.warm_capacity_bytes:
                self._hot_full()
                return False
            self._demote(victim, None)
        return True

    def _hot_full(self) -> None:
        """A block was refused by the hot tier (lock held): hook for the durable backend,
        whose tier thread then makes room for the next ones."""

    def _warm_room(self, nbytes: int) -> bool:
        """Whether a warm copy of `nbytes` fits, after the least valuable warm blocks
        left RAM for it (lock held): every block enters warm through it."""
        cap = self.warm_capacity_bytes
        if nbytes > cap:
            return False
        while self._total.warm_bytes + nbytes > cap:
            victim = self._pick_victim(self._warm)
            if victim is None:
                return False
            self._leave_ram(victim)
        return True

    def _make_hot_room(self, sizes: Iterable[int]) -> None:
        """Before blocks of `sizes` enter hot (a blocking caller, off the event loop):
        demote until they fit, compressing the victims outside the lock. Their admission
        (`_hot_room`) stays the bound; this only keeps new blocks from being refused."""
        cap = self.hot_capacity_bytes
        need = min(sum(n for n in sizes if n <= cap), cap)
        if need and self._total.hot_bytes + need > cap:  # unlocked look: a hint
            self._rebalance(cap - need)

    def _on_blob_created(self, b: _Blob) -> None:
        """Hook for the durable backend (segment accounting)."""

    def _on_blob_destroyed(self, b: _Blob) -> None:
        """Hook for the durable backend (segment accounting)."""

    # -- tier movement -------------------------------------------------------------------
    def _score(self, b: _Blob, rank: int) -> float:
        """Lower is evicted first: recency rank blended with hits and importance."""
        recency = rank / _VICTIM_WINDOW
        value = min(b.hits, 16) / 16
        return 0.5 * recency + 0.2 * value + 0.3 * b.importance

    def _pick_victim(self, tier: OrderedDict[bytes, _Blob]) -> _Blob | None:
        best: _Blob | None = None
        best_score = 0.0
        rank = 0
        for b in tier.values():
            if b.pins or b.busy:
                continue
            if rank == 0 and not b.hits and not b.importance:
                return b  # score 0: nothing can score lower (the common case)
            s = self._score(b, rank)
            if best is None or s < best_score:
                best, best_score = b, s
            rank += 1
            if rank >= _VICTIM_WINDOW:
                break
        return best

    def _rebalance(self, hot_target: int | None = None) -> None:
        """Demote hot -> warm (-> out of RAM) until hot holds at most `hot_target` bytes
        (default: its capacity) and warm fits its capacity."""
        target = self.hot_capacity_bytes if hot_target is None else hot_target
        total = self._total
        if (
            total.hot_bytes - self._hot_leaving <= target
            and total.warm_bytes <= self.warm_capacity_bytes
        ):
            return  # nothing to do (unlocked look: whoever adds bytes calls this after)
        while True:
            with self._lock:
                victim = None
                while self._total.hot_bytes - self._hot_leaving > target:
                    victim = self._pick_victim(self._hot)
                    if victim is None:
                        break
                    data = victim.hot
                    if data is not None and 0 < victim.size <= self.warm_capacity_bytes:
                        victim.busy = True  # compressed outside the lock, below
                        self._hot_leaving += victim.size
                        break
                    self._demote(victim, None)  # nothing to compress: it leaves hot now
                    victim = None
                if victim is None:
                    break
            comp: bytes | None = None
            try:
                if data is not None and 0 < victim.size <= self.warm_capacity_bytes:
                    comp = self._codec.compress(data)
                    if comp is None and self._keep_raw_in_warm():
                        comp = bytes(data)
            finally:
                with self._lock:
                    victim.busy = False
                    self._hot_leaving -= victim.size
                    if victim.hot is data and data is not None and victim.refs > 0:
                        self._demote(victim, comp)
        with self._lock:
            while self._total.warm_bytes > self.warm_capacity_bytes:
                victim = self._pick_victim(self._warm)
                if victim is None:
                    break
                self._leave_ram(victim)

    def _demote(self, b: _Blob, warm_copy: bytes | None) -> None:
        """Move `b` out of hot, into warm when `warm_copy` is given and warm has room
        for it (lock held)."""
        if warm_copy is not None and self._warm_room(len(warm_copy)):
            self._set_warm(b, warm_copy)
        elif not self._has_lower_tier():
            # No warm copy and no disk: the block leaves the store.
            self._evict_blob(b)
            return
        self._set_hot(b, None)
        c_total = self._total
        c_total.demotions += 1
        for ns in b.owners():
            self._counters(ns).demotions += 1

    def _leave_ram(self, b: _Blob) -> None:
        """Warm victim: drop the RAM copy (durable) or evict the block (memory)."""
        if self._has_lower_tier():
            self._set_warm(b, None)
            self._total.demotions += 1
            for ns in b.owners():
                self._counters(ns).demotions += 1
        else:
            self._evict_blob(b)

    def _evict_blob(self, b: _Blob) -> None:
        """Memory backend: the cache drops the block and every key that references it."""
        self._apply([DelKey(ns, key, evicted=True) for ns, key in b.key_refs()])

    def _keep_raw_in_warm(self) -> bool:
        """Memory backend keeps incompressible blocks raw in warm (no lower tier)."""
        return not self._has_lower_tier()

    def _has_lower_tier(self) -> bool:
        return False

    # -- reads ---------------------------------------------------------------------------
    def _read_lower(self, b: _Blob, loc: tuple[int, int]) -> Buffer | None:
        """Read a block that is in neither RAM tier (durable backend). None = unreadable."""
        return None

    def _recover_lower(self, b: _Blob, loc: tuple[int, int]) -> Buffer | None:
        """A lower-tier read at `loc` failed or did not verify: the block's verified bytes
        from elsewhere (durable backend: the log, when the location was wrong), or None."""
        return None

    def _drop_bad_warm(self, b: _Blob, warm: bytes) -> None:
        """A warm copy failed verification: count it and forget the copy (lock NOT held)."""
        with self._lock:
            self._total.integrity_failures += 1
            for ns in b.owners():
                self._counters(ns).integrity_failures += 1
            if b.warm is warm:
                self._set_warm(b, None)

    def _quarantine(self, b: _Blob, reason: str, loc: tuple[int, int]) -> None:
        """Drop a blob whose bytes fail verification (lock NOT held)."""
        with self._lock:
            self._total.integrity_failures += 1
            for ns in b.owners():
                self._counters(ns).integrity_failures += 1
            if self._blobs.get(b.sdig) is b:
                self._apply([DelKey(ns, key) for ns, key in b.key_refs()])

    def _stale(self, ns: str, key: str) -> bool:
        """Whether the entry was written in an epoch its scope has moved past (lock held)."""
        tag = self._tags.get((ns, key))
        return tag is not None and tag[1] < self._epoch_current(tenant_of(ns), tag[0])

    def _live(self, ns: str, key: str) -> _Blob | None:
        """The entry's blob, unless absent or stale (lock held)."""
        b = self._lookup(ns, key)
        if b is not None and self._tags and self._stale(ns, key):
            return None
        return b

    def get(self, ns: str, key: str) -> Buffer | None:
        self._validate(ns, key)
        self._check_open()
        return self._read(ns, key)

    def get_nowait(self, ns: str, key: str) -> Buffer | WouldBlock | None:
        """`get` when RAM alone answers it (a hot hit, a miss); else `WOULD_BLOCK`.

        Never does I/O or decompression, so an event loop may call it inline; on
        `WOULD_BLOCK` nothing was counted and `get` (on a worker thread) does the read.
        """
        self._validate(ns, key)
        self._check_open()
        return self._read(ns, key, nowait=True)

    def put_nowait(
        self,
        ns: str,
        key: str,
        data: BlockData,
        *,
        epoch_scope: str | None = None,
        cond: PutCond = None,
    ) -> PutResult | concurrent.futures.Future[PutResult] | WouldBlock:
        """`put` when it is cheap to start from an event loop; else `WOULD_BLOCK`.

        Cheap means: the block is small (`INLINE_MAX_BYTES`, hashed here) and fits in the
        hot tier's free room, or making room is cheap too (`_cheap_room`). The answer is the
        `PutResult`, or (durable backend) a future resolved once the PUT is on stable
        storage: await it, e.g. with `asyncio.wrap_future`. Errors are raised as by `put`
        (or set on the future).
        """
        if len(data) > INLINE_MAX_BYTES or (
            self._total.hot_bytes + len(data) > self.hot_capacity_bytes and not self._cheap_room()
        ):
            return WOULD_BLOCK
        return self._put_start(ns, key, data, epoch_scope, cond)

    def _cheap_room(self) -> bool:
        """Whether a PUT into a full hot tier may still run on the caller's thread (the
        demotion it causes is cheap). Not by default; each backend answers for itself."""
        return False

    def _put_start(
        self, ns: str, key: str, data: BlockData, epoch_scope: str | None, cond: PutCond
    ) -> PutResult | concurrent.futures.Future[PutResult]:
        """A PUT up to (not including) waiting for durability; the memory backend's is
        the whole PUT."""
        if epoch_scope is None and cond is None:  # the plain call, for overriding subclasses
            return self.put(ns, key, data)
        return self.put(ns, key, data, epoch_scope=epoch_scope, cond=cond)

    @overload
    def _read(self, ns: str, key: str) -> Buffer | None: ...
    @overload
    def _read(self, ns: str, key: str, *, nowait: bool) -> Buffer | WouldBlock | None: ...

    def _read(self, ns: str, key: str, *, nowait: bool = False) -> Buffer | WouldBlock | None:
        """GET on a (possibly internal) namespace; counts on that namespace.

        With `nowait`, a block that is not in the hot tier is `WOULD_BLOCK` (decided in
        the same critical section as the lookup, so the caller never does I/O).
        """
        with self._lock:
            c = self._counters(ns)
            b = self._lookup(ns, key)
            if (
                nowait
                and b is not None
                and b.hot is None
                and not (self._tags and self._stale(ns, key))
            ):
                return WOULD_BLOCK
            if b is not None and self._tags and self._stale(ns, key):
                c.stale_missed += 1
                self._total.stale_missed += 1
                b = None
            if b is None:
                c.get_misses += 1
                self._total.get_misses += 1
                return None
            b.hits += 1
            # keep _blobs in least-recently-used-first order for cold eviction
            del self._blobs[b.sdig]
            self._blobs[b.sdig] = b
            if b.hot is not None:
                self._hot.move_to_end(b.sdig)
                c.get_hits += 1
                self._total.get_hits += 1
                return b.hot
            warm = b.warm
            loc = (b.seg, b.off)  # read together: compaction may move the block
        data: Buffer | None = None
        corrupt = False
        if warm is not None:
            try:
                data = warm if len(warm) == b.size else self._codec.decompress(warm)
            except ValueError:
                data = None
            if data is not None and len(data) == b.size and digest_of(data) == b.digest:
                pass  # verified
            elif not self._has_lower_tier():
                data, corrupt = None, True
            else:
                # A damaged RAM copy: drop it, count it, and serve the disk copy instead.
                self._drop_bad_warm(b, warm)
                data = None
        verified = False
        if data is None and not corrupt:
            data = self._read_lower(b, loc)  # None: unreadable right now (I/O error), a miss
            if data is None:
                with self._lock:
                    moved = (b.seg, b.off) != loc
                    loc = (b.seg, b.off)
                if moved:  # compaction moved it (and dropped the old segment): read again
                    data = self._read_lower(b, loc)
                if data is None:  # where RAM says holds nothing: perhaps RAM is wrong
                    data = self._recover_lower(b, loc)  # (verified, or None: a miss)
                    verified = data is not None
            if (
                not verified
                and data is not None
                and (len(data) != b.size or digest_of(data) != b.digest)
            ):
                # distrust the location before the bytes: look for them in the log
                data = self._recover_lower(b, loc)
                corrupt = data is None
        if data is None:
            if corrupt:
                self._quarantine(b, "digest mismatch", loc)
            with self._lock:
                c.get_misses += 1
                self._total.get_misses += 1
            return None
        data = read_only(data)  # handed out, and maybe kept in hot: nobody writes it
        self._make_hot_room((b.size,))
        with self._lock:
            c.get_hits += 1
            self._total.get_hits += 1
            if self._blobs.get(b.sdig) is b and b.hot is None and self._hot_room(b.size):
                if b.warm is not None:
                    self._set_warm(b, None)
                self._set_hot(b, data)
                self._total.promotions += 1
                for o in b.owners():
                    self._counters(o).promotions += 1
        return data

    def size(self, ns: str, key: str) -> int | None:
        self._validate(ns, key)
        self._check_open()
        with self._lock:
            b = self._live(ns, key)
            return b.size if b is not None else None

    def exists(self, ns: str, key: str) -> bool:
        self._validate(ns, key)
        self._check_open()
        with self._lock:
            return self._live(ns, key) is not None

    def key_hits(self, ns: str, key: str) -> int | None:
        self._validate(ns, key)
        self._check_open()
        with self._lock:
            b = self._live(ns, key)
            return b.hits if b is not None else None

    def exists_many(self, ns: str, keys: Sequence[str]) -> list[bool]:
        for key in keys:
            self._validate(ns, key)
        self._check_open()
        with self._lock:
            idx = self._index.get(ns) or {}
            if not self._tags:
                return [k in idx for k in keys]
            return [k in idx and not self._stale(ns, k) for k in keys]

    def promote(self, ns: str, key: str) -> bool:
        self._validate(ns, key)
        with self._lock:
            b = self._lookup(ns, key)
            if b is None:
                return False
            if b.hot is not None:
                self._hot.move_to_end(b.sdig)
                return True
        return self.get(ns, key) is not None

    def set_importance(self, ns: str, key: str, score: float) -> bool:
        self._validate(ns, key)
        if not 0.0 <= score <= 1.0:
            raise ValueError(f"importance must be in [0, 1] (got {score!r})")
        with self._lock:
            b = self._lookup(ns, key)
            if b is None:
                return False
            b.importance = score
            return True

    def keys(self, ns: str, *, after: str | None = None, limit: int = 1000) -> list[str]:
        validate_namespace(ns)
        with self._lock:
            sl = self._sorted.get(ns)
            if sl is None or limit <= 0:
                return []
            it = sl.irange(minimum=after, inclusive=(False, True)) if after is not None else sl
            return list(itertools.islice(it, limit))

    def count(self, ns: str) -> int:
        with self._lock:
            return len(self._index.get(ns) or ())

    def iter_refs(self) -> Iterator[tuple[str, str, bytes]]:
        """Snapshot of every (ns, key, digest) in the store (for checks and tools)."""
        with self._lock:
            items = [(ns, k, b.digest) for ns, idx in self._index.items() for k, b in idx.items()]
        return iter(items)

    # -- epochs --------------------------------------------------------------------------
    def _epoch_current(self, tenant: str, scope: str) -> int:
        """Current epoch of `scope` (backend: RAM dict or the shared epoch registry)."""
        return self._epochs.get((tenant, scope), 0)

    def _epoch_advance(self, tenant: str, scope: str) -> int:
        with self._lock:
            if (tenant, scope) not in self._epochs:
                self._epoch_room(tenant)
            n = self._epochs.get((tenant, scope), 0) + 1
            self._epochs[(tenant, scope)] = n
            return n

    def _epoch_room(self, tenant: str) -> None:
        """Memory backend: a tenant at its scope limit first loses the scopes no live
        entry is tagged with (forgetting their epoch cannot make anything fresh)."""
        mine = [s for (t, s) in self._epochs if t == tenant]
        limit = self.max_epoch_scopes_per_tenant
        if len(mine) < limit:
            return
        used = {tag[0] for (ns, _k), tag in self._tags.items() if tenant_of(ns) == tenant}
        for scope in mine:
            if scope not in used:
                del self._epochs[(tenant, scope)]
        if len(mine) - sum(1 for sc in mine if sc not in used) >= limit:
            raise QuotaExceededError(
                f"epoch scope quota exceeded: this tenant has {limit} scopes with live "
                "entries (its limit)",
                resource="epoch_scopes",
            )

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
        return self._epoch_advance(ns, scope)

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
        removed = self._retire(stale) if stale else 0
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

    def snapshot_create(
        self,
        ns: str,
        *,
        keys: Sequence[str] | None = None,
        prefix: str | None = None,
        ttl_s: float | None = None,
    ) -> SnapshotInfo:
        validate_namespace(ns)
        for key in keys or ():
            validate_key(key)
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"invalid ttl_s: expected a positive number (got {ttl_s!r})")
        self._check_open()
        # the quotas (snapshots, pinned bytes) are checked where the snapshot is committed,
        # atomically with it: concurrent requests cannot both pass a check made before
        sid = secrets.token_hex(8)
        now = self._clock()
        rec: dict[str, Any] = {
            "created_at": now,
            "expires_at": now + ttl_s if ttl_s is not None else None,
        }
        self._snapshot_commit(ns, sid, list(keys) if keys is not None else None, prefix, rec)
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
        self._drop(ns, items)
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
        self._commit_meta(MetaPut("branch", ns, bid, rec))
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
        self._drop(ns, [("branch", branch_id)])
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

    def branch_put(self, ns: str, branch_id: str, key: str, data: BlockData) -> PutResult:
        ns_raw = self._validate(ns, key)
        self._check_size(data)
        self._check_open()
        with self._lock:
            if self._branch_rec(ns, branch_id) is None:
                raise NotFoundError(f"no branch {branch_id!r}")
        return self._put_into(branch_ns(ns, branch_id), ns_raw, key, data, None, None)

    # -- backend primitives --------------------------------------------------------------
    @abc.abstractmethod
    def _put_into(
        self,
        ns: str,
        scope_raw: bytes,
        key: str,
        data: BlockData,
        tag: tuple[str, int] | None,
        cond: PutCond,
    ) -> PutResult:
        """PUT into a (possibly internal) namespace; blobs are scoped by `scope_raw`."""

    @abc.abstractmethod
    def _snapshot_commit(
        self,
        tenant: str,
        sid: str,
        keys: list[str] | None,
        prefix: str | None,
        rec: dict[str, Any],
    ) -> None:
        """Reference (and pin) the live entries named, under snapshot_ns(tenant, sid)."""

    @abc.abstractmethod
    def _drop(self, tenant: str, items: list[tuple[str, str]]) -> None:
        """Delete the records and every entry of the named snapshots / branches."""

    @abc.abstractmethod
    def _commit_meta(self, effect: MetaPut) -> None:
        """Make a snapshot/branch record durable (durable backend) and apply it."""

    @abc.abstractmethod
    def _retire(self, pairs: list[tuple[str, str]]) -> int:
        """Delete the given entries if they are still stale; returns how many went."""

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

    # -- stats ---------------------------------------------------------------------------
    def _tier_caps(self) -> dict[str, int]:
        return {"hot": self.hot_capacity_bytes, "warm": self.warm_capacity_bytes}

    def stats(self, ns: str | None = None) -> StoreStats:
        with self._lock:
            c = self._total if ns is None else self._ns.get(ns, _Counters())
            s = StoreStats(
                unique_blocks=c.unique_blocks,
                total_refs=c.total_refs,
                logical_bytes=c.logical_bytes,
                resident_bytes=c.resident_bytes,
                dedup_savings_bytes=c.logical_bytes - c.resident_bytes,
                dedup_hits=c.dedup_hits,
                put_new=c.put_new,
                put_conflicts=c.put_conflicts,
                put_replaced=c.put_replaced,
                get_hits=c.get_hits,
                get_misses=c.get_misses,
                stale_missed=c.stale_missed,
                integrity_failures=c.integrity_failures,
                evictions=c.evictions,
                promotions=c.promotions,
                demotions=c.demotions,
                pinned_blocks=c.pinned_blocks,
            )
            caps = self._tier_caps()
            s.tiers["hot"] = TierStats(
                c.hot_blocks, c.hot_bytes, caps["hot"], c.hot_bytes, c.hot_peak
            )
            s.tiers["warm"] = TierStats(
                c.warm_blocks, c.warm_bytes, caps["warm"], c.warm_logical, c.warm_peak
            )
            if "cold" in caps:
                s.tiers["cold"] = TierStats(
                    c.cold_blocks, c.cold_bytes, caps["cold"], c.cold_bytes, c.cold_peak
                )
            if ns is None:
                s.extra.update(self._extra_stats())
        return s

    def _extra_stats(self) -> dict[str, int | float]:
        return {"namespaces": len({tenant_of(ns) for ns in self._index})}

    # -- decisions shared by both backends -----------------------------------------------
    def _count_put(self, ns: str, outcome: PutOutcome, deduped: bool) -> None:
        c = self._counters(ns)
        for cc in (c, self._total):
            if outcome is PutOutcome.NEW or outcome is PutOutcome.REPLACED:
                if outcome is PutOutcome.NEW:
                    cc.put_new += 1
                else:
                    cc.put_replaced += 1
                if deduped:
                    cc.dedup_hits += 1
            elif outcome is PutOutcome.DUPLICATE:
                cc.dedup_hits += 1
            elif outcome is PutOutcome.CONFLICT:
                cc.put_conflicts += 1

    def _pin_capacity(self) -> int:
        """The bytes pins compete for: RAM (memory backend) or the cold tier (durable)."""
        return self._tier_caps().get("cold", self.hot_capacity_bytes + self.warm_capacity_bytes)

    def _check_pin_quota(self, tenant: str, extra: int) -> None:
        """Refuse a pin/snapshot that would take `tenant` past its share (lock held)."""
        limit = int(self._pin_capacity() * self.max_pinned_fraction)
        used = self._counters(tenant).pinned_bytes
        if extra > 0 and used + extra > limit:
            raise QuotaExceededError(
                f"pin quota exceeded: {used + extra} bytes would be pinned by this tenant, "
                f"its limit is {limit} ({self.max_pinned_fraction:.0%} of {self._pin_capacity()})",
                resource="pins",
            )

    def _check_snapshot_quota(self, tenant: str, pending: int = 0) -> None:
        """Refuse a snapshot past the tenant's count (lock held)."""
        if len(self._snapshots.get(tenant, {})) + pending >= self.max_snapshots_per_tenant:
            raise QuotaExceededError(
                f"snapshot quota exceeded: {self.max_snapshots_per_tenant} snapshots; "
                "delete one (or give them a ttl_s)",
                resource="snapshots",
            )

    def _check_key_quota(self, ns: str, pending: int = 0) -> None:
        """Refuse a new key past the tenant's count (lock held; 0 means no limit)."""
        limit = self.max_keys_per_tenant
        if limit and len(self._index.get(ns) or ()) + pending >= limit:
            raise QuotaExceededError(
                f"key quota exceeded: this tenant holds {limit} keys (its limit); "
                "delete some first",
                resource="keys",
            )

    def _check_ram_room(self, size: int) -> None:
        """Memory backend: refuse a block that cannot fit beside the pinned ones."""
        budget = self.hot_capacity_bytes + self.warm_capacity_bytes
        if size > budget:
            raise CapacityError(
                f"block of {size} bytes is larger than the RAM tiers ({budget} bytes)"
            )
        pinned = self._pinned_bytes
        if pinned + size > budget:
            raise CapacityError(
                f"no room for a {size}-byte block: {pinned} of {budget} bytes are pinned"
            )

    def _base_check(self, report: ConsistencyReport) -> None:
        """RAM invariants: index <-> blobs <-> refcounts (lock held)."""
        refs: dict[bytes, int] = {}
        for ns, idx in self._index.items():
            for key, b in idx.items():
                report.keys += 1
                if self._blobs.get(b.sdig) is not b:
                    report.orphan_index_entries.append(f"{ns}/{key}")
                refs[b.sdig] = refs.get(b.sdig, 0) + 1
        for sdig, b in self._blobs.items():
            report.blocks += 1
            n = refs.get(sdig, 0)
            if n == 0:
                report.orphan_blobs.append(b.digest.hex())
            elif n != b.refs or n != len(b.key_refs()):
                report.refcount_mismatches.append(f"{b.digest.hex()}: {b.refs} != {n}")
