"""Opening a durable store: choose the index or rebuild it, replay the log, load RAM.

How it works
------------
`Opener.run` decides from what is on disk: a usable index (format, checkpoint, same
store as the segments) is loaded and the log is replayed from its checkpoint only
(O(index + tail), never O(data)); no usable index over a non-empty log refuses to start
and names the command that rebuilds it, unless a rebuild is asked for; a rebuild replays
the whole log, takes what damaged records hide from the old index where it still reads
(`recovery.salvage`), moves the old index aside (never deleted) and writes a new one;
an empty directory gets a new store. Then `_finish_open` settles the segments (trusted
ends, intended deletions, holes punched before, missing files), fills the segment space
(`store/space.py`: lengths, live and tombstone bytes, key/meta record locations),
brings the index up to date with the tail, and opens the writer at the end of the last
complete batch. Bytes after that batch were never acknowledged: they are cut off, in its
segment and in every later one (a torn batch may have rolled into a new segment), before
anything is appended, since replay would otherwise read the next batch's end-of-batch
record as theirs and apply them with it (`Opener._cut_torn_tail`).

What RAM must load (`entries`, `metas`) and what open found (lost keys, damage,
quarantine) are left on the opener for the store to take; nothing here touches RAM.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from epistemic_kvcache.errors import ConfigurationError
from epistemic_kvcache.store import records
from epistemic_kvcache.store.index import (
    FORMAT_VERSION,
    OLD_FORMATS,
    Index,
    IndexError_,
    create_index,
    open_index,
    unpack_loc,
)
from epistemic_kvcache.store.model import Effect, MetaPut
from epistemic_kvcache.store.recovery import (
    LogState,
    Salvage,
    StoreMismatchError,
    absent_segments,
    finish,
    load_index,
    newer_format,
    replay,
    reverify_quarantine,
    salvage,
    valid_ends,
)
from epistemic_kvcache.store.scan import only_zeros
from epistemic_kvcache.store.segments import LogWriter, open_segments
from epistemic_kvcache.store.space import SegmentSpace

log = logging.getLogger(__name__)

__all__ = ["Opened", "Opener", "rebuild_hint"]

Entry = tuple[str, str, bytes, int, int, int, tuple[str, int] | None, int]
"""A key RAM loads: (ns, key, sdig, size, segment, payload offset, tag, pins)."""


def lock_persist_dir(path: Path, advice: str = "") -> int:
    """Lock the persist dir `path` (a directory) for this process: the fd of its LOCK
    file, locked while it stays open. Raises `ConfigurationError` naming the dir when
    another process holds it (`advice`: what to do then, in parentheses)."""
    if not path.is_dir():
        raise ConfigurationError(f"invalid persist_dir: {str(path)!r} is not a directory")
    fd = os.open(path / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        more = f" ({advice})" if advice else ""
        raise ConfigurationError(
            f"invalid persist_dir: {str(path)!r} is in use by another process{more}"
        ) from exc
    return fd


def rebuild_hint(path: Path) -> str:
    return (
        f"run `epistemic-kvcache store rebuild-index --persist-dir {path}` "
        "(or start the server with --rebuild-index)"
    )


def index_format_refusal(path: Path, fmt: bytes | None) -> str:
    """Why an index of format `fmt` (not this version's, not one it rebuilds) is refused."""
    shown = (fmt or b"?").decode(errors="replace")
    if shown.isdigit() and int(shown) > int(FORMAT_VERSION):
        return (
            f"invalid persist_dir: {path} was written by a newer release (index format "
            f"{shown}; this release reads format {FORMAT_VERSION.decode()} and rebuilds "
            f"{', '.join(f.decode() for f in OLD_FORMATS)} from the log): run that release "
            "or a later one on it; nothing was changed"
        )
    return (
        f"invalid persist_dir: {path} has an index of format {shown} (this release reads "
        f"format {FORMAT_VERSION.decode()}): {rebuild_hint(path)}"
    )


def log_format_refusal(path: Path, sid: int, fmt: int) -> str:
    """Why a log a newer release wrote (record format `fmt`) is refused."""
    return (
        f"invalid persist_dir: {path} was written by a newer release (segment {sid:08d} "
        f"has record format {fmt}; this release reads record format {records.VERSION}): "
        "run that release or a later one on it; nothing was changed"
    )


@dataclass(frozen=True, slots=True)
class Opened:
    ix: Index
    store_id: str


class Opener:
    """Opens the log and index of `path` into `space` (one use)."""

    def __init__(
        self,
        path: Path,
        space: SegmentSpace,
        *,
        map_size: int,
        rebuild: bool,
        say: Callable[[str], None],
    ) -> None:
        self.path = path
        self.index_dir = path / "index"
        self.space = space
        self.map_size = map_size
        self.rebuild = rebuild
        self.say = say
        self.ix: Index | None = None
        self.store_id = ""
        self.rewrite: list[tuple[str, str]] = []  # keys whose state the log must state again
        self.salvaged: Salvage | None = None
        self.missing_segments: list[int] = []
        self.damage: list[tuple[int, int, int, str]] = []
        self.lost: list[tuple[str, str, bytes]] = []
        self.quarantined: dict[bytes, float] = {}
        self.integrity_failures = 0
        self.entries: list[Entry] = []
        self.metas: list[Effect] = []

    def run(self) -> Opened:
        """Open (or rebuild, or create) the index, replay the log, load the accounting."""
        try:
            return self._run()
        except BaseException:
            if self.ix is not None:
                with contextlib.suppress(Exception):
                    self.ix.close()
            raise

    def _run(self) -> Opened:
        map_size, rebuild = self.map_size, self.rebuild
        self.space.segs.update(open_segments(self.space.dir))
        newer = newer_format(self.space.segs)
        if newer is not None:
            raise ConfigurationError(log_format_refusal(self.path, *newer))
        log_nonempty = any(seg.size() > 0 for seg in self.space.segs.values())
        why: str | None = None
        ix: Index | None = None
        if rebuild:
            why = "rebuild requested"
        else:
            try:
                ix = open_index(self.index_dir, map_size)
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
                        ix.close()
                        raise ConfigurationError(index_format_refusal(self.path, fmt))
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
                f"({why}); refusing to start empty over existing data: {rebuild_hint(self.path)}"
            )
        st: LogState
        try:
            if why is None and ix is not None:
                self.ix = ix
                self.say(f"loading the index of {self.path}")
                try:
                    st = load_index(ix, self.say)
                except IndexError_ as exc:
                    raise ConfigurationError(
                        f"the store in {self.path} has segment files but its index cannot "
                        f"be used ({exc}); refusing to start over damaged rows: "
                        f"{rebuild_hint(self.path)}"
                    ) from exc
                start = ix.checkpoint()
                assert start is not None
                replay(self.space.segs, st, start, progress=self.say)
                if st.end is None:
                    st.end = start
            elif log_nonempty:
                self.say(f"rebuilding the index of {self.path} from its log ({why})")
                st = LogState()
                replay(self.space.segs, st, None, progress=self.say)
                for ns, key, hexd in reverify_quarantine(st):
                    self.say(f"block {hexd} verifies in the log: {ns}/{key} is back")
                    self.rewrite.append((ns, key))
                self._salvage(st, map_size)
                self._set_index_aside()
                self.ix = create_index(
                    self.index_dir, map_size, st.store_id or secrets.token_hex(8)
                )
            else:
                st = LogState(store_id=secrets.token_hex(8))
                self._set_index_aside()
                self.ix = create_index(self.index_dir, map_size, st.store_id or "")
        except StoreMismatchError as exc:
            raise ConfigurationError(f"invalid persist_dir: {exc}") from exc
        if self.ix is not None:
            ix_id = self.ix.meta(b"store_id")
            if st.store_id and ix_id and ix_id.decode() != st.store_id:
                raise ConfigurationError(
                    f"invalid persist_dir: its index belongs to store {ix_id.decode()}, its "
                    f"segments to {st.store_id}: {rebuild_hint(self.path)}"
                )
        self.store_id = st.store_id or secrets.token_hex(8)
        self._finish_open(st)
        assert self.ix is not None
        return Opened(self.ix, self.store_id)

    def _salvage(self, st: LogState, map_size: int) -> None:
        """A rebuild: take what damaged log records hide from the old index where it
        still reads (rows that fail their checksum are skipped), and name every key that
        cannot be restored (`salvaged`)."""
        old: LogState | None = None
        if (self.index_dir / "data.mdb").exists():
            try:
                ix = open_index(self.index_dir, map_size)
            except IndexError_ as exc:
                self.say(f"the old index cannot be read ({exc}): the log alone decides")
            else:
                try:
                    ix.tolerant = True
                    start = ix.checkpoint()
                    if start is not None and ix.meta(b"format") == FORMAT_VERSION:
                        old = load_index(ix)
                        old.seals = dict(st.seals)
                        replay(self.space.segs, old, start, verify=False, seals=False)
                        if ix.damaged_rows:
                            self.say(f"the old index has {ix.damaged_rows} damaged rows")
                except (IndexError_, StoreMismatchError) as exc:
                    self.say(f"the old index cannot be read ({exc}): the log alone decides")
                    old = None
                finally:
                    ix.close()
        sv = salvage(st, old, self.space.segs)
        self.salvaged = sv
        for ns, key in sv.restored:
            self.say(f"{ns}/{key}: its log record is damaged; restored from the old index")
            self.rewrite.append((ns, key))
        for ns, key, why in sv.unrestored:
            log.error("%s/%s is lost: %s", ns, key, why)
        for ns, key, what in sv.suspects:
            log.error("%s/%s may be lost: %s", ns, key, what)

    def _cut_torn_tail(self, end: tuple[int, int]) -> None:
        """Cut off every byte after the last complete batch `end`: in its segment, and
        all of every later one. They were never acknowledged (a batch torn by the
        crash), and replay groups records into batches by the end-of-batch flag alone:
        left in the log, the next batch written after them would be read as their end,
        and they would be applied with it at the next open. A torn batch may have rolled
        into new segments, so the last segment is not the only one to cut.

        Zeros alone are no torn write: the space the writer zeroed ahead of the log's end
        (a clean close cuts it; a process killed between writes leaves it). They are cut
        without the crash message, which stays for bytes a write really left there."""
        for sid in sorted(self.space.segs):
            if sid < end[0]:
                continue
            seg = self.space.segs[sid]
            keep = end[1] if sid == end[0] else 0
            size = seg.size()
            if size <= keep:
                continue
            if only_zeros(seg, keep, size):
                log.debug(
                    "segment %08d: cutting %d zeroed bytes after the log's end", sid, size - keep
                )
            else:
                log.info(
                    "segment %08d: dropping %d bytes after the last complete batch (a "
                    "write torn by a crash, never acknowledged)",
                    sid,
                    size - keep,
                )
            with open(seg.path, "r+b") as f:
                f.truncate(keep)
                os.fsync(f.fileno())

    def _set_index_aside(self) -> None:
        """Move an unusable index out of the way (kept for inspection, never deleted)."""
        if self.index_dir.exists() and any(self.index_dir.iterdir()):
            aside = self.path / f"index.unusable-{time.strftime('%Y%m%d-%H%M%S')}"
            self.index_dir.rename(aside)
            log.warning("moved the unusable index to %s", aside)

    def _finish_open(self, st: LogState) -> None:
        assert self.ix is not None
        ckpt = self.ix.checkpoint() or (0, 0)
        last = max(self.space.segs, default=0)
        valid = valid_ends(st, self.space.segs, ckpt)  # where each segment's trusted bytes end
        self.missing_segments = absent_segments(st, self.space.segs, ckpt)
        for sid in list(self.space.segs):
            if sid in st.segdel:  # deleted on purpose; the unlink did not happen before a crash
                with contextlib.suppress(OSError):
                    self.space.segs.pop(sid).path.unlink()
                valid.pop(sid, None)
        finish(st, self.space.segs, valid)
        self.damage = st.damage
        for sid, off, dend, reason in st.damage:
            log.error("damaged log bytes in segment %08d at %d..%d: %s", sid, off, dend, reason)
        for sid, off, hexd in st.bad_blobs:
            log.error("block %s in segment %08d at %d fails verification", hexd, sid, off)
        if self.missing_segments:
            log.error(
                "segment files missing from %s: %s (deleted by hand?); their records are lost",
                self.space.dir,
                ", ".join(f"{s:08d}" for s in self.missing_segments),
            )
        self.lost = st.lost_keys
        if self.lost:
            log.error(
                "%d keys (%d blocks) have lost their bytes (segment deleted, truncated or "
                "damaged): they read as misses; `epistemic-kvcache store check` lists them",
                len(self.lost),
                len(st.lost_blobs),
            )
        self.space.seg_len.update(valid)
        for sid, seg in self.space.segs.items():  # holes punched before this open
            with contextlib.suppress(OSError):
                on_disk = os.fstat(seg.fd).st_blocks * 512
                if on_disk < valid.get(sid, 0):
                    self.space.seg_punched[sid] = valid[sid] - on_disk
        self.space.seg_tomb = {sid: n for sid, n in st.tomb.items() if sid in self.space.segs}
        self.quarantined = dict(st.quarantine)
        failures = max(st.counters.get("integrity_failures", 0), len(st.quarantine))
        self.integrity_failures = failures + len(st.bad_blobs)
        # RAM: the keys whose bytes are here, loaded in bulk
        blobs, lost = st.blobs, st.lost_blobs
        kloc = self.space.kloc
        live = self.space.seg_live
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
            self.space.mloc[(kind, tenant, rid)] = (mloc, nbytes)
            msid = unpack_loc(mloc)[0]
            live[msid] = live.get(msid, 0) + nbytes
        self.entries, self.metas = entries, metas
        # bring the index up to date with what the tail replay found, then resume writing
        end = st.end or (last, valid.get(last, 0))
        for sid in self.space.segs:
            st.changes.segs[sid] = (self.space.seg_tomb.get(sid, 0), valid[sid])
        for sid in st.seg_rows:
            if sid not in self.space.segs:
                st.changes.segs[sid] = None
        self.ix.apply(st.changes, end, {"integrity_failures": self.integrity_failures})
        self.space.writer = LogWriter(
            self.space.dir,
            self.store_id,
            self.space.segment_bytes,
            self.space.io,
            self.space.segs,
            next_id=max([last, ckpt[0], *st.segdel]) + 1,
            delete_reserve=self.space.delete_reserve,
        )
        self._cut_torn_tail(end)
        if last in self.space.segs and last not in st.seals and end[0] == last:
            self.space.writer.resume(self.space.segs[last], end[1])
        else:
            self.space.writer.seal_active(prev_id=last)
        self.space.log_end = end
        self.space.ckpt_pos = end
