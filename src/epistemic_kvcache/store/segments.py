"""Segment files: the append-only log's storage and its writer.

How it works
------------
The log is a sequence of segment files `segments/%08d.seg` (ids increase; log order is
segment id, then offset). One segment is *active*: batches are appended to it at
`LogWriter.pos`; the others are *sealed*.

Writing a group commit (`LogWriter`):
1. The committer reserves room for each record with `alloc` while it decides the batch
   (so effects know where a block will live). When the active segment would pass
   `segment_bytes`, `alloc` rolls over: a new file is created (and its directory entry
   made durable) and its first record is a SEGH header naming the store and the previous
   segment.
2. `write` puts every piece at its offset (`pwritev`), pre-zeroes space past the end of
   the active segment for small batches (below), and `fdatasync`s each segment written:
   one sync per batch in the common case. Only then may the batch be acknowledged.
3. If a `pwrite` fails (ENOSPC, EIO) nothing was synced: `rollback` resets the write
   position and overwrites the partial bytes with zeros (they were never part of a
   complete batch, and replay must never read them as the start of a later one). If an
   `fdatasync` fails, the dirty pages may be gone (the "fsyncgate" lesson: never retry
   such a sync as if nothing happened): `abandon` seals the segments at their last
   synced end; the next batch starts a new segment and records a SEAL naming where the
   abandoned one's trusted bytes end.

Pre-zeroing: an `fdatasync` that grows a file must also commit its new size and block
allocation through the file-system journal; one that overwrites allocated blocks only
flushes data (~2x cheaper on ext4). So small batches also write zeros past the end, up
to `PREZERO_BYTES`, under the same sync; the next small batches are overwrites. That
zeroed, allocated space is also the *delete reserve*: on a full disk, tombstones still
fit in blocks that are already allocated, so DELETE keeps working and frees space. The
zeroed span shrinks when the file system's free space is low, and is never trusted:
replay ends a segment at its last complete batch.

Reading the records back (`scan`, `only_zeros`) is store/scan.py's.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

from epistemic_kvcache.buffers import read_buffer
from epistemic_kvcache.store import records
from epistemic_kvcache.store.api import Buffer
from epistemic_kvcache.store.freespace import FreeSpace
from epistemic_kvcache.store.records import Op

PREZERO_BYTES = 4 << 20
"""Zeroed space kept ahead of the active segment's end when the disk has room."""
PREZERO_MAX_BATCH = 64 << 10
"""Batches writing more than this append without pre-zeroing."""
DELETE_RESERVE_BYTES = 256 << 10
"""Allocated space a batch carrying new blocks may not use while the disk is full."""
LOW_SPACE_BYTES = 64 << 20
"""Below this much free space, pre-zeroing shrinks to a sixteenth of what is free."""
_ZEROS = bytes(PREZERO_BYTES)
_IOV_MAX = 512


class DiskIO:
    """The system calls that make bytes durable. A seam for fault-injection tests."""

    def pwrite(self, fd: int, data: Buffer, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def pwritev(self, fd: int, bufs: list[Buffer], offset: int) -> int:
        return os.pwritev(fd, bufs, offset)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def free_bytes(self, path: Path) -> int:
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize

    def total_bytes(self, path: Path) -> int:
        st = os.statvfs(path)
        return st.f_blocks * st.f_frsize

    def punch_hole(self, fd: int, offset: int, length: int) -> bool:
        """Give the file system back the blocks of a byte range (reads then return zeros;
        the file keeps its size). False where the file system cannot."""
        return punch_hole(fd, offset, length)


_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc: Any = None
PUNCH_ALIGN = 4096
"""Holes are punched in whole pages inside a dead payload (headers are never touched)."""


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """`fallocate(PUNCH_HOLE | KEEP_SIZE)`; False where unsupported (then nothing changed)."""
    global _libc
    if length <= 0:
        return True
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        except (OSError, AttributeError):
            _libc = False
    if _libc is False:
        return False
    mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
    if _libc.fallocate(fd, mode, offset, length) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err))


def seg_path(directory: Path, seg_id: int) -> Path:
    return directory / f"{seg_id:08d}.seg"


def seg_id_of(path: Path) -> int | None:
    """The id of a segment file name, None for anything else."""
    if path.suffix != ".seg" or not path.stem.isdigit():
        return None
    return int(path.stem)


def open_segments(directory: Path) -> dict[int, Segment]:
    """Every segment file in `directory` by id, opened as it is (none: no directory)."""
    segs: dict[int, Segment] = {}
    if directory.is_dir():
        for p in sorted(directory.iterdir()):
            sid = seg_id_of(p)
            if sid is not None:
                segs[sid] = Segment(sid, p, create=False)
    return segs


class Segment:
    """One segment file. The fd closes when the last reader lets go of the object."""

    __slots__ = ("__weakref__", "fd", "id", "path")

    def __init__(self, seg_id: int, path: Path, *, create: bool) -> None:
        self.id = seg_id
        self.path = path
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        self.fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), 0o600)

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def read(self, offset: int, size: int) -> bytearray | memoryview:
        """`size` bytes at `offset` (OSError on a short read: the file was truncated)."""
        # Heap memory, not a fresh mapping: a read buffer is often transient (served, then
        # freed), and malloc reuses freed heap memory without new page faults (measured:
        # 4 MiB cold GETs at 4.4 GB/s this way vs 0.5 GB/s with a fresh mmap per read).
        # Not zero-filled from 1 MiB (`read_buffer`): a 128 MiB bytearray's memset held
        # the GIL ~150-200 ms, stalling every other client for as long.
        buf = read_buffer(size)
        view = memoryview(buf)
        done = 0
        while done < size:
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"short read in {self.path.name} at {offset + done}")
            done += n
        return buf

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def fsync_dir(path: Path) -> None:
    dfd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


# -- writing -----------------------------------------------------------------------------
@dataclass(slots=True)
class _Pending:
    """What one batch writes into one segment: contiguous pieces from `start`."""

    seg: Segment
    start: int
    pieces: list[Buffer] = field(default_factory=list)
    length: int = 0


@dataclass(eq=False)
class LogWriter:
    """Appends batches to the active segment (see the module docstring)."""

    dir: Path
    store_id: str
    segment_bytes: int
    io: DiskIO
    segments: dict[int, Segment]
    _: KW_ONLY
    next_id: int
    delete_reserve: int = DELETE_RESERVE_BYTES

    def __post_init__(self) -> None:
        self.active: Segment | None = None
        self.pos = 0  # the active segment's valid end (where the next batch goes)
        self.zeroed_to = 0  # allocated and zeroed up to here in the active segment
        self.fsyncs = 0
        self.room = FreeSpace(self.io, self.dir)  # the free space, the disk-full state
        self._batch: list[_Pending] = []
        self._batch_start: tuple[Segment | None, int, int, int, int] = (None, 0, 0, 1, 0)
        self._prev_id = 0  # the segment before the active one (SEGH of the next)
        self.pending_seals: list[tuple[int, int]] = []  # abandoned (segment, valid end)
        self.last_batch_bytes = 0
        self._trim: tuple[Segment, int] | None = None

    # -- opening -------------------------------------------------------------------------
    def resume(self, seg: Segment, pos: int) -> None:
        """Continue appending to an existing segment at `pos` (its valid end)."""
        self.active = seg
        self.pos = pos
        self.zeroed_to = pos
        self._prev_id = 0

    def seal(self) -> None:
        """Seal the active segment now (between batches): cut its zeroed tail, make that
        durable, and let the next batch open a new segment (so compaction may take it)."""
        if self.active is None:
            return
        self.cut_zeroed_tail()
        self.seal_active()

    def cut_zeroed_tail(self) -> None:
        """Cut the zeroed, allocated space after the active segment's last batch (between
        batches; a clean close does it last): the file then ends where the log does, and
        the next open finds nothing to drop after the last complete batch."""
        seg = self.active
        if seg is None or self.zeroed_to <= self.pos:
            return
        os.ftruncate(seg.fd, self.pos)
        self.io.fdatasync(seg.fd)
        self.fsyncs += 1
        self.zeroed_to = self.pos

    def seal_active(self, prev_id: int | None = None) -> None:
        """Stop appending to the active segment (the next batch opens a new one)."""
        if self.active is not None:
            self._prev_id = self.active.id
        elif prev_id is not None:
            self._prev_id = prev_id
        self.active = None
        self.pos = self.zeroed_to = 0

    # -- one batch -----------------------------------------------------------------------
    def begin(self) -> None:
        self._trim = None
        self._batch = []
        self._batch_start = (self.active, self.pos, self.zeroed_to, self.next_id, self._prev_id)
        self._headers: list[bytearray] = []

    def _open_segment(self) -> Segment:
        seg_id = self.next_id
        seg = Segment(seg_id, seg_path(self.dir, seg_id), create=True)
        self.next_id += 1
        try:
            fsync_dir(self.dir)  # the file's name is durable before any record in it
        except OSError:
            with contextlib.suppress(OSError):
                seg.path.unlink()
            self.next_id -= 1
            raise
        self.fsyncs += 1
        old = self.active
        if old is not None and self.zeroed_to > self.pos:
            self._trim = (old, self.pos)  # cut its zeroed tail once this batch is durable
        prev = old.id if old is not None else self._prev_id
        self.segments[seg_id] = seg
        self.active = seg
        self.pos = self.zeroed_to = 0
        self._prev_id = prev
        head = records.encode(Op.SEGH, ns=self.store_id, epoch=seg_id, aux=prev)
        self._place(head, None)
        for sealed, valid in self.pending_seals:
            self._place(records.encode(Op.SEAL, aux=sealed, epoch=valid), None)
        return seg

    def would_roll(self, nbytes: int) -> bool:
        """Whether `alloc(nbytes)` would open a new segment. Small records fill the
        allocated space after the end first (on a full disk a new file may not be
        possible: deletes must still find room)."""
        if self.active is None:
            return True
        if self.room.full and nbytes <= 4096 and self.pos + nbytes <= self.zeroed_to:
            return False
        return self.pos > 0 and self.pos + nbytes > self.segment_bytes

    def alloc(self, header: bytearray, payload: Buffer | None = None) -> tuple[int, int]:
        """Place a record in this batch: returns (segment id, offset of the record)."""
        n = len(header) + (len(payload) if payload is not None else 0)
        if self.would_roll(n):
            self._open_segment()
        return self._place(header, payload)

    def _place(self, header: bytearray, payload: Buffer | None) -> tuple[int, int]:
        seg = self.active
        assert seg is not None
        if not self._batch or self._batch[-1].seg is not seg:
            self._batch.append(_Pending(seg, self.pos))
        p = self._batch[-1]
        off = self.pos
        p.pieces.append(header)
        n = len(header)
        if payload is not None and len(payload):
            p.pieces.append(memoryview(payload).cast("B"))
            n += len(payload)
        p.length += n
        self.pos += n
        self._headers.append(header)
        return seg.id, off

    @property
    def batch_bytes(self) -> int:
        return sum(p.length for p in self._batch)

    @property
    def empty(self) -> bool:
        return not self._batch

    def write(self, *, reserve_ok: bool) -> list[tuple[int, int]]:
        """Write and sync the batch; returns (segment id, new trusted end) of each written.

        `reserve_ok`: the batch may use the delete reserve (it carries no new blocks).
        Raises OSError; then call `rollback` (write failed) or `abandon` (sync failed),
        as `SyncFailed` tells.
        """
        if not self._batch:
            return []
        records.set_end_of_batch(self._headers[-1])
        if not reserve_ok:
            # new blocks never take the delete reserve: they need the file system's free
            # space for themselves and for the reserve after them
            if self.room.full or self.room.free_bytes() < LOW_SPACE_BYTES:
                self.room.recheck()  # look again: space may have come back
            if self.room.free_bytes() < self.batch_bytes + self.delete_reserve:
                self.room.set_full(self.batch_bytes + self.delete_reserve)
                raise OSError(errno.ENOSPC, "disk full (the space left is kept for deletes)")
        try:
            for p in self._batch:
                self._pwritev(p.seg.fd, p.pieces, p.start)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                self.room.set_full(self.batch_bytes + self.delete_reserve)
            raise
        if not reserve_ok:
            self.room.cleared_by_write()
        if self.active is not None and self._batch[-1].seg is self.active:
            self._prezero(self.batch_bytes)
        synced = []
        try:
            for p in self._batch:
                self.io.fdatasync(p.seg.fd)
                self.fsyncs += 1
                synced.append((p.seg.id, p.start + p.length))
        except OSError as exc:
            raise SyncFailed(exc) from exc
        self.last_batch_bytes = self.batch_bytes
        self.zeroed_to = max(self.zeroed_to, self.pos)
        if self._trim is not None:
            with contextlib.suppress(OSError):  # a sealed segment keeps no zeroed tail
                os.ftruncate(self._trim[0].fd, self._trim[1])
            self._trim = None
        self.pending_seals.clear()
        self._batch = []
        return synced

    def _pwritev(self, fd: int, pieces: list[Buffer], offset: int) -> None:
        if len(pieces) <= _IOV_MAX:  # the common case: one call writes it all
            want = sum(len(p) for p in pieces)  # (payload views are byte-cast by _place)
            if self.io.pwritev(fd, pieces, offset) == want:
                return
        # a short write (rare): write again from the top (the same bytes), then piecewise
        views = [memoryview(p).cast("B") for p in pieces]
        i = 0
        while i < len(views):
            chunk = views[i : i + _IOV_MAX]
            want = sum(len(v) for v in chunk)
            n = self.io.pwritev(fd, chunk, offset)  # type: ignore[arg-type]
            if n == want:
                offset += n
                i += len(chunk)
                continue
            if n <= 0:
                raise OSError(errno.EIO, "short write")
            # partial: drop what was written and continue with the rest
            offset += n
            while n:
                if n >= len(views[i]):
                    n -= len(views[i])
                    i += 1
                else:
                    views[i] = views[i][n:]
                    n = 0

    @property
    def disk_full(self) -> bool:
        """Whether a write was refused for want of space and no room came since (as
        last seen; `room.refresh()` asks the file system again)."""
        return self.room.full

    def _prezero(self, batch_bytes: int) -> None:
        """Keep zeroed, allocated space after the active segment's end: the delete reserve
        always, and more after small batches (their next syncs are then overwrites)."""
        seg = self.active
        if seg is None:
            return
        if batch_bytes > PREZERO_MAX_BATCH:
            span = low = self.delete_reserve
        else:
            span = min(PREZERO_BYTES, max(self.delete_reserve, self.segment_bytes // 4))
            free = self.room.free_bytes()
            if free < LOW_SPACE_BYTES:
                span = max(self.delete_reserve, min(span, free // 16))
            low = max(self.delete_reserve, span // 2)
        if self.zeroed_to - self.pos >= low:
            return  # enough zeroed ahead: extend only when it runs low (in one go)
        # never more than the delete reserve past the segment's nominal size
        stop = min(self.pos + span, max(self.segment_bytes, self.pos) + self.delete_reserve)
        done = max(self.pos, self.zeroed_to)
        if done >= stop:
            return
        with contextlib.suppress(OSError):  # best effort: a full disk ends it early
            while done < stop:
                n = self.io.pwrite(seg.fd, memoryview(_ZEROS)[: stop - done], done)
                if n <= 0:
                    break
                done += n
        if done < stop:  # the file system is out of space: the next write will be refused
            self.room.set_full(self.delete_reserve + (stop - done))
        self.zeroed_to = done

    def rollback(self) -> None:
        """A write failed before any sync: forget the batch, reuse its space.

        What the failed write put past the active segment's trusted end (a prefix of the
        batch: records with no end-of-batch flag) is overwritten with zeros first. Left
        there, a later batch that is shorter, or that starts in a new segment, would be
        read by replay as their end, and they would be applied with it after a crash
        (DELETEs the caller was told had failed). Zeros, not a cut, so the allocated space
        after the end stays (a full disk's delete reserve); if zeroing fails, the segment
        is cut at its trusted end, and if that fails too, it is sealed there (a SEAL
        record in the next segment tells replay where its trusted bytes end)."""
        active, pos, zeroed, next_id, prev_id = self._batch_start
        for p in self._batch:
            if p.seg is not active and p.start == 0:  # opened by this batch: nothing in it
                self.segments.pop(p.seg.id, None)
                with contextlib.suppress(OSError):
                    p.seg.path.unlink()
        self.active, self.pos = active, pos
        self.next_id, self._prev_id = next_id, prev_id
        written = [p.length for p in self._batch if active is not None and p.seg is active]
        self._batch = []
        if active is None:
            self.zeroed_to = 0
        elif written and not _scrub(active, pos, written[0]):
            self.pending_seals.append((active.id, pos))
            self.seal_active()
        else:
            try:
                self.zeroed_to = min(zeroed, active.size())
            except OSError:
                self.zeroed_to = pos

    def abandon(self) -> list[tuple[int, int]]:
        """A sync failed: seal every segment the batch wrote at its last trusted end.

        Returns (segment id, trusted end) for each; the next batch records them as SEAL
        records in a fresh segment."""
        active, pos, _zeroed, _next_id, _prev = self._batch_start
        sealed = []
        for p in self._batch:
            end = pos if p.seg is active else 0
            sealed.append((p.seg.id, end))
            # Cut the untrusted bytes off now, so not even a restart that finds them
            # whole in the page cache replays them (the SEAL covers a crash before this).
            with contextlib.suppress(OSError):
                os.ftruncate(p.seg.fd, end)
        self.pending_seals.extend(sealed)
        if self.active is not None:
            self._prev_id = self.active.id
        self.active = None
        self.pos = self.zeroed_to = 0
        self._batch = []
        return sealed


def _scrub(seg: Segment, start: int, length: int) -> bool:
    """Overwrite what a failed write may have left at `start` (up to `length` bytes) with
    zeros, or else cut the file there; synced. False when neither worked."""
    try:
        end = min(start + length, seg.size())
        off = start
        while off < end:
            n = os.pwrite(seg.fd, memoryview(_ZEROS)[: min(len(_ZEROS), end - off)], off)
            if n <= 0:
                raise OSError(errno.EIO, "short write")
            off += n
        os.fdatasync(seg.fd)
    except OSError:
        pass
    else:
        return True
    try:
        os.ftruncate(seg.fd, start)
        os.fdatasync(seg.fd)
    except OSError:
        return False
    return True


class SyncFailed(OSError):
    """An fdatasync failed: the batch's bytes are untrusted (see `LogWriter.abandon`)."""

    def __init__(self, cause: OSError) -> None:
        super().__init__(cause.errno, f"fdatasync failed: {cause.strerror or cause}")
        self.cause = cause
