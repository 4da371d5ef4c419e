"""The store's hot path with warm and with cold CPU caches, beside a dict (issue 27).

    PYTHONPATH=src .venv/bin/python -m bench.bench_store_cold [--n 20000] [--sweep-kib 0,1024]

Why does the store cost several times more per request in a server under
`redis-benchmark` (`bench_floor --floors dict,store`) than in a loop in one process? In
a server, the kernel's network stack and the load generator run between two requests
on the same two cores and evict the CPU caches; Python code that touches many objects
(the engine, its dicts, the blob, the counters, the lock, a dozen code objects) then
pays a cache miss on each. This measures it without a network: each operation runs
after a write sweep over `--sweep-kib` KiB of other memory (0: none, the caches stay
warm), and its own time is read around it with `perf_counter_ns` (the sweep is not
counted). Operations: the memory store's `put_nowait` of the bytes its key already holds
(what `redis-benchmark -t set` sends), `get_nowait` of a hot block, and, for
comparison, a dict's set with a BLAKE3 digest and a dict's get. Prints the median
microseconds per operation, best of 3.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from blake3 import blake3

from bench.bench_twins import our_store_options
from epistemic_kvcache.store import SharedKvIndex

NS = "bench"
KEY = "key:__rand_int__"


def per_op_us(op: Callable[[], object], n: int, sweep: bytearray) -> float:
    """Median microseconds of `op`, each after a write sweep over `sweep`."""
    times = []
    clock = time.perf_counter_ns
    for _ in range(n):
        if sweep:
            sweep[:] = sweep  # (CPython copies it out and back: every line read and written)
        t0 = clock()
        op()
        times.append(clock() - t0)
    return statistics.median(times) / 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--sweep-kib", default="0,1024", help="comma-separated sizes")
    args = ap.parse_args()
    store = SharedKvIndex(our_store_options())
    value = b"x" * 4096
    store.put(NS, KEY, value)
    plain: dict[str, bytes] = {KEY: value}

    def dict_set() -> None:
        plain[KEY] = bytes(value)
        blake3(plain[KEY]).digest()

    ops: list[tuple[str, Callable[[], object]]] = [
        ("store put_nowait (same bytes)", lambda: store.put_nowait(NS, KEY, value)),
        ("dict set + BLAKE3", dict_set),
        ("store get_nowait (hot)", lambda: store.get_nowait(NS, KEY)),
        ("dict get", lambda: plain.get(KEY)),
    ]
    sizes = [int(x) for x in args.sweep_kib.split(",") if x]
    print("| 4 KiB operation | " + " | ".join(f"sweep {s} KiB (µs)" for s in sizes) + " |")
    print("|---" * (1 + len(sizes)) + "|")
    for label, op in ops:
        cells = []
        for kib in sizes:
            sweep = bytearray(kib * 1024)
            cells.append(f"{min(per_op_us(op, args.n, sweep) for _ in range(3)):.2f}")
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
