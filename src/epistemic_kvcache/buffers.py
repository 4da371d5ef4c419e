"""Receive buffers for large blocks.

How it works: a block arriving on a wire is read straight into one buffer of its
announced size, and the store then keeps that very buffer in its hot tier (no copy).
Nothing here is zero-filled: `bytearray(n)` memsets its memory on the event loop before
the receive copy overwrites it (in a profile of 256 KiB SETs the allocation took 40% of
the server's samples), so a buffer is uninitialized heap memory instead (a numpy array of
a marker type: `np.empty`'s malloc without the memset). The receive overwrites every
byte before anyone reads the buffer: it is only handed on once its announced length has
arrived, and a connection that breaks off drops it unread.

Heap, not a fresh mapping per block: the server keeps freed heap memory
(`server.runtime.tune_allocator`), so in steady state, where evicted and deleted blocks
free memory as fast as new ones take it, a new block reuses resident pages and costs
its receive copy only (measured here: 4 MiB allocate+fill 0.25 ms reused vs 1.9 ms when
every block faulted fresh pages, as a fresh mmap does each time; 256 KiB 12 vs 111 us).
numpy's own `madvise(MADV_HUGEPAGE)` of large arrays is turned off
(`disable_huge_pages`): on these machines a fresh transparent huge page cost ~4 ms to
fault in (4 MiB allocate+fill 8.5 ms).

Prefaulting. Memory the process has never used still has to be faulted in, and the
kernel's page zeroing then dominates a large SET (56-75% of the server's CPU in a
profile of 256 KiB-32 MiB SETs into fresh memory; redis-server's too, it reads a large
bulk straight into a fresh allocation). For blocks of at least `POOL_MIN_BYTES` that
need not run on the event loop: a `Prefaulter` thread keeps a few buffers of the block
sizes recently asked for already faulted in (`madvise(MADV_POPULATE_WRITE)`, or a memset
where the kernel lacks it, both called through ctypes, which releases the GIL), so
`alloc_block` hands out memory the receive copy fills at memcpy speed while the faulting
of the next buffers runs on another core; on reused memory the populate call finds the
pages resident and is cheap. (Smaller blocks fault on the loop: pooling 256 KiB ones cost
more in the pool thread's GIL hand-offs than the faults it took over.)
The pool is bounded (`receive_prefault_bytes`, `configure_prefault`); sizes not asked
for within `PREFAULT_IDLE_S` are released; a size is pooled only once it was asked for
twice, so a one-off large block costs nothing. Transient buffers (a cold read that is
served and freed) are plain bytearrays.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import mmap
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Final, final

log = logging.getLogger("epistemic_kvcache.buffers")

MAX_SLACK: Final = 2
"""Bytes a receive buffer may have after its block (RESP reads a bulk's CRLF with it)."""
POOL_MIN_BYTES: Final = 1 << 20
"""Sizes below this are never pooled: for 256 KiB SETs the pool thread's GIL hand-offs
cost more (CPU per SET 156 -> 220-330 us in steady state) than the faults it takes over."""
DEFAULT_PREFAULT_BYTES: Final = 256 << 20
"""Default bound on prefaulted, not yet handed out, receive memory."""
PREFAULT_DEPTH: Final = 8
"""Ready buffers kept per pooled size (8: a block per connection of a typical client)."""
PREFAULT_SIZES: Final = 2
"""Distinct block sizes pooled at once (the most recently asked for)."""
PREFAULT_IDLE_S: Final = 10.0
"""A pooled size not asked for this long is released (its ready buffers freed)."""
_MADV_POPULATE_WRITE: Final = 23  # Linux >= 5.14; not exported by Python 3.11's mmap
_PAGE: Final = mmap.PAGESIZE

_heap_type: type[Any] | None = None
_heap_type_lock = threading.Lock()


def _receive_buffer(size: int) -> Any:
    """An uninitialized heap array of the marker type for a block of `size` bytes (and
    `MAX_SLACK` after it, so one pooled buffer serves a size with or without slack)."""
    kind = _heap_type
    if kind is None:
        kind = _make_heap_type()
    return kind((size + MAX_SLACK,), dtype="u1")


def _make_heap_type() -> type[Any]:
    global _heap_type
    with _heap_type_lock:  # the loop and the prefault thread may both get here first
        if _heap_type is None:
            import numpy as np

            class ReceiveBuffer(np.ndarray):  # type: ignore[type-arg]
                """Marker: a wire's receive buffer (`alloc_block`), handed to the store."""

            disable_huge_pages()
            _heap_type = ReceiveBuffer
        return _heap_type


def disable_huge_pages() -> None:
    """Stop numpy from asking for transparent huge pages for its large arrays (see the
    module docstring); a no-op where numpy has no such switch."""
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy < 2
        try:
            from numpy.core import multiarray  # type: ignore[no-redef]
        except ImportError:
            return
    switch = getattr(multiarray, "_set_madvise_hugepage", None)
    if switch is not None:
        switch(False)


def alloc_block(size: int, slack: int = 0) -> memoryview:
    """A writable buffer of `size` bytes for a block being received, plus `slack` (at
    most `MAX_SLACK`) bytes after it for the wire's framing, NOT zero-filled (the caller
    overwrites the block before it is read); from the prefault pool when it has one of
    that size. The store keeps the block (the first `size` bytes) without a copy
    (`handed_over`)."""
    if not 0 <= slack <= MAX_SLACK:
        raise ValueError(f"invalid slack: expected 0..{MAX_SLACK} bytes (got {slack})")
    arr = _prefaulter.take(size) if size >= POOL_MIN_BYTES else None
    if arr is None:
        arr = _receive_buffer(size)
    return memoryview(arr)[: size + slack]


READ_UNINIT_MIN_BYTES: Final = 1 << 20
"""From this size a buffer for a disk read is not zero-filled (`read_buffer`)."""


def read_buffer(size: int) -> bytearray | memoryview:
    """A writable buffer of `size` bytes for a read that overwrites all of it (a cold
    block read from its segment).

    Below `READ_UNINIT_MIN_BYTES` a plain bytearray: its memset is cheap and it reuses
    freed heap memory. From there uninitialized heap memory instead: `bytearray(n)`
    zero-fills (and page-faults) its memory while holding the GIL, ~150-200 ms for a
    128 MiB block here, during which no other thread runs (the event loop included: every
    other client stalled for as long). Uninitialized, the pages are faulted in by the
    `preadv` that fills them, in the kernel, with the GIL released."""
    if size < READ_UNINIT_MIN_BYTES:
        return bytearray(size)
    return memoryview(_receive_buffer(size))[:size]


def handed_over(buf: memoryview) -> bool:
    """Whether `buf` is a receive buffer from `alloc_block`, whole or but for the slack at
    its end: its owner hands it to the store and never touches it again, so the store may
    keep it without copying. (A smaller or shifted slice is not: keeping it would keep the
    whole buffer alive behind a smaller size, or keep bytes its owner still writes.)"""
    obj = buf.obj
    if _heap_type is None or not isinstance(obj, _heap_type):
        return False
    spare = obj.nbytes - buf.nbytes
    if spare == 0:
        return True
    if not 0 < spare <= MAX_SLACK or not buf.nbytes or buf.readonly or not buf.c_contiguous:
        return False
    start: int = obj.ctypes.data
    return ctypes.addressof(ctypes.c_char.from_buffer(buf)) == start  # the block starts it


@final
class Handover:
    """A block whose buffer its owner gives to the store for keeps: the store holds the
    memory as it is (no copy) and the owner never writes into it, nor reads it expecting
    its own changes, again. This is how the wires hand over their receive buffers
    (`received_block`); a library caller may hand over a whole `bytearray` the same way.

    The store copies any other mutable input (`bytearray`, `memoryview`, arrays) at its
    edge, so a caller can only give a buffer away on purpose, by wrapping it here.
    Accepted: a receive buffer from `alloc_block` (whole, or but for its slack:
    `handed_over`), or a whole `bytearray` (or a view of all of it). A part of a buffer is
    refused: its owner still holds the rest, and the store would keep all of it alive.
    """

    __slots__ = ("_view",)

    def __init__(self, buf: bytearray | memoryview) -> None:
        if isinstance(buf, bytearray):
            view = memoryview(buf)
        elif isinstance(buf, memoryview):
            view = buf
            obj = buf.obj
            whole_bytearray = (
                isinstance(obj, bytearray) and buf.c_contiguous and buf.nbytes == len(obj)
            )
            if not whole_bytearray and not handed_over(buf):
                raise ValueError(
                    "a Handover takes a whole bytearray or a whole receive buffer from "
                    f"alloc_block (got a view of {len(buf)} bytes of a "
                    f"{type(obj).__name__}); pass anything else as it is (it is copied)"
                )
        else:
            raise TypeError(
                "a Handover takes a bytearray or a receive buffer's memoryview "
                f"(got {type(buf).__name__})"
            )
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        self._view = view.toreadonly()

    @property
    def view(self) -> memoryview:
        """The block, read-only (what the store keeps)."""
        return self._view

    def __len__(self) -> int:
        return self._view.nbytes

    def __repr__(self) -> str:
        return f"Handover({self._view.nbytes} bytes)"


def received_block(
    buf: bytes | bytearray | memoryview,
) -> Handover | bytes | bytearray | memoryview:
    """What a wire passes to the store for a block it received into `buf`: a `Handover`
    when `buf` is a whole receive buffer (`handed_over`: the wire never touches it
    again, the store keeps it without a copy), else `buf` itself (a part of a buffer the
    wire reuses, e.g. a small bulk in a RESP read buffer: the store copies it)."""
    if isinstance(buf, memoryview) and handed_over(buf):
        return Handover(buf)
    return buf


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
    """Prefaults that failed (no memory): the pool backs off."""


class _Populate:
    """Fault in a buffer's pages without holding the GIL (ctypes releases it)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._madvise = libc.madvise
        self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._madvise.restype = ctypes.c_int
        self._use_madvise = True

    def __call__(self, arr: Any) -> None:
        addr = int(arr.ctypes.data)
        size = int(arr.nbytes)
        if self._use_madvise:
            # madvise wants page boundaries: the whole pages inside the buffer; the
            # partial pages at its ends are touched by hand below
            first = (addr + _PAGE - 1) // _PAGE * _PAGE
            last = (addr + size) // _PAGE * _PAGE
            if last <= first or self._madvise(first, last - first, _MADV_POPULATE_WRITE) == 0:
                if size:
                    arr[0] = arr[0]
                    arr[-1] = arr[-1]
                return
            if ctypes.get_errno() != 22:  # EINVAL: an older kernel; else a real failure
                raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE) failed")
            self._use_madvise = False
        ctypes.memset(addr, 0, size)


class Prefaulter:
    """A bounded pool of already-faulted receive buffers of recently requested sizes,
    refilled by one daemon thread (started on first use). Thread-safe."""

    def __init__(self, budget_bytes: int = DEFAULT_PREFAULT_BYTES) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._budget = budget_bytes
        self._ready: dict[int, list[Any]] = {}
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
    def take(self, size: int) -> Any | None:
        """A ready buffer (array) for a block of `size` bytes (`MAX_SLACK` more in all),
        or None (allocate one then)."""
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
            arr = ready.pop() if ready else None
            if arr is None:
                self._misses += 1
            else:
                self._hits += 1
                self._ready_bytes -= size
            self._start_locked()
            self._cond.notify()
            return arr

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
        """Stop the thread and free the ready buffers (tests, interpreter exit)."""
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
        self._ready_bytes -= size * len(self._ready.pop(size, ()))

    def _depths_locked(self) -> dict[int, int]:
        """Ready buffers to keep per pooled size: at most `PREFAULT_DEPTH` each, the budget
        shared by need (smallest sizes first, each at most an equal part of what is
        left), so a large size gets what a small one does not use. (Equal shares left
        4 x 32 MiB LMCache batches, next to 4 MiB ones, a pool of 4 buffers: empty after
        every batch, and the next one faulted its pages on the event loop.)"""
        left = self._budget
        depths: dict[int, int] = {}
        sizes = sorted(self._asked)
        for i, size in enumerate(sizes):
            fair = left // (len(sizes) - i)
            depths[size] = min(PREFAULT_DEPTH, fair // size)
            left -= depths[size] * size
        return depths

    def _next_size_locked(self) -> int | None:
        """The pooled size most in need of a buffer, if the budget has room for one."""
        now = time.monotonic()
        for size, last in list(self._asked.items()):
            if now - last > PREFAULT_IDLE_S:
                del self._asked[size]
                self._drop_size(size)
        if not self._asked:
            return None
        depths = self._depths_locked()
        best: int | None = None
        for size in reversed(self._asked):  # most recently asked first
            have = len(self._ready.get(size, ()))
            depth = depths[size]
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
            try:
                arr = _receive_buffer(size)
                if self._populate is None:
                    self._populate = _Populate()
                self._populate(arr)
            except (OSError, AttributeError, MemoryError) as exc:
                with self._cond:
                    self._failures += 1
                log.debug("prefault of %d bytes failed (%s); backing off", size, exc)
                backoff = 1.0
                continue
            with self._cond:
                if self._closed or size not in self._asked:
                    continue
                self._ready.setdefault(size, []).append(arr)
                self._ready_bytes += size


_prefaulter = Prefaulter()


def configure_prefault(budget_bytes: int) -> None:
    """Bound the process's pool of prefaulted receive buffers (0: off)."""
    _prefaulter.configure(budget_bytes)


def prefault_stats() -> PrefaultStats:
    """The process-wide prefault pool's state (see `PrefaultStats`)."""
    return _prefaulter.stats()


atexit.register(_prefaulter.close)
