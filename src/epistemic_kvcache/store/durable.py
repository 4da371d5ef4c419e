"""The durable backend: a log of self-describing records, an LMDB checkpoint, RAM tiers.

How a write becomes durable
---------------------------
1. The caller's thread validates, hashes (BLAKE3) and, when the PUT writes nothing (the
   key already holds these bytes, or a condition refuses it), answers at once. Otherwise
   it queues an operation for the committer (`store/committer.py`) and waits.
2. The committer takes every queued operation (group commit) and decides the batch with
   a pure function (`store/plan.py`: `decide_batch(reader, ops) -> Plan`): each operation
   against RAM as the earlier operations of the same batch left it, giving the log
   records (`store/records.py`) to write (a BLOB record for new bytes, a KEY record with
   the key's whole new state, DEL tombstones, snapshot/branch records), the effects to
   apply to RAM, and each operation's answer. RAM is read through `store/ramview.py`.
3. The plan's records are placed and written to the active segment and `fdatasync`ed
   once (`store/segments.py`): then, and only then, its effects are applied to RAM, the
   segment space's accounting updated (`store/space.py`) and the callers answered. An
   acknowledged write is in the log; an unacknowledged one is invisible. One sync per
   batch.
4. The rows the batch changed are marked dirty for the checkpointer thread
   (`store/checkpointer.py`), which writes them to the LMDB index (`store/index.py`) in
   the background, a few times a second, and moves the checkpoint position. Opening
   (`store/opening.py`) loads the index and replays the log after the checkpoint
   (`store/recovery.py`): O(index + tail), never O(data).

The log is the truth: an index that is missing, empty, damaged or from another store is
never taken as "the store is empty" (the store refuses to open and names the command to
rebuild it, or rebuilds it when asked); nothing deletes a segment it cannot account for.

Failures
--------
- A failed write (ENOSPC, EIO) fails the batch (`DiskFullError`, `StorageIOError`):
  nothing is acknowledged or visible, the write position is rolled back. A failed sync
  abandons the segment (never retried: "fsyncgate"); the next batch starts a new one.
- Anything unexpected in the committer is a store fault: the store turns read-only
  (`StoreFaultError` for every write, `health()` not ready), reads keep working.
- A read whose bytes fail verification quarantines the blob (QUAR record, keys dropped,
  `integrity_failures`); keys whose bytes are gone at open (segment deleted or cut
  short by hand) are misses from the start, counted (`lost_keys`) and listed by `check`.

Space
-----
Dead records (replaced, deleted, evicted) are reclaimed by compaction
(`store/compaction.py`), which keeps the segments within ~1.5x the live bytes plus the
active segment, and greedily within `cold_capacity_bytes` when near it. Deletes keep
working on a full disk (the allocated, zeroed space after the active segment's end is
kept for them), and space freed by deletes is usable again without a restart.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fcntl
import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from sortedcontainers import SortedList

from epistemic_kvcache.errors import (
    ConfigurationError,
    DiskFullError,
    StorageIOError,
    StoreClosedError,
    StoreError,
)
from epistemic_kvcache.options import DEFAULT_SEGMENT_BYTES, DEFAULT_STORE_OPTIONS, StoreOptions
from epistemic_kvcache.store import compaction
from epistemic_kvcache.store.api import (
    BlockData,
    ConsistencyReport,
    PutCond,
    PutResult,
    StoreHealth,
    check_block_size,
    owned_buffer,
    validate_cond,
    validate_namespace,
)
from epistemic_kvcache.store.checkpointer import Checkpointer
from epistemic_kvcache.store.codec import WarmCodec
from epistemic_kvcache.store.committer import Committer, settle
from epistemic_kvcache.store.disklog import DiskLogTier, GroupCommit, RegistryEpochs
from epistemic_kvcache.store.engine import (
    TieredEngine,
    digest_of,
)
from epistemic_kvcache.store.epochs import EpochRegistry
from epistemic_kvcache.store.index import (
    Index,
    pack_loc,
    unpack_loc,
)
from epistemic_kvcache.store.model import Ledger, _Blob, tenant_of
from epistemic_kvcache.store.opening import Opener
from epistemic_kvcache.store.plan import BatchOp as _Op
from epistemic_kvcache.store.plan import Plan, decide_batch, plan_evictions, plan_room
from epistemic_kvcache.store.ramview import RamView
from epistemic_kvcache.store.recovery import (
    Salvage,
)
from epistemic_kvcache.store.segments import (
    DiskIO,
    SyncFailed,
)
from epistemic_kvcache.store.space import Dirty, SegmentSpace

log = logging.getLogger(__name__)

__all__ = ["DiskIO", "SharedKvStoreBackend"]

_HOT_LOW_WATER = 0.8
"""When the hot tier refused a block (no room it could make without codec work), the tier
thread demotes to here."""


class SharedKvStoreBackend(TieredEngine):
    """Durable backend (`--backend durable`): hot + warm in RAM, the log on disk.

    Every acknowledged write is on stable storage; `close()` then reopen finds it. Only
    one process may open a persist directory at a time (an exclusive lock file).
    """

    def __init__(
        self,
        persist_dir: str | os.PathLike[str],
        options: StoreOptions = DEFAULT_STORE_OPTIONS,
        *,
        epoch_dir: str | os.PathLike[str] | None = None,
        shutdown_timeout_s: float = 30.0,
        codec: WarmCodec | None = None,
        io: DiskIO | None = None,
        progress: Any = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`epoch_dir`: the epoch registry (default `<persist_dir>/epochs`);
        `shutdown_timeout_s`: how long `close` waits for the committer and checkpointer;
        `io`: the disk calls (tests inject faults); `progress`: rebuild progress."""
        super().__init__(options, codec=codec, clock=clock)
        cold_capacity_bytes = options.cold_capacity_bytes
        segment_bytes = options.segment_bytes
        if segment_bytes is None:
            segment_bytes = min(DEFAULT_SEGMENT_BYTES, max(1 << 20, cold_capacity_bytes // 16))
        self._io = io or DiskIO()
        self.path = Path(persist_dir)
        self._seg_dir = self.path / "segments"
        self._space = SegmentSpace(
            self._seg_dir,
            self._lock,
            segment_bytes=segment_bytes,
            cold_capacity_bytes=cold_capacity_bytes,
            io=self._io,
        )
        self.live_capacity_bytes = cold_capacity_bytes - self._space.reserve
        """Live block bytes the cold tier holds before it evicts: the capacity less the
        reserve that compaction and deletes work in."""
        self._shutdown_timeout_s = shutdown_timeout_s
        self._progress = progress
        self._index_dir = self.path / "index"
        if self.path.exists() and not self.path.is_dir():
            raise ConfigurationError(f"invalid persist_dir: {str(self.path)!r} is not a directory")
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._seg_dir.mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            raise ConfigurationError(
                f"invalid persist_dir: cannot create {str(self.path)!r} ({exc.strerror})"
            ) from exc
        self._lock_fd = os.open(self.path / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._lock_fd)
            raise ConfigurationError(
                f"invalid persist_dir: {str(self.path)!r} is in use by another process"
            ) from exc
        # what opening finds (lost keys, damage, keys to restate, ...): filled by _open
        self._opened = Opener(
            self.path,
            self._space,
            map_size=options.map_size_bytes,
            rebuild=options.rebuild_index,
            say=self._say,
        )
        self._quarantined = self._opened.quarantined  # and every quarantine since
        self._inflight: dict[tuple[str, str], int] = {}
        self._core.inflight = self._inflight  # the committer decides those keys' PUTs
        self._batches = 0
        self._committed_ops = 0
        self._write_failures = 0
        self._index_repairs = 0
        self._recover_lock = threading.Lock()
        self._unfound: dict[bytes, tuple[int, int]] = {}
        self._recovering = True
        self._compact: compaction.Compactor | None = None
        epoch_path = Path(epoch_dir) if epoch_dir is not None else self.path / "epochs"
        self.epoch_dir = epoch_path
        self._ix: Index | None = None
        self._epochs: EpochRegistry | None = None
        try:
            private = self.path / "epochs"
            self._epochs = EpochRegistry(
                epoch_path,
                shared=epoch_path.resolve() != private.resolve(),
                max_scopes_per_tenant=options.max_epoch_scopes_per_tenant,
            )
            self._disk = DiskLogTier(self)
            self._relocate = self._disk.relocate  # for the compactor
            self._quarantine_async = self._disk.quarantine_async
            self._compose(
                sequencer=GroupCommit(self),
                lower=self._disk,
                epochs=RegistryEpochs(self._epochs, self._disk.live_tagged),
            )
            t0 = time.perf_counter()
            gc_was_enabled = gc.isenabled()
            gc.disable()  # loading N rows makes ~3N long-lived objects: no GC rescans
            try:
                ix = self._open()
            finally:
                if gc_was_enabled:
                    gc.enable()
            self.open_seconds = time.perf_counter() - t0
        except BaseException:
            self._release_files()
            raise
        self._recovering = False
        self._reader = RamView(
            self,
            live_capacity_bytes=self.live_capacity_bytes,
            relocate_blob=self._relocate,
            quarantine_async=self._quarantine_async,
            evict_segment=self._evict_segment,
            checkpoint_due=self._checkpoint_due,
        )
        self._compact = compaction.Compactor(self._space, self._reader)
        self._ckpt = Checkpointer(
            self._space,
            ix,
            self._reader,
            interval_s=options.checkpoint_interval_s,
            max_lag_bytes=options.max_checkpoint_lag_bytes,
            counters=self._persisted_counters,
        )
        self._tier_event = threading.Event()
        self._tier_stop = False
        self._tier_thread = threading.Thread(
            target=self._tier_loop, name="kvcache-tiers", daemon=True
        )
        self._committer = Committer(
            commit=self._commit,
            idle=self._idle,
            release=self._release,
            max_batch_bytes=options.commit_batch_bytes,
        )
        self._ckpt.start()
        self._tier_thread.start()
        self._committer.start()
        if self._opened.rewrite:
            # restored keys: their state goes into the log again (their record there is
            # damaged or followed by a quarantine's DEL), so no later rebuild needs the index
            ops = [_Op("rewrite", ns, key) for ns, key in self._opened.rewrite]
            self._submit_many(ops)
            concurrent.futures.wait([op.future for op in ops])
        log.info(
            "opened %d blocks, %d keys, %d segments in %.2f s (%s)",
            len(self._blobs),
            sum(len(v) for v in self._index.values()),
            len(self._space.segs),
            self.open_seconds,
            self.path,
        )

    def _release_files(self) -> None:
        for res in (self._ix, self._epochs):
            if res is not None:
                with contextlib.suppress(Exception):
                    res.close()
        self._space.segs.clear()
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)

    # -- open / recovery -----------------------------------------------------------------
    def _say(self, msg: str) -> None:
        log.info("%s", msg)
        if self._progress is not None:
            self._progress(msg)

    def _open(self) -> Index:
        """Open the log and index (`store/opening.py`), then load RAM from them."""
        o = self._opened
        opened = o.run()
        self._ix = opened.ix
        self._store_id = opened.store_id
        self._writer = self._space.writer
        self._quarantined = o.quarantined
        self._total.integrity_failures = int(o.integrity_failures)
        with self._lock:
            self._load(o.entries)
            self._apply(o.metas)
        # RAM holds them now: the rows loaded at open are not kept for the store's life
        # (they cost ~110 bytes per block: index RAM 566 -> 453 bytes per block)
        o.entries, o.metas = [], []
        return opened.ix

    def _load(
        self,
        entries: Iterable[tuple[str, str, bytes, int, int, int, tuple[str, int] | None, int]],
    ) -> None:
        """Fill an empty engine in bulk (opening a store): the same state as applying
        `AddKey` (+ `PinDelta`) per entry, built in a few passes (lock held).

        `entries`: (ns, key, scoped digest, size, segment, offset, epoch tag, pins)."""
        blobs = self._blobs
        glob = self.options.dedup_scope == "global"
        pins_of = self._pins
        by_ns: dict[str, dict[str, _Blob]] = {}
        for ns, key, sdig, size, seg, off, tag, pins in entries:
            b = blobs.get(sdig)
            if b is None:
                b = blobs[sdig] = _Blob(sdig, size)
                b.seg, b.off = seg, off
                b.owner = {} if glob else tenant_of(ns)
            b.refs += 1
            b.add_keyref((ns, key))
            if isinstance(b.owner, dict):
                t = tenant_of(ns)
                b.owner[t] = b.owner.get(t, 0) + 1
            idx = by_ns.get(ns)
            if idx is None:
                idx = by_ns[ns] = self._index.setdefault(ns, {})
            idx[key] = b
            if tag is not None:
                self._tags[(ns, key)] = tag
            if pins:
                pins_of[(ns, key)] = pins
                b.pins += pins
            c = self._counters(ns)
            c.total_refs += 1
            c.logical_bytes += b.size
        total = self._total
        for ns in by_ns:
            c = self._counters(ns)
            total.total_refs += c.total_refs
            total.logical_bytes += c.logical_bytes
            self._sorted[ns] = SortedList(self._index[ns])
        for b in blobs.values():
            Ledger.footprint(b, total, +1)
            for o in b.owners():
                Ledger.footprint(b, self._counters(o), +1)
            if b.pins:
                self._pinned_bytes += b.size
            self._lower.blob_created(b)

    @property
    def salvaged(self) -> Salvage | None:
        """What a rebuild took from the old index, and what it could not restore."""
        return self._opened.salvaged

    def disk_bytes(self) -> int:
        """Bytes of the segment files on disk (what the cold capacity bounds): their
        lengths less the dead payloads punched out, plus the zeroed space ahead."""
        return self._space.disk_bytes()

    def health(self) -> StoreHealth:
        fault = self._committer.fault
        if fault is not None or not self._committer.alive:
            return StoreHealth(
                ready=False,
                writable=False,
                committer_alive=False,
                reason=f"store fault: {fault or 'the committer stopped'}",
            )
        if self._closed:
            return StoreHealth(ready=False, writable=False, reason="the store is closed")
        if self._writer.room.refresh():
            return StoreHealth(
                ready=False, writable=False, disk_full=True, reason=f"disk full under {self.path}"
            )
        return StoreHealth()

    # -- the public operations -----------------------------------------------------------
    def put_many(
        self, ns: str, items: Sequence[tuple[str, BlockData]], *, cond: PutCond = None
    ) -> list[PutResult]:
        """Queue every item before waiting, so the batch shares one group commit.

        Every item is settled (stored or failed) before this returns or raises the first
        failure; items after a failed one may have been stored.
        """
        ns_raw = validate_namespace(ns)
        validate_cond(cond)
        for key, data in items:
            self._validate(ns, key)
            check_block_size(data, self.max_block_bytes)
        self._check_open()
        ops = []
        for key, given in items:  # hash everything first: then the committer sees them all
            data = owned_buffer(given)  # the hot tier keeps it (copied when mutable)
            digest = digest_of(data)
            sdig = self._scoped(ns_raw, digest)
            ops.append(_Op("put", ns, key, sdig=sdig, digest=digest, data=data, cond=cond))
        new = {op.sdig: op.nbytes for op in ops if op.sdig not in self._blobs}  # a hint
        self._make_hot_room(new.values())
        self._submit_many(ops)
        concurrent.futures.wait([op.future for op in ops])
        return [op.future.result() for op in ops]

    def delete(self, ns: str, key: str) -> bool:
        self._validate(ns, key)
        self._check_open()
        return bool(self._call(_Op("delete", ns, key)))

    def delete_many(self, ns: str, keys: Sequence[str]) -> list[bool]:
        for key in keys:
            self._validate(ns, key)
        self._check_open()
        ops = [_Op("delete", ns, key) for key in keys]
        self._submit_many(ops)
        concurrent.futures.wait([op.future for op in ops])
        return [bool(op.future.result()) for op in ops]

    def flush(self, ns: str) -> int:
        validate_namespace(ns)
        self._check_open()
        return int(self._call(_Op("flush", ns, "")))

    def pin(self, ns: str, key: str) -> bool:
        self._validate(ns, key)
        self._check_open()
        return bool(self._call(_Op("pin", ns, key)))

    def unpin(self, ns: str, key: str) -> bool:
        self._validate(ns, key)
        self._check_open()
        return bool(self._call(_Op("unpin", ns, key)))

    def _call(self, op: _Op) -> Any:
        self._submit(op)
        return op.future.result()

    def _submit(self, op: _Op) -> None:
        self._submit_many([op])

    def _submit_many(self, ops: list[_Op]) -> None:
        if self._closed:
            raise StoreClosedError("the store is closed")
        with self._lock:
            for op in ops:
                if op.key:
                    ref = (op.ns, op.key)
                    self._inflight[ref] = self._inflight.get(ref, 0) + 1
        try:
            self._committer.submit_many(ops)
        except StoreError:
            self._release(ops)
            raise

    def _release(self, ops: list[_Op]) -> None:
        """Ops that will not be committed (dropped, failed): no longer in flight."""
        with self._lock:
            self._release_locked(ops)

    def _release_locked(self, ops: list[_Op]) -> None:
        for op in ops:
            if op.key:
                ref = (op.ns, op.key)
                n = self._inflight.get(ref, 1) - 1
                if n > 0:
                    self._inflight[ref] = n
                else:
                    self._inflight.pop(ref, None)

    # -- the committer -------------------------------------------------------------------
    def _commit(self, batch: list[_Op]) -> None:
        """Decide (`plan.decide_batch`), write + sync once, apply, answer (committer thread)."""
        incoming = sum(op.nbytes for op in batch if op.kind == "put")
        if incoming and self._compact is not None:
            # Room first, so the files never outgrow the cold capacity: evict what the new
            # blocks displace (a batch of its own), then compact the space it frees.
            self._pre_evict(incoming)
            self._compact.make_disk_room(incoming)
        self._ckpt.wait_for_lag()
        p = decide_batch(self._reader, batch)
        res = self._write(p)
        if isinstance(res, StoreError):
            for op in batch:
                settle(op.future, res)
            self._release(batch)
            return
        self._finish(p, batch, *res)

    def _pre_evict(self, incoming: int) -> None:
        """Commit the evictions `incoming` new bytes will need, before their batch."""
        with self._lock:
            over = self._total.cold_bytes + incoming - self.live_capacity_bytes
        if over <= 0:
            return
        p = plan_room(self._reader, incoming)
        if p is None:
            return
        res = self._write(p)
        if not isinstance(res, StoreError):
            self._finish(p, [], *res)

    def _evict_segment(self, sid: int) -> bool:
        """Evict every unpinned block stored in segment `sid` (a batch of its own), so
        the segment can be deleted without copying them (committer thread)."""
        with self._lock:
            victims = [b.sdig for b in self._blobs.values() if b.seg == sid and not b.pins]
        if not victims:
            return True
        p = plan_evictions(self._reader, victims)
        if not p.records:
            return True
        res = self._write(p)
        if isinstance(res, StoreError):
            return False
        self._finish(p, [], *res)
        return True

    def _write(self, p: Plan) -> tuple[list[tuple[int, int]], list[tuple[int, int]]] | StoreError:
        """Place the plan's records and write + sync them once: ((segment, offset) of each
        record, (segment, new end) of each segment written), or the error to answer (the
        batch undone)."""
        w = self._writer
        w.begin()
        positions = [w.alloc(hdr, payload) for hdr, payload in p.records]
        if not positions:
            return positions, []
        try:
            return positions, w.write(reserve_ok=not p.new_data)
        except SyncFailed as exc:
            for sid, end in w.abandon():
                self._space.seg_len[sid] = min(self._space.seg_len.get(sid, end), end)
            return self._io_error(exc.cause, "sync")
        except OSError as exc:
            w.rollback()
            return self._io_error(exc, "write")

    def _io_error(self, exc: OSError, what: str) -> StoreError:
        self._write_failures += 1
        log.error("log %s under %s failed: %s", what, self.path, exc)
        if exc.errno == errno.ENOSPC:
            return DiskFullError(f"disk full under {self.path}: nothing was stored")
        return StorageIOError(f"write to {self.path} failed: {exc}; nothing was stored")

    def _finish(
        self,
        p: Plan,
        batch: list[_Op],
        positions: list[tuple[int, int]],
        written: list[tuple[int, int]],
    ) -> None:
        """The batch is durable: apply it to RAM, answer, mark the rows for the checkpointer."""
        p.resolve(positions)
        key_recs = {
            ref: (pack_loc(*positions[i]) if i is not None else None)
            for ref, i in p.key_recs.items()
        }
        meta_recs = {
            mk: ((pack_loc(*positions[r[0]]), r[1]) if r is not None else None)
            for mk, r in p.meta_recs.items()
        }
        tomb: dict[int, int] = {}
        for i in p.tombs:
            sid = positions[i][0]
            tomb[sid] = tomb.get(sid, 0) + len(p.records[i][0])
        w = self._writer
        with self._lock:
            dirty = self._space.dirty  # (swapped by the checkpointer under this lock)
            # where the blobs this batch may destroy are: their bytes go back to the disk
            doomed = {}
            for sdig in [*(d for d, n in p.ref_delta.items() if n < 0), *p.dropped]:
                b = self._blobs.get(sdig)
                if b is not None and b.seg >= 0 and sdig not in p.quarantine:
                    doomed[sdig] = (b, b.seg, b.off, b.size)
            for ns, key in key_recs:  # the old record of each rewritten key goes dead
                old = self._space.kloc.get(ns, {}).get(key)
                b = self._lookup(ns, key)
                if old is not None and b is not None:
                    self._space.count_key_rec(old, ns, key, b.sdig, self._tags.get((ns, key)), -1)
            for mk in meta_recs:
                om = self._space.mloc.pop(mk, None)
                if om is not None:
                    sid = unpack_loc(om[0])[0]
                    self._space.seg_live[sid] = self._space.seg_live.get(sid, 0) - om[1]
            self._apply(p.effects)
            for (ns, key), rec in key_recs.items():
                locs = self._space.kloc.get(ns)
                b = self._lookup(ns, key)
                if rec is None or b is None:
                    if locs is not None:
                        locs.pop(key, None)
                        if not locs:
                            del self._space.kloc[ns]
                    continue
                self._space.kloc.setdefault(ns, {})[key] = rec
                tag = self._tags.get((ns, key))
                self._space.count_key_rec(rec, ns, key, b.sdig, tag, +1)
            dirty.keys.update(key_recs)
            for mk, mrec in meta_recs.items():
                if mrec is not None:
                    self._space.mloc[mk] = mrec
                    sid = unpack_loc(mrec[0])[0]
                    self._space.seg_live[sid] = self._space.seg_live.get(sid, 0) + mrec[1]
            dirty.metas.update(meta_recs)
            dirty.blobs.update(p.placed, p.ref_delta, p.dropped)
            for sid, n in tomb.items():
                self._space.seg_tomb[sid] = self._space.seg_tomb.get(sid, 0) + n
            for sid, end in written:
                self._space.seg_len[sid] = end
            dirty.segs.update(tomb, (sid for sid, _e in written))
            self._quarantined.update(p.quarantine)
            dirty.quarantine.update(p.quarantine)
            for op, res, deduped in zip(batch, p.results, p.deduped, strict=True):
                if op.kind == "put" and isinstance(res, PutResult):
                    self._count_put(op.ns, res.outcome, deduped)
            self._release_locked(batch)
            self._batches += 1
            self._committed_ops += len(batch)
            if w.active is not None:
                self._space.log_end = (w.active.id, w.pos)
            dead = [
                (sid, off, size)
                for sdig, (b, sid, off, size) in doomed.items()
                if self._blobs.get(sdig) is not b
            ]
        for op, res in zip(batch, p.results, strict=True):
            settle(op.future, res)
        if dead:
            self._space.punch(dead)
        self._checkpoint_due(w.last_batch_bytes)

    # -- background threads ----------------------------------------------------------------
    def _idle(self) -> bool:
        """Maintenance between batches (committer thread): compaction, in small steps."""
        if self._compact is None or self._closed:
            return False
        return self._compact.step()

    def _tier_loop(self) -> None:
        """Keep room in the hot tier for new blocks (demotion runs off the committer)."""
        while not self._tier_stop:
            if not self._tier_event.wait(1.0):
                continue
            self._tier_event.clear()
            if self._tier_stop:
                return
            try:
                self._rebalance(int(_HOT_LOW_WATER * self.options.hot_capacity_bytes))
            except Exception:  # a tier move never takes the store down
                log.exception("tier rebalance failed")

    def _persisted_counters(self) -> dict[str, int]:
        return {"integrity_failures": self._total.integrity_failures}

    def _checkpoint_due(self, nbytes: int) -> None:
        self._ckpt.due(nbytes)

    def checkpoint(self) -> bool:
        """Write the dirty rows to the index now (True when it is up to date)."""
        return self._ckpt.checkpoint()

    # -- checks and shutdown -------------------------------------------------------------
    def lost_keys(self) -> list[tuple[str, str, str]]:
        """Keys whose bytes were found missing at open: (namespace, key, digest hex)."""
        return [(ns, key, d.hex()) for ns, key, d in self._opened.lost]

    def check(self, *, deep: bool = False) -> ConsistencyReport:
        """RAM invariants, every block inside a segment's trusted bytes (`deep`: re-hash)."""
        with self._space.maint_lock:
            report = ConsistencyReport()
            with self._lock:
                self._base_check(report)
                blobs = [(b.sdig, b.size, b.seg, b.off) for b in self._blobs.values()]
                segs = dict(self._space.segs)
                ends = dict(self._space.seg_len)
            report.lost_keys = [f"{ns}/{key}" for ns, key, _d in self._opened.lost]
            for sdig, size, sid, off in blobs:
                name = sdig[-32:].hex()
                seg = segs.get(sid)
                if seg is None or off + size > ends.get(sid, -1) or off + size > seg.size():
                    report.orphan_index_entries.append(f"blob {name} outside segment {sid}")
                    continue
                if deep and digest_of(seg.read(off, size)) != sdig[-32:]:
                    report.corrupt_blobs.append(name)
            return report

    def _close_without_checkpoint(self) -> None:
        """Stop as a crash right after the last acknowledged write would: every write is
        in the log, the index is left wherever its last checkpoint put it (tests)."""
        self._ckpt.stop(self._shutdown_timeout_s)
        with self._lock:
            self._space.dirty = Dirty()
            self._space.log_end = self._space.ckpt_pos
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        done = self._committer.stop(self._shutdown_timeout_s)
        if not done:
            log.error("the committer did not stop within %.0f s", self._shutdown_timeout_s)
        with self._lock:
            self._closed = True
        self._tier_stop = True
        self._tier_event.set()
        self._ckpt.stop(self._shutdown_timeout_s)
        if done:
            # the log's files end where its last batch does (no zeroed space after it:
            # the next open has nothing to drop), and the index is current (it replays
            # nothing)
            try:
                self._writer.cut_zeroed_tail()
            except OSError as exc:
                log.warning("cutting the zeroed space after the log's end failed: %s", exc)
            self.checkpoint()
        self._tier_thread.join(5.0)
        self._release_files()
