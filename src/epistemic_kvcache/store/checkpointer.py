"""The checkpointer: one thread that writes the index rows the log is ahead of.

How it works
------------
Every durable batch marks the rows it changed in `SegmentSpace.dirty` (keys, blobs,
snapshot/branch records, segments, quarantine) and tells the checkpointer how many log
bytes the index does not cover yet (`due`). A few times a second, or as soon as
`TRIGGER_BYTES` are due, `checkpoint` swaps the dirty set for an empty one, reads the
rows from RAM (in chunks, so readers never wait long) and writes them to the LMDB index
(`store/index.py`) together with the new checkpoint position. Opening replays the log
from that position.

The rows are read from RAM when written, so they may be newer than the position they
are written with: that is safe, since every record after the position is replayed at
open and each one sets a key's whole state (last writer wins). A failed checkpoint puts
its rows back (merged under later ones) and is retried; meanwhile the committer's
back-pressure (`wait_for_lag`) stops waiting, so writes go on and only the next open's
replay grows.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any, Protocol

from epistemic_kvcache.errors import StorageIOError
from epistemic_kvcache.store.index import Changes, Index, KeyState
from epistemic_kvcache.store.plan import BlobView, KeyView
from epistemic_kvcache.store.space import Dirty, SegmentSpace

log = logging.getLogger(__name__)

__all__ = ["TRIGGER_BYTES", "Checkpointer", "RowSource"]

TRIGGER_BYTES = 32 << 20
"""Log bytes after which the checkpointer runs without waiting for its interval."""
_CHUNK = 2000


class RowSource(Protocol):
    """What the checkpointer reads of RAM (`*_locked`: the space's lock held)."""

    def key_locked(self, ns: str, key: str) -> KeyView | None: ...

    def blob(self, sdig: bytes) -> BlobView | None: ...

    def meta(self, kind: str, tenant: str, rid: str) -> dict[str, Any] | None: ...


@dataclass(eq=False)
class Checkpointer:
    """Writes the dirty rows of `space` to `ix` on its own thread."""

    space: SegmentSpace
    ix: Index
    ram: RowSource
    _: KW_ONLY
    interval_s: float
    max_lag_bytes: int
    counters: Callable[[], dict[str, int]]

    def __post_init__(self) -> None:
        self.cv = threading.Condition()
        self.lag = 0  # log bytes the index does not cover yet
        self.error: str | None = None
        self.checkpoints = 0
        self.failures = 0
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kvcache-checkpoint", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """Stop the thread (after the checkpoint it may be writing)."""
        with self.cv:
            self._stop = True
            self.cv.notify_all()
        self._thread.join(timeout_s)

    def due(self, nbytes: int) -> None:
        """`nbytes` more of log the index does not cover yet (the rows are marked dirty)."""
        with self.cv:
            self.lag += nbytes
            if self.lag >= TRIGGER_BYTES:
                self.cv.notify_all()

    def wait_for_lag(self) -> None:
        """Back-pressure: the log may run ahead of the index by `max_lag_bytes`
        (bounding the replay at the next open), unless checkpoints are failing."""
        with self.cv:
            deadline = time.monotonic() + 5.0
            while (
                self.lag > self.max_lag_bytes
                and self.error is None
                and not self._stop
                and time.monotonic() < deadline
            ):
                self.cv.notify_all()
                self.cv.wait(0.1)

    def _loop(self) -> None:
        next_at = time.monotonic() + self.interval_s
        while True:
            with self.cv:
                while not self._stop and self.lag < TRIGGER_BYTES and time.monotonic() < next_at:
                    self.cv.wait(max(0.01, next_at - time.monotonic()))
                stopping = self._stop
            self.checkpoint()
            next_at = time.monotonic() + self.interval_s
            if stopping:
                return

    def rows(self, dirty: Dirty) -> Changes:
        """The index rows of `dirty`, read from RAM in chunks (the lock is released
        between chunks, so readers never wait long)."""
        sp, ram = self.space, self.ram
        ch = Changes.empty()
        keys = list(dirty.keys)
        for i in range(0, len(keys), _CHUNK):
            with sp.lock:
                for ns, key in keys[i : i + _CHUNK]:
                    ks = ram.key_locked(ns, key)
                    loc = sp.kloc.get(ns, {}).get(key)
                    if ks is None or loc is None:
                        ch.keys[(ns, key)] = None
                    else:
                        ch.keys[(ns, key)] = KeyState(ks.sdig, ks.pins, ks.tag, loc)
        sdigs = list(dirty.blobs)
        for i in range(0, len(sdigs), _CHUNK):
            with sp.lock:
                for sdig in sdigs[i : i + _CHUNK]:
                    b = ram.blob(sdig)
                    ch.blobs[sdig] = (b.size, b.off, b.seg) if b is not None else None
        with sp.lock:
            for mk in dirty.metas:
                body = ram.meta(*mk)
                ml = sp.mloc.get(mk)
                ch.metas[mk] = (ml[0], body) if body is not None and ml is not None else None
            for sid in dirty.segs:
                ch.segs[sid] = (
                    (sp.seg_tomb.get(sid, 0), sp.seg_len.get(sid, 0)) if sid in sp.segs else None
                )
            ch.quarantine.update(dirty.quarantine)
        return ch

    def checkpoint(self) -> bool:
        """Write the dirty rows to the index now (True when it is up to date)."""
        sp = self.space
        with sp.lock:
            dirty, sp.dirty = sp.dirty, Dirty()
            target = sp.log_end
        if not dirty and target == sp.ckpt_pos:
            return True
        with self.cv:
            lag, self.lag = self.lag, 0
        ch = self.rows(dirty)
        try:
            self.ix.apply(ch, target, self.counters())
        except StorageIOError as exc:
            with sp.lock:
                dirty.merge(sp.dirty)
                sp.dirty = dirty
            with self.cv:
                self.lag += lag
                if self.error is None:
                    log.error("index checkpoint failed (the log still has everything): %s", exc)
                self.error = str(exc)
                self.failures += 1
            time.sleep(0.5)
            return False
        with self.cv:
            if self.error is not None:
                log.info("index checkpoints work again")
            self.error = None
            sp.ckpt_pos = target
            self.checkpoints += 1
            self.cv.notify_all()
        return True
