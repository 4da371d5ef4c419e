"""The tier engine: the store interface over the RAM state and its composed parts.

How it works
------------
- `TieredEngine` is a facade. The RAM state (index, blobs, refcounts, counters, tags,
  records, the in-flight table, the RAM tiers and the lock) has one owner, `RamState`
  (ram.py), whose public API the engine and every other part call. Snapshots, branches
  and epochs are a collaborator, `Catalog` (catalog.py).
- What differs between backends is wired once by the backend's constructor
  (`_compose`), each behind a small protocol in seams.py: the lower tier (what lies below
  RAM: nothing, or the durable backend's log), the sequencer (how a write reaches RAM:
  applied at once, or group-committed first) and the epoch source.
- A GET asks the hot core (hotcore.py, compiled twin) first: a hot hit or a miss is
  answered there in one call; anything else is `RamState.read`.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Iterator, Sequence
from typing import overload

from epistemic_kvcache.errors import StoreClosedError
from epistemic_kvcache.options import DedupScope, StoreOptions
from epistemic_kvcache.shared import MAX_SCOPE_BYTES
from epistemic_kvcache.store.api import (
    BlockData,
    BranchInfo,
    Buffer,
    PutCond,
    PutResult,
    SharedKvBackend,
    SnapshotInfo,
    StoreStats,
    check_block_size,
    read_only,
    validate_cond,
    validate_namespace,
)
from epistemic_kvcache.store.catalog import Catalog
from epistemic_kvcache.store.codec import WarmCodec
from epistemic_kvcache.store.core import DECLINED
from epistemic_kvcache.store.model import (
    DIGEST_BYTES,
    INLINE_MAX_BYTES,
    WOULD_BLOCK,
    AddKey,
    DelKey,
    Effect,
    MetaDel,
    MetaPut,
    Move,
    PinDelta,
    WouldBlock,
    _Blob,
    branch_ns,
    digest_of,
    parse_internal_ns,
    snapshot_ns,
    tenant_of,
    validate_scope,
)
from epistemic_kvcache.store.ram import RamState
from epistemic_kvcache.store.seams import EpochSource, LowerTier, Sequencer

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


class TieredEngine(SharedKvBackend):
    """The store interface over `RamState`, a lower tier and a sequencer.

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
        self.options = options
        """Tiers and quotas, read where they apply. The per-tenant quotas keep one tenant
        from pinning (or snapshotting) the store full and leaving every other tenant's
        PUTs without room."""
        self.max_block_bytes = options.max_block_bytes  # the store seam's attribute
        self.ram = RamState(options, codec=codec if codec is not None else WarmCodec(), clock=clock)
        """The RAM state and its one owner (ram.py)."""
        self.catalog = Catalog(self.ram, self)
        """Snapshots, branches and epochs (catalog.py)."""
        self._closed = False
        self._core = self.ram.core
        self._total = self.ram.total  # (the store's counters: one object for its life)

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
        self.ram.compose(lower=lower, epochs=epochs)

    # -- what the catalog and the sequencers use (catalog.CatalogHost) ------------------
    @property
    def sequencer(self) -> Sequencer:
        return self._seq

    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the store is closed")

    def put_into(
        self, ns: str, ns_raw: bytes, key: str, data: BlockData, tag: tuple[str, int] | None
    ) -> PutResult:
        """A blocking PUT into a (possibly internal) namespace, validated."""
        r = self._seq.put(ns, ns_raw, key, data, tag, None, True)
        return r if isinstance(r, PutResult) else r.result()

    # -- reads ---------------------------------------------------------------------------
    def get(self, ns: str, key: str) -> Buffer | None:
        if not self._closed:
            data = self._core.get(ns, key)  # a hot hit, a miss: the hit path answers
            if data is not WOULD_BLOCK:
                return data
        self.ram.validate(ns, key)
        self.check_open()
        return self.read(ns, key)

    def get_nowait(self, ns: str, key: str) -> Buffer | WouldBlock | None:
        """`get` when RAM alone answers it (a hot hit, a miss); else `WOULD_BLOCK`.

        Never does I/O or decompression, so an event loop may call it inline; on
        `WOULD_BLOCK` nothing was counted and `get` (on a worker thread) does the read.
        """
        if not self._closed:
            data = self._core.get(ns, key)
            if data is not WOULD_BLOCK:
                return data
        self.ram.validate(ns, key)
        self.check_open()
        return self.read(ns, key, nowait=True)

    @overload
    def read(self, ns: str, key: str) -> Buffer | None: ...
    @overload
    def read(self, ns: str, key: str, *, nowait: bool) -> Buffer | WouldBlock | None: ...

    def read(self, ns: str, key: str, *, nowait: bool = False) -> Buffer | WouldBlock | None:
        """GET on a (possibly internal) namespace, validated; counts on that namespace.

        With `nowait`, a block that is not in the hot tier is `WOULD_BLOCK` (decided in
        the same critical section as the lookup, so the caller never does I/O).
        """
        ram = self.ram
        with ram.lock:
            c = ram.counters(ns)
            b = ram.lookup_locked(ns, key)
            stale = b is not None and ram.stale_locked(ns, key)
            if nowait and b is not None and b.hot is None and not stale:
                return WOULD_BLOCK
            if b is None or stale:
                if stale:
                    c.stale_missed += 1
                    ram.total.stale_missed += 1
                c.get_misses += 1
                ram.total.get_misses += 1
                return None
            b.hits += 1
            ram.used_locked(b)
            if b.hot is not None:
                c.get_hits += 1
                ram.total.get_hits += 1
                return b.hot
            warm = b.warm
            loc = (b.seg, b.off)  # read together: compaction may move the block
        data = self._read_below(b, warm, loc)
        with ram.lock:
            if data is None:
                c.get_misses += 1
                ram.total.get_misses += 1
                return None
        data = read_only(data)  # handed out, and maybe kept in hot: nobody writes it
        tiers = ram.tiers
        tiers.make_hot_room((b.size,))
        with ram.lock:
            c.get_hits += 1
            ram.total.get_hits += 1
            if ram.blob(b.sdig) is b and b.hot is None and tiers.hot_room(b.size):
                if b.warm is not None:
                    tiers.set_warm(b, None)
                tiers.set_hot(b, data)
                ram.bump(b, "promotions")
        return data

    def _read_below(self, b: _Blob, warm: bytes | None, loc: tuple[int, int]) -> Buffer | None:
        """A block hot does not hold: from warm (verified), else from the lower tier
        (verified, recovered or quarantined); None: a miss (lock NOT held)."""
        ram = self.ram
        lower = ram.lower
        data: Buffer | None = None
        corrupt = False
        if warm is not None:
            try:
                data = warm if len(warm) == b.size else ram.codec.decompress(warm)
            except ValueError:
                data = None
            if data is not None and len(data) == b.size and digest_of(data) == b.digest:
                return data  # verified
            if not lower.keeps_blocks:
                data, corrupt = None, True
            else:
                # A damaged RAM copy: drop it, count it, and serve the disk copy instead.
                with ram.lock:
                    ram.bump(b, "integrity_failures")
                    if b.warm is warm:
                        ram.tiers.set_warm(b, None)
                data = None
        verified = False
        if data is None and not corrupt:
            data = lower.read(b, loc)  # None: unreadable right now (I/O error), a miss
            if data is None:
                with ram.lock:
                    moved = (b.seg, b.off) != loc
                    loc = (b.seg, b.off)
                if moved:  # compaction moved it (and dropped the old segment): read again
                    data = lower.read(b, loc)
                if data is None:  # where RAM says holds nothing: perhaps RAM is wrong
                    data = lower.recover(b, loc)  # (verified, or None: a miss)
                    verified = data is not None
            if (
                not verified
                and data is not None
                and (len(data) != b.size or digest_of(data) != b.digest)
            ):
                # distrust the location before the bytes: look for them in the log
                data = lower.recover(b, loc)
                corrupt = data is None
        if data is None and corrupt:
            self._quarantine(b, "digest mismatch", loc)
        return data

    def _quarantine(self, b: _Blob, reason: str, loc: tuple[int, int]) -> None:
        """Drop a blob whose bytes fail verification (lock NOT held); the lower tier
        quarantines it where it keeps it."""
        ram = self.ram
        if ram.lower.quarantine(b, reason, loc):
            return
        with ram.lock:
            ram.bump(b, "integrity_failures")
            if ram.blob(b.sdig) is b:
                ram.apply_locked([DelKey(ns, key) for ns, key in b.key_refs()])

    def size(self, ns: str, key: str) -> int | None:
        self.ram.validate(ns, key)
        self.check_open()
        with self.ram.lock:
            b = self.ram.live_locked(ns, key)
            return b.size if b is not None else None

    def exists(self, ns: str, key: str) -> bool:
        self.ram.validate(ns, key)
        self.check_open()
        with self.ram.lock:
            return self.ram.live_locked(ns, key) is not None

    def key_hits(self, ns: str, key: str) -> int | None:
        self.ram.validate(ns, key)
        self.check_open()
        with self.ram.lock:
            b = self.ram.live_locked(ns, key)
            return b.hits if b is not None else None

    def exists_nowait(self, ns: str, keys: Sequence[str]) -> int:
        """How many of `keys` exist (one count per mention): the index is in RAM, so
        always answered at once (every RESP EXISTS runs this inline)."""
        if not self._closed:
            n = self._core.exists(ns, keys)
            if n != DECLINED:
                return n
        for key in keys:
            self.ram.validate(ns, key)
        self.check_open()
        with self.ram.lock:
            return self.ram.exists_count_locked(ns, keys)

    def exists_many(self, ns: str, keys: Sequence[str]) -> list[bool]:
        for key in keys:
            self.ram.validate(ns, key)
        self.check_open()
        with self.ram.lock:
            return self.ram.exists_many_locked(ns, keys)

    def keys(self, ns: str, *, after: str | None = None, limit: int = 1000) -> list[str]:
        validate_namespace(ns)
        return self.ram.keys(ns, after=after, limit=limit)

    def count(self, ns: str) -> int:
        with self.ram.lock:
            return self.ram.ns_len_locked(ns)

    def iter_refs(self) -> Iterator[tuple[str, str, bytes]]:
        """Snapshot of every (ns, key, digest) in the store (for checks and tools)."""
        return self.ram.iter_refs()

    def stats(self, ns: str | None = None) -> StoreStats:
        return self.ram.stats(ns)

    # -- writes ----------------------------------------------------------------------------
    def _start_put(
        self, ns: str, key: str, data: BlockData, scope: str | None, cond: PutCond, wait: bool
    ) -> PutResult | concurrent.futures.Future[PutResult]:
        # `check_block_size`, `validate_cond` and `check_open` behind their tests,
        # written inline: this runs for every PUT
        ns_raw = self.ram.validate(ns, key)
        if len(data) > self.max_block_bytes:
            check_block_size(data, self.max_block_bytes)
        if cond is not None:
            validate_cond(cond)
        if self._closed:
            self.check_open()
        tag = self.catalog.tag_for(ns, scope) if scope is not None else None
        return self._seq.put(ns, ns_raw, key, data, tag, cond, wait)

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
            and not self.ram.tiers.cheap_room()
        ):
            return WOULD_BLOCK
        if cond is None and not self._closed:
            r = self._core.put(ns, key, data)  # the bytes the key holds: a duplicate
            if r is not WOULD_BLOCK:
                return r
        if not self._seq.queues:  # applied at once: the whole PUT, as `put` (or an override)
            return self.put(ns, key, data, cond=cond)
        return self._start_put(ns, key, data, None, cond, False)

    def evict(self, ns: str, key: str) -> bool:
        """Push the block out of RAM. A lower tier that keeps it: the RAM copies go, the
        block reads back from below (a promotion); none: the block and its keys go."""
        ram = self.ram
        ram.validate(ns, key)
        self.check_open()
        with ram.lock:
            b = ram.lookup_locked(ns, key)
            if b is None or b.pins:
                return False
            if not ram.lower.keeps_blocks:
                ram.evict_blob_locked(b)
                return True
            if b.hot is not None:
                ram.tiers.set_hot(b, None)
            if b.warm is not None:
                ram.tiers.set_warm(b, None)
            ram.bump(b, "evictions")
            return True

    def promote(self, ns: str, key: str) -> bool:
        ram = self.ram
        ram.validate(ns, key)
        with ram.lock:
            b = ram.lookup_locked(ns, key)
            if b is None:
                return False
            if b.hot is not None:
                ram.tiers.hot.move_to_end(b.sdig)
                return True
        return self.get(ns, key) is not None

    def set_importance(self, ns: str, key: str, score: float) -> bool:
        self.ram.validate(ns, key)
        if not 0.0 <= score <= 1.0:
            raise ValueError(f"importance must be in [0, 1] (got {score!r})")
        with self.ram.lock:
            b = self.ram.lookup_locked(ns, key)
            if b is None:
                return False
            b.importance = score
            return True

    # -- snapshots, branches, epochs (the catalog) ---------------------------------------
    def _snapshot_create(
        self, ns: str, keys: Sequence[str] | None, prefix: str | None, ttl_s: float | None
    ) -> SnapshotInfo:
        return self.catalog.snapshot_create(ns, keys, prefix, ttl_s)

    def snapshot_info(self, ns: str, snapshot_id: str) -> SnapshotInfo | None:
        return self.catalog.snapshot_info(ns, snapshot_id)

    def snapshot_list(self, ns: str) -> list[SnapshotInfo]:
        return self.catalog.snapshot_list(ns)

    def snapshot_delete(self, ns: str, snapshot_id: str) -> bool:
        return self.catalog.snapshot_delete(ns, snapshot_id)

    def snapshot_get(self, ns: str, snapshot_id: str, key: str) -> Buffer | None:
        return self.catalog.snapshot_get(ns, snapshot_id, key)

    def branch_create(self, ns: str, snapshot_id: str) -> BranchInfo:
        return self.catalog.branch_create(ns, snapshot_id)

    def branch_info(self, ns: str, branch_id: str) -> BranchInfo | None:
        return self.catalog.branch_info(ns, branch_id)

    def branch_list(self, ns: str) -> list[BranchInfo]:
        return self.catalog.branch_list(ns)

    def branch_delete(self, ns: str, branch_id: str) -> bool:
        return self.catalog.branch_delete(ns, branch_id)

    def branch_get(self, ns: str, branch_id: str, key: str) -> Buffer | None:
        return self.catalog.branch_get(ns, branch_id, key)

    def branch_size(self, ns: str, branch_id: str, key: str) -> int | None:
        return self.catalog.branch_size(ns, branch_id, key)

    def _branch_put(self, ns: str, branch_id: str, key: str, data: BlockData) -> PutResult:
        return self.catalog.branch_put(ns, branch_id, key, data)

    def epoch_get(self, ns: str, scope: str) -> int:
        return self.catalog.epoch_get(ns, scope)

    def epoch_bump(self, ns: str, scope: str) -> int:
        return self.catalog.epoch_bump(ns, scope)

    def retire_stale(self, *, max_items: int = 1000, budget_s: float = 0.05) -> int:
        return self.catalog.retire_stale(max_items=max_items, budget_s=budget_s)
