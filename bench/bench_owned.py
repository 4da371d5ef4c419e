"""What the store's ownership of its bytes costs a library caller (issue 22 item 3).

    .venv/bin/python -m bench.bench_owned [--sizes 4KiB,32MiB] [--repeat 5]

In process, memory backend (hot tier large enough for everything): per block size, the
median time of one `put` of a new block given as `bytes`, as a `bytearray` (copied by the
store since it owns its bytes; kept as it was before) and, where the tree has it, as a
`Handover` of a bytearray (kept without a copy), then of one `get` hit of it. Each
round uses a fresh store and fresh, distinct blocks. Run it with each tree first on
PYTHONPATH to compare two trees on the same machine.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.bench_cpu import parse_size
from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.store import SharedKvIndex

try:
    from epistemic_kvcache.buffers import Handover
except ImportError:  # a tree from before the store owned its bytes
    Handover = None  # type: ignore[assignment, misc]

KiB, MiB = 1024, 1024 * 1024


def blocks(size: int, n: int, seed: int) -> list[bytearray]:
    out = []
    for i in range(n):
        b = bytearray(size)
        b[:16] = (seed * 1_000_003 + i).to_bytes(16, "little")
        b[-16:] = b[:16]
        out.append(b)
    return out


def one_round(
    size: int, n: int, seed: int, wrap: Callable[[bytearray], Any]
) -> tuple[float, float]:
    """Seconds per put and per get (hot hit) of `n` new blocks of `size`."""
    data = [wrap(b) for b in blocks(size, n, seed)]
    store = SharedKvIndex(
        StoreOptions(hot_capacity_bytes=(n + 1) * size + MiB, warm_capacity_bytes=0)
    )
    gc.collect()
    t0 = time.perf_counter()
    for i, d in enumerate(data):
        store.put("t", str(i), d)
    t1 = time.perf_counter()
    for i in range(n):
        store.get("t", str(i))
    t2 = time.perf_counter()
    store.close()
    return (t1 - t0) / n, (t2 - t1) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4KiB,32MiB")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    kinds: list[tuple[str, Callable[[bytearray], Any]]] = [
        ("bytes", bytes),
        ("bytearray", lambda b: b),
    ]
    if Handover is not None:
        kinds.append(("Handover(bytearray)", Handover))
    print("| block | given as | put (median) | get hit (median) |")
    print("|---|---|---|---|")
    for size in (parse_size(s) for s in args.sizes.split(",")):
        n = max(4, min(2000, (192 * MiB) // size))
        for name, wrap in kinds:
            puts, gets = [], []
            for r in range(args.repeat):
                p, g = one_round(size, n, r, wrap)
                puts.append(p)
                gets.append(g)
            print(
                f"| {size // KiB} KiB | {name} | {statistics.median(puts) * 1e6:.1f} us "
                f"| {statistics.median(gets) * 1e6:.2f} us |"
            )


if __name__ == "__main__":
    main()
