"""Compaction: reclaim the space of dead records, and keep the log within its bounds.

How it works
------------
Records go dead when a later record supersedes them (a key replaced or deleted, a blob
whose last key went, a snapshot dropped). Each segment's *live* bytes are known exactly
(`SegmentSpace.seg_live`: the blobs, key records and snapshot/branch records RAM points
at), tombstone bytes are counted apart (`seg_tomb`); the rest of a sealed segment is dead.
The compactor works on the segment space (`store/space.py`), asks RAM what is live
through `LiveRam` (`RamState`'s public calls), and asks the store to evict, relocate or
quarantine through `Maintenance`; it never reads the store.

Between batches, on the committer thread, `Compactor.step` picks a sealed segment and
copies its live records to the head of the log, in steps of `STEP_BYTES`, through the
same write-and-sync path as any batch. A copy is always the record's *current* state,
so replaying the log in order still gives the right answer with the copy placed later.
Once a segment holds nothing live it is deleted: a SEGDEL record first (so a missing
file is known to be intended), then the unlink. A copy is made durable before RAM (and,
later, the index) points at it, so a crash at any moment leaves either copy valid.

Tombstones (DEL/MDEL) must outlive every older record they shadow: one is copied
forward while a segment older than its own exists, or while its segment is not yet
covered by the index checkpoint (replay starts there). QUAR records (the quarantine
list) are always kept; SEGDEL records only while the index may still need them. A SEAL
(an abandoned segment's trusted end) is made unnecessary by cutting that segment short.

Which segment:
- a segment with nothing live and no tombstones is deleted without reading it;
- normally the sealed segment with the most dead bytes, once at least a third of it is
  dead: the log then stays within ~1.5x the live bytes plus the active segment;
- near `cold_capacity_bytes`, or after ENOSPC, any segment with dead bytes whose live
  part fits in the room left (most dead first): space comes back without a restart;
- when tombstones add up (more than a tenth of the live bytes), the oldest segment,
  whose tombstones can then be dropped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import Any, Protocol

from epistemic_kvcache.errors import StoreError
from epistemic_kvcache.store import records
from epistemic_kvcache.store.index import pack_loc, unpack_loc
from epistemic_kvcache.store.plan import BlobView, KeyView
from epistemic_kvcache.store.records import Op
from epistemic_kvcache.store.recovery import META_CODES, META_KINDS
from epistemic_kvcache.store.scan import Damage, scan
from epistemic_kvcache.store.segments import SyncFailed
from epistemic_kvcache.store.space import SegmentSpace

log = logging.getLogger(__name__)

STEP_BYTES = 32 << 20
"""Bytes of a segment one step reads (bounds how long it delays the next batch)."""
_BACKOFF_S = 5.0


class LiveRam(Protocol):
    """What the compactor reads of RAM (`ram.RamState`; `*_locked`: lock held)."""

    def key(self, ns: str, key: str) -> KeyView | None: ...

    def blob(self, sdig: bytes) -> BlobView | None: ...

    def meta(self, kind: str, tenant: str, rid: str) -> dict[str, Any] | None: ...

    def key_locked(self, ns: str, key: str) -> KeyView | None: ...

    def use_order(self) -> list[tuple[int, int, int]]:
        """(segment, size, pins) of every blob, least recently used first."""

    def move_locked(self, sdig: bytes, old: tuple[int, int], new: tuple[int, int]) -> int:
        """Point RAM at the copy at `new` if the blob is still at `old`: its size, or 0."""


class Maintenance(Protocol):
    """What the compactor asks the store to do (`batches.Batches`)."""

    def relocate(self, sdig: bytes, wrong: tuple[int, int], right: tuple[int, int]) -> None:
        """Point RAM at a verified copy of a blob RAM places at `wrong`."""

    def quarantine_async(self, sdig: bytes, loc: tuple[int, int]) -> None: ...

    def evict_segment(self, sid: int) -> bool:
        """Evict every unpinned block of segment `sid` (a batch of its own)."""

    def checkpoint_due(self, nbytes: int) -> None: ...


class Compactor:
    """Compaction of one store's segment space (runs on its committer thread)."""

    def __init__(self, space: SegmentSpace, ram: LiveRam, maint: Maintenance) -> None:
        self.space = space
        self.ram = ram
        self.maint = maint
        self.cursor: tuple[int, int] | None = None
        self.backoff_until = 0.0
        self._bad: set[bytes] = set()

    # -- policy --------------------------------------------------------------------------
    def pressure(self) -> bool:
        sp = self.space
        return sp.writer.disk_full or sp.disk_bytes() + sp.reserve > sp.cold_capacity_bytes

    def candidate(self, *, room: int | None = None) -> int | None:
        """The segment to work on next, if any is worth it."""
        sp = self.space
        if self.cursor is not None and self.cursor[0] in sp.segs:
            return self.cursor[0]
        sealed = sp.sealed()
        if not sealed:
            return None
        with sp.lock:
            for sid in sealed:  # nothing live, nothing to carry: just delete it
                if sp.seg_live.get(sid, 0) <= 0 and sp.seg_tomb.get(sid, 0) <= 0:
                    return sid
            pressure = room is not None or self.pressure()
            best, best_dead = None, 0
            for sid in sealed:
                length = sp.seg_len.get(sid, 0)
                dead = sp.dead(sid)
                if pressure:  # worth it when a fair share comes back, and the copy fits
                    live_part = length - dead
                    ok = dead >= max(64 << 10, length // 8) and (room is None or live_part <= room)
                else:
                    ok = dead * 3 >= length and dead >= min(1 << 20, sp.segment_bytes // 64)
                if ok and dead > best_dead:
                    best, best_dead = sid, dead
            if best is not None:
                return best
            live_total = sum(sp.seg_live.values())
            tomb_total = sum(sp.seg_tomb.values())
            if tomb_total > max(16 << 20, live_total // 10):
                return min(sealed)
        return None

    # -- entry points --------------------------------------------------------------------
    def step(self) -> bool:
        """One step of idle maintenance; True when there is more to do soon."""
        if time.monotonic() < self.backoff_until:
            return False
        self._seal_a_dead_active()
        sid = self.candidate()
        if sid is None:
            return False
        return self._work(sid)

    def _seal_a_dead_active(self) -> None:
        """The active segment is never compacted; one that is mostly dead (a store whose
        keys churn in place) is sealed while idle, so its space can come back."""
        sp = self.space
        w = sp.writer
        if w.active is None:
            return
        length = w.pos
        with sp.lock:
            live = sp.seg_live.get(w.active.id, 0) + sp.seg_tomb.get(w.active.id, 0)
        if length >= max(32 << 20, sp.segment_bytes // 4) and (length - live) * 2 >= length:
            try:
                w.seal()
            except OSError as exc:
                log.error("sealing segment %08d failed: %s", w.active.id, exc)

    def make_disk_room(self, incoming: int) -> None:
        """Before a batch: compact until `incoming` more bytes fit, both the cold capacity
        and (after an ENOSPC) the file system's free space."""
        sp = self.space
        w = sp.writer
        incoming += 64 << 10  # record headers and slack
        for _ in range(256):
            # the files may grow by the batch, and by the delete reserve zeroed after it
            cap_room = sp.cold_capacity_bytes - sp.disk_bytes() - w.delete_reserve
            room = cap_room
            if w.disk_full:
                w.room.recheck()  # look again
                room = min(room, w.room.free_bytes() - w.delete_reserve)
            if incoming <= room:
                return
            sid = self.candidate(room=max(0, room))
            if sid is not None:
                if not self._work(sid):
                    return
                continue
            if cap_room >= incoming:
                return  # the file system is full, not the cold tier: no block is evicted
            # nothing can be copied into the room left: empty a segment by evicting its
            # blocks (the cache gives up some blocks; it never needs room to do so)
            sid = self._eviction_victim(max(0, room))
            if sid is None or not self.maint.evict_segment(sid) or not self._work(sid):
                return

    def _eviction_victim(self, room: int) -> int | None:
        """The sealed segment to empty: the one whose most recently used unpinned block
        is the least recently used (LRU, by segment); a segment holding no block goes
        first (it frees space without evicting anything). What stays (pinned blocks, key
        records) must fit the room left."""
        sealed = set(self.space.sealed())
        last_use: dict[int, int] = {}
        pinned: dict[int, int] = {}
        for rank, (seg, size, pins) in enumerate(self.ram.use_order()):
            if pins:
                pinned[seg] = pinned.get(seg, 0) + size
            else:
                last_use[seg] = rank
        best, best_key = None, None
        for sid in sealed:
            if pinned.get(sid, 0) > room:
                continue
            key = (last_use.get(sid, -1), sid)
            if best_key is None or key < best_key:
                best, best_key = sid, key
        return best

    # -- one step ------------------------------------------------------------------------
    def _work(self, sid: int) -> bool:
        try:
            with self.space.maint_lock:
                return self._copy_step(sid)
        except (OSError, StoreError) as exc:
            log.error("compaction of segment %08d failed (nothing lost): %s", sid, exc)
            self.backoff_until = time.monotonic() + _BACKOFF_S
            self.cursor = None
            return False

    def _write(self) -> list[tuple[int, int]]:
        w = self.space.writer
        try:
            return w.write(reserve_ok=True)
        except SyncFailed:
            self.space.abandon()
            raise
        except OSError:
            w.rollback()
            raise

    def _copy_step(self, sid: int) -> bool:
        sp, ram = self.space, self.ram
        seg = sp.segs[sid]
        start = self.cursor[1] if self.cursor is not None and self.cursor[0] == sid else 0
        end = sp.seg_len.get(sid, 0)
        with sp.lock:
            nothing_live = sp.seg_live.get(sid, 0) <= 0 and sp.seg_tomb.get(sid, 0) <= 0
        if nothing_live or start >= end:
            return self._delete_if_dead(sid)
        w = sp.writer
        w.begin()
        ckpt_seg = sp.ckpt_pos[0]
        older_exists = min(sp.segs) < sid
        keep_tombs = older_exists or sid >= ckpt_seg
        blob_moves: list[tuple[bytes, int, int, int]] = []  # sdig, old off, new seg, new off
        key_moves: list[tuple[str, str, int, int]] = []  # ns, key, old loc, new loc
        meta_moves: list[tuple[tuple[str, str, str], int, int, int]] = []
        tomb: dict[int, int] = {}
        bad: list[tuple[bytes, tuple[int, int]]] = []
        pos = start
        budget = STEP_BYTES
        for item in scan(seg, start, end, payloads=True, verify=True):
            if budget <= 0:
                break
            if isinstance(item, Damage):
                pos = item.end
                continue
            pos = item.end
            budget -= item.end - item.off
            rec = item.rec
            op = rec.op
            here = pack_loc(sid, item.off)
            if op is Op.BLOB:
                b = ram.blob(rec.sdig)
                if b is None:
                    continue
                if (b.seg, b.off) != (sid, item.data_off):
                    if not (item.ok and rec.plen == b.size):
                        continue
                    # RAM places the block elsewhere: only a copy if that place holds it
                    # (a damaged index row may have sent it astray; this copy verifies)
                    if sp.blob_placed(b.sdig, b.size, (b.seg, b.off)):
                        continue
                    self.maint.relocate(b.sdig, (b.seg, b.off), (sid, item.data_off))
                    if (b.seg, b.off) != (sid, item.data_off):
                        continue
                if not item.ok or item.payload is None:
                    bad.append((rec.sdig, (sid, item.data_off)))
                    continue
                hdr = records.encode(Op.BLOB, sdig=rec.sdig, plen=rec.plen)
                nsid, noff = w.alloc(hdr, item.payload)
                blob_moves.append((rec.sdig, item.data_off, nsid, noff + len(hdr)))
            elif op is Op.KEY:
                if sp.kloc.get(rec.ns, {}).get(rec.key) != here:
                    continue
                ks = ram.key(rec.ns, rec.key)
                if ks is None:
                    continue
                hdr = records.encode(
                    Op.KEY, ns=rec.ns, key=rec.key, sdig=ks.sdig, pins=ks.pins, tag=ks.tag
                )
                nsid, noff = w.alloc(hdr)
                key_moves.append((rec.ns, rec.key, here, pack_loc(nsid, noff)))
            elif op is Op.META:
                kind = META_KINDS.get(rec.aux, "")
                mk = (kind, rec.ns, rec.key)
                cur = sp.mloc.get(mk)
                body = ram.meta(kind, rec.ns, rec.key) if kind else None
                if cur is None or cur[0] != here or body is None:
                    continue
                raw = json.dumps(body).encode()
                hdr = records.encode(
                    Op.META,
                    ns=rec.ns,
                    key=rec.key,
                    aux=META_CODES[kind],
                    plen=len(raw),
                    pcrc=records.payload_crc(raw),
                )
                nsid, noff = w.alloc(hdr, raw)
                meta_moves.append((mk, here, pack_loc(nsid, noff), len(hdr) + len(raw)))
            elif op in (Op.DEL, Op.MDEL):
                if not keep_tombs:
                    continue
                if op is Op.DEL:
                    if ram.key(rec.ns, rec.key) is not None:
                        continue  # the key exists again: a later KEY record wins
                else:
                    kind = META_KINDS.get(rec.aux, "")
                    if kind and ram.meta(kind, rec.ns, rec.key) is not None:
                        continue
                hdr = records.encode(op, ns=rec.ns, key=rec.key, aux=rec.aux)
                nsid, _noff = w.alloc(hdr)
                tomb[nsid] = tomb.get(nsid, 0) + len(hdr)
            elif op is Op.QUAR or (op is Op.SEGDEL and rec.aux >= ckpt_seg):
                hdr = records.encode(op, sdig=rec.sdig, aux=rec.aux)
                nsid, _noff = w.alloc(hdr)
                tomb[nsid] = tomb.get(nsid, 0) + len(hdr)
            elif op is Op.SEAL:
                self._cut_sealed(rec.aux, rec.epoch)
        written = self._write() if not w.empty else []
        self._apply(sid, blob_moves, key_moves, meta_moves, tomb, written)
        for sdig, loc in bad:
            if sdig not in self._bad:
                self._bad.add(sdig)
                log.error("integrity failure during compaction: %s", sdig[-32:].hex())
                with contextlib.suppress(StoreError):
                    self.maint.quarantine_async(sdig, loc)
        self.cursor = (sid, pos) if pos < end else None
        if pos >= end:
            sp.compactions += 1
            self._delete_if_dead(sid)
        return True

    def _apply(
        self,
        sid: int,
        blob_moves: list[tuple[bytes, int, int, int]],
        key_moves: list[tuple[str, str, int, int]],
        meta_moves: list[tuple[tuple[str, str, str], int, int, int]],
        tomb: dict[int, int],
        written: list[tuple[int, int]],
    ) -> None:
        sp, ram = self.space, self.ram
        moved = 0
        with sp.lock:
            dirty = sp.dirty
            for sdig, old_off, nsid, noff in blob_moves:
                n = ram.move_locked(sdig, (sid, old_off), (nsid, noff))
                if n:
                    dirty.blobs.add(sdig)
                    moved += n
            for ns, key, old, new in key_moves:
                locs = sp.kloc.get(ns)
                ks = ram.key_locked(ns, key)
                if locs is None or locs.get(key) != old or ks is None:
                    continue
                locs[key] = new
                sp.count_key_rec(old, ns, key, ks.sdig, ks.tag, -1)
                sp.count_key_rec(new, ns, key, ks.sdig, ks.tag, +1)
                dirty.keys.add((ns, key))
            for mk, old, new, nbytes in meta_moves:
                cur = sp.mloc.get(mk)
                if cur is None or cur[0] != old:
                    continue
                sp.mloc[mk] = (new, nbytes)
                sp.add_live(unpack_loc(old)[0], -cur[1])
                sp.add_live(unpack_loc(new)[0], nbytes)
                dirty.metas.add(mk)
            for tsid, n in tomb.items():
                sp.add_tomb(tsid, n)
            dirty.segs.update(tomb)
            if written:
                sp.written(written)
        sp.compacted_bytes += moved
        if written:
            self.maint.checkpoint_due(sp.writer.last_batch_bytes)

    def _cut_sealed(self, target: int, trusted_end: int) -> None:
        """Cut an abandoned segment to its trusted end, so its SEAL is needed no more."""
        seg = self.space.segs.get(target)
        if seg is None or seg.size() <= trusted_end:
            return
        os.ftruncate(seg.fd, trusted_end)
        os.fsync(seg.fd)

    def _delete_if_dead(self, sid: int) -> bool:
        """Delete a segment that holds nothing live (a SEGDEL record first, then unlink)."""
        sp = self.space
        with sp.lock:
            if sp.seg_live.get(sid, 0) > 0:
                return False
        w = sp.writer
        if w.active is not None and w.active.id == sid:
            return False
        w.begin()
        hdr = records.encode(Op.SEGDEL, aux=sid)
        tsid, _off = w.alloc(hdr)
        written = self._write()
        with sp.lock:
            seg = sp.drop_segment(sid)
            sp.add_tomb(tsid, len(hdr))
            sp.dirty.segs.add(tsid)
            sp.written(written)
        if seg is not None:
            with contextlib.suppress(OSError):
                seg.path.unlink()
        sp.segments_deleted += 1
        if self.cursor is not None and self.cursor[0] == sid:
            self.cursor = None
        self.maint.checkpoint_due(w.last_batch_bytes)
        return True
