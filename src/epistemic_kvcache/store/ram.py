"""The store's RAM state and its one owner: index, blobs, counters, tags, records, the
in-flight table, the RAM tiers and the lock.

How it works
------------
- `(namespace, key) -> blob` is the index (a dict per namespace, plus a sorted list for
  paging); blobs are content-addressed by their scoped digest (model.py), with a
  reference count. Every mutation is an effect (`AddKey`, `DelKey`, `PinDelta`,
  `MetaPut`, `MetaDel`, `Move`) applied by one method, `apply_locked`, under `lock`.
- `RamState` is the only object that holds these containers; the engine (a facade,
  engine.py), the sequencers (memory.py `ApplyNow`, disklog.py `GroupCommit`), the disk
  log, the batch decision (plan.py, its `Reader`), the compactor (its `LiveRam`) and
  the checkpointer (its `RowSource`) call its public methods. A method takes `lock`
  unless its name ends in `_locked`: then its caller holds it, to make several calls
  one atomic step. The hot core (hotcore.py, its compiled twin) is handed the
  containers once and answers the hit paths on them under the same lock.
- Stats are exact: the `Ledger` (model.py) moves every blob's footprint with it.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from sortedcontainers import SortedList

from epistemic_kvcache.errors import QuotaExceededError
from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.shared import MAX_KEY_BYTES
from epistemic_kvcache.store.api import (
    PUT_CONFLICT,
    PUT_DUPLICATE,
    PUT_MISSING,
    ConsistencyReport,
    PutCond,
    PutOutcome,
    PutResult,
    StoreStats,
    decide_put,
    validate_key,
    validate_namespace,
)
from epistemic_kvcache.store.codec import WarmCodec
from epistemic_kvcache.store.core import HotCore
from epistemic_kvcache.store.effects import EffectApplier, Entry
from epistemic_kvcache.store.model import (
    _VALID_NS_CACHE,
    DelKey,
    Effect,
    Ledger,
    Move,
    _Blob,
    _Counters,
    tenant_of,
)
from epistemic_kvcache.store.plan import KeyView
from epistemic_kvcache.store.seams import EpochSource, LowerTier, NoLowerTier, RamEpochs
from epistemic_kvcache.store.tiers import RamTiers

__all__ = ["RamState"]


class RamState:
    """The store's RAM state with its public, locked API (see the module docstring)."""

    def __init__(
        self, options: StoreOptions, *, codec: WarmCodec, clock: Callable[[], float] = time.time
    ) -> None:
        self.options = options
        self.codec = codec
        self.clock = clock
        """Wall-clock seconds (snapshot TTLs, creation times; tests pass a fake clock)."""
        self.lock = threading.Lock()
        """The one lock of every container below."""
        self.live_capacity_bytes = options.cold_capacity_bytes
        """Live block bytes the lower tier holds before it evicts (the durable backend
        sets it: the cold capacity less its reserve)."""
        self.cold_capacity_bytes = options.cold_capacity_bytes
        self.max_keys_per_tenant = options.max_keys_per_tenant
        self._index: dict[str, dict[str, _Blob]] = {}
        # the same keys in order, per namespace: listing (SCAN) walks a page of it under
        # the lock in O(log n + page), never sorting a whole namespace
        self._sorted: dict[str, SortedList] = {}
        self._blobs: dict[bytes, _Blob] = {}  # insertion order = least recently used first
        self._pins: dict[tuple[str, str], int] = {}
        self._ledger = Ledger()
        self._total = self._ledger.total
        # (ns, key) -> (epoch scope, epoch) for entries written with an epoch scope
        self._tags: dict[tuple[str, str], tuple[str, int]] = {}
        # "snap"/"branch" -> tenant -> id -> record
        self._records: dict[str, dict[str, dict[str, dict[str, Any]]]] = {"snap": {}, "branch": {}}
        self._inflight: dict[tuple[str, str], int] = {}
        """(ns, key) -> writes queued for the committer: their PUTs are decided there."""
        self._retire_pos = 0  # where `stale_scan` resumes in the ring of tags
        self._valid_ns: dict[str, bytes] = {}  # namespace -> its UTF-8 (validated)
        self._lower: LowerTier = NoLowerTier()
        self.tiers = RamTiers(
            lock=self.lock,
            ledger=self._ledger,
            codec=codec,
            hot_capacity_bytes=options.hot_capacity_bytes,
            warm_capacity_bytes=options.warm_capacity_bytes,
            lower=self._lower,
            evict=self.evict_blob_locked,
        )
        self._effects = EffectApplier(
            options=options,
            index=self._index,
            sorted_keys=self._sorted,
            blobs=self._blobs,
            pins=self._pins,
            tags=self._tags,
            records=self._records,
            ledger=self._ledger,
            tiers=self.tiers,
        )
        self._epochs: EpochSource = RamEpochs(
            self.lock, self._tags, options.max_epoch_scopes_per_tenant
        )
        self._epoch_current = self._epochs.current
        # the hit paths (hotcore.py): RAM answers most requests there, in one call
        self.core = HotCore(
            index=self._index,
            blobs=self._blobs,
            hot=self.tiers.hot,
            by_ns=self._ledger.by_ns,
            total=self._total,
            lock=self.lock,
            tags=self._tags,
            valid_ns=self._valid_ns,
            global_dedup=options.dedup_scope == "global",
            max_block_bytes=min(options.max_block_bytes, sys.maxsize),  # (a C field there)
        )
        self.core.inflight = self._inflight

    def compose(self, *, lower: LowerTier | None = None, epochs: EpochSource | None = None) -> None:
        """Wire what lies below RAM (default: nothing) and where epochs come from (default:
        RAM), before anything is stored."""
        if lower is not None:
            self._lower = self.tiers.lower = self._effects.lower = lower
        if epochs is not None:
            self._epochs = epochs
            self._epoch_current = epochs.current

    @property
    def lower(self) -> LowerTier:
        return self._lower

    @property
    def epochs(self) -> EpochSource:
        return self._epochs

    @property
    def total(self) -> _Counters:
        """The store-wide counters (read them under `lock` for a consistent view)."""
        return self._total

    @property
    def pinned_bytes(self) -> int:
        """Bytes of blobs with at least one pin."""
        return self._effects.pinned_bytes

    # -- names ---------------------------------------------------------------------------
    def validate(self, ns: str, key: str) -> bytes:
        """Check a namespace and key; the namespace's UTF-8 (cached per namespace)."""
        if not (key.isascii() and 0 < len(key) <= MAX_KEY_BYTES):  # (else: surely valid)
            validate_key(key)
        raw = self._valid_ns.get(ns)
        if raw is None:  # validated once per namespace (the set of names is bounded)
            raw = validate_namespace(ns)
            if len(self._valid_ns) >= _VALID_NS_CACHE:
                self._valid_ns.clear()
            self._valid_ns[ns] = raw
        return raw

    def scoped(self, ns_raw: bytes, digest: bytes) -> bytes:
        """A block's scoped digest: the key of its blob in its dedup scope."""
        if self.options.dedup_scope == "global":
            return digest
        return ns_raw + b"\x00" + digest

    def first_write_wins(self, ns: str) -> bool:
        """Whether `ns`'s tenant keeps first-write-wins (a plain PUT never replaces)."""
        f = self.options.first_write_wins
        return f if isinstance(f, bool) else tenant_of(ns) in f

    # -- lookups (lock held) -------------------------------------------------------------
    def lookup_locked(self, ns: str, key: str) -> _Blob | None:
        idx = self._index.get(ns)
        return idx.get(key) if idx is not None else None

    def stale_locked(self, ns: str, key: str) -> bool:
        """Whether the entry was written in an epoch its scope has moved past."""
        tag = self._tags.get((ns, key))
        return tag is not None and tag[1] < self._epoch_current(tenant_of(ns), tag[0])

    def live_locked(self, ns: str, key: str) -> _Blob | None:
        """The entry's blob, unless absent or stale."""
        b = self.lookup_locked(ns, key)
        if b is not None and self._tags and self.stale_locked(ns, key):
            return None
        return b

    def pins_locked(self, ns: str, key: str) -> int:
        return self._pins.get((ns, key), 0)

    def tag_locked(self, ns: str, key: str) -> tuple[str, int] | None:
        return self._tags.get((ns, key))

    def has_blob(self, sdig: bytes) -> bool:
        """Whether blob `sdig` is stored (a hint without the lock)."""
        return sdig in self._blobs

    def counters(self, ns: str) -> _Counters:
        """The namespace's counters, made when first asked (lock held)."""
        return self._ledger.counters(ns)

    def counters_of(self, ns: str) -> _Counters:
        """The namespace's counters, or empty ones (never made)."""
        return self._ledger.by_ns.get(ns) or _Counters()

    def count_put(self, ns: str, outcome: PutOutcome, deduped: bool) -> None:
        """Count one decided PUT (lock held)."""
        self._ledger.count_put(ns, outcome, deduped)

    def bump(self, b: _Blob, name: str) -> None:
        """Count one event on the blob's owners and the total (lock held)."""
        self._ledger.bump(b, name)

    def ns_len_locked(self, ns: str) -> int:
        return len(self._index.get(ns) or ())

    def ns_blobs_locked(self, ns: str) -> list[_Blob]:
        return list((self._index.get(ns) or {}).values())

    def blob_list_locked(self) -> list[_Blob]:
        """Every blob, least recently used first."""
        return list(self._blobs.values())

    # -- the PUT decision (lock held) ----------------------------------------------------
    def decide_put_locked(
        self, ns: str, key: str, sdig: bytes, digest: bytes, size: int, cond: PutCond
    ) -> tuple[PutOutcome, _Blob | None, PutResult | None]:
        """Decide a PUT of hashed bytes against the key's entry: (outcome, the entry or
        None, the answer when the PUT writes nothing - counted here - else None). A stale
        entry decides as an absent one."""
        existing = self.lookup_locked(ns, key)
        live = None if existing is None or (self._tags and self.stale_locked(ns, key)) else existing
        held = live.sdig if live is not None else None
        # (first-write-wins decides only over other bytes: not looked up for the rest)
        fww = held is not None and held != sdig and self.first_write_wins(ns)
        outcome = decide_put(held, sdig, cond, fww)
        if outcome is PUT_MISSING or outcome is PUT_DUPLICATE:
            # (a duplicate holds these very bytes: the key's digest and size are these)
            self._ledger.count_put(ns, outcome, False)
            return outcome, existing, PutResult(outcome, digest, size)
        if outcome is PUT_CONFLICT:
            assert live is not None  # nothing written
            self._ledger.count_put(ns, outcome, False)
            return outcome, existing, PutResult(outcome, live.digest, live.size)
        return outcome, existing, None

    # -- the writes in flight ------------------------------------------------------------
    def enter_flight(self, refs: Iterable[tuple[str, str]]) -> None:
        """Keys whose writes are queued for the committer: their PUTs are decided there,
        in order (the hot core and `GroupCommit` leave them alone)."""
        with self.lock:
            for ref in refs:
                self._inflight[ref] = self._inflight.get(ref, 0) + 1

    def leave_flight_locked(self, refs: Iterable[tuple[str, str]]) -> None:
        for ref in refs:
            n = self._inflight.get(ref, 1) - 1
            if n > 0:
                self._inflight[ref] = n
            else:
                self._inflight.pop(ref, None)

    def in_flight_locked(self, ns: str, key: str) -> bool:
        return bool(self._inflight.get((ns, key)))

    # -- effects: the only code that changes the index and refcounts ---------------------
    def apply(self, effects: Sequence[Effect]) -> None:
        with self.lock:
            self.apply_locked(effects)

    def apply_locked(self, effects: Sequence[Effect]) -> None:
        """Apply decided (and, for the durable backend, committed) effects."""
        self._effects.apply(effects)

    def load_locked(self, entries: Iterable[Entry]) -> None:
        """Fill an empty store in bulk (opening a durable one): the same state as applying
        `AddKey` (+ `PinDelta`) per entry."""
        self._effects.load(entries)

    # -- quotas (lock held) --------------------------------------------------------------
    def pin_capacity(self) -> int:
        """The bytes pins compete for: RAM, or what the lower tier says (the cold tier)."""
        cap = self._lower.pin_capacity()
        o = self.options
        return o.hot_capacity_bytes + o.warm_capacity_bytes if cap is None else cap

    def check_pin_quota_locked(self, tenant: str, extra: int) -> None:
        """Refuse a pin/snapshot that would take `tenant` past its share."""
        fraction = self.options.max_pinned_fraction
        limit = int(self.pin_capacity() * fraction)
        used = self._ledger.counters(tenant).pinned_bytes
        if extra > 0 and used + extra > limit:
            raise QuotaExceededError(
                f"pin quota exceeded: {used + extra} bytes would be pinned by this tenant, "
                f"its limit is {limit} ({fraction:.0%} of {self.pin_capacity()})",
                resource="pins",
            )

    def check_snapshot_quota_locked(self, tenant: str, pending: int = 0) -> None:
        """Refuse a snapshot past the tenant's count."""
        limit = self.options.max_snapshots_per_tenant
        if len(self._records["snap"].get(tenant, {})) + pending >= limit:
            raise QuotaExceededError(
                f"snapshot quota exceeded: {limit} snapshots; delete one (or give them a ttl_s)",
                resource="snapshots",
            )

    def check_key_quota_locked(self, ns: str, pending: int = 0) -> None:
        """Refuse a new key past the tenant's count (0 means no limit)."""
        limit = self.options.max_keys_per_tenant
        if limit and len(self._index.get(ns) or ()) + pending >= limit:
            raise QuotaExceededError(
                f"key quota exceeded: this tenant holds {limit} keys (its limit); "
                "delete some first",
                resource="keys",
            )

    # the batch decision's view (plan.py `Reader`): each call takes the lock
    def check_key_quota(self, ns: str, pending: int) -> None:
        with self.lock:
            self.check_key_quota_locked(ns, pending)

    def check_pin_quota(self, tenant: str, extra: int) -> None:
        with self.lock:
            self.check_pin_quota_locked(tenant, extra)

    def check_snapshot_quota(self, tenant: str, pending: int) -> None:
        with self.lock:
            self.check_snapshot_quota_locked(tenant, pending)

    # -- the views of the batch decision, the compactor and the checkpointer -------------
    def key(self, ns: str, key: str) -> KeyView | None:
        with self.lock:
            return self.key_locked(ns, key)

    def key_locked(self, ns: str, key: str) -> KeyView | None:
        b = self.lookup_locked(ns, key)
        if b is None:
            return None
        ref = (ns, key)
        return KeyView(b.sdig, b.size, self._pins.get(ref, 0), self._tags.get(ref))

    def blob(self, sdig: bytes) -> _Blob | None:
        return self._blobs.get(sdig)

    def key_refs(self, sdig: bytes) -> list[tuple[str, str]]:
        with self.lock:
            b = self._blobs.get(sdig)
            return b.key_refs() if b is not None else []

    def meta(self, kind: str, tenant: str, rid: str) -> dict[str, Any] | None:
        """A snapshot ("snap") or branch record (a dict read: no lock needed)."""
        return self._records[kind].get(tenant, {}).get(rid)

    def records_locked(self, kind: str, tenant: str) -> dict[str, dict[str, Any]]:
        """The tenant's snapshot or branch records, id -> record (do not change it)."""
        return self._records[kind].get(tenant, {})

    def ns_keys(self, ns: str) -> list[str]:
        with self.lock:
            return list(self._index.get(ns) or ())

    def ns_keys_locked(self, ns: str) -> list[str]:
        return list(self._index.get(ns) or ())

    def cold_bytes(self) -> int:
        with self.lock:
            return self._total.cold_bytes

    def lru_victims(self, need: int, skip: set[bytes]) -> list[tuple[bytes, int]] | None:
        victims: list[tuple[bytes, int]] = []
        with self.lock:
            for b in self._blobs.values():  # least recently used first
                if need <= 0:
                    break
                if b.pins or b.sdig in skip:
                    continue
                victims.append((b.sdig, b.size))
                need -= b.size
        return victims if need <= 0 else None

    def epoch(self, tenant: str, scope: str) -> int:
        return self._epoch_current(tenant, scope)

    def now(self) -> float:
        return time.time()

    def use_order(self) -> list[tuple[int, int, int]]:
        with self.lock:
            return [(b.seg, b.size, b.pins) for b in self._blobs.values()]

    def move_locked(self, sdig: bytes, old: tuple[int, int], new: tuple[int, int]) -> int:
        """Point RAM at the copy at `new` if the blob is still at `old`: its size, or 0."""
        b = self._blobs.get(sdig)
        if b is None or (b.seg, b.off) != old:
            return 0
        self.apply_locked([Move(sdig, new[0], new[1])])
        return b.size

    def at_locked(self, sdig: bytes, loc: tuple[int, int]) -> _Blob | None:
        """Blob `sdig` if RAM still places it at `loc`."""
        b = self._blobs.get(sdig)
        return b if b is not None and (b.seg, b.off) == loc else None

    def segment_victims_locked(self, sid: int) -> list[bytes]:
        """The unpinned blobs stored in segment `sid`."""
        return [b.sdig for b in self._blobs.values() if b.seg == sid and not b.pins]

    def tagged(self, tenant: str, scope: str) -> int:
        """Entries tagged with (tenant, scope) (the epoch registry prunes scopes with none)."""
        with self.lock:
            return sum(
                1
                for (ns, _k), tag in self._tags.items()
                if tag[0] == scope and tenant_of(ns) == tenant
            )

    # -- reads (lock held) ----------------------------------------------------------------
    def used_locked(self, b: _Blob) -> None:
        """A read used blob `b`: most recently used now (cold eviction takes the least
        recently used first; hot keeps its own order)."""
        del self._blobs[b.sdig]
        self._blobs[b.sdig] = b
        if b.hot is not None:
            self.tiers.hot.move_to_end(b.sdig)

    def exists_count_locked(self, ns: str, keys: Sequence[str]) -> int:
        """How many of `keys` exist, not stale (one count per mention)."""
        idx = self._index.get(ns)
        if not idx:
            return 0
        tags = self._tags
        return sum(1 for k in keys if k in idx and not (tags and self.stale_locked(ns, k)))

    def exists_many_locked(self, ns: str, keys: Sequence[str]) -> list[bool]:
        idx = self._index.get(ns) or {}
        if not self._tags:
            return [k in idx for k in keys]
        return [k in idx and not self.stale_locked(ns, k) for k in keys]

    def evict_blob_locked(self, b: _Blob) -> None:
        """No lower tier: the cache drops the block and every key that references it."""
        self.apply_locked([DelKey(ns, key, evicted=True) for ns, key in b.key_refs()])

    def keys(self, ns: str, *, after: str | None = None, limit: int = 1000) -> list[str]:
        with self.lock:
            sl = self._sorted.get(ns)
            if sl is None or limit <= 0:
                return []
            it = sl.irange(minimum=after, inclusive=(False, True)) if after is not None else sl
            return list(itertools.islice(it, limit))

    def iter_refs(self) -> Iterator[tuple[str, str, bytes]]:
        """Snapshot of every (ns, key, digest) in the store (for checks and tools)."""
        with self.lock:
            items = [(ns, k, b.digest) for ns, idx in self._index.items() for k, b in idx.items()]
        return iter(items)

    def summary(self) -> tuple[int, int]:
        """(blobs, keys) stored."""
        with self.lock:
            return len(self._blobs), sum(len(v) for v in self._index.values())

    # -- stats and checks ----------------------------------------------------------------
    def stats(self, ns: str | None = None) -> StoreStats:
        o = self.options
        caps = {"hot": o.hot_capacity_bytes, "warm": o.warm_capacity_bytes}
        caps.update(self._lower.caps())
        with self.lock:
            c = self._total if ns is None else self._ledger.by_ns.get(ns, _Counters())
            s = c.stats(caps)
            if ns is None:
                s.extra["namespaces"] = len({tenant_of(n) for n in self._index})
                s.extra.update(self._lower.extra_stats())
        return s

    def check_locked(self, report: ConsistencyReport) -> None:
        """RAM invariants: index <-> blobs <-> refcounts."""
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

    # -- the catalog's internal namespaces (lock held) ------------------------------------
    def stale_scan(self, max_items: int, deadline: float) -> list[tuple[str, str]]:
        """Stale entries, up to `max_items` or `deadline` (monotonic), resuming the ring
        of tagged entries where the last scan stopped (lock held)."""
        stale: list[tuple[str, str]] = []
        tags = self._tags
        start = self._retire_pos % len(tags) if tags else 0
        ring = itertools.chain(
            itertools.islice(tags, start, None), itertools.islice(tags, 0, start)
        )
        scanned = 0
        for ns, key in ring:
            if len(stale) >= max_items or (scanned & 255 == 255 and time.monotonic() > deadline):
                break
            scanned += 1
            if self.stale_locked(ns, key):
                stale.append((ns, key))
        self._retire_pos = start + scanned - len(stale)  # retired entries leave the ring
        return stale

    def expired_locked(self, now: float) -> list[tuple[str, str, str]]:
        """(kind, tenant, id) of the records whose `expires_at` has passed."""
        return [
            (kind, tenant, rid)
            for kind, table in self._records.items()
            for tenant, recs in table.items()
            for rid, rec in recs.items()
            if rec.get("expires_at") is not None and rec["expires_at"] <= now
        ]

    def forget_ns_locked(self, ns: str) -> None:
        """Drop an emptied internal namespace's dicts and counters."""
        if not self._index.get(ns):
            self._index.pop(ns, None)
            self._sorted.pop(ns, None)
            self._ledger.by_ns.pop(ns, None)
