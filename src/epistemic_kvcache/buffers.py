"""Receive buffers for large blocks.

How it works: a block arriving on a wire is read straight into one buffer of its
announced size, and the store then keeps that very buffer in its hot tier (no copy).
`bytearray(n)` zero-fills it in user space first, on the event loop: page faults, a
memset, then the receive copy (three passes over the memory; in a profile of 32 MiB SETs
the allocation line took 57% of the event loop's samples). An anonymous `mmap` instead
gets zeroed pages from the kernel as the receive touches them (two passes; measured here
2.3-2.6 GB/s allocate+fill vs 1.7 GB/s for bytearray).

Prefaulting. Even so, the page faults of fresh memory dominate a large SET: in a profile
of 256 KiB-32 MiB SETs the kernel's page zeroing (`clear_page`) took 56-75% of the
server's CPU, and redis-server's too (it reads a large bulk straight into a fresh
allocation). The faults cannot be avoided for memory the store keeps, but they need not
run on the event loop: a `Prefaulter` thread keeps a few mappings of the block sizes
recently asked for already faulted in (`madvise(MADV_POPULATE_WRITE)`, or a memset where
the kernel lacks it, both called through ctypes, which releases the GIL), so
`alloc_block` hands out memory the receive copy fills at memcpy speed while the faulting
of the next buffers runs on another core. The pool is bounded (`receive_prefault_bytes`,
`configure_prefault`); sizes not asked for within `PREFAULT_IDLE_S` are released; a
size is pooled only once it was asked for twice, so a one-off large block costs nothing.

Only blocks of at least `MMAP_MIN_BYTES` get a mapping, and at most `MAX_MAPPINGS` live at
once (the kernel limits a process to ~65k mappings, `vm.max_map_count`); past that, or
when mmap fails, the buffer is a plain bytearray. The store recognises memoryviews of an
mmap as handed over (see `store.api.owned_buffer`) and keeps them without copying.
Transient buffers (a cold read that is served and freed) should stay bytearrays: malloc
reuses freed heap memory without faults, a fresh mapping faults every time.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import mmap
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

log = logging.getLogger("epistemic_kvcache.buffers")

MMAP_MIN_BYTES = 1 << 20
"""Below this, bytearray's cost is noise and a mapping per block would waste map slots."""
MAX_MAPPINGS = 16_384
"""A quarter of Linux's default vm.max_map_count, leaving room for malloc, LMDB, threads."""
DEFAULT_PREFAULT_BYTES: Final = 256 << 20
"""Default bound on prefaulted, not yet handed out, receive memory."""
PREFAULT_DEPTH: Final = 8
"""Ready buffers kept per pooled size (8: a block per connection of a typical client)."""
PREFAULT_SIZES: Final = 2
"""Distinct block sizes pooled at once (the most recently asked for)."""
PREFAULT_IDLE_S: Final = 10.0
"""A pooled size not asked for this long is released (its ready buffers unmapped)."""
_MADV_POPULATE_WRITE: Final = 23  # Linux >= 5.14; not exported by Python 3.11's mmap

_lock = threading.Lock()
_live = 0


def _release() -> None:
    global _live
    with _lock:
        _live -= 1


def _new_mapping(size: int) -> mmap.mmap | None:
    """A fresh anonymous mapping counted against `MAX_MAPPINGS`, or None (cap, failure)."""
    global _live
    with _lock:
        if _live >= MAX_MAPPINGS:
            return None
        _live += 1
    try:
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError):
        _release()
        return None
    weakref.finalize(mm, _release)
    return mm


def alloc_block(size: int) -> bytearray | memoryview:
    """A writable, zero-filled buffer of exactly `size` bytes (a memoryview over an mmap
    when large, prefaulted when the pool has one of that size)."""
    if size < MMAP_MIN_BYTES:
        return bytearray(size)
    mm = _prefaulter.take(size)
    if mm is None:
        mm = _new_mapping(size)
        if mm is None:
            return bytearray(size)
    return memoryview(mm)


def live_mappings() -> int:
    """How many mmap-backed block buffers are alive (for tests and stats)."""
    return _live


@dataclass(frozen=True, slots=True)
class PrefaultStats:
    """What the prefault pool holds and how often it had the buffer asked for."""

    budget_bytes: int
    ready_bytes: int
    ready_buffers: int
    hits: int
    """Large buffers handed out already faulted in."""
    misses: int
    """Large buffers of a pooled size the pool had none ready for (faulted on the loop)."""
    failures: int
    """Prefaults that failed (no memory, no mapping slot): the pool backs off."""


class _Populate:
    """Fault in a mapping's pages without holding the GIL (ctypes releases it)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._madvise = libc.madvise
        self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._madvise.restype = ctypes.c_int
        self._use_madvise = True

    def __call__(self, mm: mmap.mmap) -> None:
        ref = ctypes.c_char.from_buffer(mm)  # a buffer export: released below
        try:
            addr = ctypes.addressof(ref)
            if self._use_madvise:
                if self._madvise(addr, len(mm), _MADV_POPULATE_WRITE) == 0:
                    return
                if ctypes.get_errno() != 22:  # EINVAL: an older kernel; else a real failure
                    raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE) failed")
                self._use_madvise = False
            ctypes.memset(addr, 0, len(mm))
        finally:
            del ref


class Prefaulter:
    """A bounded pool of already-faulted mappings of recently requested sizes, refilled
    by one daemon thread (started on first use). Thread-safe."""

    def __init__(self, budget_bytes: int = DEFAULT_PREFAULT_BYTES) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._budget = budget_bytes
        self._ready: dict[int, list[mmap.mmap]] = {}
        self._ready_bytes = 0
        self._asked: OrderedDict[int, float] = OrderedDict()
        """Size -> when last asked for, least recent first (sizes asked at least twice)."""
        self._seen: OrderedDict[int, None] = OrderedDict()
        """Sizes asked for once (a second request makes a size pooled)."""
        self._hits = self._misses = self._failures = 0
        self._thread: threading.Thread | None = None
        self._populate: _Populate | None = None
        self._closed = False

    # -- the event loop's side ------------------------------------------------------------
    def take(self, size: int) -> mmap.mmap | None:
        """A ready mapping of exactly `size` bytes, or None (then allocate one directly)."""
        with self._cond:
            if self._budget <= 0 or self._closed or size > self._budget:
                return None
            if size in self._asked:
                self._asked[size] = time.monotonic()
                self._asked.move_to_end(size)
            elif size in self._seen:
                del self._seen[size]
                self._asked[size] = time.monotonic()
                while len(self._asked) > PREFAULT_SIZES:
                    old, _ = self._asked.popitem(last=False)
                    self._drop_size(old)
            else:
                self._seen[size] = None
                while len(self._seen) > 16:
                    self._seen.popitem(last=False)
                return None
            ready = self._ready.get(size)
            mm = ready.pop() if ready else None
            if mm is None:
                self._misses += 1
            else:
                self._hits += 1
                self._ready_bytes -= size
            self._start_locked()
            self._cond.notify()
            return mm

    # -- configuration and stats ----------------------------------------------------------
    def configure(self, budget_bytes: int) -> None:
        """Bound the ready memory (0 turns the pool off and releases what it holds)."""
        with self._cond:
            self._budget = max(0, budget_bytes)
            if self._budget == 0:  # off: forget the sizes too
                for size in list(self._ready):
                    self._drop_size(size)
                self._asked.clear()
                self._seen.clear()
            self._cond.notify()

    def stats(self) -> PrefaultStats:
        with self._cond:
            return PrefaultStats(
                budget_bytes=self._budget,
                ready_bytes=self._ready_bytes,
                ready_buffers=sum(len(v) for v in self._ready.values()),
                hits=self._hits,
                misses=self._misses,
                failures=self._failures,
            )

    def close(self) -> None:
        """Stop the thread and unmap the ready buffers (tests, interpreter exit)."""
        with self._cond:
            self._closed = True
            for size in list(self._ready):
                self._drop_size(size)
            self._cond.notify()
        thread = self._thread
        if thread is not None:
            thread.join(5)

    # -- the filler thread ----------------------------------------------------------------
    def _start_locked(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ekv-prefault", daemon=True)
            self._thread.start()

    def _drop_size(self, size: int) -> None:
        for mm in self._ready.pop(size, ()):
            self._ready_bytes -= size
            mm.close()

    def _next_size_locked(self) -> int | None:
        """The pooled size most in need of a buffer, if the budget has room for one."""
        now = time.monotonic()
        for size, last in list(self._asked.items()):
            if now - last > PREFAULT_IDLE_S:
                del self._asked[size]
                self._drop_size(size)
        if not self._asked:
            return None
        share = self._budget // len(self._asked)
        best: int | None = None
        for size in reversed(self._asked):  # most recently asked first
            have = len(self._ready.get(size, ()))
            depth = min(PREFAULT_DEPTH, share // size)
            if (
                have < depth
                and self._ready_bytes + size <= self._budget
                and (best is None or have < len(self._ready.get(best, ())))
            ):
                best = size
        return best

    def _run(self) -> None:
        backoff = 0.0
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    size = None if backoff else self._next_size_locked()
                    if size is not None:
                        break
                    self._cond.wait(backoff or PREFAULT_IDLE_S / 2)
                    backoff = 0.0
            mm = _new_mapping(size)
            try:
                if mm is None:
                    raise OSError("no mapping slot or no memory")
                if self._populate is None:
                    self._populate = _Populate()
                self._populate(mm)
            except (OSError, AttributeError) as exc:
                if mm is not None:
                    mm.close()
                with self._cond:
                    self._failures += 1
                log.debug("prefault of %d bytes failed (%s); backing off", size, exc)
                backoff = 1.0
                continue
            with self._cond:
                if self._closed or size not in self._asked:
                    mm.close()
                    continue
                self._ready.setdefault(size, []).append(mm)
                self._ready_bytes += size


_prefaulter = Prefaulter()


def configure_prefault(budget_bytes: int) -> None:
    """Bound the process's pool of prefaulted receive buffers (0: off)."""
    _prefaulter.configure(budget_bytes)


def prefault_stats() -> PrefaultStats:
    """The process-wide prefault pool's state (see `PrefaultStats`)."""
    return _prefaulter.stats()


atexit.register(_prefaulter.close)
