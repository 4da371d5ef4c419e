"""The log's segment space: the segment files, what is known of their bytes, the writer.

How it works
------------
`SegmentSpace` is the one place that knows where records are and how much of each
segment is still needed:

- `segs` (the open files), `seg_len` (each segment's trusted end), `seg_live` (bytes of
  records RAM still points at: blobs, key records, snapshot/branch records),
  `seg_tomb` (bytes of tombstones), `seg_punched` (dead payload bytes given back to the
  file system); the rest of a sealed segment is dead, for compaction to reclaim;
- `kloc` / `mloc`: where each key's and each snapshot/branch record's current state
  is in the log (the index rows point there too);
- `writer` (`segments.LogWriter`), `log_end` (the end of the last durable batch) and
  `ckpt_pos` (what the index checkpoint covers);
- `dirty`: the index rows the next checkpoint rewrites (swapped by the checkpointer).

Every mapping is read and changed under the store's lock (`lock`, shared with the
engine), except by the committer thread, the only one that writes the log, which may
read what only it changes without it. The committer's apply step and the compactor
both change the space; neither reads the other's privates.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from epistemic_kvcache.store import records
from epistemic_kvcache.store.api import Buffer
from epistemic_kvcache.store.index import unpack_loc
from epistemic_kvcache.store.model import digest_of
from epistemic_kvcache.store.records import Op
from epistemic_kvcache.store.scan import Damage, scan
from epistemic_kvcache.store.segments import (
    DELETE_RESERVE_BYTES,
    PUNCH_ALIGN,
    DiskIO,
    LogWriter,
    Segment,
)

log = logging.getLogger(__name__)

__all__ = ["Dirty", "SegmentSpace"]


@dataclass(slots=True)
class Dirty:
    """What changed since the last checkpoint: the index rows to rewrite from RAM."""

    keys: set[tuple[str, str]] = field(default_factory=set)
    blobs: set[bytes] = field(default_factory=set)
    metas: set[tuple[str, str, str]] = field(default_factory=set)
    segs: set[int] = field(default_factory=set)
    quarantine: dict[bytes, float] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.keys or self.blobs or self.metas or self.segs or self.quarantine)

    def merge(self, later: Dirty) -> None:
        self.keys |= later.keys
        self.blobs |= later.blobs
        self.metas |= later.metas
        self.segs |= later.segs
        self.quarantine.update(later.quarantine)


class SegmentSpace:
    """The segments of one store and their accounting (see the module docstring)."""

    writer: LogWriter  # set once the log is open

    def __init__(
        self,
        seg_dir: Path,
        lock: threading.Lock,
        *,
        segment_bytes: int,
        cold_capacity_bytes: int,
        io: DiskIO,
    ) -> None:
        self.dir = seg_dir
        self.lock = lock
        self.io = io
        self.segment_bytes = segment_bytes
        self.cold_capacity_bytes = cold_capacity_bytes
        # room kept free inside the cold capacity: two segments (at most an eighth) for
        # compaction to copy into, and the allocated space deletes write into
        self.delete_reserve = min(DELETE_RESERVE_BYTES, cold_capacity_bytes // 8)
        self.reserve = min(2 * segment_bytes, cold_capacity_bytes // 8) + self.delete_reserve
        self.maint_lock = threading.Lock()
        """Held by compaction steps and by `check`: they never overlap."""
        self.segs: dict[int, Segment] = {}
        self.seg_len: dict[int, int] = {}  # valid end of each segment
        self.seg_live: dict[int, int] = {}  # bytes of live records per segment
        self.seg_tomb: dict[int, int] = {}  # bytes of tombstones per segment
        self.seg_punched: dict[int, int] = {}  # bytes of dead payloads punched out
        self.kloc: dict[str, dict[str, int]] = {}  # record location of each key's state
        self.mloc: dict[tuple[str, str, str], tuple[int, int]] = {}  # (location, bytes)
        self.dirty = Dirty()
        self.log_end: tuple[int, int] = (0, 0)
        self.ckpt_pos: tuple[int, int] = (0, 0)
        self.compactions = 0
        self.compacted_bytes = 0
        self.segments_deleted = 0
        self.punched_bytes = 0
        self.punch_ok = True

    # -- accounting ----------------------------------------------------------------------
    def disk_bytes(self) -> int:
        """Bytes of the segment files on disk (what the cold capacity bounds): their
        lengths less the dead payloads punched out, plus the zeroed space ahead."""
        w = self.writer
        punched = sum(self.seg_punched.values())
        return sum(self.seg_len.values()) - punched + max(0, w.zeroed_to - w.pos)

    def add_live(self, sid: int, n: int) -> None:
        self.seg_live[sid] = self.seg_live.get(sid, 0) + n

    def add_tomb(self, sid: int, n: int) -> None:
        self.seg_tomb[sid] = self.seg_tomb.get(sid, 0) + n

    def count_key_rec(
        self, loc: int, ns: str, key: str, sdig: bytes, tag: tuple[str, int] | None, sign: int
    ) -> None:
        """Add (or remove) a key record's bytes to its segment's live bytes (lock held)."""
        n = records.record_length(Op.KEY, ns, key, sdig, tag[0] if tag else "")
        self.add_live(unpack_loc(loc)[0], sign * n)

    def dead(self, sid: int) -> int:
        """Bytes of segment `sid` nothing needs any more."""
        n = self.seg_len.get(sid, 0) - self.seg_live.get(sid, 0) - self.seg_tomb.get(sid, 0)
        return max(0, n)

    def sealed(self) -> list[int]:
        w = self.writer
        active = w.active.id if w.active is not None else -1
        return [sid for sid in self.segs if sid != active]

    # -- after a write -------------------------------------------------------------------
    def abandon(self) -> None:
        """A sync failed: the writer drops its segment; its trusted end stays where the
        last durable batch left it."""
        for sid, end in self.writer.abandon():
            self.seg_len[sid] = min(self.seg_len.get(sid, end), end)

    def written(self, written: list[tuple[int, int]]) -> None:
        """A batch is durable: (segment, new end) of each segment it wrote (lock held)."""
        for sid, end in written:
            self.seg_len[sid] = end
        self.dirty.segs.update(sid for sid, _e in written)
        w = self.writer
        if w.active is not None:
            self.log_end = (w.active.id, w.pos)

    def apply_batch_locked(
        self,
        *,
        key_recs: dict[tuple[str, str], int | None],
        before: dict[tuple[str, str], tuple[bytes, tuple[str, int] | None] | None],
        after: dict[tuple[str, str], tuple[bytes, tuple[str, int] | None] | None],
        meta_recs: dict[tuple[str, str, str], tuple[int, int] | None],
        tombs: dict[int, int],
        written: list[tuple[int, int]],
        blobs: Iterable[Iterable[bytes]],
        quarantine: dict[bytes, float],
    ) -> None:
        """The space's half of a durable batch, once RAM applied its effects (lock held):
        each rewritten key's record moves (`key_recs`: ref -> its new record's location,
        None when deleted; `before`/`after`: the key's (scoped digest, tag) in RAM on
        either side of the batch), each snapshot/branch record too (`meta_recs`), the
        tombstones and the segments' new ends are counted, and the index rows are marked
        for the next checkpoint."""
        kloc = self.kloc
        for ref, rec in key_recs.items():
            ns, key = ref
            old = kloc.get(ns, {}).get(key)
            was = before.get(ref)
            if old is not None and was is not None:  # the old record goes dead
                self.count_key_rec(old, ns, key, was[0], was[1], -1)
            now = after.get(ref)
            if rec is None or now is None:
                locs = kloc.get(ns)
                if locs is not None:
                    locs.pop(key, None)
                    if not locs:
                        del kloc[ns]
                continue
            kloc.setdefault(ns, {})[key] = rec
            self.count_key_rec(rec, ns, key, now[0], now[1], +1)
        self.dirty.keys.update(key_recs)
        for mk, mrec in meta_recs.items():
            om = self.mloc.pop(mk, None)
            if om is not None:
                self.add_live(unpack_loc(om[0])[0], -om[1])
            if mrec is not None:
                self.mloc[mk] = mrec
                self.add_live(unpack_loc(mrec[0])[0], mrec[1])
        self.dirty.metas.update(meta_recs)
        for sdigs in blobs:
            self.dirty.blobs.update(sdigs)
        for sid, n in tombs.items():
            self.add_tomb(sid, n)
        self.dirty.segs.update(tombs)
        self.written(written)
        self.dirty.quarantine.update(quarantine)

    def punch(self, dead: list[tuple[int, int, int]]) -> None:
        """Give the disk back the payload bytes of blocks that just died (their deleting
        batch is durable): whole pages inside each payload are punched out of the file,
        record headers stay, so the log still scans. Deleted data makes room at once,
        whatever its layout, without copying anything (a full disk has no room to copy
        into). Replay and compaction never read a dead payload; one that is read back
        (a whole-log `check`) is not reported, since no key references it."""
        if not self.punch_ok:
            return
        for sid, off, size in dead:
            seg = self.segs.get(sid)
            start = -(-off // PUNCH_ALIGN) * PUNCH_ALIGN
            end = (off + size) // PUNCH_ALIGN * PUNCH_ALIGN
            if seg is None or end <= start:
                continue
            try:
                if not self.io.punch_hole(seg.fd, start, end - start):
                    self.punch_ok = False
                    log.info("%s cannot punch holes: dead bytes wait for compaction", self.dir)
                    return
            except OSError as exc:
                log.warning("punching dead bytes out of segment %08d failed: %s", sid, exc)
                continue
            with self.lock:
                self.seg_punched[sid] = self.seg_punched.get(sid, 0) + end - start
                self.punched_bytes += end - start

    # -- looking in the log --------------------------------------------------------------
    def blob_placed(self, sdig: bytes, size: int, loc: tuple[int, int]) -> bool:
        """Whether the log holds a BLOB record of `sdig` with `size` bytes at `loc`."""
        seg = self.segs.get(loc[0])
        hlen = records.blob_header_length(sdig)
        if seg is None or loc[1] < hlen:
            return False
        try:
            rec = records.decode(seg.read(loc[1] - hlen, hlen))
        except (OSError, records.RecordError):
            return False
        return rec.op is Op.BLOB and rec.sdig == sdig and rec.plen == size

    def find_in_log(self, sdig: bytes, size: int, first: int) -> tuple[int, int, Buffer] | None:
        """A copy of `sdig` in the log whose bytes verify: (segment, payload offset, bytes).
        Reads record headers only, from segment `first`, then newest first."""
        with self.lock:
            segs = dict(self.segs)
            ends = dict(self.seg_len)
        if self.writer.active is not None:
            ends[self.writer.active.id] = self.writer.pos
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

    def drop_segment(self, sid: int) -> Segment | None:
        """Forget segment `sid` (its SEGDEL record is durable; lock held)."""
        seg = self.segs.pop(sid, None)
        self.seg_len.pop(sid, None)
        self.seg_live.pop(sid, None)
        self.seg_tomb.pop(sid, None)
        self.seg_punched.pop(sid, None)
        self.dirty.segs.add(sid)
        return seg

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.segs.clear()
