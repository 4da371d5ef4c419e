"""What releasing the GIL would buy the compiled twins' C-only work (issue 27, item 4).

    .venv/bin/python -m bench.bench_gil_twins [--sizes 4KiB,32KiB,64KiB,256KiB] [--seconds 1]

How it works
------------
The compiled twins touch Python objects almost everywhere; the stretches that do not are
memory operations on a block's bytes: the store's hot core compares a re-sent block with
the hot copy byte for byte (store/hotcore.py `HotCore.put`, blocks up to
`INLINE_MAX_BYTES`), and the framer copies each small bulk out of its receive buffer
(proto/resp_parser.py, bulks under `large_bulk_threshold`). This bench compiles a probe
with Cython into a temporary folder (the same compiler the twins use) with both forms of
each operation, `memcmp` / `memcpy` with the GIL held and with it released
(`with nogil`), and calls them in a loop from 1 and from 2 threads, with the GIL switch
interval the server sets for several event loops (server/runtime.py `SWITCH_INTERVAL_S`).
Printed per size and form: calls per second on 1 and 2 threads, and the 2-thread
speedup; above the table, the cost of one uncontended release-and-retake. A release
pays only where 2 threads beat 1 by more than the held form's 2 threads do.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from bench.bench_cpu import parse_size
from bench.bench_server import human
from epistemic_kvcache.server.runtime import SWITCH_INTERVAL_S

PROBE = """\
# cython: language_level=3
from libc.string cimport memcmp, memcpy
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE


def compare_held(bytes a, bytes b):
    return memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(b), <size_t>PyBytes_GET_SIZE(a)) == 0


def compare_free(bytes a, bytes b):
    cdef const char *pa = PyBytes_AS_STRING(a)
    cdef const char *pb = PyBytes_AS_STRING(b)
    cdef size_t n = <size_t>PyBytes_GET_SIZE(a)
    cdef int r
    with nogil:
        r = memcmp(pa, pb, n)
    return r == 0


def copy_held(bytes a, bytes unused):
    cdef bytes out = PyBytes_FromStringAndSize(NULL, PyBytes_GET_SIZE(a))
    memcpy(PyBytes_AS_STRING(out), PyBytes_AS_STRING(a), <size_t>PyBytes_GET_SIZE(a))
    return out


def copy_free(bytes a, bytes unused):
    cdef bytes out = PyBytes_FromStringAndSize(NULL, PyBytes_GET_SIZE(a))
    cdef char *po = PyBytes_AS_STRING(out)
    cdef const char *pa = PyBytes_AS_STRING(a)
    cdef size_t n = <size_t>PyBytes_GET_SIZE(a)
    with nogil:
        memcpy(po, pa, n)
    return out


def release_and_retake(int n):
    cdef int i
    for i in range(n):
        with nogil:
            pass
"""

OPS = ("compare", "copy")


def build_probe(folder: Path) -> ModuleType:
    """Compile the probe with the venv's Cython and import it."""
    source = folder / "gil_probe.pyx"
    source.write_text(PROBE)
    cythonize = Path(sys.executable).parent / "cythonize"
    subprocess.run(
        [str(cythonize), "-i", "-q", "-3", str(source)],
        cwd=folder,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    built = next(folder.glob("gil_probe*.so"))
    spec = importlib.util.spec_from_file_location("gil_probe", built)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rate(
    fn: Callable[[bytes, bytes], object], a: bytes, b: bytes, threads: int, seconds: float
) -> float:
    """Calls per second of `fn(a, b)`, all threads together, over `seconds`."""
    counts = [0] * threads
    go = threading.Barrier(threads + 1)
    deadline = [0.0]

    def work(i: int) -> None:
        go.wait()
        n = 0
        while time.perf_counter() < deadline[0]:
            for _ in range(50):
                fn(a, b)
            n += 50
        counts[i] = n

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    deadline[0] = time.perf_counter() + seconds
    started = time.perf_counter()
    go.wait()
    for w in workers:
        w.join()
    return sum(counts) / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4KiB,32KiB,64KiB,256KiB")
    ap.add_argument("--seconds", type=float, default=1.0, help="per cell")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="kvbench-gil-") as tmp:
        probe = build_probe(Path(tmp))
        n = 200_000
        best = min(_timed(probe.release_and_retake, n) for _ in range(5)) / n
        results["handoff_ns"] = best * 1e9
        print(f"usable cores: {len(os.sched_getaffinity(0))}, load {os.getloadavg()[0]:.2f}, "
              f"switch interval {SWITCH_INTERVAL_S * 1e3:g} ms, {args.seconds:g} s per cell")  # fmt: skip
        print(f"one uncontended release and retake of the GIL: {best * 1e9:.0f} ns\n")
        print("| op | size | GIL | 1 thread, k calls/s | 2 threads, k calls/s | 2 / 1 |")
        print("|---|---|---|---|---|---|")
        for op in OPS:
            for size in sizes:
                a = os.urandom(size)
                b = bytes(bytearray(a))  # equal bytes, another object: a full compare
                for form in ("held", "free"):
                    fn = getattr(probe, f"{op}_{form}")
                    one = rate(fn, a, b, 1, args.seconds)
                    two = rate(fn, a, b, 2, args.seconds)
                    results[f"{op} {size} {form}"] = two / one
                    print(f"| {op} | {human(size)} | {form} | {one / 1e3:.0f} | "
                          f"{two / 1e3:.0f} | {two / one:.2f}x |")  # fmt: skip
    return results


def _timed(fn: Callable[[int], object], n: int) -> float:
    started = time.perf_counter()
    fn(n)
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
