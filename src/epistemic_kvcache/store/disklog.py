"""The durable backend's parts (store/seams.py): the disk log as the lower tier, group
commit as the sequencer, the shared registry as the epoch source, and the log's state.

How it works
------------
`SharedKvStoreBackend` (store/durable.py) composes its `TieredEngine` with these objects
instead of overriding engine hooks. RAM is reached only through `RamState`'s public API
(ram.py); the log's side lives in `DurableLog`: the segment space, what opening found,
the committer and the checkpointer, the quarantined blocks and the log's counters, and
the one way an operation reaches the committer (`submit_many`: its keys marked in flight
in RAM first, so their PUTs are decided in order there). The engine calls
`DiskLogTier.read` for a block RAM no longer holds, `recover`/`quarantine` when those
bytes fail verification, and `GroupCommit.put` for a write: it hashes the block, answers
at once a PUT that writes nothing (the same bytes, a refused condition), and queues the
rest for the committer.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from epistemic_kvcache.errors import StoreClosedError, StoreError
from epistemic_kvcache.store import records
from epistemic_kvcache.store.api import BlockData, Buffer, PutCond, PutResult, owned_buffer
from epistemic_kvcache.store.catalog import Catalog
from epistemic_kvcache.store.checkpointer import Checkpointer
from epistemic_kvcache.store.committer import Committer
from epistemic_kvcache.store.epochs import EpochRegistry
from epistemic_kvcache.store.model import MetaPut, Move, _Blob, digest_of
from epistemic_kvcache.store.opening import Opener
from epistemic_kvcache.store.plan import BatchOp as _Op
from epistemic_kvcache.store.ram import RamState
from epistemic_kvcache.store.seams import Started, Tag
from epistemic_kvcache.store.space import SegmentSpace

log = logging.getLogger("epistemic_kvcache.store.durable")

__all__ = ["DiskLogTier", "DurableLog", "GroupCommit", "RegistryEpochs"]


class DurableLog:
    """The log side of a durable store (see the module docstring). `committer` and
    `ckpt` are set once they are built; RAM is `ram`'s."""

    committer: Committer
    ckpt: Checkpointer

    def __init__(self, ram: RamState, space: SegmentSpace, opened: Opener, path: Path) -> None:
        self.ram = ram
        self.space = space
        self.opened = opened
        self.path = path
        self.quarantined: dict[bytes, float] = opened.quarantined
        """Scoped digest -> when: every block quarantined (at open and since)."""
        self.unfound: dict[bytes, tuple[int, int]] = {}
        """Blocks looked for in the log in vain, where RAM placed them."""
        self.recover_lock = threading.Lock()
        self.tier_event = threading.Event()
        """Set when the hot tier refused a block: the tier thread makes room."""
        self.closed = False
        self.batches = 0
        self.committed_ops = 0
        self.write_failures = 0
        self.index_repairs = 0

    # -- operations to the committer --------------------------------------------------------
    def submit_many(self, ops: list[_Op]) -> None:
        """Queue `ops` for the committer, their keys in flight in RAM until committed."""
        if self.closed:
            raise StoreClosedError("the store is closed")
        self.ram.enter_flight([(op.ns, op.key) for op in ops if op.key])
        try:
            self.committer.submit_many(ops)
        except StoreError:
            self.release(ops)
            raise

    def submit(self, op: _Op) -> None:
        self.submit_many([op])

    def call(self, op: _Op) -> Any:
        """Submit `op` and wait for its answer."""
        self.submit(op)
        return op.future.result()

    def release(self, ops: list[_Op]) -> None:
        """Ops that will not be committed (dropped, failed): no longer in flight."""
        with self.ram.lock:
            self.release_locked(ops)

    def release_locked(self, ops: list[_Op]) -> None:
        self.ram.leave_flight_locked([(op.ns, op.key) for op in ops if op.key])

    # -- what the log reports ------------------------------------------------------------
    def disk_full(self) -> bool:
        return self.space.writer.room.refresh()

    def extra_stats(self) -> dict[str, int | float]:
        sp = self.space
        w = sp.writer
        out: dict[str, int | float] = {
            "fsyncs": w.fsyncs,
            "commit_batches": self.batches,
            "committed_ops": self.committed_ops,
            "write_failures": self.write_failures,
            "segments": len(sp.segs),
            "segment_bytes": sum(sp.seg_len.values()),
            "live_log_bytes": sum(sp.seg_live.values()),
            "disk_bytes": sp.disk_bytes(),
            "compactions": sp.compactions,
            "compacted_bytes": sp.compacted_bytes,
            "punched_bytes": sp.punched_bytes,
            "segments_deleted": sp.segments_deleted,
            "checkpoints": self.ckpt.checkpoints,
            "checkpoint_failures": self.ckpt.failures,
            "index_repairs": self.index_repairs,
            "checkpoint_lag_bytes": self.ckpt.lag,
            "lost_keys": len(self.opened.lost),
            "quarantined_blocks": len(self.quarantined),
            "damaged_log_regions": len(self.opened.damage),
            "missing_segments": len(self.opened.missing_segments),
            "store_fault": int(self.committer.fault is not None),
            "disk_full": int(self.disk_full()),
        }
        out["fs_free_bytes"], out["fs_total_bytes"] = w.room.fs_space()
        return out


# -- the parts the engine is composed with (seams.py) -------------------------------------
class DiskLogTier:
    """`LowerTier`: the log on disk holds every block; RAM holds copies."""

    keeps_blocks = True

    def __init__(self, ram: RamState, durable: DurableLog) -> None:
        self._ram = ram
        self._log = durable

    def hot_full(self) -> None:
        self._log.tier_event.set()  # the tier thread makes room in hot for the next blocks

    def blob_created(self, b: _Blob) -> None:
        self._log.space.add_live(b.seg, records.blob_header_length(b.sdig) + b.size)

    def blob_destroyed(self, b: _Blob) -> None:
        self._log.space.add_live(b.seg, -records.blob_header_length(b.sdig) - b.size)

    def caps(self) -> dict[str, int]:
        return {"cold": self._log.space.cold_capacity_bytes}

    def pin_capacity(self) -> int | None:
        return self._ram.live_capacity_bytes

    def extra_stats(self) -> dict[str, int | float]:
        return self._log.extra_stats()

    def read(self, b: _Blob, loc: tuple[int, int]) -> Buffer | None:
        seg = self._log.space.segs.get(loc[0])
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
        dl = self._log
        if dl.space.blob_placed(b.sdig, b.size, loc):
            return None
        with dl.recover_lock:
            if dl.unfound.get(b.sdig) == loc:
                return None  # looked already: nothing in the log
            with self._ram.lock:
                if self._ram.at_locked(b.sdig, loc) is not b:
                    return None  # moved or gone meanwhile: the caller's read was stale
            found = dl.space.find_in_log(b.sdig, b.size, loc[0])
            if found is None:
                dl.unfound[b.sdig] = loc
                log.error(
                    "block %s is not at segment %08d offset %d where the index puts it, "
                    "and no copy in the log verifies",
                    b.digest.hex(),
                    loc[0],
                    loc[1],
                )
                return None
            sid, off, data = found
            self.relocate(b.sdig, loc, (sid, off))
            return data

    def relocate(self, sdig: bytes, wrong: tuple[int, int], right: tuple[int, int]) -> None:
        """Point RAM (and, at the next checkpoint, the index row) at the verified copy of
        a blob RAM places at `wrong`."""
        ram, dl = self._ram, self._log
        with ram.lock:
            b = ram.at_locked(sdig, wrong)
            if b is None:
                return
            ram.apply_locked([Move(sdig, right[0], right[1])])
            dl.space.dirty.blobs.add(sdig)
            dl.index_repairs += 1
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
        ram = self._ram
        with ram.lock:
            if ram.at_locked(b.sdig, loc) is not b:
                return True  # deleted (its payload punched) or moved while it was read
            log.error("integrity failure: blob %s (%s); quarantined", b.digest.hex(), reason)
            ram.bump(b, "integrity_failures")
        op = _Op("quarantine", "", "", sdig=b.sdig, loc=loc)
        with contextlib.suppress(StoreError):
            self._log.call(op)
        return True

    def quarantine_async(self, sdig: bytes, loc: tuple[int, int]) -> None:
        """Queue a quarantine without waiting for it (from the committer thread itself)."""
        ram = self._ram
        with ram.lock:
            ram.total.integrity_failures += 1
            b = ram.blob(sdig)
            for ns in b.owners() if b is not None else ():
                ram.counters(ns).integrity_failures += 1
        self._log.committer.submit(_Op("quarantine", "", "", sdig=sdig, loc=loc))


class GroupCommit:
    """`Sequencer`: writes queue for the committer, which decides a batch, writes and
    syncs it once, then applies it to RAM and answers."""

    queues = True

    def __init__(self, ram: RamState, durable: DurableLog, catalog: Catalog) -> None:
        self._ram = ram
        self._log = durable
        self._catalog = catalog

    def put(
        self, ns: str, raw: bytes, key: str, data: BlockData, tag: Tag, cond: PutCond, wait: bool
    ) -> Started:
        """Hash, answer a PUT that writes nothing at once, else queue it for the committer
        (`wait`: a blocking caller, which first demotes what the block displaces from
        hot, so that it enters hot when committed, then waits for the result)."""
        ram = self._ram
        data = owned_buffer(data)  # the hot tier keeps it
        digest = digest_of(data)
        sdig = ram.scoped(raw, digest)
        with ram.lock:
            if not ram.in_flight_locked(ns, key):  # else the committer decides, in order
                answer = ram.decide_put_locked(ns, key, sdig, digest, len(data), cond)[2]
                if answer is not None:
                    return answer
        if wait and not ram.has_blob(sdig):  # unlocked look: a hint
            ram.tiers.make_hot_room((len(data),))
        op = _Op("put", ns, key, sdig=sdig, digest=digest, data=data, tag=tag, cond=cond)
        self._log.submit(op)
        if wait:
            result: PutResult = op.future.result()
            return result
        return op.future

    def snapshot(
        self, tenant: str, sid: str, keys: list[str] | None, prefix: str | None, rec: dict[str, Any]
    ) -> None:
        self._log.call(_Op("snapshot", tenant, sid, payload=(keys, prefix, rec)))

    def drop(self, tenant: str, items: list[tuple[str, str]]) -> None:
        self._log.call(_Op("drop", tenant, "", payload=items))
        with self._ram.lock:
            self._catalog.forget_locked(tenant, items)

    def commit_meta(self, effect: MetaPut) -> None:
        self._log.call(_Op("meta_put", effect.tenant, "", payload=effect))

    def retire(self, pairs: list[tuple[str, str]]) -> int:
        ops = [_Op("retire", ns, key) for ns, key in pairs]
        self._log.submit_many(ops)
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
