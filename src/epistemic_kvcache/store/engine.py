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
  (also LRU). When hot is over capacity, `_rebalance` picks a victim among the least
  recently used few, blending recency with value (hits, external importance); pinned
  blocks are never chosen. The victim is compressed *outside* the lock and moved to warm;
  a block that does not compress below the codec's ratio is kept raw (memory backend)
  or just dropped from RAM (durable backend: it is on disk). When warm is over capacity
  its victims leave RAM: dropped (durable) or evicted with all their keys (memory).
- Every read from warm (and from disk, in the durable backend) is verified against the
  digest; a mismatch quarantines the blob, counts `integrity_failures`, and is a miss.
- Stats are exact: every blob's footprint (unique block, resident bytes, per-tier
  occupancy, pinned) is added to each namespace that references it and to the store
  total, and moved with it between tiers, under the one lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import blake3

from epistemic_kvcache.errors import (
    BlockTooLargeError,
    CapacityError,
    ConfigurationError,
    StoreClosedError,
)
from epistemic_kvcache.store.api import (
    Buffer,
    ConsistencyReport,
    PutOutcome,
    PutResult,
    SharedKvBackend,
    StoreStats,
    TierStats,
    validate_key,
    validate_namespace,
)
from epistemic_kvcache.store.codec import WarmCodec

DedupScope = Literal["namespace", "global"]

DIGEST_BYTES = 32
# Above this size BLAKE3 hashes with several threads (and releases the GIL).
_PARALLEL_HASH_BYTES = 1 << 20
# How many least-recently-used entries compete when a tier picks a victim.
_VICTIM_WINDOW = 8


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
        # (ns, key) when one key references the blob, a list of them when several
        self.keys: tuple[str, str] | list[tuple[str, str]] | None = None
        self.busy = False

    @property
    def digest(self) -> bytes:
        return self.sdig[-DIGEST_BYTES:]

    def key_refs(self) -> list[tuple[str, str]]:
        k = self.keys
        if k is None:
            return []
        return [k] if isinstance(k, tuple) else list(k)

    def add_keyref(self, ref: tuple[str, str]) -> None:
        k = self.keys
        if k is None:
            self.keys = ref
        elif isinstance(k, tuple):
            self.keys = [k, ref]
        else:
            k.append(ref)

    def remove_keyref(self, ref: tuple[str, str]) -> None:
        k = self.keys
        if isinstance(k, tuple):
            if k == ref:
                self.keys = None
        elif k is not None:
            k.remove(ref)
            if len(k) == 1:
                self.keys = k[0]

    def owners(self) -> Iterable[str]:
        o = self.owner
        return (o,) if isinstance(o, str) else tuple(o)


@dataclass(slots=True)
class _Counters:
    """Per-namespace counters and gauges (gauges are kept exact under the lock)."""

    cold_blocks: int = 0
    cold_bytes: int = 0
    dedup_hits: int = 0
    demotions: int = 0
    evictions: int = 0
    get_hits: int = 0
    get_misses: int = 0
    hot_blocks: int = 0
    hot_bytes: int = 0
    integrity_failures: int = 0
    logical_bytes: int = 0
    pinned_blocks: int = 0
    promotions: int = 0
    put_conflicts: int = 0
    put_new: int = 0
    resident_bytes: int = 0
    stale_missed: int = 0
    total_refs: int = 0
    unique_blocks: int = 0
    warm_blocks: int = 0
    warm_bytes: int = 0
    warm_logical: int = 0


@dataclass(frozen=True, slots=True)
class AddKey:
    """Effect: `key` now references the blob `sdig` (creating it when `data` is given)."""

    ns: str
    key: str
    sdig: bytes
    size: int
    data: Buffer | None = None  # the block's bytes when the blob is new
    seg: int = -1
    off: int = 0


@dataclass(frozen=True, slots=True)
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


Effect = AddKey | DelKey | PinDelta


class TieredEngine(SharedKvBackend):
    """RAM tiers, index, refcounts and stats; subclasses add (or omit) the disk."""

    def __init__(
        self,
        *,
        hot_capacity_bytes: int,
        warm_capacity_bytes: int,
        max_block_bytes: int,
        dedup_scope: DedupScope,
        codec: WarmCodec | None,
    ) -> None:
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
        self._codec = codec if codec is not None else WarmCodec()
        self._lock = threading.Lock()
        self._closed = False
        self._index: dict[str, dict[str, _Blob]] = {}
        self._blobs: dict[bytes, _Blob] = {}  # insertion order = least recently used first
        self._hot: OrderedDict[bytes, _Blob] = OrderedDict()
        self._warm: OrderedDict[bytes, _Blob] = OrderedDict()
        self._pins: dict[tuple[str, str], int] = {}
        self._ns: dict[str, _Counters] = {}
        self._total = _Counters()
        self._hot_leaving = 0  # bytes of hot blobs being demoted right now

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
        return validate_namespace(ns)

    def _check_size(self, data: Buffer) -> None:
        if len(data) > self.max_block_bytes:
            raise BlockTooLargeError(
                f"block of {len(data)} bytes exceeds max_block_bytes={self.max_block_bytes}"
            )

    def _lookup(self, ns: str, key: str) -> _Blob | None:
        idx = self._index.get(ns)
        return idx.get(key) if idx is not None else None

    def _footprint(self, b: _Blob, c: _Counters, sign: int) -> None:
        c.unique_blocks += sign
        c.resident_bytes += sign * b.size
        if b.hot is not None:
            c.hot_blocks += sign
            c.hot_bytes += sign * b.size
        if b.warm is not None:
            c.warm_blocks += sign
            c.warm_bytes += sign * len(b.warm)
            c.warm_logical += sign * b.size
        if b.seg >= 0:
            c.cold_blocks += sign
            c.cold_bytes += sign * b.size
        if b.pins:
            c.pinned_blocks += sign

    def _account(self, b: _Blob, sign: int) -> None:
        """Add (+1) or remove (-1) the blob's footprint from its owners and the total."""
        self._footprint(b, self._total, sign)
        for ns in b.owners():
            self._footprint(b, self._counters(ns), sign)

    def _set_hot(self, b: _Blob, data: Buffer | None) -> None:
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
            else:
                self._apply_pin(e)

    def _apply_add(self, e: AddKey) -> None:
        b = self._blobs.get(e.sdig)
        c = self._counters(e.ns)
        if b is None:
            b = _Blob(e.sdig, e.size)
            b.seg, b.off = e.seg, e.off
            b.owner = {} if self.dedup_scope == "global" else e.ns
            self._blobs[e.sdig] = b
            self._footprint(b, self._total, +1)
            if isinstance(b.owner, str):
                self._footprint(b, c, +1)
            if e.data is not None and e.size <= self.hot_capacity_bytes:
                self._set_hot(b, e.data)
            self._on_blob_created(b)
        b.refs += 1
        b.add_keyref((e.ns, e.key))
        if isinstance(b.owner, dict):
            n = b.owner.get(e.ns, 0)
            b.owner[e.ns] = n + 1
            if n == 0:
                self._footprint(b, c, +1)
        self._index.setdefault(e.ns, {})[e.key] = b
        c.total_refs += 1
        c.logical_bytes += b.size
        self._total.total_refs += 1
        self._total.logical_bytes += b.size

    def _apply_del(self, e: DelKey) -> None:
        idx = self._index.get(e.ns)
        b = idx.pop(e.key, None) if idx is not None else None
        if b is None:
            return
        c = self._counters(e.ns)
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
            n = b.owner[e.ns] - 1
            if n == 0:
                self._footprint(b, c, -1)
                del b.owner[e.ns]
            else:
                b.owner[e.ns] = n
        if b.refs == 0:
            if isinstance(b.owner, str):
                self._footprint(b, c, -1)
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
        self._account(b, -1)
        b.pins += delta
        self._account(b, +1)

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
            s = self._score(b, rank)
            if best is None or s < best_score:
                best, best_score = b, s
            rank += 1
            if rank >= _VICTIM_WINDOW:
                break
        return best

    def _rebalance(self) -> None:
        """Demote hot -> warm (-> out of RAM) until both tiers fit their capacity."""
        while True:
            with self._lock:
                over = self._total.hot_bytes - self._hot_leaving - self.hot_capacity_bytes
                victim = self._pick_victim(self._hot) if over > 0 else None
                if victim is None:
                    break
                victim.busy = True
                self._hot_leaving += victim.size
                data = victim.hot
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
        """Move `b` out of hot, into warm when `warm_copy` is given (lock held)."""
        if warm_copy is not None:
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
    def _read_lower(self, b: _Blob) -> Buffer | None:
        """Read a block that is in neither RAM tier (durable backend). None = unreadable."""
        return None

    def _quarantine(self, b: _Blob, reason: str) -> None:
        """Drop a blob whose bytes fail verification (lock NOT held)."""
        with self._lock:
            self._total.integrity_failures += 1
            for ns in b.owners():
                self._counters(ns).integrity_failures += 1
            if self._blobs.get(b.sdig) is b:
                self._apply([DelKey(ns, key) for ns, key in b.key_refs()])

    def get(self, ns: str, key: str) -> Buffer | None:
        self._validate(ns, key)
        self._check_open()
        with self._lock:
            c = self._counters(ns)
            b = self._lookup(ns, key)
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
        data: Buffer | None
        corrupt = False
        if warm is not None:
            try:
                data = warm if len(warm) == b.size else self._codec.decompress(warm)
            except ValueError:
                data, corrupt = None, True
        else:
            data = self._read_lower(b)  # None: unreadable right now (I/O error), a miss
        if data is not None and (len(data) != b.size or digest_of(data) != b.digest):
            data, corrupt = None, True
        if data is None:
            if corrupt:
                self._quarantine(b, "digest mismatch")
            with self._lock:
                c.get_misses += 1
                self._total.get_misses += 1
            return None
        with self._lock:
            c.get_hits += 1
            self._total.get_hits += 1
            if self._blobs.get(b.sdig) is b and b.hot is None and b.size <= self.hot_capacity_bytes:
                if b.warm is not None:
                    self._set_warm(b, None)
                self._set_hot(b, data)
                self._total.promotions += 1
                for o in b.owners():
                    self._counters(o).promotions += 1
        self._rebalance()
        return data

    def size(self, ns: str, key: str) -> int | None:
        self._validate(ns, key)
        self._check_open()
        with self._lock:
            b = self._lookup(ns, key)
            return b.size if b is not None else None

    def exists(self, ns: str, key: str) -> bool:
        self._validate(ns, key)
        self._check_open()
        with self._lock:
            return self._lookup(ns, key) is not None

    def exists_many(self, ns: str, keys: Sequence[str]) -> list[bool]:
        for key in keys:
            self._validate(ns, key)
        self._check_open()
        with self._lock:
            idx = self._index.get(ns) or {}
            return [k in idx for k in keys]

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
            names = sorted(self._index.get(ns) or ())
        if after is not None:
            import bisect

            names = names[bisect.bisect_right(names, after) :]
        return names[:limit]

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
            s.tiers["hot"] = TierStats(c.hot_blocks, c.hot_bytes, caps["hot"], c.hot_bytes)
            s.tiers["warm"] = TierStats(c.warm_blocks, c.warm_bytes, caps["warm"], c.warm_logical)
            if "cold" in caps:
                s.tiers["cold"] = TierStats(c.cold_blocks, c.cold_bytes, caps["cold"], c.cold_bytes)
            if ns is None:
                s.extra.update(self._extra_stats())
        return s

    def _extra_stats(self) -> dict[str, int | float]:
        return {"namespaces": len(self._index)}

    # -- decisions shared by both backends -----------------------------------------------
    def _count_put(self, ns: str, outcome: PutOutcome, deduped: bool) -> None:
        c = self._counters(ns)
        for cc in (c, self._total):
            if outcome is PutOutcome.NEW:
                cc.put_new += 1
                if deduped:
                    cc.dedup_hits += 1
            elif outcome is PutOutcome.DUPLICATE:
                cc.dedup_hits += 1
            else:
                cc.put_conflicts += 1

    def _check_ram_room(self, size: int) -> None:
        """Memory backend: refuse a block that cannot fit beside the pinned ones."""
        budget = self.hot_capacity_bytes + self.warm_capacity_bytes
        if size > budget:
            raise CapacityError(
                f"block of {size} bytes is larger than the RAM tiers ({budget} bytes)"
            )
        pinned = sum(b.size for b in self._blobs.values() if b.pins)
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


class SharedKvIndex(TieredEngine):
    """In-process, RAM-only backend (`--backend memory`): hot + warm tiers, no disk.

    Eviction from warm drops blocks (it is a cache). Thread-safe.
    """

    def __init__(
        self,
        *,
        hot_capacity_bytes: int = 1 << 30,
        warm_capacity_bytes: int = 1 << 30,
        max_block_bytes: int = 128 << 20,
        dedup_scope: DedupScope = "namespace",
        codec: WarmCodec | None = None,
    ) -> None:
        super().__init__(
            hot_capacity_bytes=hot_capacity_bytes,
            warm_capacity_bytes=warm_capacity_bytes,
            max_block_bytes=max_block_bytes,
            dedup_scope=dedup_scope,
            codec=codec,
        )

    def put(self, ns: str, key: str, data: Buffer) -> PutResult:
        ns_raw = self._validate(ns, key)
        self._check_size(data)
        self._check_open()
        if isinstance(data, memoryview):
            data = bytes(data)  # the caller may reuse its buffer; bytes/bytearray are kept
        digest = digest_of(data)
        sdig = self._scoped(ns_raw, digest)
        with self._lock:
            result = self._put_locked(ns, key, sdig, digest, data)
        if result.outcome is PutOutcome.NEW:
            self._rebalance()
        return result

    def _put_locked(self, ns: str, key: str, sdig: bytes, digest: bytes, data: Buffer) -> PutResult:
        size = len(data)
        existing = self._lookup(ns, key)
        if existing is not None:
            outcome = PutOutcome.DUPLICATE if existing.sdig == sdig else PutOutcome.CONFLICT
            self._count_put(ns, outcome, False)
            return PutResult(outcome, existing.digest, existing.size)
        shared = sdig in self._blobs
        if not shared:
            self._check_ram_room(size)
        self._apply([AddKey(ns, key, sdig, size, None if shared else data)])
        b = self._blobs[sdig]
        if b.hot is None and b.warm is None:
            # larger than the hot tier: straight to warm (compressed when worth it)
            comp = self._codec.compress(data) or bytes(data)
            self._set_warm(b, comp)
        self._count_put(ns, PutOutcome.NEW, shared)
        return PutResult(PutOutcome.NEW, digest, size)

    def put_many(self, ns: str, items: Sequence[tuple[str, Buffer]]) -> list[PutResult]:
        return [self.put(ns, key, data) for key, data in items]

    def delete(self, ns: str, key: str) -> bool:
        self._validate(ns, key)
        self._check_open()
        with self._lock:
            if self._lookup(ns, key) is None:
                return False
            self._apply([DelKey(ns, key)])
            return True

    def pin(self, ns: str, key: str) -> bool:
        self._validate(ns, key)
        self._check_open()
        with self._lock:
            if self._lookup(ns, key) is None:
                return False
            self._apply([PinDelta(ns, key, +1)])
            return True

    def unpin(self, ns: str, key: str) -> bool:
        self._validate(ns, key)
        self._check_open()
        with self._lock:
            if self._pins.get((ns, key), 0) <= 0:
                return False
            self._apply([PinDelta(ns, key, -1)])
            return True

    def evict(self, ns: str, key: str) -> bool:
        self._validate(ns, key)
        self._check_open()
        with self._lock:
            b = self._lookup(ns, key)
            if b is None or b.pins:
                return False
            self._evict_blob(b)
            return True

    def check(self, *, deep: bool = False) -> ConsistencyReport:
        report = ConsistencyReport()
        with self._lock:
            self._base_check(report)
            blobs = list(self._blobs.values()) if deep else []
        for b in blobs:
            data: Buffer | None = b.hot
            if data is None and b.warm is not None:
                try:
                    data = b.warm if len(b.warm) == b.size else self._codec.decompress(b.warm)
                except ValueError:
                    data = None
            if data is None or digest_of(data) != b.digest:
                report.corrupt_blobs.append(b.digest.hex())
        return report

    def close(self) -> None:
        with self._lock:
            self._closed = True
