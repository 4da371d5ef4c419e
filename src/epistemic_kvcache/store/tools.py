"""Offline tools on a persist dir: `store check` and `store rebuild-index`.

`check` replays the whole log (verifying every block against its digest when `deep`),
reads the index checkpoint plus the log after it (what a server would open), and
compares the two: damaged log regions, blocks that fail verification, keys whose bytes
are gone, segments the store expects and does not find (those the index lists, gaps
after its checkpoint: `recovery.absent_segments`, what a server reports at open), and
any difference between the index and the log are reported. It changes nothing; it
takes the persist dir's lock, so it refuses to run beside a server.

`rebuild-index` moves the current index aside (never deletes it) and builds a new one
from the log, exactly as a server started with `--rebuild-index` does.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from epistemic_kvcache.errors import ConfigurationError
from epistemic_kvcache.options import DEFAULT_STORE_OPTIONS, StoreOptions
from epistemic_kvcache.store import records
from epistemic_kvcache.store.index import Index, IndexError_, open_index
from epistemic_kvcache.store.opening import lock_persist_dir, log_format_refusal
from epistemic_kvcache.store.recovery import (
    LogState,
    absent_segments,
    finish,
    load_index,
    newer_format,
    replay,
    reverify_quarantine,
    valid_ends,
)
from epistemic_kvcache.store.segments import Segment, open_segments

Progress = Callable[[str], None]


@dataclass(slots=True)
class CheckSummary:
    """What `check` found. `ok` when nothing is damaged, lost or inconsistent."""

    segments: int = 0
    log_bytes: int = 0
    records: int = 0
    batches: int = 0
    blocks: int = 0
    keys: int = 0
    block_bytes: int = 0
    snapshots_and_branches: int = 0
    quarantined: int = 0
    damaged: list[str] = field(default_factory=list)
    bad_blocks: list[str] = field(default_factory=list)
    lost_keys: list[str] = field(default_factory=list)
    missing_segments: list[int] = field(default_factory=list)
    index: str = "ok"
    index_mismatches: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not (
            self.damaged
            or self.bad_blocks
            or self.lost_keys
            or self.missing_segments
            or self.index_mismatches
            or self.index != "ok"
        )

    def lines(self) -> list[str]:
        """A human summary, one finding per line."""
        out = [
            f"segments: {self.segments} ({self.log_bytes} bytes), {self.records} records "
            f"in {self.batches} group commits",
            f"blocks: {self.blocks} ({self.block_bytes} bytes), keys: {self.keys}, "
            f"snapshots/branches: {self.snapshots_and_branches}, quarantined: {self.quarantined}",
            f"index: {self.index}",
        ]
        out += [f"damaged log bytes: {d}" for d in self.damaged]
        out += [f"block fails verification: {b}" for b in self.bad_blocks]
        out += [f"key lost its bytes: {k}" for k in self.lost_keys]
        out += [f"segment missing: {s:08d}" for s in self.missing_segments]
        out += [f"index differs from the log: {m}" for m in self.index_mismatches]
        out.append(f"{'OK' if self.ok else 'PROBLEMS FOUND'} ({self.seconds:.2f} s)")
        return out


def _lock(path: Path) -> int:
    return lock_persist_dir(path, "stop the server")


def check(
    persist_dir: str | os.PathLike[str],
    *,
    deep: bool = True,
    map_size_bytes: int = 64 << 30,
    progress: Progress | None = None,
) -> CheckSummary:
    """Check a persist dir offline (see the module docstring)."""
    t0 = time.perf_counter()
    path = Path(persist_dir)
    fd = _lock(path)
    try:
        segs = open_segments(path / "segments")
        newer = newer_format(segs)
        if newer is not None:  # its records would all read as damage here
            raise ConfigurationError(log_format_refusal(path, *newer))
        out = CheckSummary(segments=len(segs), log_bytes=sum(s.size() for s in segs.values()))
        full = LogState()
        if progress is not None:
            progress(f"replaying the whole log of {path} ({out.log_bytes >> 20} MiB)")
        replay(segs, full, None, verify=deep, progress=progress)
        if deep:  # what a rebuild would bring back (a quarantined block that verifies)
            reverify_quarantine(full)
        finish(full, segs, valid_ends(full, segs, (0, 0)))
        out.records, out.batches = full.records, full.batches
        out.keys = len(full.keys) - len(full.lost_keys)
        out.blocks = len(full.blobs) - len(full.lost_blobs)
        out.block_bytes = sum(
            size for sdig, (size, _o, _s) in full.blobs.items() if sdig not in full.lost_blobs
        )
        out.snapshots_and_branches = len(full.metas)
        out.quarantined = len(full.quarantine)
        out.damaged = [f"segment {s:08d} at {a}..{b}: {why}" for s, a, b, why in full.damage]
        out.bad_blocks = [f"{d} (segment {s:08d} at {o})" for s, o, d in full.bad_blobs]
        out.lost_keys = [f"{ns}/{key} ({d.hex()})" for ns, key, d in full.lost_keys]
        # the index, as a server would open it
        try:
            ix = open_index(path / "index", map_size_bytes)
        except IndexError_ as exc:
            out.index = f"unusable ({exc}): run `epistemic-kvcache store rebuild-index`"
        else:
            try:
                _check_index(out, ix, segs, full)
            except IndexError_ as exc:
                out.index = f"unusable ({exc}): run `epistemic-kvcache store rebuild-index`"
            finally:
                ix.close()
        out.seconds = time.perf_counter() - t0
        return out
    finally:
        os.close(fd)


def _check_index(out: CheckSummary, ix: Index, segs: dict[int, Segment], full: LogState) -> None:
    """Compare what a server would open (the index plus the log after its checkpoint)
    with the whole log: keys and their blocks, where each block is, and what is lost."""
    start = ix.checkpoint()
    if ix.is_empty() or start is None:
        out.index = "empty: run `epistemic-kvcache store rebuild-index`"
        return
    st = load_index(ix)
    replay(segs, st, start, verify=False)
    finish(st, segs, valid_ends(st, segs, start))
    # what a server opening the store reports missing (gaps below the checkpoint are
    # segments compaction deleted: the index's rows say which segments exist there)
    out.missing_segments = absent_segments(st, segs, start)
    if st.replayed_bytes:
        out.index = f"ok ({st.replayed_bytes} bytes of log after its checkpoint)"
    found = out.index_mismatches

    def note(line: str) -> bool:
        found.append(line)
        if len(found) >= 100:
            found.append("... (more)")
            return False
        return True

    mine = {k: v.sdig for k, v in st.keys.items()}
    truth = {k: v.sdig for k, v in full.keys.items()}
    for k in sorted(set(mine) | set(truth)):
        if mine.get(k) != truth.get(k):
            line = f"{k[0]}/{k[1]}: index {'has' if k in mine else 'lacks'} it"
            if not note(line + (" (other bytes)" if k in mine and k in truth else "")):
                return
    # a key the log serves but the index's view loses (its block row points elsewhere)
    lost_here = {(ns, key) for ns, key, _d in st.lost_keys}
    lost_there = {(ns, key) for ns, key, _d in full.lost_keys}
    for ns, key in sorted(lost_here - lost_there):
        if not note(f"{ns}/{key}: the index loses its bytes, the log has them"):
            return
    for sdig in sorted(set(st.blobs) & set(full.blobs)):
        if sdig in full.lost_blobs or st.blobs[sdig] == full.blobs[sdig]:
            continue
        # the log may hold several valid copies (compaction): the index's must be one
        size, off, sid = st.blobs[sdig]
        where = f"block {sdig[-32:].hex()}: the index places it where it is not"
        if not _blob_at(segs, sdig, size, off, sid) and not note(where):
            return


def _blob_at(segs: dict[int, Segment], sdig: bytes, size: int, off: int, sid: int) -> bool:
    """Whether segment `sid` holds a BLOB record of `sdig` with `size` bytes at `off`."""
    seg = segs.get(sid)
    hlen = records.blob_header_length(sdig)
    if seg is None or off < hlen or off + size > seg.size():
        return False
    try:
        rec = records.decode(seg.read(off - hlen, hlen))
    except (OSError, records.RecordError):
        return False
    return rec.op is records.Op.BLOB and rec.sdig == sdig and rec.plen == size


@dataclass(slots=True)
class RebuildSummary:
    """What `rebuild_index` made, and every key it could not restore."""

    blocks: int
    keys: int
    segments: int
    log_bytes: int
    damaged: int
    lost_keys: int
    seconds: float
    lost: list[str] = field(default_factory=list)
    """Each key the rebuild cannot serve, by name, with why."""
    restored: int = 0
    """Keys whose newest log record is damaged, taken from the old index."""

    def lines(self) -> list[str]:
        out = [
            f"rebuilt the index from {self.segments} segments ({self.log_bytes} bytes) in "
            f"{self.seconds:.2f} s: {self.blocks} blocks, {self.keys} keys",
            f"damaged log regions: {self.damaged}, keys whose bytes are gone: {self.lost_keys}, "
            f"restored from the old index: {self.restored}",
        ]
        out += [f"lost: {line}" for line in self.lost]
        return out


def rebuild_index(
    persist_dir: str | os.PathLike[str],
    options: StoreOptions = DEFAULT_STORE_OPTIONS,
    *,
    progress: Progress | None = None,
) -> RebuildSummary:
    """Set the index aside and build a new one from the log (offline)."""
    from epistemic_kvcache.store.durable import SharedKvStoreBackend

    t0 = time.perf_counter()
    store = SharedKvStoreBackend(
        persist_dir, dataclasses.replace(options, rebuild_index=True), progress=progress
    )
    try:
        extra = store.stats(None).extra
        lost = [f"{ns}/{key} (its bytes are gone)" for ns, key, _d in store.lost_keys()]
        sv = store.salvaged
        if sv is not None:
            lost += [f"{ns}/{key} ({why})" for ns, key, why in sv.unrestored]
            lost += [f"{ns}/{key} (probably: {what})" for ns, key, what in sv.suspects]
        blocks, keys = store.ram.summary()
        return RebuildSummary(
            blocks=blocks,
            keys=keys,
            segments=int(extra["segments"]),
            log_bytes=int(extra["segment_bytes"]),
            damaged=int(extra["damaged_log_regions"]),
            lost_keys=len(lost),
            seconds=time.perf_counter() - t0,
            lost=lost,
            restored=len(sv.restored) if sv is not None else 0,
        )
    finally:
        store.close()
