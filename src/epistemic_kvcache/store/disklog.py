"""The durable backend's parts of the tier engine (store/seams.py): the disk log as the
lower tier, group commit as the sequencer, the shared registry as the epoch source.

How it works
------------
`SharedKvStoreBackend` (store/durable.py) composes its `TieredEngine` with these three
objects instead of overriding engine hooks. Each holds the backend through
`DurableCore`, the narrow view of it they use (its lock, segment space, committer and
counters), so this module never imports durable.py: the engine calls
`DiskLogTier.read` for a block RAM no longer holds, `recover`/`quarantine` when those
bytes fail verification, and `GroupCommit.put` for a write: it hashes the block,
answers at once a PUT that writes nothing (the same bytes, a refused condition), and
queues the rest for the committer.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from epistemic_kvcache.errors import StoreError
from epistemic_kvcache.store import records
from epistemic_kvcache.store.api import (
    BlockData,
    Buffer,
    PutCond,
    PutOutcome,
    PutResult,
    owned_buffer,
)
from epistemic_kvcache.store.checkpointer import Checkpointer
from epistemic_kvcache.store.committer import Committer
from epistemic_kvcache.store.epochs import EpochRegistry
from epistemic_kvcache.store.model import (
    Effect,
    Ledger,
    MetaPut,
    Move,
    _Blob,
    _Counters,
    digest_of,
    tenant_of,
)
from epistemic_kvcache.store.opening import Opener
from epistemic_kvcache.store.plan import BatchOp as _Op
from epistemic_kvcache.store.seams import Started, Tag
from epistemic_kvcache.store.segments import LogWriter
from epistemic_kvcache.store.space import SegmentSpace

log = logging.getLogger("epistemic_kvcache.store.durable")

__all__ = ["DiskLogTier", "DurableCore", "GroupCommit", "RegistryEpochs"]


class DurableCore(Protocol):
    """What the parts below use of the durable backend."""

    live_capacity_bytes: int
    _lock: threading.Lock
    _recover_lock: threading.Lock
    _tier_event: threading.Event
    _space: SegmentSpace
    _writer: LogWriter
    _ckpt: Checkpointer
    _committer: Committer
    _ledger: Ledger
    _total: _Counters
    _blobs: dict[bytes, _Blob]
    _tags: dict[tuple[str, str], tuple[str, int]]
    _unfound: dict[bytes, tuple[int, int]]
    _quarantined: dict[bytes, float]
    _opened: Opener
    _inflight: dict[tuple[str, str], int]
    _batches: int
    _committed_ops: int
    _write_failures: int
    _index_repairs: int

    def disk_bytes(self) -> int: ...
    def _counters(self, ns: str) -> _Counters: ...
    def _apply(self, effects: Sequence[Effect]) -> None: ...
    def _call(self, op: _Op) -> Any: ...
    def _submit(self, op: _Op) -> None: ...
    def _submit_many(self, ops: list[_Op]) -> None: ...
    def _forget_internal(self, tenant: str, items: list[tuple[str, str]]) -> None: ...
    def _scoped(self, ns_raw: bytes, digest: bytes) -> bytes: ...
    def _lookup(self, ns: str, key: str) -> _Blob | None: ...
    def _decide_put_locked(
        self, ns: str, key: str, sdig: bytes, digest: bytes, size: int, cond: PutCond
    ) -> tuple[PutOutcome, _Blob | None, PutResult | None]: ...
    def _make_hot_room(self, sizes: Iterable[int]) -> None: ...


# -- the parts the engine is composed with (seams.py) -------------------------------------
class DiskLogTier:
    """`LowerTier`: the log on disk holds every block; RAM holds copies."""

    keeps_blocks = True

    def __init__(self, store: DurableCore) -> None:
        self._s = store

    def hot_full(self) -> None:
        self._s._tier_event.set()  # the tier thread makes room in hot for the next blocks

    def blob_created(self, b: _Blob) -> None:
        seg_live = self._s._space.seg_live
        seg_live[b.seg] = seg_live.get(b.seg, 0) + records.blob_header_length(b.sdig) + b.size

    def blob_destroyed(self, b: _Blob) -> None:
        seg_live = self._s._space.seg_live
        seg_live[b.seg] = seg_live.get(b.seg, 0) - records.blob_header_length(b.sdig) - b.size

    def caps(self) -> dict[str, int]:
        return {"cold": self._s._space.cold_capacity_bytes}

    def pin_capacity(self) -> int | None:
        return self._s.live_capacity_bytes

    def extra_stats(self) -> dict[str, int | float]:
        s = self._s
        w = s._writer
        out: dict[str, int | float] = {}
        out.update(
            fsyncs=w.fsyncs,
            commit_batches=s._batches,
            committed_ops=s._committed_ops,
            write_failures=s._write_failures,
            segments=len(s._space.segs),
            segment_bytes=sum(s._space.seg_len.values()),
            live_log_bytes=sum(s._space.seg_live.values()),
            disk_bytes=s.disk_bytes(),
            compactions=s._space.compactions,
            compacted_bytes=s._space.compacted_bytes,
            punched_bytes=s._space.punched_bytes,
            segments_deleted=s._space.segments_deleted,
            checkpoints=s._ckpt.checkpoints,
            checkpoint_failures=s._ckpt.failures,
            index_repairs=s._index_repairs,
            checkpoint_lag_bytes=s._ckpt.lag,
            lost_keys=len(s._opened.lost),
            quarantined_blocks=len(s._quarantined),
            damaged_log_regions=len(s._opened.damage),
            missing_segments=len(s._opened.missing_segments),
            store_fault=int(s._committer.fault is not None),
            disk_full=int(w.room.refresh()),
        )
        out["fs_free_bytes"], out["fs_total_bytes"] = w.room.fs_space()
        return out

    def read(self, b: _Blob, loc: tuple[int, int]) -> Buffer | None:
        seg = self._s._space.segs.get(loc[0])
        if seg is None:
            return None
        try:
            return seg.read(loc[1], b.size)
        except OSError as exc:
            log.error("read of %s failed: %s", b.digest.hex(), exc)
            return None

    def recover(self, b: _Blob, loc: tuple[int, int]) -> Buffer | None:
        """A read at `loc` failed or did not verify. Distrust the location before the
        bytes: if the log holds the block's BLOB record at `loc`, the bytes are damaged
        (None: the caller quarantines them). Otherwise the location is wrong (a damaged
        index row): look for a copy in the log whose bytes verify, point RAM at it (the
        index row is rewritten at the next checkpoint) and serve it."""
        s = self._s
        if s._space.blob_placed(b.sdig, b.size, loc):
            return None
        with s._recover_lock:
            if s._unfound.get(b.sdig) == loc:
                return None  # looked already: nothing in the log
            with s._lock:
                if s._blobs.get(b.sdig) is not b or (b.seg, b.off) != loc:
                    return None  # moved or gone meanwhile: the caller's read was stale
            found = s._space.find_in_log(b.sdig, b.size, loc[0])
            if found is None:
                s._unfound[b.sdig] = loc
                log.error(
                    "block %s is not at segment %08d offset %d where the index puts it, "
                    "and no copy in the log verifies",
                    b.digest.hex(),
                    loc[0],
                    loc[1],
                )
                return None
            sid, off, data = found
            self.relocate(b, loc, (sid, off))
            return data

    def relocate(self, b: _Blob, wrong: tuple[int, int], right: tuple[int, int]) -> None:
        """Point RAM (and, at the next checkpoint, the index row) at the verified copy."""
        s = self._s
        with s._lock:
            if s._blobs.get(b.sdig) is not b or (b.seg, b.off) != wrong:
                return
            s._apply([Move(b.sdig, right[0], right[1])])
            s._space.dirty.blobs.add(b.sdig)
            s._index_repairs += 1
        log.warning(
            "block %s was not where the index put it (segment %08d offset %d): found "
            "intact in segment %08d at %d; the index row is repaired",
            b.digest.hex(),
            wrong[0],
            wrong[1],
            right[0],
            right[1],
        )

    def quarantine(self, b: _Blob, reason: str, loc: tuple[int, int]) -> bool:
        s = self._s
        with s._lock:
            if s._blobs.get(b.sdig) is not b or (b.seg, b.off) != loc:
                return True  # deleted (its payload punched) or moved while it was read
        log.error("integrity failure: blob %s (%s); quarantined", b.digest.hex(), reason)
        with s._lock:
            s._ledger.bump(b, "integrity_failures")
        op = _Op("quarantine", "", "", sdig=b.sdig, loc=loc)
        with contextlib.suppress(StoreError):
            s._submit(op)
            op.future.result()
        return True

    def quarantine_async(self, sdig: bytes, loc: tuple[int, int]) -> None:
        """Queue a quarantine without waiting for it (from the committer thread itself)."""
        s = self._s
        with s._lock:
            s._total.integrity_failures += 1
            b = s._blobs.get(sdig)
            for ns in b.owners() if b is not None else ():
                s._counters(ns).integrity_failures += 1
        s._committer.submit(_Op("quarantine", "", "", sdig=sdig, loc=loc))

    def live_tagged(self, tenant: str, scope: str) -> int:
        """This store's entries tagged with (tenant, scope): the registry prunes scopes
        with none."""
        s = self._s
        with s._lock:
            return sum(
                1
                for (ns, _k), tag in s._tags.items()
                if tag[0] == scope and tenant_of(ns) == tenant
            )


class GroupCommit:
    """`Sequencer`: writes queue for the committer, which decides a batch, writes and
    syncs it once, then applies it to RAM and answers."""

    queues = True

    def __init__(self, store: DurableCore) -> None:
        self._s = store

    def put(
        self, ns: str, raw: bytes, key: str, data: BlockData, tag: Tag, cond: PutCond, wait: bool
    ) -> Started:
        """Hash, answer a PUT that writes nothing at once, else queue it for the committer
        (`wait`: a blocking caller, which first demotes what the block displaces from
        hot, so that it enters hot when committed, then waits for the result)."""
        s = self._s
        data = owned_buffer(data)  # the hot tier keeps it
        digest = digest_of(data)
        sdig = s._scoped(raw, digest)
        with s._lock:
            if not s._inflight.get((ns, key)):  # else the committer decides, in order
                answer = s._decide_put_locked(ns, key, sdig, digest, len(data), cond)[2]
                if answer is not None:
                    return answer
        if wait and sdig not in s._blobs:  # unlocked look: a hint
            s._make_hot_room((len(data),))
        op = _Op("put", ns, key, sdig=sdig, digest=digest, data=data, tag=tag, cond=cond)
        s._submit(op)
        if wait:
            result: PutResult = op.future.result()
            return result
        return op.future

    def snapshot(
        self, tenant: str, sid: str, keys: list[str] | None, prefix: str | None, rec: dict[str, Any]
    ) -> None:
        self._s._call(_Op("snapshot", tenant, sid, payload=(keys, prefix, rec)))

    def drop(self, tenant: str, items: list[tuple[str, str]]) -> None:
        s = self._s
        s._call(_Op("drop", tenant, "", payload=items))
        with s._lock:
            s._forget_internal(tenant, items)

    def commit_meta(self, effect: MetaPut) -> None:
        self._s._call(_Op("meta_put", effect.tenant, "", payload=effect))

    def retire(self, pairs: list[tuple[str, str]]) -> int:
        ops = [_Op("retire", ns, key) for ns, key in pairs]
        self._s._submit_many(ops)
        return sum(1 for op in ops if op.future.result())


class RegistryEpochs:
    """`EpochSource` over the shared on-disk registry (epochs.py)."""

    def __init__(self, registry: EpochRegistry, live: Callable[[str, str], int]) -> None:
        self._registry = registry
        self._live = live

    def current(self, tenant: str, scope: str) -> int:
        return self._registry.current(tenant, scope)

    def bump(self, tenant: str, scope: str) -> int:
        return self._registry.advance(tenant, scope, self._live)
