"""The committer's work: decide a batch, write and sync it once, apply it, answer.

How it works
------------
`Batches.commit(batch)` runs on the committer thread (committer.py) for every batch of
queued operations. Room first: when the new bytes would take the cold tier past its
live capacity, the least recently used blocks are evicted in a batch of their own, and
compaction frees the disk they leave. Then the batch is decided by a pure function
(plan.py `decide_batch`, reading RAM through `RamState`), its records placed and
written to the active segment and synced once (segments.py); only then are its effects
applied to RAM (`RamState.apply_locked`) and its half of the segment space's accounting
(`SegmentSpace.apply_batch_locked`), under the RAM lock, and the callers answered. A
failed write or sync fails the whole batch (nothing applied or acknowledged; a failed
sync abandons the segment). `Batches` is also what the compactor asks for maintenance
(compaction.py `Maintenance`).
"""

from __future__ import annotations

import errno
import logging

from epistemic_kvcache.errors import DiskFullError, StorageIOError, StoreError
from epistemic_kvcache.store import compaction
from epistemic_kvcache.store.api import PutResult
from epistemic_kvcache.store.committer import settle
from epistemic_kvcache.store.disklog import DiskLogTier, DurableLog
from epistemic_kvcache.store.index import pack_loc
from epistemic_kvcache.store.plan import BatchOp as _Op
from epistemic_kvcache.store.plan import Plan, decide_batch, plan_evictions, plan_room
from epistemic_kvcache.store.ram import RamState
from epistemic_kvcache.store.segments import SyncFailed

log = logging.getLogger("epistemic_kvcache.store.durable")

__all__ = ["Batches"]

KeyState = tuple[bytes, tuple[str, int] | None]
"""A key's (scoped digest, epoch tag) in RAM."""


class Batches:
    """Decide, write, sync and apply the committer's batches (see the module docstring)."""

    compactor: compaction.Compactor | None = None
    """Set once the store is open (compaction needs the loaded RAM)."""

    def __init__(self, ram: RamState, durable: DurableLog, disk: DiskLogTier) -> None:
        self._ram = ram
        self._log = durable
        self._disk = disk
        self._space = durable.space

    def commit(self, batch: list[_Op]) -> None:
        """Decide (`plan.decide_batch`), write + sync once, apply, answer (committer thread)."""
        incoming = sum(op.nbytes for op in batch if op.kind == "put")
        if incoming and self.compactor is not None:
            # Room first, so the files never outgrow the cold capacity: evict what the new
            # blocks displace (a batch of its own), then compact the space it frees.
            self._pre_evict(incoming)
            self.compactor.make_disk_room(incoming)
        self._log.ckpt.wait_for_lag()
        p = decide_batch(self._ram, batch)
        res = self._write(p)
        if isinstance(res, StoreError):
            for op in batch:
                settle(op.future, res)
            self._log.release(batch)
            return
        self._finish(p, batch, *res)

    def _pre_evict(self, incoming: int) -> None:
        """Commit the evictions `incoming` new bytes will need, before their batch."""
        ram = self._ram
        with ram.lock:
            over = ram.total.cold_bytes + incoming - ram.live_capacity_bytes
        if over <= 0:
            return
        p = plan_room(ram, incoming)
        if p is None:
            return
        res = self._write(p)
        if not isinstance(res, StoreError):
            self._finish(p, [], *res)

    def _write(self, p: Plan) -> tuple[list[tuple[int, int]], list[tuple[int, int]]] | StoreError:
        """Place the plan's records and write + sync them once: ((segment, offset) of each
        record, (segment, new end) of each segment written), or the error to answer (the
        batch undone)."""
        w = self._space.writer
        w.begin()
        positions = [w.alloc(hdr, payload) for hdr, payload in p.records]
        if not positions:
            return positions, []
        try:
            return positions, w.write(reserve_ok=not p.new_data)
        except SyncFailed as exc:
            self._space.abandon()
            return self._io_error(exc.cause, "sync")
        except OSError as exc:
            w.rollback()
            return self._io_error(exc, "write")

    def _io_error(self, exc: OSError, what: str) -> StoreError:
        self._log.write_failures += 1
        path = self._log.path
        log.error("log %s under %s failed: %s", what, path, exc)
        if exc.errno == errno.ENOSPC:
            return DiskFullError(f"disk full under {path}: nothing was stored")
        return StorageIOError(f"write to {path} failed: {exc}; nothing was stored")

    def _finish(
        self,
        p: Plan,
        batch: list[_Op],
        positions: list[tuple[int, int]],
        written: list[tuple[int, int]],
    ) -> None:
        """The batch is durable: apply it to RAM and to the space, answer, mark the rows
        for the checkpointer."""
        p.resolve(positions)
        key_recs = {
            ref: (pack_loc(*positions[i]) if i is not None else None)
            for ref, i in p.key_recs.items()
        }
        meta_recs = {
            mk: ((pack_loc(*positions[r[0]]), r[1]) if r is not None else None)
            for mk, r in p.meta_recs.items()
        }
        tombs: dict[int, int] = {}
        for i in p.tombs:
            sid = positions[i][0]
            tombs[sid] = tombs.get(sid, 0) + len(p.records[i][0])
        ram, dl = self._ram, self._log
        with ram.lock:
            # where the blobs this batch may destroy are: their bytes go back to the disk
            doomed = {}
            for sdig in [*(d for d, n in p.ref_delta.items() if n < 0), *p.dropped]:
                b = ram.blob(sdig)
                if b is not None and b.seg >= 0 and sdig not in p.quarantine:
                    doomed[sdig] = (b, b.seg, b.off, b.size)
            before = {ref: self._key_state(*ref) for ref in key_recs}
            ram.apply_locked(p.effects)
            self._space.apply_batch_locked(
                key_recs=key_recs,
                before=before,
                after={ref: self._key_state(*ref) for ref in key_recs},
                meta_recs=meta_recs,
                tombs=tombs,
                written=written,
                blobs=(p.placed, p.ref_delta, p.dropped),
                quarantine=p.quarantine,
            )
            dl.quarantined.update(p.quarantine)
            for op, res, deduped in zip(batch, p.results, p.deduped, strict=True):
                if op.kind == "put" and isinstance(res, PutResult):
                    ram.count_put(op.ns, res.outcome, deduped)
            dl.release_locked(batch)
            dl.batches += 1
            dl.committed_ops += len(batch)
            dead = [
                (sid, off, size)
                for sdig, (b, sid, off, size) in doomed.items()
                if ram.blob(sdig) is not b
            ]
        for op, res in zip(batch, p.results, strict=True):
            settle(op.future, res)
        if dead:
            self._space.punch(dead)
        self.checkpoint_due(self._space.writer.last_batch_bytes)

    def _key_state(self, ns: str, key: str) -> KeyState | None:
        kv = self._ram.key_locked(ns, key)
        return (kv.sdig, kv.tag) if kv is not None else None

    # -- what the compactor asks (compaction.Maintenance) ----------------------------------
    def evict_segment(self, sid: int) -> bool:
        """Evict every unpinned block stored in segment `sid` (a batch of its own), so
        the segment can be deleted without copying them (committer thread)."""
        with self._ram.lock:
            victims = self._ram.segment_victims_locked(sid)
        if not victims:
            return True
        p = plan_evictions(self._ram, victims)
        if not p.records:
            return True
        res = self._write(p)
        if isinstance(res, StoreError):
            return False
        self._finish(p, [], *res)
        return True

    def relocate(self, sdig: bytes, wrong: tuple[int, int], right: tuple[int, int]) -> None:
        self._disk.relocate(sdig, wrong, right)

    def quarantine_async(self, sdig: bytes, loc: tuple[int, int]) -> None:
        self._disk.quarantine_async(sdig, loc)

    def checkpoint_due(self, nbytes: int) -> None:
        self._log.ckpt.due(nbytes)
