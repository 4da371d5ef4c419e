"""Reading segment files back: their records in order, damage found and skipped.

How it works
------------
`scan` reads a segment's records in log order through a window of buffered positional
reads (`_Window`: headers are small, so one 1 MiB `pread` serves many; a block payload
is read on its own, into a buffer of its size). A header that does not verify is
damage (or the torn tail of the last batch): it is reported as `Damage` and the scanner
resyncs on the next record magic, so one damaged record never hides the ones after it.
A record's payload is checked against its digest (blocks) or CRC (metadata); one that
fails or cannot be read is still returned, marked `ok=False`, and the caller decides
(recovery and the compactor set such a block aside, never copy it). `only_zeros` tells
whether a span reads as zeros (the pre-zeroed space past a segment's last batch, which
store/segments.py writes).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

from epistemic_kvcache.store import records
from epistemic_kvcache.store.model import digest_of
from epistemic_kvcache.store.records import Op, Record, RecordError
from epistemic_kvcache.store.segments import Segment

_SCAN_WINDOW = 1 << 20


def only_zeros(seg: Segment, off: int, end: int) -> bool:
    """Whether bytes `off..end` of `seg` are all zero (a hole reads as zeros; False when
    the file is shorter or cannot be read)."""
    try:
        pos = off
        while pos < end:
            n = min(_SCAN_WINDOW, end - pos)
            chunk = os.pread(seg.fd, n, pos)
            if len(chunk) != n or chunk.count(0) != n:
                return False
            pos += n
    except OSError:
        return False
    return True


@dataclass(slots=True)
class Scanned:
    """One record read back: its header, where it starts, and its payload if asked."""

    off: int
    rec: Record
    payload: bytearray | memoryview | None = None
    ok: bool = True
    """False when the payload does not match its digest / checksum (or is cut short)."""

    @property
    def end(self) -> int:
        return self.off + self.rec.hlen + self.rec.plen

    @property
    def data_off(self) -> int:
        return self.off + self.rec.hlen


@dataclass(slots=True)
class Damage:
    """Bytes between `off` and `end` that hold no valid record header."""

    off: int
    end: int
    reason: str


class _Window:
    """Buffered positional reads over a file (headers are small; blocks are not)."""

    def __init__(self, seg: Segment, stop: int) -> None:
        self.seg = seg
        self.stop = stop
        self.base = 0
        self.buf = b""

    def get(self, off: int, n: int) -> bytes:
        """Up to `n` bytes at `off` (fewer at the end of the range)."""
        n = min(n, self.stop - off)
        if n <= 0:
            return b""
        if not (self.base <= off and off + n <= self.base + len(self.buf)):
            want = max(n, _SCAN_WINDOW)
            self.buf = os.pread(self.seg.fd, min(want, self.stop - off), off)
            self.base = off
        return self.buf[off - self.base : off - self.base + n]


def _find_magic(win: _Window, start: int) -> int:
    """Offset of the next record magic at or after `start` (or the end of the range)."""
    pos = start
    while pos < win.stop:
        chunk = win.get(pos, _SCAN_WINDOW)
        if not chunk:
            break
        i = chunk.find(records.MAGIC)
        if i >= 0:
            return pos + i
        pos += max(1, len(chunk) - len(records.MAGIC) + 1)
    return win.stop


def scan(
    seg: Segment,
    start: int,
    stop: int | None = None,
    *,
    payloads: bool = True,
    verify: bool = True,
) -> Iterator[Scanned | Damage]:
    """Records of `seg` from `start` to `stop` (default: end of file), in order.

    `payloads`: read BLOB payloads (always read for META). `verify`: check BLOB payloads
    against their digest (`Scanned.ok`). Damage is reported as `Damage` and skipped.
    """
    end = seg.size() if stop is None else min(stop, seg.size())
    win = _Window(seg, end)
    pos = start
    while pos < end:
        head = win.get(pos, records.FIXED_BYTES)
        try:
            hlen = records.header_length(head)
            rec = records.decode(win.get(pos, hlen))
        except RecordError as exc:
            nxt = _find_magic(win, pos + 1)
            yield Damage(pos, nxt, str(exc))
            pos = nxt
            continue
        rec_end = pos + hlen + rec.plen
        if rec_end > end:
            nxt = _find_magic(win, pos + 1)
            yield Damage(pos, nxt, "record cut short")
            pos = nxt
            continue
        item = Scanned(pos, rec)
        if rec.plen and (rec.op is not Op.BLOB or payloads or verify):
            try:
                item.payload = seg.read(pos + hlen, rec.plen)
            except OSError:
                item.ok = False
            if item.payload is not None:
                if rec.op is Op.BLOB:
                    if verify and digest_of(item.payload) != rec.sdig[-32:]:
                        item.ok = False
                elif records.payload_crc(item.payload) != rec.pcrc:
                    item.ok = False
            if rec.op is Op.BLOB and not payloads:
                item.payload = None
        yield item
        pos = rec_end
