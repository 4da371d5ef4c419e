"""Recovery: the store's state from the index checkpoint plus the log after it.

How it works
------------
`LogState` is what replaying the log gives: keys, blob locations, snapshot and branch
records, the quarantine, and per-segment tombstone bytes. Opening a store fills it from
the LMDB checkpoint (`store/index.py`, O(index)) and then `replay`s the log after the
checkpoint position (O(tail)). Rebuilding the index fills it by replaying every segment.

Replay reads records in log order and applies them a batch at a time: records are
held until the record that ends their group commit arrives, so a batch torn by a crash
is dropped whole. Damaged bytes are skipped (the scanner resyncs on the next record),
counted and listed; zeros that run to the end of a segment are space the writer zeroed
ahead and had not cut yet when it died, not damage. A segment abandoned after a failed
sync is read only up to the end its SEAL record names (SEALs are always among the first
records of a segment, so a short pre-pass finds them all). BLOB payloads are verified
against their digest while replaying; a block that fails is never located, so its keys
read as lost.

After replay, `finish` drops blobs no key references, and sorts out what is *lost*: a
key whose blob has no valid bytes any more (segment deleted or truncated by hand, or
its record damaged) is not served; it is counted and listed by `store check`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from epistemic_kvcache.store import records
from epistemic_kvcache.store.index import Changes, Index, KeyState, pack_loc
from epistemic_kvcache.store.records import Op
from epistemic_kvcache.store.scan import Damage, Scanned, only_zeros, scan
from epistemic_kvcache.store.segments import Segment

log = logging.getLogger(__name__)

META_KINDS = {1: "snap", 2: "branch"}
META_CODES = {"snap": 1, "branch": 2}

Progress = Callable[[str], None]


class StoreMismatchError(ValueError):
    """Segments (or index) of different stores in one persist dir."""


@dataclass(slots=True)
class LogState:
    """The store as the log says (see the module docstring)."""

    store_id: str | None = None
    keys: dict[tuple[str, str], KeyState] = field(default_factory=dict)
    blobs: dict[bytes, tuple[int, int, int]] = field(default_factory=dict)  # size, off, seg
    metas: dict[tuple[str, str, str], tuple[int, int, dict[str, Any]]] = field(
        default_factory=dict
    )  # (kind, tenant, id) -> (location, record bytes, record)
    quarantine: dict[bytes, float] = field(default_factory=dict)
    tomb: dict[int, int] = field(default_factory=dict)
    seg_rows: dict[int, tuple[int, int]] = field(default_factory=dict)  # from the index
    seals: dict[int, int] = field(default_factory=dict)
    segdel: set[int] = field(default_factory=set)
    damage: list[tuple[int, int, int, str]] = field(default_factory=list)
    bad_blobs: list[tuple[int, int, str]] = field(default_factory=list)
    ends: dict[int, int] = field(default_factory=dict)  # segment -> end of its last batch
    end: tuple[int, int] | None = None
    changes: Changes = field(default_factory=Changes.empty)
    batches: int = 0
    records: int = 0
    replayed_bytes: int = 0
    tail_bytes: int = 0  # after the last complete batch: a torn write or pre-zeroed space
    lost_keys: list[tuple[str, str, bytes]] = field(default_factory=list)
    lost_blobs: set[bytes] = field(default_factory=set)
    counters: dict[str, int] = field(default_factory=dict)
    quar_dels: dict[tuple[str, str], KeyState] = field(default_factory=dict)
    del_locs: dict[tuple[str, str], int] = field(default_factory=dict)  # the last DEL of a key
    tail_damage: list[tuple[int, int, int, str]] = field(default_factory=list)
    """Keys deleted because their block was quarantined (and not written since)."""


def load_index(ix: Index, progress: Progress | None = None) -> LogState:
    """The checkpoint's state (no log read)."""
    st = LogState()
    sid = ix.meta(b"store_id")
    st.store_id = sid.decode() if sid else None
    for n, (ns, key, ks) in enumerate(ix.iter_keys(), 1):
        st.keys[(ns, key)] = ks
        if progress is not None and n % 500_000 == 0:
            progress(f"loaded {n} keys from the index")
    for sdig, row in ix.iter_blobs():
        st.blobs[sdig] = row
    for kind, tenant, rid, loc, rec in ix.iter_metas():
        st.metas[(kind, tenant, rid)] = (loc, _meta_bytes(tenant, rid, rec), rec)
    st.quarantine = ix.quarantined()
    st.seg_rows = dict(ix.iter_segs())
    st.tomb = {sid: row[0] for sid, row in st.seg_rows.items()}
    st.counters = ix.counters()
    return st


def _meta_bytes(tenant: str, rid: str, rec: dict[str, Any]) -> int:
    return records.record_length(Op.META, tenant, rid) + len(json.dumps(rec).encode())


def read_seals(segments: dict[int, Segment], st: LogState) -> None:
    """Collect SEAL records (always right after a segment's SEGH) and check store ids."""
    for sid in sorted(segments):
        for item in scan(segments[sid], 0, None, payloads=False, verify=False):
            if isinstance(item, Damage):
                break
            rec = item.rec
            if rec.op is Op.SEGH:
                _check_store(st, rec.ns, sid)
                continue
            if rec.op is not Op.SEAL:
                break
            st.seals[rec.aux] = min(rec.epoch, st.seals.get(rec.aux, rec.epoch))


def _check_store(st: LogState, store_id: str, sid: int) -> None:
    if st.store_id is None:
        st.store_id = store_id
    elif store_id != st.store_id:
        raise StoreMismatchError(
            f"segment {sid:08d} belongs to store {store_id}, not {st.store_id}"
        )


def replay(
    segments: dict[int, Segment],
    st: LogState,
    start: tuple[int, int] | None,
    *,
    verify: bool = True,
    progress: Progress | None = None,
    seals: bool = True,
) -> None:
    """Apply the log from `start` (None: from the beginning) to `st`, batch by batch,
    after the segments' seals (`seals=False`: `st.seals` holds them already)."""
    if seals:
        read_seals(segments, st)
    pending: list[tuple[int, Scanned]] = []
    t_last = time.monotonic()
    last = max(segments, default=None)
    for sid in sorted(segments):
        if start is not None and sid < start[0]:
            continue
        seg = segments[sid]
        off = start[1] if start is not None and sid == start[0] else 0
        stop = st.seals.get(sid)
        if stop is not None and stop < off:
            continue
        for item in scan(seg, off, stop, payloads=False, verify=verify):
            if isinstance(item, Damage):
                if sid != last and _zeroed_tail(seg, item.off, item.end):
                    st.tail_bytes += item.end - item.off  # (the last one's: below)
                    continue
                st.damage.append((sid, item.off, item.end, item.reason))
                continue
            pending.append((sid, item))
            st.replayed_bytes += item.end - item.off
            if item.rec.end_of_batch:
                for psid, pitem in pending:
                    _apply(st, psid, pitem)
                    if pitem.end > st.ends.get(psid, 0):
                        st.ends[psid] = pitem.end  # a batch may span two segments
                st.records += len(pending)
                st.batches += 1
                pending.clear()
                st.ends[sid] = item.end
                st.end = (sid, item.end)
            if progress is not None and time.monotonic() - t_last > 2.0:
                t_last = time.monotonic()
                progress(
                    f"replaying segment {sid:08d}: {st.records} records, "
                    f"{st.replayed_bytes >> 20} MiB"
                )
    # Records after the last complete batch were never acknowledged: dropped. Bytes after
    # it in the last segment are its torn tail or pre-zeroed space, not damage.
    if last is not None:
        tail_from = st.ends.get(last, 0)
        tail = [d for d in st.damage if d[0] == last and d[1] >= tail_from]
        st.damage = [d for d in st.damage if d not in tail]
        st.tail_damage = tail
        st.tail_bytes = sum(d[2] - d[1] for d in tail)


def _zeroed_tail(seg: Segment, off: int, end: int) -> bool:
    """Whether `off..end` runs to the end of `seg` and holds only zeros: space the writer
    zeroed ahead of a segment's end, which a batch rolling over into a new segment cuts
    off once it is durable. A crash between the two leaves it in the middle of that
    batch: not damage."""
    try:
        return end == seg.size() and only_zeros(seg, off, end)
    except OSError:
        return False


def _apply(st: LogState, sid: int, item: Scanned) -> None:
    rec = item.rec
    op = rec.op
    ch = st.changes
    size = item.end - item.off
    if op is Op.BLOB:
        if item.ok:
            loc = (rec.plen, item.data_off, sid)
            st.blobs[rec.sdig] = loc
            ch.blobs[rec.sdig] = loc
        else:
            st.bad_blobs.append((sid, item.off, rec.sdig[-32:].hex()))
    elif op is Op.KEY:
        ks = KeyState(rec.sdig, rec.pins, rec.tag, pack_loc(sid, item.off))
        st.keys[(rec.ns, rec.key)] = ks
        ch.keys[(rec.ns, rec.key)] = ks
        st.quar_dels.pop((rec.ns, rec.key), None)
    elif op is Op.DEL:
        prior = st.keys.pop((rec.ns, rec.key), None)
        st.del_locs[(rec.ns, rec.key)] = pack_loc(sid, item.off)
        if rec.aux == records.DEL_QUARANTINED and prior is not None:
            st.quar_dels[(rec.ns, rec.key)] = prior
        else:
            st.quar_dels.pop((rec.ns, rec.key), None)
        ch.keys[(rec.ns, rec.key)] = None
        _tomb(st, sid, size)
    elif op is Op.META:
        kind = META_KINDS.get(rec.aux)
        if kind is None or not item.ok or item.payload is None:
            st.damage.append((sid, item.off, item.end, "bad snapshot/branch record"))
            return
        body = json.loads(bytes(item.payload))
        m = (pack_loc(sid, item.off), size, body)
        st.metas[(kind, rec.ns, rec.key)] = m
        ch.metas[(kind, rec.ns, rec.key)] = (m[0], body)
    elif op is Op.MDEL:
        kind = META_KINDS.get(rec.aux, "")
        st.metas.pop((kind, rec.ns, rec.key), None)
        ch.metas[(kind, rec.ns, rec.key)] = None
        _tomb(st, sid, size)
    elif op is Op.QUAR:
        st.quarantine[rec.sdig] = rec.aux / 1000
        ch.quarantine[rec.sdig] = rec.aux / 1000
        _tomb(st, sid, size)
    elif op is Op.SEGH:
        _check_store(st, rec.ns, sid)
    elif op is Op.SEGDEL:
        st.segdel.add(rec.aux)
        _tomb(st, sid, size)


def reverify_quarantine(st: LogState) -> list[tuple[str, str, str]]:
    """After a whole-log replay that verified every block: a quarantined block with a
    copy in the log that verifies was quarantined by mistake (say, a read at a wrong
    location). Lift its quarantine and bring back the keys the quarantine deleted (unless
    written since). Returns (namespace, key, digest hex) of each key brought back."""
    back: list[tuple[str, str, str]] = []
    for sdig in [d for d in st.quarantine if d in st.blobs]:
        del st.quarantine[sdig]
        st.changes.quarantine.pop(sdig, None)
        for ref, ks in list(st.quar_dels.items()):
            if ks.sdig == sdig and ref not in st.keys:
                st.keys[ref] = ks
                st.changes.keys[ref] = ks
                del st.quar_dels[ref]
                back.append((ref[0], ref[1], sdig[-32:].hex()))
    return back


@dataclass(slots=True)
class Salvage:
    """What a rebuild could not take from the log alone (see `salvage`)."""

    restored: list[tuple[str, str]] = field(default_factory=list)
    """Keys whose newest record is damaged, taken from the old index (block verified)."""
    unrestored: list[tuple[str, str, str]] = field(default_factory=list)
    """(namespace, key, why): keys the old index had that the rebuild cannot serve."""
    suspects: list[tuple[str, str, str]] = field(default_factory=list)
    """(namespace, key, what): keys named by a damaged record (its checksum fails, so the
    name is a best guess) that the rebuild does not hold as that record would have it."""


def _in_damage(loc: int, regions: list[tuple[int, int, int, str]]) -> bool:
    sid, off = loc >> 40, loc & ((1 << 40) - 1)
    return any(d[0] == sid and d[1] <= off < d[2] for d in regions)


def salvage(st: LogState, old: LogState | None, segments: dict[int, Segment]) -> Salvage:
    """After a whole-log replay (`st`), recover what damaged records hide.

    `old` is the old index's view (its rows plus the log after its checkpoint) when it
    still reads. A key it holds whose record lies in a damaged region of the log (so the
    replay never saw it) is taken from it when its block verifies in the log; otherwise
    it is named as lost. Without an old index, damaged regions are decoded leniently
    (without their checksum) and the keys they name are reported as suspects."""
    out = Salvage()
    regions = st.damage + st.tail_damage
    if old is not None:
        for ref, oks in old.keys.items():
            cur = st.keys.get(ref)
            if cur is not None and cur.loc >= oks.loc:
                continue  # the log has this record, or a later one
            if cur is None and st.del_locs.get(ref, -1) > oks.loc:
                continue  # deleted after the old index's record
            # the log lost the record the old index has (damaged, cut short, or its
            # segment deleted): take it from there when its block verifies in the log
            if oks.sdig in st.blobs and oks.sdig not in st.lost_blobs:
                st.keys[ref] = oks
                st.changes.keys[ref] = oks
                out.restored.append(ref)
                continue
            where = "is damaged" if _in_damage(oks.loc, regions) else "is gone"
            why = f"its newest record {where} and its block is gone"
            if cur is not None:  # never serve the older value the log still has
                del st.keys[ref]
                st.changes.keys[ref] = None
                why += " (an older value is not served)"
            out.unrestored.append((ref[0], ref[1], why))
    for ref, ks in st.quar_dels.items():
        if ref not in st.keys and ks.sdig in st.quarantine:
            why = f"its block {ks.sdig[-32:].hex()} failed verification (quarantined)"
            out.unrestored.append((ref[0], ref[1], why))
    for sid, start, _end, _why in regions:
        seg = segments.get(sid)
        if seg is None:
            continue
        try:
            rec = records.decode_unchecked(
                bytes(os.pread(seg.fd, records.FIXED_BYTES + 2048, start))
            )
        except (OSError, records.RecordError):
            continue
        ref = (rec.ns, rec.key)
        if rec.op is Op.KEY and (ref not in st.keys or st.keys[ref].sdig != rec.sdig):
            if ref not in out.restored and ref not in {(n, k) for n, k, _w in out.unrestored}:
                out.suspects.append((rec.ns, rec.key, "its KEY record is damaged"))
        elif rec.op is Op.DEL and ref in st.keys and st.keys[ref].loc < pack_loc(sid, start):
            out.suspects.append((rec.ns, rec.key, "a damaged DEL may have deleted it"))
    return out


def _tomb(st: LogState, sid: int, size: int) -> None:
    st.tomb[sid] = st.tomb.get(sid, 0) + size


def finish(st: LogState, segments: dict[int, Segment], valid_end: dict[int, int]) -> None:
    """Drop unreferenced blobs; find lost blobs (bytes gone) and the keys that lose them."""
    referenced = {ks.sdig for ks in st.keys.values()}
    # a dead payload that fails verification is no loss (and is punched out on purpose)
    wanted = {sdig[-32:].hex() for sdig in referenced if sdig not in st.blobs}
    wanted |= {sdig[-32:].hex() for sdig in st.quarantine}  # still failing: a known loss
    st.bad_blobs = [bb for bb in st.bad_blobs if bb[2] in wanted]
    for sdig in [s for s in st.blobs if s not in referenced]:
        del st.blobs[sdig]
        st.changes.blobs[sdig] = None
    for sdig, (size, off, sid) in st.blobs.items():
        seg = segments.get(sid)
        if seg is None or off + size > valid_end.get(sid, 0):
            st.lost_blobs.add(sdig)
    for (ns, key), ks in st.keys.items():
        if ks.sdig not in st.blobs or ks.sdig in st.lost_blobs:
            st.lost_keys.append((ns, key, ks.sdig[-32:]))


def newer_format(segments: dict[int, Segment]) -> tuple[int, int] | None:
    """(segment id, record format) of the first segment whose first record a newer
    release wrote (a record format above `records.VERSION`); None when there is none.
    Such a log is refused, never replayed: this code would read its records as damage."""
    for sid in sorted(segments):
        try:
            head = os.pread(segments[sid].fd, len(records.MAGIC) + 1, 0)
        except OSError:
            continue
        magic, version = head[:-1], head[-1:]
        if magic == records.MAGIC and version and version[0] > records.VERSION:
            return sid, version[0]
    return None


def missing_segments(ids: list[int], deleted: set[int], first: int | None = None) -> list[int]:
    """Segment ids missing from the sequence `ids` (sorted), not deleted on purpose.
    Gaps are walked, not the whole id range (a stray file named 99999999.seg must not
    make this a hundred million steps); a gap longer than 1000 lists its first 1000."""
    out: list[int] = []
    prev = ids[0] if first is None and ids else first
    if prev is None:
        return out
    for sid in ids:
        if sid > prev + 1:
            gap = [i for i in range(prev + 1, min(sid, prev + 1001)) if i not in deleted]
            out.extend(gap)
        prev = max(prev, sid)
    return out


def absent_segments(st: LogState, segments: dict[int, Segment], ckpt: tuple[int, int]) -> list[int]:
    """Segment files the store expects and does not find (not deleted on purpose), after
    loading the index checkpoint into `st` and replaying the log from `ckpt`: those the
    index lists (its segment rows), and gaps in the sequence after the checkpoint.

    Below the checkpoint a gap in the ids is no evidence: compaction deletes segments
    there (a SEGDEL record, then the unlink) and drops the SEGDEL record once the index
    covers it, so the index's rows alone say which of those segments exist."""
    gone = {sid for sid in st.seg_rows if sid not in segments and sid not in st.segdel}
    if ckpt[0] > 0:
        later = sorted(sid for sid in segments if sid >= ckpt[0])
        gone.update(missing_segments(later, st.segdel, ckpt[0] - 1))
    return sorted(gone)


def valid_ends(st: LogState, segments: dict[int, Segment], ckpt: tuple[int, int]) -> dict[int, int]:
    """Where each segment's trusted bytes end, after replaying from `ckpt`.

    Sealed (abandoned) segments end where their SEAL says; replayed segments at the end of
    their last complete batch; older ones where the index last saw them."""
    out = {}
    for sid, seg in segments.items():
        size = seg.size()
        if sid in st.seals:
            end = st.seals[sid]
        elif sid >= ckpt[0]:
            end = st.ends.get(sid, ckpt[1] if sid == ckpt[0] else 0)
        else:
            end = st.seg_rows.get(sid, (0, size))[1]
        out[sid] = min(end, size)
    return out
