"""The store lock under N threads (issue 26 item 4): how long it is held, how long it is
waited for, and what fraction of the wall time it is held.

How it works
------------
The store has one engine lock (`TieredEngine._lock`, shared with its RAM tiers, epochs
and RAM view) and, on the durable backend, the group committer's condition lock. Both
are created when the store is built, so this benchmark builds the store with the
modules' `threading` swapped for a proxy whose `Lock` / `Condition` hand out
`TimedLock`s (then puts the real module back): nothing in src/ changes and nothing
is measured outside this benchmark. A `TimedLock` wraps a real lock and records, per
acquisition, the wait (`perf_counter_ns` before and after `acquire`) and the hold
(acquire to release); `Condition.wait` releases and re-acquires it through the same
path, so a committer sleeping on its condition is not counted as holding it.

Then 1, 2 and 4 threads run GET (hot hits of keys written before the clock starts) or
SET (new bytes every time: the first 8 bytes carry a counter; each thread overwrites a
ring of 16 keys, so old blobs are freed and RAM stays bounded) directly against the
store, no network, for `--seconds` per configuration, at 4 KiB, 256 KiB and 4 MiB, on
the memory and the durable backend. Printed: ops/s, hold p50/p99, wait p50/p99 (µs),
the fraction of the wall time the lock is held (holds never overlap: the sum of holds
over the wall time), and acquisitions per operation.

Under CPython's GIL a thread that waits for the lock, or holds it while another thread
has the GIL, counts that time too: wait and hold here are what a request sees.

    PYTHONPATH=src python -m bench.bench_lock [--seconds 1.5] [--threads 1,2,4]
        [--sizes 4096,262144,4194304] [--backends memory,durable] [--dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import shutil
import tempfile
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.store import SharedKvIndex, SharedKvStoreBackend
from epistemic_kvcache.store import committer as committer_mod
from epistemic_kvcache.store import engine as engine_mod

KiB, MiB = 1024, 1024 * 1024
RING = 16
"""Keys each SET thread overwrites in turn (and each GET thread reads)."""


class TimedLock:
    """A `threading.Lock` that records each acquisition's wait and hold (ns)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self.waits: list[int] = []
        self.holds: list[int] = []
        self._since = 0
        self.recording = False

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        t0 = time.perf_counter_ns()
        got = self._lock.acquire(blocking, timeout)
        if got:
            t1 = time.perf_counter_ns()
            self._since = t1
            if self.recording:
                self.waits.append(t1 - t0)
        return got

    def release(self) -> None:
        held = time.perf_counter_ns() - self._since
        self._lock.release()
        if self.recording:
            self.holds.append(held)

    __enter__ = acquire

    def __exit__(self, *exc: object) -> None:
        self.release()

    def locked(self) -> bool:
        return self._lock.locked()

    # what threading.Condition uses when its lock provides it (else it probes with
    # acquire(False), which would be counted as an acquisition)
    def _is_owned(self) -> bool:
        return self._lock.locked()

    def _release_save(self) -> None:
        self.release()

    def _acquire_restore(self, _state: object) -> None:
        self.acquire()

    def reset(self) -> None:
        self.waits, self.holds = [], []


@contextlib.contextmanager
def timed_locks() -> Iterator[list[TimedLock]]:
    """While open, stores built get `TimedLock`s for the engine lock and the committer's
    condition; yields the list of locks made."""
    made: list[TimedLock] = []

    def lock() -> TimedLock:
        made.append(TimedLock("engine"))
        return made[-1]

    def condition(lock: Any = None) -> threading.Condition:
        made.append(TimedLock("committer"))
        return threading.Condition(made[-1])  # type: ignore[arg-type]

    proxy = types.SimpleNamespace(**vars(threading))
    proxy.Lock, proxy.Condition = lock, condition
    saved = engine_mod.threading, committer_mod.threading
    engine_mod.threading = proxy  # type: ignore[assignment]
    committer_mod.threading = proxy  # type: ignore[assignment]
    try:
        yield made
    finally:
        engine_mod.threading, committer_mod.threading = saved


def open_store(backend: str, path: Path) -> tuple[Any, list[TimedLock]]:
    opts = StoreOptions(
        hot_capacity_bytes=2 * 1024 * MiB, warm_capacity_bytes=0, cold_capacity_bytes=1 << 40
    )
    with timed_locks() as made:
        store = SharedKvIndex(opts) if backend == "memory" else SharedKvStoreBackend(path, opts)
    return store, made


def run(store: Any, op: str, size: int, threads: int, seconds: float) -> tuple[int, float]:
    """`threads` threads doing `op` for `seconds`; (operations, wall seconds)."""
    base = os.urandom(size)
    counter = itertools.count()
    if op == "GET":
        for t in range(threads):
            for i in range(RING):
                store.put("b", f"k{t}-{i}", next(counter).to_bytes(8, "little") + base[8:])
    stop = threading.Event()
    done = [0] * threads
    start = threading.Barrier(threads + 1)

    def work(t: int) -> None:
        keys = [f"k{t}-{i}" for i in range(RING)]
        n = 0
        start.wait()
        if op == "GET":
            get = store.get
            while not stop.is_set():
                if get("b", keys[n % RING]) is None:
                    raise AssertionError("a GET missed")
                n += 1
        else:
            put = store.put
            while not stop.is_set():
                put("b", keys[n % RING], next(counter).to_bytes(8, "little") + base[8:])
                n += 1
        done[t] = n

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    start.wait()
    t0 = time.perf_counter()
    time.sleep(seconds)  # the measured interval: the threads run meanwhile
    stop.set()
    for th in pool:
        th.join()
    return sum(done), time.perf_counter() - t0


def pct(samples: list[int], q: float) -> float:
    return float(np.percentile(np.asarray(samples, dtype=np.int64), q)) / 1000 if samples else 0.0


def human(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def measure(
    backends: list[str], sizes: list[int], thread_counts: list[int], seconds: float, d: Path
) -> list[str]:
    rows = [
        "| backend | op | size | threads | ops/s | lock | acq/op | hold p50 µs | hold p99 µs "
        "| wait p50 µs | wait p99 µs | held % of wall |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for backend, size, op, threads in itertools.product(
        backends, sizes, ("GET", "SET"), thread_counts
    ):
        path = d / f"{backend}-{size}-{op}-{threads}"
        store, locks = open_store(backend, path)
        try:
            if op == "GET":  # written before the clock starts, not counted
                run(store, "SET", size, threads, 0.0)
            # warm up (allocator, first segment), then measure
            run(store, op, size, threads, min(0.3, seconds))
            for lk in locks:
                lk.reset()
                lk.recording = True
            n, wall = run(store, op, size, threads, seconds)
            for lk in locks:
                lk.recording = False
        finally:
            store.close()
            shutil.rmtree(path, ignore_errors=True)
        for lk in locks:
            if not lk.holds:
                continue
            rows.append(
                f"| {backend} | {op} | {human(size)} | {threads} | {n / wall:,.0f} | {lk.name} "
                f"| {len(lk.holds) / max(n, 1):.1f} | {pct(lk.holds, 50):.1f} "
                f"| {pct(lk.holds, 99):.1f} | {pct(lk.waits, 50):.1f} | {pct(lk.waits, 99):.1f} "
                f"| {100 * sum(lk.holds) / 1e9 / wall:.1f} |"
            )
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument("--threads", default="1,2,4")
    p.add_argument("--sizes", default=f"{4 * KiB},{256 * KiB},{4 * MiB}")
    p.add_argument("--backends", default="memory,durable")
    p.add_argument("--dir", default=None, help="where the durable stores go (default: a temp dir)")
    a = p.parse_args(argv)
    ints: Callable[[str], list[int]] = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        rows = measure(a.backends.split(","), ints(a.sizes), ints(a.threads), a.seconds, Path(tmp))
    print(f"\nload: {os.getloadavg()[0]:.2f} (1-min), cpus: {os.cpu_count()}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
