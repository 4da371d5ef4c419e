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
   apply to RAM, and each operation's answer. RAM is read through `RamState`'s public
   API (`store/ram.py`).
3. The plan's records are placed and written to the active segment and `fdatasync`ed
   once (`store/segments.py`, driven by `store/batches.py`): then, and only then, its
   effects are applied to RAM, the segment space applies its half of the batch
   (`store/space.py`) and the callers are answered. An acknowledged write is in the log;
   an unacknowledged one is invisible. One sync per batch.
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
import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from epistemic_kvcache.errors import ConfigurationError
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
from epistemic_kvcache.store.batches import Batches
from epistemic_kvcache.store.checkpointer import Checkpointer
from epistemic_kvcache.store.codec import WarmCodec
from epistemic_kvcache.store.committer import Committer
from epistemic_kvcache.store.disklog import DiskLogTier, DurableLog, GroupCommit, RegistryEpochs
from epistemic_kvcache.store.engine import TieredEngine, digest_of
from epistemic_kvcache.store.epochs import EpochRegistry
from epistemic_kvcache.store.index import Index
from epistemic_kvcache.store.opening import Opener, lock_persist_dir
from epistemic_kvcache.store.plan import BatchOp as _Op
from epistemic_kvcache.store.recovery import Salvage
from epistemic_kvcache.store.segments import DiskIO
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
        self.space = SegmentSpace(
            self.path / "segments",
            self.ram.lock,
            segment_bytes=segment_bytes,
            cold_capacity_bytes=cold_capacity_bytes,
            io=self._io,
        )
        """The log's segments and their accounting (store/space.py)."""
        self.live_capacity_bytes = cold_capacity_bytes - self.space.reserve
        """Live block bytes the cold tier holds before it evicts: the capacity less the
        reserve that compaction and deletes work in."""
        self.ram.live_capacity_bytes = self.live_capacity_bytes
        self._shutdown_timeout_s = shutdown_timeout_s
        self._progress = progress
        self._lock_fd = self._lock_dir()
        # what opening finds (lost keys, damage, keys to restate, ...)
        opener = Opener(
            self.path,
            self.space,
            map_size=options.map_size_bytes,
            rebuild=options.rebuild_index,
            say=self._say,
        )
        self.log = DurableLog(self.ram, self.space, opener, self.path)
        """The log side: what opening found, the committer, the checkpointer, counters."""
        self.recovering = True
        self._ix: Index | None = None
        self._epochs: EpochRegistry | None = None
        epoch_path = Path(epoch_dir) if epoch_dir is not None else self.path / "epochs"
        self.epoch_dir = epoch_path
        try:
            self._epochs = EpochRegistry(
                epoch_path,
                shared=epoch_path.resolve() != (self.path / "epochs").resolve(),
                max_scopes_per_tenant=options.max_epoch_scopes_per_tenant,
            )
            disk = DiskLogTier(self.ram, self.log)
            self._batches = Batches(self.ram, self.log, disk)
            self._compose(
                sequencer=GroupCommit(self.ram, self.log, self.catalog),
                lower=disk,
                epochs=RegistryEpochs(self._epochs, self.ram.tagged),
            )
            t0 = time.perf_counter()
            gc_was_enabled = gc.isenabled()
            gc.disable()  # loading N rows makes ~3N long-lived objects: no GC rescans
            try:
                ix = self._open(opener)
            finally:
                if gc_was_enabled:
                    gc.enable()
            self.open_seconds = time.perf_counter() - t0
        except BaseException:
            self._release_files()
            raise
        self.recovering = False
        self._compact: compaction.Compactor | None
        self._batches.compactor = self._compact = compaction.Compactor(
            self.space, self.ram, self._batches
        )
        self.log.ckpt = self._ckpt = Checkpointer(
            self.space,
            ix,
            self.ram,
            interval_s=options.checkpoint_interval_s,
            max_lag_bytes=options.max_checkpoint_lag_bytes,
            counters=self._persisted_counters,
        )
        self._tier_stop = False
        self._tier_thread = threading.Thread(
            target=self._tier_loop, name="kvcache-tiers", daemon=True
        )
        self.log.committer = self._committer = Committer(
            commit=self._batches.commit,
            idle=self._idle,
            release=self.log.release,
            max_batch_bytes=options.commit_batch_bytes,
        )
        self._ckpt.start()
        self._tier_thread.start()
        self._committer.start()
        if opener.rewrite:
            # restored keys: their state goes into the log again (their record there is
            # damaged or followed by a quarantine's DEL), so no later rebuild needs the index
            ops = [_Op("rewrite", ns, key) for ns, key in opener.rewrite]
            self.log.submit_many(ops)
            concurrent.futures.wait([op.future for op in ops])
        blobs, keys = self.ram.summary()
        log.info(
            "opened %d blocks, %d keys, %d segments in %.2f s (%s)",
            blobs,
            keys,
            len(self.space.segs),
            self.open_seconds,
            self.path,
        )

    def _lock_dir(self) -> int:
        """Create the persist dir if needed and lock it for this process (its fd)."""
        if self.path.exists() and not self.path.is_dir():
            raise ConfigurationError(f"invalid persist_dir: {str(self.path)!r} is not a directory")
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.space.dir.mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            raise ConfigurationError(
                f"invalid persist_dir: cannot create {str(self.path)!r} ({exc.strerror})"
            ) from exc
        return lock_persist_dir(self.path)

    def _release_files(self) -> None:
        for res in (self._ix, self._epochs):
            if res is not None:
                with contextlib.suppress(Exception):
                    res.close()
        self.space.segs.clear()
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)

    # -- open / recovery -----------------------------------------------------------------
    def _say(self, msg: str) -> None:
        log.info("%s", msg)
        if self._progress is not None:
            self._progress(msg)

    def _open(self, o: Opener) -> Index:
        """Open the log and index (`store/opening.py`), then load RAM from them."""
        opened = o.run()
        self._ix = opened.ix
        self._store_id = opened.store_id
        self.log.quarantined = o.quarantined
        self.ram.total.integrity_failures = int(o.integrity_failures)
        with self.ram.lock:
            self.ram.load_locked(o.entries)
            self.ram.apply_locked(o.metas)
        # RAM holds them now: the rows loaded at open are not kept for the store's life
        # (they cost ~110 bytes per block: index RAM 566 -> 453 bytes per block)
        o.entries, o.metas = [], []
        return opened.ix

    @property
    def salvaged(self) -> Salvage | None:
        """What a rebuild took from the old index, and what it could not restore."""
        return self.log.opened.salvaged

    def disk_bytes(self) -> int:
        """Bytes of the segment files on disk (what the cold capacity bounds): their
        lengths less the dead payloads punched out, plus the zeroed space ahead."""
        return self.space.disk_bytes()

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
        if self.log.disk_full():
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
        ram = self.ram
        ns_raw = validate_namespace(ns)
        validate_cond(cond)
        for key, data in items:
            ram.validate(ns, key)
            check_block_size(data, self.max_block_bytes)
        self.check_open()
        ops = []
        for key, given in items:  # hash everything first: then the committer sees them all
            data = owned_buffer(given)  # the hot tier keeps it (copied when mutable)
            digest = digest_of(data)
            sdig = ram.scoped(ns_raw, digest)
            ops.append(_Op("put", ns, key, sdig=sdig, digest=digest, data=data, cond=cond))
        new = {op.sdig: op.nbytes for op in ops if not ram.has_blob(op.sdig)}  # a hint
        ram.tiers.make_hot_room(new.values())
        self.log.submit_many(ops)
        concurrent.futures.wait([op.future for op in ops])
        return [op.future.result() for op in ops]

    def delete(self, ns: str, key: str) -> bool:
        self.ram.validate(ns, key)
        self.check_open()
        return bool(self.log.call(_Op("delete", ns, key)))

    def delete_many(self, ns: str, keys: Sequence[str]) -> list[bool]:
        for key in keys:
            self.ram.validate(ns, key)
        self.check_open()
        ops = [_Op("delete", ns, key) for key in keys]
        self.log.submit_many(ops)
        concurrent.futures.wait([op.future for op in ops])
        return [bool(op.future.result()) for op in ops]

    def flush(self, ns: str) -> int:
        validate_namespace(ns)
        self.check_open()
        return int(self.log.call(_Op("flush", ns, "")))

    def pin(self, ns: str, key: str) -> bool:
        self.ram.validate(ns, key)
        self.check_open()
        return bool(self.log.call(_Op("pin", ns, key)))

    def unpin(self, ns: str, key: str) -> bool:
        self.ram.validate(ns, key)
        self.check_open()
        return bool(self.log.call(_Op("unpin", ns, key)))

    # -- background threads ----------------------------------------------------------------
    def _idle(self) -> bool:
        """Maintenance between batches (committer thread): compaction, in small steps."""
        if self._closed or self._compact is None:
            return False
        return self._compact.step()

    def _tier_loop(self) -> None:
        """Keep room in the hot tier for new blocks (demotion runs off the committer)."""
        event = self.log.tier_event
        while not self._tier_stop:
            if not event.wait(1.0):
                continue
            event.clear()
            if self._tier_stop:
                return
            try:
                self.ram.tiers.rebalance(int(_HOT_LOW_WATER * self.options.hot_capacity_bytes))
            except Exception:  # a tier move never takes the store down
                log.exception("tier rebalance failed")

    def _persisted_counters(self) -> dict[str, int]:
        return {"integrity_failures": self.ram.total.integrity_failures}

    def checkpoint(self) -> bool:
        """Write the dirty rows to the index now (True when it is up to date)."""
        return self._ckpt.checkpoint()

    # -- checks and shutdown -------------------------------------------------------------
    def lost_keys(self) -> list[tuple[str, str, str]]:
        """Keys whose bytes were found missing at open: (namespace, key, digest hex)."""
        return [(ns, key, d.hex()) for ns, key, d in self.log.opened.lost]

    def check(self, *, deep: bool = False) -> ConsistencyReport:
        """RAM invariants, every block inside a segment's trusted bytes (`deep`: re-hash)."""
        sp = self.space
        with sp.maint_lock:
            report = ConsistencyReport()
            with self.ram.lock:
                self.ram.check_locked(report)
                blobs = [(b.sdig, b.size, b.seg, b.off) for b in self.ram.blob_list_locked()]
                segs = dict(sp.segs)
                ends = dict(sp.seg_len)
            report.lost_keys = [f"{ns}/{key}" for ns, key, _d in self.log.opened.lost]
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
        with self.ram.lock:
            self.space.dirty = Dirty()
            self.space.log_end = self.space.ckpt_pos
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        done = self._committer.stop(self._shutdown_timeout_s)
        if not done:
            log.error("the committer did not stop within %.0f s", self._shutdown_timeout_s)
        with self.ram.lock:
            self._closed = self.log.closed = True
        self._tier_stop = True
        self.log.tier_event.set()
        self._ckpt.stop(self._shutdown_timeout_s)
        if done:
            # the log's files end where its last batch does (no zeroed space after it:
            # the next open has nothing to drop), and the index is current (it replays
            # nothing)
            try:
                self.space.writer.cut_zeroed_tail()
            except OSError as exc:
                log.warning("cutting the zeroed space after the log's end failed: %s", exc)
            self.checkpoint()
        self._tier_thread.join(5.0)
        self._release_files()
