"""The tier engine shared by every backend: index, blobs, refcounts, reads, stats.

How it works
------------
- `(namespace, key) -> blob` is the index (a dict per namespace, plus a sorted list for
  paging); blobs are content-addressed by their scoped digest (model.py), with a
  reference count. Mutations are effects (`AddKey`, `DelKey`, `PinDelta`, ...) applied
  to RAM by one method, `_apply`, under the one engine lock.
- The engine is *composed*, not specialised by hooks: `self._tiers` (tiers.py) holds
  the hot and warm RAM tiers, `self._lower` (a `LowerTier`, seams.py) is what lies below
  RAM (nothing, or the durable backend's log), `self._seq` (a `Sequencer`) is how a
  write reaches RAM (applied at once, or group-committed first), `self._epoch_src` (an
  `EpochSource`) says which epoch a scope is in. A backend wires its parts once with
  `_compose`; the snapshot/branch/epoch calls live in the `Catalog` mixin (catalog.py).
- A GET takes the lock once when hot answers it. Otherwise the warm copy is decompressed
  and verified, or the lower tier reads (and, on a mismatch, recovers or quarantines)
  the block, all outside the lock; the verified bytes are promoted to hot when it has
  room (`RamTiers.hot_room`).
- Stats are exact: the `Ledger` (model.py) moves every blob's footprint with it.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

from sortedcontainers import SortedList

from epistemic_kvcache.errors import (
    QuotaExceededError,
    StoreClosedError,
)
from epistemic_kvcache.options import DedupScope, StoreOptions
from epistemic_kvcache.shared import MAX_KEY_BYTES, MAX_SCOPE_BYTES
from epistemic_kvcache.store.api import (
    PUT_CONFLICT,
    PUT_DUPLICATE,
    PUT_MISSING,
    BlockData,
    Buffer,
    ConsistencyReport,
    PutCond,
    PutOutcome,
    PutResult,
    SharedKvBackend,
    StoreStats,
    check_block_size,
    decide_put,
    read_only,
    validate_cond,
    validate_key,
    validate_namespace,
)
from epistemic_kvcache.store.catalog import Catalog, RamEpochs
from epistemic_kvcache.store.codec import WarmCodec
from epistemic_kvcache.store.core import DECLINED, HotCore
from epistemic_kvcache.store.model import (
    _VALID_NS_CACHE,
    DIGEST_BYTES,
    INLINE_MAX_BYTES,
    WOULD_BLOCK,
    AddKey,
    DelKey,
    Effect,
    Ledger,
    MetaDel,
    MetaPut,
    Move,
    PinDelta,
    WouldBlock,
    _Blob,
    _Counters,
    branch_ns,
    digest_of,
    parse_internal_ns,
    snapshot_ns,
    tenant_of,
    validate_scope,
)
from epistemic_kvcache.store.seams import EpochSource, LowerTier, NoLowerTier, Sequencer
from epistemic_kvcache.store.tiers import RamTiers

__all__ = [
    "DIGEST_BYTES",
    "INLINE_MAX_BYTES",
    "MAX_SCOPE_BYTES",
    "WOULD_BLOCK",
    "AddKey",
    "DedupScope",
    "DelKey",
    "Effect",
    "MetaDel",
    "MetaPut",
    "Move",
    "PinDelta",
    "TieredEngine",
    "WouldBlock",
    "_Blob",
    "branch_ns",
    "digest_of",
    "parse_internal_ns",
    "snapshot_ns",
    "tenant_of",
    "validate_scope",
]


class TieredEngine(Catalog, SharedKvBackend):
    """Index, refcounts, reads and stats over composed RAM tiers, lower tier and sequencer.

    A backend subclass adds its public calls and wires its parts with `_compose`; it
    overrides no engine method."""

    index_in_ram = True
    _seq: Sequencer

    def __init__(
        self,
        options: StoreOptions,
        *,
        codec: WarmCodec | None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`options` were validated when built; `clock`: wall-clock seconds for snapshot
        TTLs and creation times (tests pass a fake clock they advance)."""
        self._clock = clock
        self.options = options
        """Tiers and quotas, read where they apply (`self.options.x`: plain attribute
        reads). The per-tenant quotas keep one tenant from pinning (or snapshotting) the
        store full and leaving every other tenant's PUTs without room."""
        self.max_block_bytes = options.max_block_bytes  # the store seam's attribute
        self._codec = codec if codec is not None else WarmCodec()
        self._lock = threading.Lock()
        self._closed = False
        self._index: dict[str, dict[str, _Blob]] = {}
        # the same keys in order, per namespace: listing (SCAN) walks a page of it under
        # the lock in O(log n + page), never sorting a whole namespace
        self._sorted: dict[str, SortedList] = {}
        self._blobs: dict[bytes, _Blob] = {}  # insertion order = least recently used first
        self._pins: dict[tuple[str, str], int] = {}
        self._ledger = Ledger()
        self._ns: dict[str, _Counters] = self._ledger.by_ns
        self._total = self._ledger.total
        self._counters = self._ledger.counters
        self._count_put = self._ledger.count_put
        self._pinned_bytes = 0  # bytes of blobs with at least one pin
        # (ns, key) -> (epoch scope, epoch) for entries written with an epoch scope
        self._tags: dict[tuple[str, str], tuple[str, int]] = {}
        # tenant -> id -> record
        self._snapshots: dict[str, dict[str, dict[str, Any]]] = {}
        self._branches: dict[str, dict[str, dict[str, Any]]] = {}
        self._retire_pos = 0  # where retire_stale's scan of _tags resumes
        self._valid_ns: dict[str, bytes] = {}  # namespace -> its UTF-8 (validated)
        self._lower: LowerTier = NoLowerTier()
        self._tiers = RamTiers(
            lock=self._lock,
            ledger=self._ledger,
            codec=self._codec,
            hot_capacity_bytes=options.hot_capacity_bytes,
            warm_capacity_bytes=options.warm_capacity_bytes,
            lower=self._lower,
            evict=self._evict_blob,
        )
        t = self._tiers
        self._hot = t.hot
        self._warm = t.warm
        self._set_hot = t.set_hot
        self._set_warm = t.set_warm
        self._hot_room = t.hot_room
        self._warm_room = t.warm_room
        self._make_hot_room = t.make_hot_room
        self._rebalance = t.rebalance
        self._epoch_src: EpochSource = RamEpochs(
            self._lock, self._tags, options.max_epoch_scopes_per_tenant
        )
        self._epoch_current = self._epoch_src.current
        # the hit paths (hotcore.py): RAM answers most requests there, in one call
        self._core = HotCore(
            index=self._index,
            blobs=self._blobs,
            hot=self._hot,
            by_ns=self._ns,
            total=self._total,
            lock=self._lock,
            tags=self._tags,
            valid_ns=self._valid_ns,
            global_dedup=options.dedup_scope == "global",
            max_block_bytes=min(options.max_block_bytes, sys.maxsize),  # (a C field there)
        )

    def _compose(
        self,
        *,
        sequencer: Sequencer,
        lower: LowerTier | None = None,
        epochs: EpochSource | None = None,
    ) -> None:
        """Wire the backend's parts (before anything is stored): how writes are sequenced,
        what lies below RAM (default: nothing), where epochs come from (default: RAM)."""
        self._seq = sequencer
        if lower is not None:
            self._lower = self._tiers.lower = lower
        if epochs is not None:
            self._epoch_src = epochs
            self._epoch_current = epochs.current

    # -- helpers -------------------------------------------------------------------------
    def _scoped(self, ns_raw: bytes, digest: bytes) -> bytes:
        if self.options.dedup_scope == "global":
            return digest
        return ns_raw + b"\x00" + digest

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the store is closed")

    def _validate(self, ns: str, key: str) -> bytes:
        if not (key.isascii() and 0 < len(key) <= MAX_KEY_BYTES):  # (else: surely valid)
            validate_key(key)
        raw = self._valid_ns.get(ns)
        if raw is None:  # validated once per namespace (the set of names is bounded)
            raw = validate_namespace(ns)
            if len(self._valid_ns) >= _VALID_NS_CACHE:
                self._valid_ns.clear()
            self._valid_ns[ns] = raw
        return raw

    def _fww(self, ns: str) -> bool:
        """Whether `ns`'s tenant keeps first-write-wins (a plain PUT never replaces)."""
        f = self.options.first_write_wins
        return f if isinstance(f, bool) else tenant_of(ns) in f

    def _lookup(self, ns: str, key: str) -> _Blob | None:
        idx = self._index.get(ns)
        return idx.get(key) if idx is not None else None

    def _decide_put_locked(
        self, ns: str, key: str, sdig: bytes, digest: bytes, size: int, cond: PutCond
    ) -> tuple[PutOutcome, _Blob | None, PutResult | None]:
        """Decide a PUT of hashed bytes against the key's entry as RAM holds it (lock
        held): (outcome, the entry or None, the answer when the PUT writes nothing -
        counted here - else None). A stale entry decides as an absent one."""
        existing = self._lookup(ns, key)
        live = None if existing is None or (self._tags and self._stale(ns, key)) else existing
        held = live.sdig if live is not None else None
        # (first-write-wins decides only over other bytes: not looked up for the rest)
        fww = held is not None and held != sdig and self._fww(ns)
        outcome = decide_put(held, sdig, cond, fww)
        if outcome is PUT_MISSING or outcome is PUT_DUPLICATE:
            # (a duplicate holds these very bytes: the key's digest and size are these)
            self._count_put(ns, outcome, False)
            return outcome, existing, PutResult(outcome, digest, size)
        if outcome is PUT_CONFLICT:
            assert live is not None  # nothing written
            self._count_put(ns, outcome, False)
            return outcome, existing, PutResult(outcome, live.digest, live.size)
        return outcome, existing, None

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
                    self._lower.blob_destroyed(b)
                    b.seg, b.off = e.seg, e.off
                    self._lower.blob_created(b)
            else:
                recs = self._meta(e.kind).get(e.tenant)
                if recs is not None:
                    recs.pop(e.id, None)

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
            b.owner = {} if self.options.dedup_scope == "global" else tenant
            self._blobs[e.sdig] = b
            if e.data is not None and self._hot_room(e.size):
                b.hot = read_only(e.data)  # counted hot by the footprints below
                self._hot[e.sdig] = b
            Ledger.footprint(b, self._total, +1)
            if isinstance(b.owner, str):
                Ledger.footprint(b, oc, +1)
            self._lower.blob_created(b)
        b.refs += 1
        b.add_keyref((e.ns, e.key))
        if isinstance(b.owner, dict):
            n = b.owner.get(tenant, 0)
            b.owner[tenant] = n + 1
            if n == 0:
                Ledger.footprint(b, oc, +1)
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
                Ledger.footprint(b, oc, -1)
                del b.owner[tenant]
            else:
                b.owner[tenant] = n
        if b.refs == 0:
            if isinstance(b.owner, str):
                Ledger.footprint(b, oc, -1)
            Ledger.footprint(b, self._total, -1)
            del self._blobs[b.sdig]
            if b.hot is not None:
                self._hot.pop(b.sdig, None)
            if b.warm is not None:
                self._warm.pop(b.sdig, None)
            b.hot = b.warm = None
            self._lower.blob_destroyed(b)

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
        self._ledger.account(b, -1)
        b.pins += delta
        self._ledger.account(b, +1)
        if was != (b.pins > 0):
            self._pinned_bytes += b.size if b.pins > 0 else -b.size

    def _evict_blob(self, b: _Blob) -> None:
        """No lower tier: the cache drops the block and every key that references it."""
        self._apply([DelKey(ns, key, evicted=True) for ns, key in b.key_refs()])

    def _drop_bad_warm(self, b: _Blob, warm: bytes) -> None:
        """A warm copy failed verification: count it and forget the copy (lock NOT held)."""
        with self._lock:
            self._ledger.bump(b, "integrity_failures")
            if b.warm is warm:
                self._set_warm(b, None)

    def _quarantine(self, b: _Blob, reason: str, loc: tuple[int, int]) -> None:
        """Drop a blob whose bytes fail verification (lock NOT held); the lower tier
        quarantines it where it keeps it."""
        if self._lower.quarantine(b, reason, loc):
            return
        with self._lock:
            self._ledger.bump(b, "integrity_failures")
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
        if not self._closed:
            data = self._core.get(ns, key)  # a hot hit, a miss: the hit path answers
            if data is not WOULD_BLOCK:
                return data
        self._validate(ns, key)
        self._check_open()
        return self._read(ns, key)

    def get_nowait(self, ns: str, key: str) -> Buffer | WouldBlock | None:
        """`get` when RAM alone answers it (a hot hit, a miss); else `WOULD_BLOCK`.

        Never does I/O or decompression, so an event loop may call it inline; on
        `WOULD_BLOCK` nothing was counted and `get` (on a worker thread) does the read.
        """
        if not self._closed:
            data = self._core.get(ns, key)
            if data is not WOULD_BLOCK:
                return data
        self._validate(ns, key)
        self._check_open()
        return self._read(ns, key, nowait=True)

    def _start_put(
        self, ns: str, key: str, data: BlockData, scope: str | None, cond: PutCond, wait: bool
    ) -> PutResult | concurrent.futures.Future[PutResult]:
        # `check_block_size`, `validate_cond` and `_check_open` behind their tests,
        # written inline: this runs for every PUT
        ns_raw = self._validate(ns, key)
        if len(data) > self.max_block_bytes:
            check_block_size(data, self.max_block_bytes)
        if cond is not None:
            validate_cond(cond)
        if self._closed:
            self._check_open()
        tag = self._tag_for(ns, scope) if scope is not None else None
        return self._seq.put(ns, ns_raw, key, data, tag, cond, wait)

    def _put_into(
        self, ns: str, ns_raw: bytes, key: str, data: BlockData, tag: tuple[str, int] | None
    ) -> PutResult:
        """A blocking PUT into a (possibly internal) namespace, validated."""
        r = self._seq.put(ns, ns_raw, key, data, tag, None, True)
        return r if isinstance(r, PutResult) else r.result()

    def put_nowait(
        self, ns: str, key: str, data: BlockData, *, cond: PutCond = None
    ) -> PutResult | concurrent.futures.Future[PutResult] | WouldBlock:
        """`put` when it is cheap to start from an event loop; else `WOULD_BLOCK`.

        Cheap means: the block is small (`INLINE_MAX_BYTES`, hashed here) and fits in the
        hot tier's free room, or making room is cheap too (`RamTiers.cheap_room`). The
        answer is the `PutResult`, or (group commit) a future resolved once the PUT is on
        stable storage: await it, e.g. with `asyncio.wrap_future`. Errors are raised as
        by `put` (or set on the future).
        """
        if len(data) > INLINE_MAX_BYTES or (
            self._total.hot_bytes + len(data) > self.options.hot_capacity_bytes
            and not self._tiers.cheap_room()
        ):
            return WOULD_BLOCK
        if cond is None and not self._closed:
            r = self._core.put(ns, key, data)  # the bytes the key holds: a duplicate
            if r is not WOULD_BLOCK:
                return r
        if not self._seq.queues:  # applied at once: the whole PUT, as `put` (or an override)
            return self.put(ns, key, data, cond=cond)
        return self._start_put(ns, key, data, None, cond, False)

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
            elif not self._lower.keeps_blocks:
                data, corrupt = None, True
            else:
                # A damaged RAM copy: drop it, count it, and serve the disk copy instead.
                self._drop_bad_warm(b, warm)
                data = None
        verified = False
        if data is None and not corrupt:
            data = self._lower.read(b, loc)  # None: unreadable right now (I/O error), a miss
            if data is None:
                with self._lock:
                    moved = (b.seg, b.off) != loc
                    loc = (b.seg, b.off)
                if moved:  # compaction moved it (and dropped the old segment): read again
                    data = self._lower.read(b, loc)
                if data is None:  # where RAM says holds nothing: perhaps RAM is wrong
                    data = self._lower.recover(b, loc)  # (verified, or None: a miss)
                    verified = data is not None
            if (
                not verified
                and data is not None
                and (len(data) != b.size or digest_of(data) != b.digest)
            ):
                # distrust the location before the bytes: look for them in the log
                data = self._lower.recover(b, loc)
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
                self._ledger.bump(b, "promotions")
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

    def exists_nowait(self, ns: str, keys: Sequence[str]) -> int:
        """How many of `keys` exist (one count per mention): the index is in RAM, so
        always answered at once. `exists_many` summed, without its list (every RESP
        EXISTS runs this inline)."""
        if not self._closed:
            n = self._core.exists(ns, keys)
            if n != DECLINED:
                return n
        for key in keys:
            self._validate(ns, key)
        if self._closed:
            self._check_open()
        with self._lock:
            idx = self._index.get(ns)
            found = 0
            if idx:
                tags = self._tags
                for k in keys:
                    if k in idx and not (tags and self._stale(ns, k)):
                        found += 1
            return found

    def exists_many(self, ns: str, keys: Sequence[str]) -> list[bool]:
        for key in keys:
            self._validate(ns, key)
        self._check_open()
        with self._lock:
            idx = self._index.get(ns) or {}
            if not self._tags:
                return [k in idx for k in keys]
            return [k in idx and not self._stale(ns, k) for k in keys]

    def evict(self, ns: str, key: str) -> bool:
        """Push the block out of RAM. A lower tier that keeps it: the RAM copies go, the
        block reads back from below (a promotion); none: the block and its keys go."""
        self._validate(ns, key)
        self._check_open()
        with self._lock:
            b = self._lookup(ns, key)
            if b is None or b.pins:
                return False
            if not self._lower.keeps_blocks:
                self._evict_blob(b)
                return True
            if b.hot is not None:
                self._set_hot(b, None)
            if b.warm is not None:
                self._set_warm(b, None)
            self._ledger.bump(b, "evictions")
            return True

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

    # -- stats ---------------------------------------------------------------------------
    def _tier_caps(self) -> dict[str, int]:
        o = self.options
        caps = {"hot": o.hot_capacity_bytes, "warm": o.warm_capacity_bytes}
        caps.update(self._lower.caps())
        return caps

    def stats(self, ns: str | None = None) -> StoreStats:
        with self._lock:
            c = self._total if ns is None else self._ns.get(ns, _Counters())
            s = c.stats(self._tier_caps())
            if ns is None:
                s.extra.update(self._extra_stats())
        return s

    def _extra_stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {"namespaces": len({tenant_of(ns) for ns in self._index})}
        out.update(self._lower.extra_stats())
        return out

    # -- decisions shared by both backends -----------------------------------------------
    def _pin_capacity(self) -> int:
        """The bytes pins compete for: RAM, or what the lower tier says (the cold tier)."""
        cap = self._lower.pin_capacity()
        o = self.options
        return o.hot_capacity_bytes + o.warm_capacity_bytes if cap is None else cap

    def _check_pin_quota(self, tenant: str, extra: int) -> None:
        """Refuse a pin/snapshot that would take `tenant` past its share (lock held)."""
        fraction = self.options.max_pinned_fraction
        limit = int(self._pin_capacity() * fraction)
        used = self._counters(tenant).pinned_bytes
        if extra > 0 and used + extra > limit:
            raise QuotaExceededError(
                f"pin quota exceeded: {used + extra} bytes would be pinned by this tenant, "
                f"its limit is {limit} ({fraction:.0%} of {self._pin_capacity()})",
                resource="pins",
            )

    def _check_snapshot_quota(self, tenant: str, pending: int = 0) -> None:
        """Refuse a snapshot past the tenant's count (lock held)."""
        limit = self.options.max_snapshots_per_tenant
        if len(self._snapshots.get(tenant, {})) + pending >= limit:
            raise QuotaExceededError(
                f"snapshot quota exceeded: {limit} snapshots; delete one (or give them a ttl_s)",
                resource="snapshots",
            )

    def _check_key_quota(self, ns: str, pending: int = 0) -> None:
        """Refuse a new key past the tenant's count (lock held; 0 means no limit)."""
        limit = self.options.max_keys_per_tenant
        if limit and len(self._index.get(ns) or ()) + pending >= limit:
            raise QuotaExceededError(
                f"key quota exceeded: this tenant holds {limit} keys (its limit); "
                "delete some first",
                resource="keys",
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
