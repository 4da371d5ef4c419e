"""The memory backend (`--backend memory`): the tiered engine with no disk.

Decisions are taken and applied under the engine lock in one step (there is nothing to
make durable first); eviction from the warm tier drops blocks and their keys.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from epistemic_kvcache.errors import CapacityError, NotFoundError
from epistemic_kvcache.store.api import (
    BlockData,
    Buffer,
    ConsistencyReport,
    PutCond,
    PutOutcome,
    PutResult,
    decide_put,
    owned_buffer,
    validate_cond,
    validate_namespace,
)
from epistemic_kvcache.store.codec import WarmCodec
from epistemic_kvcache.store.engine import (
    _VICTIM_WINDOW,
    INLINE_MAX_BYTES,
    AddKey,
    DedupScope,
    DelKey,
    Effect,
    MetaPut,
    PinDelta,
    TieredEngine,
    digest_of,
    parse_internal_ns,
)


class SharedKvIndex(TieredEngine):
    """In-process, RAM-only backend (`--backend memory`): hot + warm tiers, no disk.

    Eviction from warm drops blocks (it is a cache). Thread-safe.
    """

    durable = False

    def __init__(
        self,
        *,
        hot_capacity_bytes: int = 1 << 30,
        warm_capacity_bytes: int = 1 << 30,
        max_block_bytes: int = 128 << 20,
        dedup_scope: DedupScope = "namespace",
        codec: WarmCodec | None = None,
        max_pinned_fraction: float = 0.5,
        max_snapshots_per_tenant: int = 256,
        max_keys_per_tenant: int = 0,
        first_write_wins: bool | frozenset[str] = False,
        max_epoch_scopes_per_tenant: int = 10_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(
            clock=clock,
            max_keys_per_tenant=max_keys_per_tenant,
            max_epoch_scopes_per_tenant=max_epoch_scopes_per_tenant,
            hot_capacity_bytes=hot_capacity_bytes,
            warm_capacity_bytes=warm_capacity_bytes,
            max_block_bytes=max_block_bytes,
            dedup_scope=dedup_scope,
            codec=codec,
            max_pinned_fraction=max_pinned_fraction,
            max_snapshots_per_tenant=max_snapshots_per_tenant,
            first_write_wins=first_write_wins,
        )

    def _cheap_room(self) -> bool:
        """Whether the blocks the hot tier would demote next can leave it on the caller's
        thread: dropped (no warm tier), or compressed into warm when each is at most
        `INLINE_MAX_BYTES` (a few tens of microseconds of codec work, like the hash). A
        full cache, the normal state of one, must not send every PUT to the thread pool."""
        if self.warm_capacity_bytes == 0:
            return True
        with self._lock:
            for n, b in enumerate(self._hot.values()):
                if n >= _VICTIM_WINDOW:
                    return True
                if b.size > INLINE_MAX_BYTES:
                    return False
        return True

    def put(
        self,
        ns: str,
        key: str,
        data: BlockData,
        *,
        epoch_scope: str | None = None,
        cond: PutCond = None,
    ) -> PutResult:
        ns_raw = self._validate(ns, key)
        self._check_size(data)
        validate_cond(cond)
        self._check_open()
        return self._put_into(ns, ns_raw, key, data, self._tag_for(ns, epoch_scope), cond)

    def _put_into(
        self,
        ns: str,
        scope_raw: bytes,
        key: str,
        data: BlockData,
        tag: tuple[str, int] | None,
        cond: PutCond,
    ) -> PutResult:
        data = owned_buffer(data)  # the hot tier keeps it
        digest = digest_of(data)
        sdig = self._scoped(scope_raw, digest)
        if sdig not in self._blobs:  # unlocked look: new bytes will need room in hot
            self._make_hot_room((len(data),))
        with self._lock:
            return self._put_locked(ns, key, sdig, digest, data, tag, cond)

    def _put_locked(
        self,
        ns: str,
        key: str,
        sdig: bytes,
        digest: bytes,
        data: Buffer,
        tag: tuple[str, int] | None = None,
        cond: PutCond = None,
    ) -> PutResult:
        size = len(data)
        internal = parse_internal_ns(ns)
        if internal is not None and internal[2] not in self._meta(internal[1]).get(internal[0], {}):
            # the branch was deleted while this PUT was being hashed
            raise NotFoundError(f"no {internal[1]} {internal[2]!r}")
        existing = self._lookup(ns, key)
        stale = existing is not None and bool(self._tags) and self._stale(ns, key)
        outcome = decide_put(
            None if existing is None or stale else existing.sdig, sdig, cond, self._fww(ns)
        )
        if outcome is PutOutcome.MISSING:
            self._count_put(ns, outcome, False)
            return PutResult(outcome, digest, size)
        if outcome is PutOutcome.DUPLICATE or outcome is PutOutcome.CONFLICT:
            assert existing is not None  # nothing written
            self._count_put(ns, outcome, False)
            return PutResult(outcome, existing.digest, existing.size)
        if existing is None and internal is None:
            self._check_key_quota(ns)
        shared = sdig in self._blobs
        # the same bytes over a stale entry that is their only reference: the blob goes
        # with the entry, and this PUT brings its bytes back
        reborn = shared and existing is not None and existing.sdig == sdig and existing.refs == 1
        warm_copy: bytes | None = None
        if not shared or reborn:
            self._check_ram_room(size)
            if not self._hot_room(size):
                # larger than the hot tier, or hot is full of blocks that cannot leave it
                # now (pinned, being demoted): straight to warm, compressed when worth it
                warm_copy = self._codec.compress(data) or bytes(data)
                if not self._warm_room(len(warm_copy)):
                    raise CapacityError(
                        f"no room for a {size}-byte block: the hot tier "
                        f"({self.hot_capacity_bytes} bytes) and the warm tier "
                        f"({self.warm_capacity_bytes} bytes) are full of pinned blocks "
                        "or too small for it"
                    )
        effects: list[Effect] = []
        pins = 0
        if existing is not None:  # replaced, or stale (a stale entry is replaced, not kept)
            pins = self._pins.get((ns, key), 0)
            effects.append(DelKey(ns, key))
        hot_data = None if (shared and not reborn) or warm_copy is not None else data
        effects.append(AddKey(ns, key, sdig, size, hot_data, tag=tag))
        if pins:
            effects.append(PinDelta(ns, key, pins))  # pins belong to the key: they stay
        self._apply(effects)
        if warm_copy is not None:
            self._set_warm(self._blobs[sdig], warm_copy)
        self._count_put(ns, outcome, shared)
        return PutResult(outcome, digest, size)

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

    def _snapshot_commit(
        self,
        tenant: str,
        sid: str,
        keys: list[str] | None,
        prefix: str | None,
        rec: dict[str, Any],
    ) -> None:
        with self._lock:
            self._check_snapshot_quota(tenant)
            effects = self._snapshot_effects(tenant, sid, keys, prefix)
            newly = {
                e.sdig: e.size
                for e in effects
                if isinstance(e, AddKey) and not self._blobs[e.sdig].pins
            }
            self._check_pin_quota(tenant, sum(newly.values()))
            effects.append(MetaPut("snap", tenant, sid, rec))
            self._apply(effects)

    def _drop(self, tenant: str, items: list[tuple[str, str]]) -> None:
        with self._lock:
            self._apply(self._drop_effects(tenant, items))
            self._forget_internal(tenant, items)

    def _commit_meta(self, effect: MetaPut) -> None:
        with self._lock:
            self._apply([effect])

    def _retire(self, pairs: list[tuple[str, str]]) -> int:
        n = 0
        with self._lock:
            for ns, key in pairs:
                if self._lookup(ns, key) is not None and self._stale(ns, key):
                    self._apply([DelKey(ns, key)])
                    n += 1
        return n

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
