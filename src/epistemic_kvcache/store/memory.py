"""The memory backend (`--backend memory`): the tier engine with no disk, applying now.

How it works
------------
`SharedKvIndex` is `TieredEngine` composed with `NoLowerTier` (a block that leaves RAM
leaves the store: eviction from warm drops blocks and their keys) and `ApplyNow`, the
sequencer that decides a write and applies its effects under the RAM lock in one step,
in the caller's thread (there is nothing to make durable first). Both go through
`RamState`'s public API (ram.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from epistemic_kvcache.errors import CapacityError, NotFoundError
from epistemic_kvcache.options import DEFAULT_STORE_OPTIONS, StoreOptions
from epistemic_kvcache.store.api import (
    BlockData,
    Buffer,
    ConsistencyReport,
    PutCond,
    PutResult,
    owned_buffer,
    validate_namespace,
)
from epistemic_kvcache.store.catalog import Catalog
from epistemic_kvcache.store.codec import WarmCodec
from epistemic_kvcache.store.engine import (
    AddKey,
    DelKey,
    Effect,
    MetaPut,
    PinDelta,
    TieredEngine,
    digest_of,
    parse_internal_ns,
)
from epistemic_kvcache.store.ram import RamState
from epistemic_kvcache.store.seams import Tag


class ApplyNow:
    """`Sequencer` that decides and applies under the RAM lock, in the caller's thread."""

    queues = False

    def __init__(self, ram: RamState, catalog: Catalog) -> None:
        self._ram = ram
        self._catalog = catalog

    def put(
        self, ns: str, raw: bytes, key: str, data: BlockData, tag: Tag, cond: PutCond, wait: bool
    ) -> PutResult:
        ram = self._ram
        data = owned_buffer(data)  # the hot tier keeps it
        digest = digest_of(data)
        sdig = ram.scoped(raw, digest)
        if not ram.has_blob(sdig):  # unlocked look: new bytes will need room in hot
            ram.tiers.make_hot_room((len(data),))
        with ram.lock:
            return self.put_locked(ns, key, sdig, digest, data, tag, cond)

    def put_locked(
        self,
        ns: str,
        key: str,
        sdig: bytes,
        digest: bytes,
        data: Buffer,
        tag: tuple[str, int] | None = None,
        cond: PutCond = None,
    ) -> PutResult:
        """Decide and apply a PUT of hashed bytes (RAM lock held)."""
        ram = self._ram
        size = len(data)
        internal = parse_internal_ns(ns)
        if internal is not None and ram.meta(internal[1], internal[0], internal[2]) is None:
            # the branch was deleted while this PUT was being hashed
            raise NotFoundError(f"no {internal[1]} {internal[2]!r}")
        outcome, existing, answer = ram.decide_put_locked(ns, key, sdig, digest, size, cond)
        if answer is not None:
            return answer
        if existing is None and internal is None:
            ram.check_key_quota_locked(ns)
        shared_blob = ram.blob(sdig)
        shared = shared_blob is not None
        # the same bytes over a stale entry that is their only reference: the blob goes
        # with the entry, and this PUT brings its bytes back
        reborn = shared and existing is not None and existing.sdig == sdig and existing.refs == 1
        warm_copy: bytes | None = None
        tiers = ram.tiers
        if not shared or reborn:
            self._check_ram_room(size)
            if not tiers.hot_room(size):
                # larger than the hot tier, or hot is full of blocks that cannot leave it
                # now (pinned, being demoted): straight to warm, compressed when worth it
                warm_copy = ram.codec.compress(data) or bytes(data)
                if not tiers.warm_room(len(warm_copy)):
                    o = ram.options
                    raise CapacityError(
                        f"no room for a {size}-byte block: the hot tier "
                        f"({o.hot_capacity_bytes} bytes) and the warm tier "
                        f"({o.warm_capacity_bytes} bytes) are full of pinned blocks "
                        "or too small for it"
                    )
        effects: list[Effect] = []
        pins = 0
        if existing is not None:  # replaced, or stale (a stale entry is replaced, not kept)
            pins = ram.pins_locked(ns, key)
            effects.append(DelKey(ns, key))
        hot_data = None if (shared and not reborn) or warm_copy is not None else data
        effects.append(AddKey(ns, key, sdig, size, hot_data, tag=tag))
        if pins:
            effects.append(PinDelta(ns, key, pins))  # pins belong to the key: they stay
        ram.apply_locked(effects)
        if warm_copy is not None:
            stored = ram.blob(sdig)
            assert stored is not None  # just added
            tiers.set_warm(stored, warm_copy)
        ram.count_put(ns, outcome, shared)
        return PutResult(outcome, digest, size)

    def _check_ram_room(self, size: int) -> None:
        """Refuse a block that cannot fit beside the pinned ones (lock held)."""
        ram = self._ram
        budget = ram.options.hot_capacity_bytes + ram.options.warm_capacity_bytes
        if size > budget:
            raise CapacityError(
                f"block of {size} bytes is larger than the RAM tiers ({budget} bytes)"
            )
        pinned = ram.pinned_bytes
        if pinned + size > budget:
            raise CapacityError(
                f"no room for a {size}-byte block: {pinned} of {budget} bytes are pinned"
            )

    def snapshot(
        self, tenant: str, sid: str, keys: list[str] | None, prefix: str | None, rec: dict[str, Any]
    ) -> None:
        ram = self._ram
        with ram.lock:
            ram.check_snapshot_quota_locked(tenant)
            effects = self._catalog.snapshot_effects_locked(tenant, sid, keys, prefix)
            newly: dict[bytes, int] = {}
            for x in effects:
                if isinstance(x, AddKey):
                    b = ram.blob(x.sdig)
                    if b is not None and not b.pins:
                        newly[x.sdig] = x.size
            ram.check_pin_quota_locked(tenant, sum(newly.values()))
            effects.append(MetaPut("snap", tenant, sid, rec))
            ram.apply_locked(effects)

    def drop(self, tenant: str, items: list[tuple[str, str]]) -> None:
        with self._ram.lock:
            self._ram.apply_locked(self._catalog.drop_effects_locked(tenant, items))
            self._catalog.forget_locked(tenant, items)

    def commit_meta(self, effect: MetaPut) -> None:
        self._ram.apply([effect])

    def retire(self, pairs: list[tuple[str, str]]) -> int:
        ram = self._ram
        n = 0
        with ram.lock:
            for ns, key in pairs:
                if ram.lookup_locked(ns, key) is not None and ram.stale_locked(ns, key):
                    ram.apply_locked([DelKey(ns, key)])
                    n += 1
        return n


class SharedKvIndex(TieredEngine):
    """In-process, RAM-only backend (`--backend memory`): hot + warm tiers, no disk.

    Eviction from warm drops blocks (it is a cache). Thread-safe.
    """

    durable = False

    def __init__(
        self,
        options: StoreOptions = DEFAULT_STORE_OPTIONS,
        *,
        codec: WarmCodec | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(options, codec=codec, clock=clock)
        self._now = ApplyNow(self.ram, self.catalog)
        self._compose(sequencer=self._now)
        self.put_locked = self._now.put_locked
        """Decide and apply a PUT of hashed bytes with the RAM lock held (the cluster
        backend's RAM cache fills itself through it)."""

    def put_many(
        self, ns: str, items: Sequence[tuple[str, BlockData]], *, cond: PutCond = None
    ) -> list[PutResult]:
        return [self.put(ns, key, data, cond=cond) for key, data in items]

    def flush(self, ns: str) -> int:
        validate_namespace(ns)
        self.check_open()
        ram = self.ram
        with ram.lock:
            keys = ram.ns_keys_locked(ns)
            ram.apply_locked([DelKey(ns, key) for key in keys])
            return len(keys)

    def delete(self, ns: str, key: str) -> bool:
        ram = self.ram
        ram.validate(ns, key)
        self.check_open()
        with ram.lock:
            if ram.lookup_locked(ns, key) is None:
                return False
            ram.apply_locked([DelKey(ns, key)])
            return True

    def pin(self, ns: str, key: str) -> bool:
        ram = self.ram
        ram.validate(ns, key)
        self.check_open()
        with ram.lock:
            b = ram.lookup_locked(ns, key)
            if b is None:
                return False
            ram.check_pin_quota_locked(ns, 0 if b.pins else b.size)
            ram.apply_locked([PinDelta(ns, key, +1)])
            return True

    def unpin(self, ns: str, key: str) -> bool:
        ram = self.ram
        ram.validate(ns, key)
        self.check_open()
        with ram.lock:
            if ram.pins_locked(ns, key) <= 0:
                return False
            ram.apply_locked([PinDelta(ns, key, -1)])
            return True

    def check(self, *, deep: bool = False) -> ConsistencyReport:
        report = ConsistencyReport()
        ram = self.ram
        with ram.lock:
            ram.check_locked(report)
            blobs = ram.blob_list_locked() if deep else []
        for b in blobs:
            data: Buffer | None = b.hot
            if data is None and b.warm is not None:
                try:
                    data = b.warm if len(b.warm) == b.size else ram.codec.decompress(b.warm)
                except ValueError:
                    data = None
            if data is None or digest_of(data) != b.digest:
                report.corrupt_blobs.append(b.digest.hex())
        return report

    def close(self) -> None:
        with self.ram.lock:
            self._closed = True
