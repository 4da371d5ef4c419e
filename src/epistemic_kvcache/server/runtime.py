"""What a server sets in the process it runs in: allocator, garbage collector, GIL, signals.

How it works: each call changes one process-wide setting once, at start-up, and says
why in its docstring with the figure that made it worth it. `tune_allocator` (glibc
`mallopt`: keep block buffers on the heap and freed ones for reuse) runs before the
event loop starts (server/app.py `run`); `tune_gc` (freeze what start-up made, collect
young objects rarely) and `tune_switch_interval` (hand the GIL over every 0.5 ms with
several event loops) run once the store is open, in a server process of its own only
(not an embedded `ServerThread`); `install_signals` connects SIGTERM/SIGINT to the
graceful stop and SIGHUP to the reload, on the main thread only.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
import threading
from collections.abc import Callable
from typing import Final

log = logging.getLogger("epistemic_kvcache.server")


def install_signals(
    loop: asyncio.AbstractEventLoop, stop: asyncio.Event, reload: Callable[[], None]
) -> list[int]:
    """SIGTERM/SIGINT -> graceful stop, SIGHUP -> reload (main thread only; elsewhere the
    caller uses `ServerHandle.stop()` / `reload()`)."""
    if threading.current_thread() is not threading.main_thread():
        return []
    installed: list[int] = []
    stopping: list[signal.Signals] = []
    try:
        loop.add_signal_handler(signal.SIGHUP, reload)
    except (NotImplementedError, RuntimeError, ValueError, AttributeError):
        pass
    else:
        installed.append(signal.SIGHUP)
    for sig in (signal.SIGTERM, signal.SIGINT):

        def on_signal(sig: signal.Signals = sig) -> None:
            if stopping:
                log.warning("%s again: already shutting down", sig.name)
            else:
                log.info("%s received", sig.name)
                stopping.append(sig)
            stop.set()

        try:
            loop.add_signal_handler(sig, on_signal)
        except (NotImplementedError, RuntimeError, ValueError):
            continue
        installed.append(sig)
    return installed


TRIM_THRESHOLD_BYTES: Final = 16 << 20
"""Free memory at the top of the heap glibc keeps before giving it back to the kernel."""


def tune_allocator() -> bool:
    """Keep block buffers on the malloc heap, and freed ones for reuse.

    glibc serves allocations above its mmap threshold (at most 32 MiB) with a new mmap,
    so every 32 MiB request body is zero-filled and page-faulted in again: measured here
    at 1.3 GB/s for allocate+fill vs 3.9 GB/s with a 1 GiB threshold. Freed heap memory
    is reused by later blocks without faults (256 KiB allocate+fill 12 us on reused
    memory vs 111 us on fresh pages): a cache in steady state frees its oldest blocks,
    low in the heap, and the new ones reuse that memory. glibc gives memory back to the
    kernel only from the top of the heap, once more than `TRIM_THRESHOLD_BYTES` is free
    there, and all threads share one arena (per-thread arenas, one per store thread,
    each kept their own free memory), so what it keeps beyond what is in use stays within
    the allocator slack docs/security.md counts in its RSS bound. Returns False where
    mallopt is unavailable (non-glibc); nothing changes then.

    mallopt takes C ints, set as its argtypes: an earlier version passed a 4 GiB trim
    threshold that ctypes masked to 0 (trim on every free).
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
    return (
        bool(mallopt(m_mmap_threshold, 1 << 30))
        and bool(mallopt(m_trim_threshold, TRIM_THRESHOLD_BYTES))
        and bool(mallopt(m_arena_max, 1))
    )


GC_GEN0_THRESHOLD: Final = 20_000
"""Container allocations between young-generation collections (CPython's default: 700)."""


def tune_gc() -> None:
    """Set the cyclic garbage collector up for a long-running store process.

    What start-up made (modules, the reopened index of a durable store: one object per
    block) is moved out of the collector's generations (`gc.freeze`), so a full
    collection no longer walks it; and young collections run every `GC_GEN0_THRESHOLD`
    container allocations instead of every 700. Measured on 4 KiB SETs before this: ~1 us
    of collector time per request, with full collections pausing the event loop for
    ~30 ms each as the store grew. Reference counting frees blocks either way; the
    collector only finds cycles, which the store's structures do not form.
    """
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


SWITCH_INTERVAL_S: Final = 0.0005
"""The GIL switch interval of a server running several event loops (CPython's: 5 ms)."""


def tune_switch_interval(n_loops: int) -> None:
    """With several event loops, hand the GIL over every `SWITCH_INTERVAL_S`, not 5 ms.

    Each loop releases the GIL while it polls and retakes it for every I/O callback
    (uvloop), as does a store thread and a reply written without the GIL. While another
    loop is busy (a tenant pipelining thousands of commands), each retake waits until
    that loop is made to drop the GIL: up to the switch interval. A small GET takes
    several such retakes, so with CPython's 5 ms a quiet tenant's requests queued behind
    a flooding one's on the other loop (tests/test_abuse.py `auth_pipeline_flood`, 2
    loops on 2 cores: RESP GET p99 16-1311 ms, 4 of 12 runs failing; 6-33 ms, none
    failing, with 0.5 ms). One loop has no other loop to wait for and keeps the
    interpreter's default.
    """
    if n_loops > 1:
        sys.setswitchinterval(SWITCH_INTERVAL_S)
