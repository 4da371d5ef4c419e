"""The free space of the file system under the segments, and the one "disk full" truth.

How it works
------------
`FreeSpace.full` is what `health()` (`/readyz`), `stats` (`disk_full`) and the metrics
(`kvcache_store_disk_full`, `kvcache_store_writable`) report, so they always agree:

- it is set by the first write refused for want of space (`set_full`): an ENOSPC from
  `pwrite`, or the writer's own refusal to let new blocks take the space kept for
  deletes, or zeroing ahead that ran out of space. It remembers how many free bytes
  the refused write needed;
- it is cleared when the file system has that much free again (`refresh`, asked afresh
  at every readiness probe and scrape: a DELETE punched its block out, compaction
  deleted a segment, another process freed space), or when a write that needed new
  space succeeds (`cleared_by_write`). The need is bounded by half the file system, so
  one outsized batch cannot keep a half-empty disk "full".

Before, a refused write set the flag, but every health check cleared it again as soon as
a sixteenth of the file system (at most 64 MiB) was free: on a 12 MiB tmpfs a 1 MB PUT
was refused with 1.2 MB free while `/readyz` said ready and the gauges said not full.

The free space itself is asked at most every half second on the write path
(`free_bytes`; `recheck` forces the next call to ask), and afresh for the metrics
(`fs_space`: `kvcache_store_fs_free_bytes` / `kvcache_store_fs_total_bytes`).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Protocol


class StatFs(Protocol):
    def free_bytes(self, path: Path) -> int: ...

    def total_bytes(self, path: Path) -> int: ...


class FreeSpace:
    """Free space and the disk-full state of one directory's file system (see above).
    Written by the committer thread, read (and cleared) by readiness probes."""

    def __init__(self, io: StatFs, directory: Path) -> None:
        self.io = io
        self.dir = directory
        self.full = False
        self._need = 0
        self._lock = threading.Lock()
        self._checked = 0.0
        self._free = 1 << 62
        self._total: int | None = None

    def recheck(self) -> None:
        """The next `free_bytes` asks the file system again (not its cached answer)."""
        self._checked = 0.0

    def free_bytes(self) -> int:
        """Bytes an unprivileged writer may use (`f_bavail`), cached for half a second."""
        now = time.monotonic()
        if now - self._checked > 0.5:
            try:
                self._free = self.io.free_bytes(self.dir)
            except OSError:
                self._free = 0
            self._checked = now
        return self._free

    def total_bytes(self) -> int:
        """The file system's size (asked once)."""
        if self._total is None:
            try:
                self._total = self.io.total_bytes(self.dir)
            except OSError:
                return 1 << 62
        return self._total

    def fs_space(self) -> tuple[int, int]:
        """(free, total) bytes, asked now; (0, 0) when the file system cannot say."""
        try:
            return self.io.free_bytes(self.dir), self.io.total_bytes(self.dir)
        except OSError:
            return 0, 0

    def set_full(self, need: int) -> None:
        """A write needing `need` free bytes was refused for want of space."""
        with self._lock:
            self._need = min(need, self.total_bytes() // 2)
            self.full = True

    def cleared_by_write(self) -> None:
        """A write that needed new space succeeded: the disk is not full."""
        if self.full:
            with self._lock:
                self.full = False

    def refresh(self) -> bool:
        """Whether the disk is full now (asks the file system afresh while it is)."""
        if self.full:
            with self._lock:
                self._checked = 0.0
                if self.full and self.free_bytes() >= self._need:
                    self.full = False
        return self.full
