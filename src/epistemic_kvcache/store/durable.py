"""The durable backend: a log of self-describing records, an LMDB checkpoint, RAM tiers.

How a write becomes durable
---------------------------
1. The caller's thread validates, hashes (BLAKE3) and, when the PUT writes nothing (the
   key already holds these bytes, or a condition refuses it), answers at once. Otherwise
   it queues an operation for the committer (`store/committer.py`) and waits.
2. The committer takes every queued operation (group commit) and decides each one
   against RAM as the earlier operations of the same batch left it (`_View`), emitting
   log records (`store/records.py`) into the batch: a BLOB record for new bytes, a KEY
   record with the key's whole new state, DEL tombstones, snapshot/branch records.
3. The batch is written to the active segment and `fdatasync`ed once
   (`store/segments.py`): then, and only then, its effects are applied to RAM and the
   callers answered. An acknowledged write is in the log; an unacknowledged one is
   invisible. One sync per batch.
4. The row changes of the batch go to the checkpointer thread, which writes them to the
   LMDB index (`store/index.py`) in the background, a few times a second, and moves the
   checkpoint position. Opening loads the index and replays the log after the checkpoint
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
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epistemic_kvcache.errors import (
    CapacityError,
    ConfigurationError,
    DiskFullError,
    NotFoundError,
    StorageIOError,
    StoreClosedError,
    StoreError,
)
from epistemic_kvcache.store import compaction, records
from epistemic_kvcache.store.api import (
    BlockData,
    Buffer,
    ConsistencyReport,
    PutCond,
    PutOutcome,
    PutResult,
    StoreHealth,
    decide_put,
    owned_buffer,
    validate_cond,
    validate_namespace,
)
from epistemic_kvcache.store.codec import WarmCodec
from epistemic_kvcache.store.committer import Committer, settle
from epistemic_kvcache.store.engine import (
    AddKey,
    DedupScope,
    DelKey,
    Effect,
    MetaDel,
    MetaPut,
    Move,
    PinDelta,
    TieredEngine,
    _Blob,
    branch_ns,
    digest_of,
    parse_internal_ns,
    snapshot_ns,
    tenant_of,
)
from epistemic_kvcache.store.epochs import DEFAULT_MAX_SCOPES_PER_TENANT, EpochRegistry
from epistemic_kvcache.store.index import (
    FORMAT_VERSION,
    OLD_FORMATS,
    Changes,
    Index,
    IndexError_,
    KeyState,
    create_index,
    open_index,
    pack_loc,
    unpack_loc,
)
from epistemic_kvcache.store.records import Op
from epistemic_kvcache.store.recovery import (
    META_CODES,
    LogState,
    Salvage,
    StoreMismatchError,
    finish,
    load_index,
    read_seals,
    replay,
    reverify_quarantine,
    salvage,
    valid_ends,
)
from epistemic_kvcache.store.seams import Started, Tag
from epistemic_kvcache.store.segments import (
    DELETE_RESERVE_BYTES,
    PUNCH_ALIGN,
    Damage,
    DiskIO,
    LogWriter,
    Segment,
    SyncFailed,
    scan,
    seg_id_of,
)

log = logging.getLogger(__name__)

__all__ = ["DiskIO", "SharedKvStoreBackend"]

DEFAULT_SEGMENT_BYTES = 256 << 20
_CHECKPOINT_TRIGGER_BYTES = 32 << 20
"""Log bytes after which the checkpointer runs without waiting for its interval."""
_HOT_LOW_WATER = 0.8
"""When the hot tier refused a block (no room it could make without codec work), the tier
thread demotes to here."""


def _rebuild_hint(path: Path) -> str:
    return (
        f"run `epistemic-kvcache store rebuild-index --persist-dir {path}` "
        "(or start the server with --rebuild-index)"
    )


@dataclass(slots=True)
class _Op:
    kind: str  # put | delete | pin | unpin | quarantine | snapshot | drop | meta_put |
    #            retire | flush
    ns: str
    key: str
    sdig: bytes = b""
    digest: bytes = b""
    data: Buffer | None = None
    deduped: bool = False  # a new key whose bytes were already stored
    loc: tuple[int, int] = (-1, 0)  # quarantine: (segment, offset) of the copy that failed
    tag: tuple[str, int] | None = None  # put: the epoch tag to write with the entry
    payload: Any = None  # snapshot / drop / meta_put arguments
    cond: PutCond = None
    future: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)

    @property
    def nbytes(self) -> int:
        return len(self.data) if self.data is not None else 0


@dataclass(slots=True)
class _KS:
    """A key's state while a batch is decided."""

    sdig: bytes
    size: int
    pins: int
    tag: tuple[str, int] | None


class _View:
    """RAM as the earlier operations of this batch left it (nothing applied yet)."""

    def __init__(self, store: SharedKvStoreBackend) -> None:
        self.s = store
        self.keys: dict[tuple[str, str], _KS | None] = {}
        self.ref_delta: dict[bytes, int] = {}
        self.placed: dict[bytes, tuple[int, int, int]] = {}  # size, segment, payload offset
        self.added: dict[bytes, list[tuple[str, str]]] = {}
        self.metas: dict[tuple[str, str, str], dict[str, Any] | None] = {}
        self.effects: list[Effect] = []
        self.key_recs: dict[tuple[str, str], tuple[int, int] | None] = {}
        self.meta_recs: dict[tuple[str, str, str], tuple[int, int] | None] = {}
        self.tomb: dict[int, int] = {}
        self.quarantine: dict[bytes, float] = {}
        self.new_bytes = 0
        self.freed = 0
        self.dropped: set[bytes] = set()
        self.touched: set[bytes] = set()
        self.pinned_extra: dict[str, int] = {}
        self.new_data = False
        self.segdel: list[int] = []

    def key(self, ns: str, key: str) -> _KS | None:
        ref = (ns, key)
        if ref in self.keys:
            return self.keys[ref]
        s = self.s
        with s._lock:
            b = s._lookup(ns, key)
            if b is None:
                return None
            return _KS(b.sdig, b.size, s._pins.get(ref, 0), s._tags.get(ref))

    def refs(self, sdig: bytes) -> int:
        b = self.s._blobs.get(sdig)
        return (b.refs if b is not None else 0) + self.ref_delta.get(sdig, 0)

    def blob_loc(self, sdig: bytes) -> tuple[int, int, int] | None:
        """(size, segment, payload offset) of a blob that exists after the batch so far."""
        if self.refs(sdig) <= 0:
            return None
        if sdig in self.placed:
            return self.placed[sdig]
        b = self.s._blobs.get(sdig)
        if b is None:
            return None
        return b.size, b.seg, b.off

    def incref(self, sdig: bytes, ref: tuple[str, str]) -> None:
        self.ref_delta[sdig] = self.ref_delta.get(sdig, 0) + 1
        self.added.setdefault(sdig, []).append(ref)
        self.touched.add(sdig)

    def decref(self, sdig: bytes) -> None:
        self.ref_delta[sdig] = self.ref_delta.get(sdig, 0) - 1

    def meta(self, kind: str, tenant: str, rid: str) -> dict[str, Any] | None:
        k = (kind, tenant, rid)
        if k in self.metas:
            return self.metas[k]
        return self.s._meta(kind).get(tenant, {}).get(rid)

    def ns_keys(self, ns: str) -> list[str]:
        """Keys of `ns` as this batch sees them (RAM's, plus this batch's additions)."""
        with self.s._lock:
            names = list(self.s._index.get(ns) or ())
        extra = [k for (n, k), st in self.keys.items() if n == ns and st is not None]
        return list(dict.fromkeys([*names, *extra]))


@dataclass(slots=True)
class _Dirty:
    """What changed since the last checkpoint: the index rows to rewrite from RAM."""

    keys: set[tuple[str, str]] = field(default_factory=set)
    blobs: set[bytes] = field(default_factory=set)
    metas: set[tuple[str, str, str]] = field(default_factory=set)
    segs: set[int] = field(default_factory=set)
    quarantine: dict[bytes, float] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.keys or self.blobs or self.metas or self.segs or self.quarantine)

    def merge(self, later: _Dirty) -> None:
        self.keys |= later.keys
        self.blobs |= later.blobs
        self.metas |= later.metas
        self.segs |= later.segs
        self.quarantine.update(later.quarantine)


class SharedKvStoreBackend(TieredEngine):
    """Durable backend (`--backend durable`): hot + warm in RAM, the log on disk.

    Every acknowledged write is on stable storage; `close()` then reopen finds it. Only
    one process may open a persist directory at a time (an exclusive lock file).
    """

    def __init__(
        self,
        persist_dir: str | os.PathLike[str],
        *,
        hot_capacity_bytes: int = 1 << 30,
        warm_capacity_bytes: int = 1 << 30,
        cold_capacity_bytes: int = 100 << 30,
        max_block_bytes: int = 128 << 20,
        dedup_scope: DedupScope = "namespace",
        codec: WarmCodec | None = None,
        max_pinned_fraction: float = 0.5,
        max_snapshots_per_tenant: int = 256,
        max_keys_per_tenant: int = 0,
        max_epoch_scopes_per_tenant: int = DEFAULT_MAX_SCOPES_PER_TENANT,
        segment_bytes: int | None = None,
        map_size_bytes: int = 64 << 30,
        max_batch_bytes: int = 512 << 20,
        checkpoint_interval_s: float = 1.0,
        max_checkpoint_lag_bytes: int = 512 << 20,
        shutdown_timeout_s: float = 30.0,
        rebuild_index: bool = False,
        io: DiskIO | None = None,
        epoch_dir: str | os.PathLike[str] | None = None,
        first_write_wins: bool | frozenset[str] = False,
        progress: Any = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(
            clock=clock,
            hot_capacity_bytes=hot_capacity_bytes,
            warm_capacity_bytes=warm_capacity_bytes,
            max_block_bytes=max_block_bytes,
            dedup_scope=dedup_scope,
            codec=codec,
            max_pinned_fraction=max_pinned_fraction,
            max_snapshots_per_tenant=max_snapshots_per_tenant,
            max_keys_per_tenant=max_keys_per_tenant,
            first_write_wins=first_write_wins,
            max_epoch_scopes_per_tenant=max_epoch_scopes_per_tenant,
        )
        if not isinstance(cold_capacity_bytes, int) or cold_capacity_bytes <= 0:
            raise ConfigurationError(
                f"invalid cold_capacity_bytes: expected a positive integer "
                f"(got {cold_capacity_bytes!r})"
            )
        self.cold_capacity_bytes = cold_capacity_bytes
        if segment_bytes is None:
            segment_bytes = min(DEFAULT_SEGMENT_BYTES, max(1 << 20, cold_capacity_bytes // 16))
        self._segment_bytes = segment_bytes
        # room kept free inside the cold capacity for compaction and deletes
        # room kept free inside the cold capacity: two segments (at most an eighth) for
        # compaction to copy into, and the allocated space deletes write into
        self._delete_reserve = min(DELETE_RESERVE_BYTES, cold_capacity_bytes // 8)
        self._reserve = min(2 * segment_bytes, cold_capacity_bytes // 8) + self._delete_reserve
        self.live_capacity_bytes = cold_capacity_bytes - self._reserve
        """Live block bytes the cold tier holds before it evicts: the capacity less the
        reserve that compaction and deletes work in."""
        self._max_batch_bytes = max_batch_bytes
        self._ckpt_interval = checkpoint_interval_s
        self._max_lag = max_checkpoint_lag_bytes
        self._shutdown_timeout_s = shutdown_timeout_s
        self._io = io or DiskIO()
        self._progress = progress
        self.path = Path(persist_dir)
        self._seg_dir = self.path / "segments"
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
        # state filled by _open
        self._segs: dict[int, Segment] = {}
        self._seg_len: dict[int, int] = {}  # valid end of each segment
        self._seg_live: dict[int, int] = {}  # bytes of live records per segment
        self._seg_tomb: dict[int, int] = {}  # bytes of tombstones per segment
        self._kloc: dict[str, dict[str, int]] = {}  # record location of each key's state
        self._mloc: dict[tuple[str, str, str], tuple[int, int]] = {}  # (location, bytes)
        self._quarantined: dict[bytes, float] = {}
        self._lost: list[tuple[str, str, bytes]] = []
        self._damage: list[tuple[int, int, int, str]] = []
        self._missing_segments: list[int] = []
        self._inflight: dict[tuple[str, str], int] = {}
        self._batches = 0
        self._committed_ops = 0
        self._write_failures = 0
        self._compactions = 0
        self._compacted_bytes = 0
        self._segments_deleted = 0
        self._checkpoints = 0
        self._checkpoint_failures = 0
        self._index_repairs = 0
        self._seg_punched: dict[int, int] = {}  # bytes of dead payloads punched out
        self._punched_bytes = 0
        self._punch_ok = True
        self._rewrite: list[tuple[str, str]] = []  # keys whose state the log must state again
        self.salvaged: Salvage | None = None
        """What a rebuild took from the old index, and what it could not restore."""
        self._recover_lock = threading.Lock()
        self._unfound: dict[bytes, tuple[int, int]] = {}
        self._recovering = True
        self._compact: compaction.Compactor | None = None
        self._maint_lock = threading.Lock()
        epoch_path = Path(epoch_dir) if epoch_dir is not None else self.path / "epochs"
        self.epoch_dir = epoch_path
        self._ix: Index | None = None
        self._epochs: EpochRegistry | None = None
        try:
            private = self.path / "epochs"
            self._epochs = EpochRegistry(
                epoch_path,
                shared=epoch_path.resolve() != private.resolve(),
                max_scopes_per_tenant=max_epoch_scopes_per_tenant,
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
                self._open(map_size_bytes, rebuild_index)
            finally:
                if gc_was_enabled:
                    gc.enable()
            self.open_seconds = time.perf_counter() - t0
        except BaseException:
            self._release_files()
            raise
        self._recovering = False
        self._compact = compaction.Compactor(self)
        self._ckpt_cv = threading.Condition()
        self._dirty = _Dirty()  # rows the next checkpoint writes (under self._lock)
        self._ckpt_lag = 0
        self._ckpt_stop = False
        self._ckpt_error: str | None = None
        self._ckpt_thread = threading.Thread(
            target=self._checkpoint_loop, name="kvcache-checkpoint", daemon=True
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
            max_batch_bytes=max_batch_bytes,
        )
        self._ckpt_thread.start()
        self._tier_thread.start()
        self._committer.start()
        if self._rewrite:
            # restored keys: their state goes into the log again (their record there is
            # damaged or followed by a quarantine's DEL), so no later rebuild needs the index
            ops = [_Op("rewrite", ns, key) for ns, key in self._rewrite]
            self._submit_many(ops)
            concurrent.futures.wait([op.future for op in ops])
        log.info(
            "opened %d blocks, %d keys, %d segments in %.2f s (%s)",
            len(self._blobs),
            sum(len(v) for v in self._index.values()),
            len(self._segs),
            self.open_seconds,
            self.path,
        )

    def _release_files(self) -> None:
        for res in (self._ix, self._epochs):
            if res is not None:
                with contextlib.suppress(Exception):
                    res.close()
        self._segs.clear()
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)

    # -- open / recovery -----------------------------------------------------------------
    def _say(self, msg: str) -> None:
        log.info("%s", msg)
        if self._progress is not None:
            self._progress(msg)

    def _open(self, map_size: int, rebuild: bool) -> None:
        for p in sorted(self._seg_dir.iterdir()):
            sid = seg_id_of(p)
            if sid is not None:
                self._segs[sid] = Segment(sid, p, create=False)
        log_nonempty = any(seg.size() > 0 for seg in self._segs.values())
        why: str | None = None
        ix: Index | None = None
        if rebuild:
            why = "rebuild requested"
        else:
            try:
                ix = open_index(self._index_dir, map_size)
                if ix.is_empty():
                    why = "index is empty"
                else:
                    fmt = ix.meta(b"format")
                    if fmt in OLD_FORMATS:
                        # an index is a checkpoint of the log: an older one is rebuilt
                        log.warning(
                            "the index of %s has format %s (no row checksums); rebuilding "
                            "it from the log",
                            self.path,
                            (fmt or b"?").decode(),
                        )
                        rebuild = True
                        why = f"index format {(fmt or b'?').decode()}"
                    elif fmt != FORMAT_VERSION:
                        raise ConfigurationError(
                            f"invalid persist_dir: {self.path} holds a store of format "
                            f"{(fmt or b'?').decode()}; this version reads format "
                            f"{FORMAT_VERSION.decode()} (move it aside or run "
                            f"`epistemic-kvcache store upgrade --persist-dir {self.path}`)"
                        )
                    elif ix.checkpoint() is None:
                        why = "index has no checkpoint"
            except IndexError_ as exc:
                why = str(exc)
                ix = None
            if why is not None and ix is not None:
                ix.close()
                ix = None
        if why is not None and log_nonempty and not rebuild:
            raise ConfigurationError(
                f"the store in {self.path} has segment files but its index cannot be used "
                f"({why}); refusing to start empty over existing data: {_rebuild_hint(self.path)}"
            )
        st: LogState
        try:
            if why is None and ix is not None:
                self._ix = ix
                self._say(f"loading the index of {self.path}")
                try:
                    st = load_index(ix, self._say)
                except IndexError_ as exc:
                    raise ConfigurationError(
                        f"the store in {self.path} has segment files but its index cannot "
                        f"be used ({exc}); refusing to start over damaged rows: "
                        f"{_rebuild_hint(self.path)}"
                    ) from exc
                read_seals(self._segs, st)
                start = ix.checkpoint()
                assert start is not None
                replay(self._segs, st, start, progress=self._say)
                if st.end is None:
                    st.end = start
            elif log_nonempty:
                self._say(f"rebuilding the index of {self.path} from its log ({why})")
                st = LogState()
                read_seals(self._segs, st)
                replay(self._segs, st, None, progress=self._say)
                for ns, key, hexd in reverify_quarantine(st):
                    self._say(f"block {hexd} verifies in the log: {ns}/{key} is back")
                    self._rewrite.append((ns, key))
                self._salvage(st, map_size)
                self._set_index_aside()
                self._ix = create_index(
                    self._index_dir, map_size, st.store_id or secrets.token_hex(8)
                )
            else:
                st = LogState(store_id=secrets.token_hex(8))
                self._set_index_aside()
                self._ix = create_index(self._index_dir, map_size, st.store_id or "")
        except StoreMismatchError as exc:
            raise ConfigurationError(f"invalid persist_dir: {exc}") from exc
        if self._ix is not None:
            ix_id = self._ix.meta(b"store_id")
            if st.store_id and ix_id and ix_id.decode() != st.store_id:
                raise ConfigurationError(
                    f"invalid persist_dir: its index belongs to store {ix_id.decode()}, its "
                    f"segments to {st.store_id}: {_rebuild_hint(self.path)}"
                )
        self._store_id = st.store_id or secrets.token_hex(8)
        self._finish_open(st)

    def _salvage(self, st: LogState, map_size: int) -> None:
        """A rebuild: take what damaged log records hide from the old index where it
        still reads (rows that fail their checksum are skipped), and name every key that
        cannot be restored (`salvaged`)."""
        old: LogState | None = None
        if (self._index_dir / "data.mdb").exists():
            try:
                ix = open_index(self._index_dir, map_size)
            except IndexError_ as exc:
                self._say(f"the old index cannot be read ({exc}): the log alone decides")
            else:
                try:
                    ix.tolerant = True
                    start = ix.checkpoint()
                    if start is not None and ix.meta(b"format") == FORMAT_VERSION:
                        old = load_index(ix)
                        old.seals = dict(st.seals)
                        replay(self._segs, old, start, verify=False)
                        if ix.damaged_rows:
                            self._say(f"the old index has {ix.damaged_rows} damaged rows")
                except (IndexError_, StoreMismatchError) as exc:
                    self._say(f"the old index cannot be read ({exc}): the log alone decides")
                    old = None
                finally:
                    ix.close()
        sv = salvage(st, old, self._segs)
        self.salvaged = sv
        for ns, key in sv.restored:
            self._say(f"{ns}/{key}: its log record is damaged; restored from the old index")
            self._rewrite.append((ns, key))
        for ns, key, why in sv.unrestored:
            log.error("%s/%s is lost: %s", ns, key, why)
        for ns, key, what in sv.suspects:
            log.error("%s/%s may be lost: %s", ns, key, what)

    def _set_index_aside(self) -> None:
        """Move an unusable index out of the way (kept for inspection, never deleted)."""
        if self._index_dir.exists() and any(self._index_dir.iterdir()):
            aside = self.path / f"index.unusable-{time.strftime('%Y%m%d-%H%M%S')}"
            self._index_dir.rename(aside)
            log.warning("moved the unusable index to %s", aside)

    def _finish_open(self, st: LogState) -> None:
        assert self._ix is not None
        ckpt = self._ix.checkpoint() or (0, 0)
        last = max(self._segs, default=0)
        valid = valid_ends(st, self._segs, ckpt)  # where each segment's trusted bytes end
        if ckpt[0] > 0:
            from epistemic_kvcache.store.tools import missing_segments

            later = sorted(sid for sid in self._segs if sid >= ckpt[0])
            self._missing_segments = missing_segments(later, st.segdel, ckpt[0] - 1)
        for sid in list(self._segs):
            if sid in st.segdel:  # deleted on purpose; the unlink did not happen before a crash
                with contextlib.suppress(OSError):
                    self._segs.pop(sid).path.unlink()
                valid.pop(sid, None)
        finish(st, self._segs, valid)
        self._damage = st.damage
        for sid, off, dend, reason in st.damage:
            log.error("damaged log bytes in segment %08d at %d..%d: %s", sid, off, dend, reason)
        for sid, off, hexd in st.bad_blobs:
            log.error("block %s in segment %08d at %d fails verification", hexd, sid, off)
        if self._missing_segments:
            log.error(
                "segment files missing from %s: %s (deleted by hand?); their records are lost",
                self._seg_dir,
                ", ".join(f"{s:08d}" for s in self._missing_segments),
            )
        self._lost = st.lost_keys
        if self._lost:
            log.error(
                "%d keys (%d blocks) have lost their bytes (segment deleted, truncated or "
                "damaged): they read as misses; `epistemic-kvcache store check` lists them",
                len(self._lost),
                len(st.lost_blobs),
            )
        self._seg_len = valid
        for sid, seg in self._segs.items():  # holes punched before this open
            with contextlib.suppress(OSError):
                on_disk = os.fstat(seg.fd).st_blocks * 512
                if on_disk < valid.get(sid, 0):
                    self._seg_punched[sid] = valid[sid] - on_disk
        self._seg_tomb = {sid: n for sid, n in st.tomb.items() if sid in self._segs}
        self._quarantined = dict(st.quarantine)
        failures = max(st.counters.get("integrity_failures", 0), len(st.quarantine))
        self._total.integrity_failures = failures + len(st.bad_blobs)
        # RAM: the keys whose bytes are here, loaded in bulk
        blobs, lost = st.blobs, st.lost_blobs
        kloc = self._kloc
        live = self._seg_live
        nslen: dict[str, int] = {}
        entries = []
        for (ns, key), ks in st.keys.items():
            bl = blobs.get(ks.sdig)
            if bl is None or ks.sdig in lost:
                continue
            size, off, sid = bl
            entries.append((ns, key, ks.sdig, size, sid, off, ks.tag, ks.pins))
            locs = kloc.get(ns)
            if locs is None:
                locs = kloc[ns] = {}
                nslen[ns] = len(ns.encode())
            locs[key] = ks.loc
            # the key record's bytes count as live in its segment
            rsid = unpack_loc(ks.loc)[0]
            n = records.FIXED_BYTES + nslen[ns] + len(key.encode()) + len(ks.sdig)
            if ks.tag is not None:
                n += len(ks.tag[0].encode())
            live[rsid] = live.get(rsid, 0) + n
        metas: list[Effect] = []
        for (kind, tenant, rid), (mloc, nbytes, rec) in st.metas.items():
            metas.append(MetaPut(kind, tenant, rid, rec))
            self._mloc[(kind, tenant, rid)] = (mloc, nbytes)
            msid = unpack_loc(mloc)[0]
            live[msid] = live.get(msid, 0) + nbytes
        with self._lock:
            self._load(entries)
            self._apply(metas)
        # bring the index up to date with what the tail replay found, then resume writing
        end = st.end or (last, valid.get(last, 0))
        for sid in self._segs:
            st.changes.segs[sid] = (self._seg_tomb.get(sid, 0), valid[sid])
        for sid in st.seg_rows:
            if sid not in self._segs:
                st.changes.segs[sid] = None
        self._ix.apply(st.changes, end, self._persisted_counters())
        self._writer = LogWriter(
            self._seg_dir,
            self._store_id,
            self._segment_bytes,
            self._io,
            self._segs,
            next_id=max([last, ckpt[0], *st.segdel]) + 1,
            delete_reserve=self._delete_reserve,
        )
        if last in self._segs and last not in st.seals and end[0] == last:
            seg = self._segs[last]
            if seg.size() > end[1]:  # bytes past the last complete batch: never acknowledged
                with open(seg.path, "r+b") as f:
                    f.truncate(end[1])
                    os.fsync(f.fileno())
            self._writer.resume(seg, end[1])
        else:
            self._writer.seal_active(prev_id=last)
        self._log_end: tuple[int, int] = end
        self._ckpt_pos: tuple[int, int] = end

    def _count_key_rec(
        self,
        loc: int,
        ns: str,
        key: str,
        sdig: bytes,
        tag: tuple[str, int] | None,
        sign: int,
    ) -> None:
        """Add (or remove) a key record's bytes to its segment's live bytes (lock held)."""
        sid = unpack_loc(loc)[0]
        n = records.record_length(Op.KEY, ns, key, sdig, tag[0] if tag else "")
        self._seg_live[sid] = self._seg_live.get(sid, 0) + sign * n

    def disk_bytes(self) -> int:
        """Bytes of the segment files on disk (what the cold capacity bounds): their
        lengths less the dead payloads punched out, plus the zeroed space ahead."""
        w = self._writer
        punched = sum(self._seg_punched.values())
        return sum(self._seg_len.values()) - punched + max(0, w.zeroed_to - w.pos)

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
        if self._writer.refresh_disk_full():
            return StoreHealth(
                ready=False, writable=False, disk_full=True, reason=f"disk full under {self.path}"
            )
        return StoreHealth()

    def _blob_placed(self, sdig: bytes, size: int, loc: tuple[int, int]) -> bool:
        """Whether the log holds a BLOB record of `sdig` with `size` bytes at `loc`."""
        seg = self._segs.get(loc[0])
        hlen = records.blob_header_length(sdig)
        if seg is None or loc[1] < hlen:
            return False
        try:
            rec = records.decode(seg.read(loc[1] - hlen, hlen))
        except (OSError, records.RecordError):
            return False
        return rec.op is Op.BLOB and rec.sdig == sdig and rec.plen == size

    def _find_in_log(self, sdig: bytes, size: int, first: int) -> tuple[int, int, Buffer] | None:
        """A copy of `sdig` in the log whose bytes verify: (segment, payload offset, bytes).
        Reads record headers only, from segment `first`, then newest first."""
        with self._lock:
            segs = dict(self._segs)
            ends = dict(self._seg_len)
        if self._writer.active is not None:
            ends[self._writer.active.id] = self._writer.pos
        order = sorted(segs, reverse=True)
        if first in segs:
            order.remove(first)
            order.insert(0, first)
        for sid in order:
            seg = segs[sid]
            try:
                for item in scan(seg, 0, ends.get(sid, 0), payloads=False, verify=False):
                    if isinstance(item, Damage) or item.rec.op is not Op.BLOB:
                        continue
                    if item.rec.sdig != sdig or item.rec.plen != size:
                        continue
                    data = seg.read(item.data_off, size)
                    if digest_of(data) == sdig[-32:]:
                        return sid, item.data_off, data
            except OSError as exc:
                log.error("reading segment %08d failed: %s", sid, exc)
        return None

    # -- the public operations -----------------------------------------------------------
    def _put_submit(
        self,
        ns: str,
        scope_raw: bytes,
        key: str,
        data: BlockData,
        tag: tuple[str, int] | None,
        cond: PutCond,
        *,
        make_room: bool = False,
    ) -> PutResult | concurrent.futures.Future[PutResult]:
        """Hash, answer a PUT that writes nothing at once, else queue it for the committer
        (`make_room`: a blocking caller, which first demotes what the block displaces
        from hot, so that it enters hot when committed)."""
        data = owned_buffer(data)  # the hot tier keeps it
        digest = digest_of(data)
        sdig = self._scoped(scope_raw, digest)
        ref = (ns, key)
        with self._lock:
            if not self._inflight.get(ref):
                existing = self._lookup(ns, key)
                if existing is not None and self._tags and self._stale(ns, key):
                    existing = None
                outcome = decide_put(
                    existing.sdig if existing is not None else None, sdig, cond, self._fww(ns)
                )
                if outcome is PutOutcome.MISSING:
                    self._count_put(ns, outcome, False)
                    return PutResult(outcome, digest, len(data))
                if outcome is PutOutcome.DUPLICATE or outcome is PutOutcome.CONFLICT:
                    assert existing is not None
                    self._count_put(ns, outcome, False)
                    return PutResult(outcome, existing.digest, existing.size)
        if make_room and sdig not in self._blobs:  # unlocked look: a hint
            self._make_hot_room((len(data),))
        op = _Op("put", ns, key, sdig=sdig, digest=digest, data=data, tag=tag, cond=cond)
        self._submit(op)
        return op.future

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
            self._check_size(data)
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

    def evict(self, ns: str, key: str) -> bool:
        """Drop the block's RAM copies; it stays on disk and reads back (a promotion)."""
        self._validate(ns, key)
        self._check_open()
        with self._lock:
            b = self._lookup(ns, key)
            if b is None or b.pins:
                return False
            if b.hot is not None:
                self._set_hot(b, None)
            if b.warm is not None:
                self._set_warm(b, None)
            self._total.evictions += 1
            for o in b.owners():
                self._counters(o).evictions += 1
            return True

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
        """Decide, write + sync once, apply, answer (committer thread)."""
        incoming = sum(op.nbytes for op in batch if op.kind == "put")
        if incoming and self._compact is not None:
            # Room first, so the files never outgrow the cold capacity: evict what the new
            # blocks displace (a batch of its own), then compact the space it frees.
            self._pre_evict(incoming)
            self._compact.make_disk_room(incoming)
        self._wait_for_checkpoint_lag()
        w = self._writer
        w.begin()
        v = _View(self)
        results: list[Any] = []
        for op in batch:
            try:
                results.append(self._decide(v, op))
            except StoreError as exc:
                results.append(exc)
        written: list[tuple[int, int]] = []
        if not w.empty:
            res = self._write(v)
            if isinstance(res, StoreError):
                for op in batch:
                    settle(op.future, res)
                self._release(batch)
                return
            written = res
        self._finish(v, batch, results, written)

    def _pre_evict(self, incoming: int) -> None:
        """Commit the evictions `incoming` new bytes will need, before their batch."""
        with self._lock:
            over = self._total.cold_bytes + incoming - self.live_capacity_bytes
        if over <= 0:
            return
        w = self._writer
        w.begin()
        v = _View(self)
        try:
            self._make_room(v, incoming)
        except CapacityError:
            return  # the batch itself will say so, per PUT
        if w.empty:
            return
        res = self._write(v)
        if not isinstance(res, StoreError):
            self._finish(v, [], [], res)

    def _evict_segment(self, sid: int) -> bool:
        """Evict every unpinned block stored in segment `sid` (a batch of its own), so
        the segment can be deleted without copying them (committer thread)."""
        with self._lock:
            victims = [b.sdig for b in self._blobs.values() if b.seg == sid and not b.pins]
        if not victims:
            return True
        w = self._writer
        w.begin()
        v = _View(self)
        for sdig in victims:
            v.dropped.add(sdig)
            for ns, key in self._keys_of_blob(v, sdig):
                self._emit_del(v, ns, key, evicted=True)
        if w.empty:
            return True
        res = self._write(v)
        if isinstance(res, StoreError):
            return False
        self._finish(v, [], [], res)
        return True

    def _write(self, v: _View) -> list[tuple[int, int]] | StoreError:
        """Write and sync the batch: (segment, new end) of each written, or the error to
        answer (the batch undone)."""
        w = self._writer
        try:
            return w.write(reserve_ok=not v.new_data)
        except SyncFailed as exc:
            for sid, end in w.abandon():
                self._seg_len[sid] = min(self._seg_len.get(sid, end), end)
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
        v: _View,
        batch: list[_Op],
        results: list[Any],
        written: list[tuple[int, int]],
    ) -> None:
        """The batch is durable: apply it to RAM, answer, mark the rows for the checkpointer."""
        w = self._writer
        with self._lock:
            dirty = self._dirty  # (swapped by the checkpointer under this lock)
            # where the blobs this batch may destroy are: their bytes go back to the disk
            doomed = {}
            for sdig in [*(d for d, n in v.ref_delta.items() if n < 0), *v.dropped]:
                b = self._blobs.get(sdig)
                if b is not None and b.seg >= 0 and sdig not in v.quarantine:
                    doomed[sdig] = (b, b.seg, b.off, b.size)
            for ns, key in v.key_recs:  # the old record of each rewritten key goes dead
                old = self._kloc.get(ns, {}).get(key)
                b = self._lookup(ns, key)
                if old is not None and b is not None:
                    self._count_key_rec(old, ns, key, b.sdig, self._tags.get((ns, key)), -1)
            for mk in v.meta_recs:
                om = self._mloc.pop(mk, None)
                if om is not None:
                    sid = unpack_loc(om[0])[0]
                    self._seg_live[sid] = self._seg_live.get(sid, 0) - om[1]
            self._apply(v.effects)
            for (ns, key), rec in v.key_recs.items():
                locs = self._kloc.get(ns)
                b = self._lookup(ns, key)
                if rec is None or b is None:
                    if locs is not None:
                        locs.pop(key, None)
                        if not locs:
                            del self._kloc[ns]
                    continue
                self._kloc.setdefault(ns, {})[key] = rec[0]
                tag = self._tags.get((ns, key))
                self._count_key_rec(rec[0], ns, key, b.sdig, tag, +1)
            dirty.keys.update(v.key_recs)
            for mk, mrec in v.meta_recs.items():
                if mrec is not None:
                    self._mloc[mk] = mrec
                    sid = unpack_loc(mrec[0])[0]
                    self._seg_live[sid] = self._seg_live.get(sid, 0) + mrec[1]
            dirty.metas.update(v.meta_recs)
            dirty.blobs.update(v.placed, v.ref_delta, v.dropped)
            for sid, n in v.tomb.items():
                self._seg_tomb[sid] = self._seg_tomb.get(sid, 0) + n
            for sid, end in written:
                self._seg_len[sid] = end
            dirty.segs.update(v.tomb, (sid for sid, _e in written))
            self._quarantined.update(v.quarantine)
            dirty.quarantine.update(v.quarantine)
            for op, res in zip(batch, results, strict=True):
                if op.kind == "put" and isinstance(res, PutResult):
                    self._count_put(op.ns, res.outcome, op.deduped)
            self._release_locked(batch)
            self._batches += 1
            self._committed_ops += len(batch)
            if w.active is not None:
                self._log_end = (w.active.id, w.pos)
            dead = [
                (sid, off, size)
                for sdig, (b, sid, off, size) in doomed.items()
                if self._blobs.get(sdig) is not b
            ]
        for op, res in zip(batch, results, strict=True):
            settle(op.future, res)
        if dead:
            self._punch(dead)
        self._checkpoint_due(w.last_batch_bytes)

    def _punch(self, dead: list[tuple[int, int, int]]) -> None:
        """Give the disk back the payload bytes of blocks that just died (their deleting
        batch is durable): whole pages inside each payload are punched out of the file,
        record headers stay, so the log still scans. Deleted data makes room at once,
        whatever its layout, without copying anything (a full disk has no room to copy
        into). Replay and compaction never read a dead payload; one that is read back
        (a whole-log `check`) is not reported, since no key references it."""
        if not self._punch_ok:
            return
        for sid, off, size in dead:
            seg = self._segs.get(sid)
            start = -(-off // PUNCH_ALIGN) * PUNCH_ALIGN
            end = (off + size) // PUNCH_ALIGN * PUNCH_ALIGN
            if seg is None or end <= start:
                continue
            try:
                if not self._io.punch_hole(seg.fd, start, end - start):
                    self._punch_ok = False
                    log.info("%s cannot punch holes: dead bytes wait for compaction", self.path)
                    return
            except OSError as exc:
                log.warning("punching dead bytes out of segment %08d failed: %s", sid, exc)
                continue
            with self._lock:
                self._seg_punched[sid] = self._seg_punched.get(sid, 0) + end - start
                self._punched_bytes += end - start

    def _emit(self, v: _View, header: bytearray, payload: Buffer | None = None) -> tuple[int, int]:
        return self._writer.alloc(header, payload)

    def _emit_key(self, v: _View, ns: str, key: str, ks: _KS) -> None:
        hdr = records.encode(Op.KEY, ns=ns, key=key, sdig=ks.sdig, pins=ks.pins, tag=ks.tag)
        sid, off = self._emit(v, hdr)
        v.key_recs[(ns, key)] = (pack_loc(sid, off), len(hdr))
        v.keys[(ns, key)] = ks

    def _emit_del(
        self, v: _View, ns: str, key: str, *, evicted: bool = False, aux: int = 0
    ) -> None:
        cur = v.key(ns, key)
        hdr = records.encode(Op.DEL, ns=ns, key=key, aux=records.DEL_EVICTED if evicted else aux)
        sid, _off = self._emit(v, hdr)
        v.tomb[sid] = v.tomb.get(sid, 0) + len(hdr)
        v.key_recs[(ns, key)] = None
        v.keys[(ns, key)] = None
        v.effects.append(DelKey(ns, key, evicted=evicted))
        if cur is not None:
            v.decref(cur.sdig)

    def _emit_meta(self, v: _View, kind: str, tenant: str, rid: str, rec: dict[str, Any]) -> None:
        body = json.dumps(rec).encode()
        hdr = records.encode(
            Op.META,
            ns=tenant,
            key=rid,
            aux=META_CODES[kind],
            plen=len(body),
            pcrc=records.payload_crc(body),
        )
        sid, off = self._emit(v, hdr, body)
        v.meta_recs[(kind, tenant, rid)] = (pack_loc(sid, off), len(hdr) + len(body))
        v.metas[(kind, tenant, rid)] = rec
        v.effects.append(MetaPut(kind, tenant, rid, rec))

    def _emit_mdel(self, v: _View, kind: str, tenant: str, rid: str) -> None:
        hdr = records.encode(Op.MDEL, ns=tenant, key=rid, aux=META_CODES[kind])
        sid, _off = self._emit(v, hdr)
        v.tomb[sid] = v.tomb.get(sid, 0) + len(hdr)
        v.meta_recs[(kind, tenant, rid)] = None
        v.metas[(kind, tenant, rid)] = None
        v.effects.append(MetaDel(kind, tenant, rid))

    def _is_stale(self, ns: str, ks: _KS) -> bool:
        return ks.tag is not None and ks.tag[1] < self._epoch_current(tenant_of(ns), ks.tag[0])

    def _decide(self, v: _View, op: _Op) -> Any:
        kind = op.kind
        if kind == "put":
            return self._decide_put(v, op)
        if kind == "delete":
            if v.key(op.ns, op.key) is None:
                return False
            self._emit_del(v, op.ns, op.key)
            return True
        if kind in ("pin", "unpin"):
            return self._decide_pin(v, op)
        if kind == "quarantine":
            return self._decide_quarantine(v, op)
        if kind == "snapshot":
            return self._decide_snapshot(v, op)
        if kind == "drop":
            return self._decide_drop(v, op)
        if kind == "meta_put":
            e: MetaPut = op.payload
            if e.kind == "branch" and v.meta("snap", e.tenant, e.record["snapshot_id"]) is None:
                raise NotFoundError(f"no snapshot {e.record['snapshot_id']!r}")
            self._emit_meta(v, e.kind, e.tenant, e.id, e.record)
            return None
        if kind == "retire":
            cur = v.key(op.ns, op.key)
            if cur is None or not self._is_stale(op.ns, cur):
                return False
            self._emit_del(v, op.ns, op.key)
            return True
        if kind == "rewrite":
            cur = v.key(op.ns, op.key)
            if cur is None:
                return False
            self._emit_key(v, op.ns, op.key, cur)
            return True
        if kind == "flush":
            names = v.ns_keys(op.ns)
            n = 0
            for key in names:
                if v.key(op.ns, key) is not None:
                    self._emit_del(v, op.ns, key)
                    n += 1
            return n
        raise StoreError(f"unknown operation {kind!r}")

    def _decide_put(self, v: _View, op: _Op) -> PutResult:
        assert op.data is not None
        ns, key = op.ns, op.key
        internal = parse_internal_ns(ns)
        if internal is not None and v.meta(internal[1], internal[0], internal[2]) is None:
            # the branch was deleted while this PUT was being hashed or queued
            raise NotFoundError(f"no {internal[1]} {internal[2]!r}")
        cur = v.key(ns, key)
        stale = cur is not None and self._is_stale(ns, cur)
        live = None if cur is None or stale else cur
        outcome = decide_put(live.sdig if live else None, op.sdig, op.cond, self._fww(ns))
        if outcome is PutOutcome.MISSING:
            return PutResult(outcome, op.digest, len(op.data))
        if outcome is PutOutcome.DUPLICATE or outcome is PutOutcome.CONFLICT:
            assert live is not None
            return PutResult(outcome, live.sdig[-32:], live.size)
        if cur is None and self.max_keys_per_tenant and internal is None:
            self._key_quota(v, ns)
        pins = live.pins if live is not None else 0
        loc = v.blob_loc(op.sdig)
        data: Buffer | None = None
        if loc is None:
            size = len(op.data)
            self._make_room(v, size)
            hdr = records.encode(Op.BLOB, sdig=op.sdig, plen=size)
            sid, off = self._emit(v, hdr, op.data)
            loc = (size, sid, off + len(hdr))
            v.placed[op.sdig] = loc
            v.new_bytes += size
            v.new_data = True
            data = op.data  # enters hot when applied if the tier has room (`_hot_room`)
        else:
            op.deduped = True
        size, sid, data_off = loc
        if cur is not None:
            v.effects.append(DelKey(ns, key))
            v.decref(cur.sdig)
        self._emit_key(v, ns, key, _KS(op.sdig, size, pins, op.tag))
        v.incref(op.sdig, (ns, key))
        v.effects.append(AddKey(ns, key, op.sdig, size, data, sid, data_off, op.tag))
        if pins:
            v.effects.append(PinDelta(ns, key, pins))  # pins belong to the key: they stay
        return PutResult(outcome, op.digest, size)

    def _key_quota(self, v: _View, ns: str) -> None:
        """The tenant's key count as RAM and this batch have it, against its quota."""
        with self._lock:
            idx = self._index.get(ns) or {}
            added = sum(
                1 for (n, k), st in v.keys.items() if n == ns and st is not None and k not in idx
            )
            self._check_key_quota(ns, added)

    def _pin_room(self, v: _View, tenant: str, extra: int) -> None:
        """Atomic pin quota: RAM's pinned bytes plus what this batch pins (committer)."""
        if extra <= 0:
            return
        pending = v.pinned_extra.get(tenant, 0)
        with self._lock:
            self._check_pin_quota(tenant, pending + extra)
        v.pinned_extra[tenant] = pending + extra

    def _blob_pinned(self, v: _View, sdig: bytes) -> bool:
        b = self._blobs.get(sdig)
        if b is not None and b.pins:
            return True
        return any(st is not None and st.sdig == sdig and st.pins for st in v.keys.values())

    def _decide_pin(self, v: _View, op: _Op) -> bool:
        cur = v.key(op.ns, op.key)
        if cur is None:
            return False
        if op.kind == "pin":
            if not self._blob_pinned(v, cur.sdig):
                self._pin_room(v, tenant_of(op.ns), cur.size)
            new = _KS(cur.sdig, cur.size, cur.pins + 1, cur.tag)
            delta = 1
        else:
            if cur.pins == 0:
                return False
            new = _KS(cur.sdig, cur.size, cur.pins - 1, cur.tag)
            delta = -1
        self._emit_key(v, op.ns, op.key, new)
        v.effects.append(PinDelta(op.ns, op.key, delta))
        return True

    def _keys_of_blob(self, v: _View, sdig: bytes) -> list[tuple[str, str]]:
        """Keys that reference `sdig` after the batch so far."""
        with self._lock:
            b = self._blobs.get(sdig)
            refs = b.key_refs() if b is not None else []
        out = []
        for ns, key in dict.fromkeys([*refs, *v.added.get(sdig, ())]):
            st = v.key(ns, key)
            if st is not None and st.sdig == sdig:
                out.append((ns, key))
        return out

    def _decide_quarantine(self, v: _View, op: _Op) -> None:
        b = self._blobs.get(op.sdig)
        if b is None or (b.seg, b.off) != op.loc or op.sdig in v.placed:
            return  # gone, or stored again since: a fresh copy, not the one that failed
        now = time.time()
        hdr = records.encode(Op.QUAR, sdig=op.sdig, aux=int(now * 1000))
        sid, _off = self._emit(v, hdr)
        v.tomb[sid] = v.tomb.get(sid, 0) + len(hdr)
        v.quarantine[op.sdig] = now
        for ns, key in self._keys_of_blob(v, op.sdig):
            self._emit_del(v, ns, key, aux=records.DEL_QUARANTINED)
        v.dropped.add(op.sdig)

    def _make_room(self, v: _View, size: int) -> None:
        """Evict the least valuable unpinned blocks until `size` more live bytes fit."""
        budget = self.live_capacity_bytes
        with self._lock:
            used = self._total.cold_bytes
        need = used - v.freed + v.new_bytes + size - budget
        if need <= 0:
            return
        victims: list[_Blob] = []
        with self._lock:
            for b in self._blobs.values():  # least recently used first
                if need <= 0:
                    break
                if b.pins or b.sdig in v.touched or b.sdig in v.dropped:
                    continue
                victims.append(b)
                need -= b.size
        if need > 0:
            raise CapacityError(
                f"no room for a {size}-byte block: the cold tier ({self.cold_capacity_bytes} "
                f"bytes) is full of pinned or in-flight blocks"
            )
        for b in victims:
            v.dropped.add(b.sdig)
            for ns, key in self._keys_of_blob(v, b.sdig):
                self._emit_del(v, ns, key, evicted=True)
            v.freed += b.size

    def _decide_snapshot(self, v: _View, op: _Op) -> int:
        """Reference and pin the tenant's live entries under the snapshot namespace."""
        keys, prefix, rec = op.payload
        tenant, sid = op.ns, op.key
        pending = sum(1 for (k, t, _r), m in v.metas.items() if k == "snap" and t == tenant and m)
        with self._lock:
            self._check_snapshot_quota(tenant, pending)
        names = list(dict.fromkeys(keys)) if keys is not None else v.ns_keys(tenant)
        entries: list[tuple[str, _KS]] = []
        for key in names:
            if prefix is not None and not key.startswith(prefix):
                continue
            cur = v.key(tenant, key)
            if cur is None or self._is_stale(tenant, cur):
                continue  # stale entries are not captured
            entries.append((key, cur))
        newly = {st.sdig: st.size for _k, st in entries if not self._blob_pinned(v, st.sdig)}
        self._pin_room(v, tenant, sum(newly.values()))
        sns = snapshot_ns(tenant, sid)
        for key, cur in entries:
            loc = v.blob_loc(cur.sdig)
            assert loc is not None
            self._emit_key(v, sns, key, _KS(cur.sdig, cur.size, 1, None))
            v.incref(cur.sdig, (sns, key))
            v.effects.append(AddKey(sns, key, cur.sdig, cur.size, None, loc[1], loc[2]))
            v.effects.append(PinDelta(sns, key, +1))
        self._emit_meta(v, "snap", tenant, sid, rec)
        return len(entries)

    def _decide_drop(self, v: _View, op: _Op) -> int:
        """Delete every entry of the named snapshots / branches, and their records."""
        tenant = op.ns
        n = 0
        for kind, rid in op.payload:
            if v.meta(kind, tenant, rid) is None:
                continue
            ins = snapshot_ns(tenant, rid) if kind == "snap" else branch_ns(tenant, rid)
            for key in v.ns_keys(ins):
                if v.key(ins, key) is not None:
                    self._emit_del(v, ins, key)
                    n += 1
            self._emit_mdel(v, kind, tenant, rid)
        return n

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
                self._rebalance(int(_HOT_LOW_WATER * self.hot_capacity_bytes))
            except Exception:  # a tier move never takes the store down
                log.exception("tier rebalance failed")

    def _persisted_counters(self) -> dict[str, int]:
        return {"integrity_failures": self._total.integrity_failures}

    def _checkpoint_due(self, nbytes: int) -> None:
        """`nbytes` more of log the index does not cover yet (the rows are marked dirty)."""
        with self._ckpt_cv:
            self._ckpt_lag += nbytes
            if self._ckpt_lag >= _CHECKPOINT_TRIGGER_BYTES:
                self._ckpt_cv.notify_all()

    def _rows(self, dirty: _Dirty) -> Changes:
        """The index rows of `dirty`, read from RAM in chunks (the lock is released
        between chunks, so readers never wait long)."""
        ch = Changes.empty()
        keys = list(dirty.keys)
        for i in range(0, len(keys), 2000):
            with self._lock:
                for ns, key in keys[i : i + 2000]:
                    b = self._lookup(ns, key)
                    loc = self._kloc.get(ns, {}).get(key)
                    if b is None or loc is None:
                        ch.keys[(ns, key)] = None
                    else:
                        pins = self._pins.get((ns, key), 0)
                        ch.keys[(ns, key)] = KeyState(b.sdig, pins, self._tags.get((ns, key)), loc)
        sdigs = list(dirty.blobs)
        for i in range(0, len(sdigs), 2000):
            with self._lock:
                for sdig in sdigs[i : i + 2000]:
                    blob = self._blobs.get(sdig)
                    ch.blobs[sdig] = (blob.size, blob.off, blob.seg) if blob is not None else None
        with self._lock:
            for mk in dirty.metas:
                body = self._meta(mk[0]).get(mk[1], {}).get(mk[2])
                ml = self._mloc.get(mk)
                ch.metas[mk] = (ml[0], body) if body is not None and ml is not None else None
            for sid in dirty.segs:
                ch.segs[sid] = (
                    (self._seg_tomb.get(sid, 0), self._seg_len.get(sid, 0))
                    if sid in self._segs
                    else None
                )
            ch.quarantine.update(dirty.quarantine)
        return ch

    def _wait_for_checkpoint_lag(self) -> None:
        """Back-pressure: the log may run ahead of the index by `max_checkpoint_lag_bytes`
        (bounding the replay at the next open), unless checkpoints are failing."""
        with self._ckpt_cv:
            deadline = time.monotonic() + 5.0
            while (
                self._ckpt_lag > self._max_lag
                and self._ckpt_error is None
                and not self._ckpt_stop
                and time.monotonic() < deadline
            ):
                self._ckpt_cv.notify_all()
                self._ckpt_cv.wait(0.1)

    def _checkpoint_loop(self) -> None:
        next_at = time.monotonic() + self._ckpt_interval
        while True:
            with self._ckpt_cv:
                while (
                    not self._ckpt_stop
                    and self._ckpt_lag < _CHECKPOINT_TRIGGER_BYTES
                    and time.monotonic() < next_at
                ):
                    self._ckpt_cv.wait(max(0.01, next_at - time.monotonic()))
                stopping = self._ckpt_stop
            self.checkpoint()
            next_at = time.monotonic() + self._ckpt_interval
            if stopping:
                return

    def checkpoint(self) -> bool:
        """Write the dirty rows to the index now (True when it is up to date).

        The rows are read from RAM here, so they may be newer than the checkpoint position
        they are written with: that is safe, since every record after the position is
        replayed at open and each one sets a key's whole state (last writer wins)."""
        with self._lock:
            dirty, self._dirty = self._dirty, _Dirty()
            target = self._log_end
        if not dirty and target == self._ckpt_pos:
            return True
        with self._ckpt_cv:
            lag, self._ckpt_lag = self._ckpt_lag, 0
        ch = self._rows(dirty)
        assert self._ix is not None
        try:
            self._ix.apply(ch, target, self._persisted_counters())
        except StorageIOError as exc:
            with self._lock:
                dirty.merge(self._dirty)
                self._dirty = dirty
            with self._ckpt_cv:
                self._ckpt_lag += lag
                if self._ckpt_error is None:
                    log.error("index checkpoint failed (the log still has everything): %s", exc)
                self._ckpt_error = str(exc)
                self._checkpoint_failures += 1
            time.sleep(0.5)
            return False
        with self._ckpt_cv:
            if self._ckpt_error is not None:
                log.info("index checkpoints work again")
            self._ckpt_error = None
            self._ckpt_pos = target
            self._checkpoints += 1
            self._ckpt_cv.notify_all()
        return True

    # -- checks and shutdown -------------------------------------------------------------
    def lost_keys(self) -> list[tuple[str, str, str]]:
        """Keys whose bytes were found missing at open: (namespace, key, digest hex)."""
        return [(ns, key, d.hex()) for ns, key, d in self._lost]

    def check(self, *, deep: bool = False) -> ConsistencyReport:
        """RAM invariants, every block inside a segment's trusted bytes (`deep`: re-hash)."""
        with self._maint_lock:
            report = ConsistencyReport()
            with self._lock:
                self._base_check(report)
                blobs = [(b.sdig, b.size, b.seg, b.off) for b in self._blobs.values()]
                segs = dict(self._segs)
                ends = dict(self._seg_len)
            report.lost_keys = [f"{ns}/{key}" for ns, key, _d in self._lost]
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
        with self._ckpt_cv:
            self._ckpt_stop = True
            self._ckpt_cv.notify_all()
        self._ckpt_thread.join(self._shutdown_timeout_s)
        with self._lock:
            self._dirty = _Dirty()
            self._log_end = self._ckpt_pos
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
        with self._ckpt_cv:
            self._ckpt_stop = True
            self._ckpt_cv.notify_all()
        self._ckpt_thread.join(self._shutdown_timeout_s)
        if done:
            self.checkpoint()  # the index is current: the next open replays nothing
        self._tier_thread.join(5.0)
        self._release_files()


# -- the parts the engine is composed with (seams.py) -------------------------------------
class DiskLogTier:
    """`LowerTier`: the log on disk holds every block; RAM holds copies."""

    keeps_blocks = True

    def __init__(self, store: SharedKvStoreBackend) -> None:
        self._s = store

    def hot_full(self) -> None:
        self._s._tier_event.set()  # the tier thread makes room in hot for the next blocks

    def blob_created(self, b: _Blob) -> None:
        seg_live = self._s._seg_live
        seg_live[b.seg] = seg_live.get(b.seg, 0) + records.blob_header_length(b.sdig) + b.size

    def blob_destroyed(self, b: _Blob) -> None:
        seg_live = self._s._seg_live
        seg_live[b.seg] = seg_live.get(b.seg, 0) - records.blob_header_length(b.sdig) - b.size

    def caps(self) -> dict[str, int]:
        return {"cold": self._s.cold_capacity_bytes}

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
            segments=len(s._segs),
            segment_bytes=sum(s._seg_len.values()),
            live_log_bytes=sum(s._seg_live.values()),
            disk_bytes=s.disk_bytes(),
            compactions=s._compactions,
            compacted_bytes=s._compacted_bytes,
            punched_bytes=s._punched_bytes,
            segments_deleted=s._segments_deleted,
            checkpoints=s._checkpoints,
            checkpoint_failures=s._checkpoint_failures,
            index_repairs=s._index_repairs,
            checkpoint_lag_bytes=s._ckpt_lag,
            lost_keys=len(s._lost),
            quarantined_blocks=len(s._quarantined),
            damaged_log_regions=len(s._damage),
            missing_segments=len(s._missing_segments),
            store_fault=int(s._committer.fault is not None),
            disk_full=int(w.disk_full),
        )
        return out

    def read(self, b: _Blob, loc: tuple[int, int]) -> Buffer | None:
        seg = self._s._segs.get(loc[0])
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
        if s._blob_placed(b.sdig, b.size, loc):
            return None
        with s._recover_lock:
            if s._unfound.get(b.sdig) == loc:
                return None  # looked already: nothing in the log
            with s._lock:
                if s._blobs.get(b.sdig) is not b or (b.seg, b.off) != loc:
                    return None  # moved or gone meanwhile: the caller's read was stale
            found = s._find_in_log(b.sdig, b.size, loc[0])
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
            s._dirty.blobs.add(b.sdig)
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

    def __init__(self, store: SharedKvStoreBackend) -> None:
        self._s = store

    def put(
        self, ns: str, raw: bytes, key: str, data: BlockData, tag: Tag, cond: PutCond, wait: bool
    ) -> Started:
        started = self._s._put_submit(ns, raw, key, data, tag, cond, make_room=wait)
        if wait and not isinstance(started, PutResult):
            result: PutResult = started.result()
            return result
        return started

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
