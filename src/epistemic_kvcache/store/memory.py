"""The memory backend (`--backend memory`): the tier engine with no disk, applying now.

How it works
------------
`SharedKvIndex` is `TieredEngine` composed with `NoLowerTier` (a block that leaves RAM
leaves the store: eviction from warm drops blocks and their keys) and `ApplyNow`, the
sequencer that decides a write and applies its effects under the engine lock in one
step, in the caller's thread (there is nothing to make durable first).
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
from epistemic_kvcache.store.seams import Tag


class ApplyNow:
    """`Sequencer` that decides and applies under the engine lock, in the caller's thread."""

    queues = False

    def __init__(self, engine: TieredEngine) -> None:
        self._e = engine

    def put(
        self, ns: str, raw: bytes, key: str, data: BlockData, tag: Tag, cond: PutCond, wait: bool
    ) -> PutResult:
        e = self._e
        data = owned_buffer(data)  # the hot tier keeps it
        digest = digest_of(data)
        sdig = e._scoped(raw, digest)
        if sdig not in e._blobs:  # unlocked look: new bytes will need room in hot
            e._make_hot_room((len(data),))
        with e._lock:
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
        """Decide and apply a PUT of hashed bytes (engine lock held)."""
        e = self._e
        size = len(data)
        internal = parse_internal_ns(ns)
        if internal is not None and internal[2] not in e._meta(internal[1]).get(internal[0], {}):
            # the branch was deleted while this PUT was being hashed
            raise NotFoundError(f"no {internal[1]} {internal[2]!r}")
        outcome, existing, answer = e._decide_put_locked(ns, key, sdig, digest, size, cond)
        if answer is not None:
            return answer
        if existing is None and internal is None:
            e._check_key_quota(ns)
        shared = sdig in e._blobs
        # the same bytes over a stale entry that is their only reference: the blob goes
        # with the entry, and this PUT brings its bytes back
        reborn = shared and existing is not None and existing.sdig == sdig and existing.refs == 1
        warm_copy: bytes | None = None
        if not shared or reborn:
            self._check_ram_room(size)
            if not e._hot_room(size):
                # larger than the hot tier, or hot is full of blocks that cannot leave it
                # now (pinned, being demoted): straight to warm, compressed when worth it
                warm_copy = e._codec.compress(data) or bytes(data)
                if not e._warm_room(len(warm_copy)):
                    raise CapacityError(
                        f"no room for a {size}-byte block: the hot tier "
                        f"({e.options.hot_capacity_bytes} bytes) and the warm tier "
                        f"({e.options.warm_capacity_bytes} bytes) are full of pinned blocks "
                        "or too small for it"
                    )
        effects: list[Effect] = []
        pins = 0
        if existing is not None:  # replaced, or stale (a stale entry is replaced, not kept)
            pins = e._pins.get((ns, key), 0)
            effects.append(DelKey(ns, key))
        hot_data = None if (shared and not reborn) or warm_copy is not None else data
        effects.append(AddKey(ns, key, sdig, size, hot_data, tag=tag))
        if pins:
            effects.append(PinDelta(ns, key, pins))  # pins belong to the key: they stay
        e._apply(effects)
        if warm_copy is not None:
            e._set_warm(e._blobs[sdig], warm_copy)
        e._count_put(ns, outcome, shared)
        return PutResult(outcome, digest, size)

    def _check_ram_room(self, size: int) -> None:
        """Refuse a block that cannot fit beside the pinned ones (lock held)."""
        e = self._e
        budget = e.options.hot_capacity_bytes + e.options.warm_capacity_bytes
        if size > budget:
            raise CapacityError(
                f"block of {size} bytes is larger than the RAM tiers ({budget} bytes)"
            )
        pinned = e._pinned_bytes
        if pinned + size > budget:
            raise CapacityError(
                f"no room for a {size}-byte block: {pinned} of {budget} bytes are pinned"
            )

    def snapshot(
        self, tenant: str, sid: str, keys: list[str] | None, prefix: str | None, rec: dict[str, Any]
    ) -> None:
        e = self._e
        with e._lock:
            e._check_snapshot_quota(tenant)
            effects = e._snapshot_effects(tenant, sid, keys, prefix)
            newly = {
                x.sdig: x.size
                for x in effects
                if isinstance(x, AddKey) and not e._blobs[x.sdig].pins
            }
            e._check_pin_quota(tenant, sum(newly.values()))
            effects.append(MetaPut("snap", tenant, sid, rec))
            e._apply(effects)

    def drop(self, tenant: str, items: list[tuple[str, str]]) -> None:
        e = self._e
        with e._lock:
            e._apply(e._drop_effects(tenant, items))
            e._forget_internal(tenant, items)

    def commit_meta(self, effect: MetaPut) -> None:
        with self._e._lock:
            self._e._apply([effect])

    def retire(self, pairs: list[tuple[str, str]]) -> int:
        e = self._e
        n = 0
        with e._lock:
            for ns, key in pairs:
                if e._lookup(ns, key) is not None and e._stale(ns, key):
                    e._apply([DelKey(ns, key)])
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
        self._now = ApplyNow(self)
        self._compose(sequencer=self._now)
        self._put_locked = self._now.put_locked

    def put_many(
        self, ns: str, items: Sequence[tuple[str, BlockData]], *, cond: PutCond = None
    ) -> list[PutResult]:
        return [self.put(ns, key, data, cond=cond) for key, data in items]

    def flush(self, ns: str) -> int:
        validate_namespace(ns)
        self._check_open()
        with self._lock:
            keys = list(self._index.get(ns) or ())
            self._apply([DelKey(ns, key) for key in keys])
            return len(keys)

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
            b = self._lookup(ns, key)
            if b is None:
                return False
            self._check_pin_quota(ns, 0 if b.pins else b.size)
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
