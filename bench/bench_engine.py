"""Engine-feature benchmarks (issue 6): fork cost, branch read overhead, retire_stale.

    .venv/bin/python -m bench.bench_engine [--quick] [--dir DIR] [--blocks N]

Prints markdown tables:
- snapshot + fork of N blocks (default 10,000) in the durable backend: time, and bytes
  copied measured as the change of on-disk segment bytes and of resident bytes (the
  target is zero block bytes), in-process and over HTTP;
- branch read overhead: `branch_get` of a key that falls through to the snapshot and of
  an overlay key vs plain `get`, in-process (memory backend) and over HTTP (one client
  thread, keep-alive), as a ratio;
- `retire_stale` throughput after an epoch bump, memory and durable backends.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from epistemic_kvcache.client import EpistemicGraphKVBackend
from epistemic_kvcache.config import load_config
from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.server.app import ServerThread
from epistemic_kvcache.store import SharedKvIndex, SharedKvStoreBackend
from epistemic_kvcache.store.api import SharedKvBackend

KiB, MiB = 1024, 1024 * 1024
NS = "bench"
TOKEN = "bench-token-0123456789abcdef"


def block(i: int, size: int) -> bytes:
    return np.random.default_rng(i).bytes(size)


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def durable(path: Path) -> SharedKvStoreBackend:
    return SharedKvStoreBackend(path, StoreOptions(map_size_bytes=4 << 30))


def disk_bytes(store: SharedKvBackend) -> int:
    return int(store.stats(None).extra.get("segment_bytes", 0))


def fill(store: SharedKvBackend, n: int, size: int, prefix: str = "b") -> list[str]:
    keys = [f"{prefix}{i:06d}" for i in range(n)]
    for start in range(0, n, 256):
        chunk = keys[start : start + 256]
        store.put_many(NS, [(k, block(start + j, size)) for j, k in enumerate(chunk)])
    return keys


# -- fork ---------------------------------------------------------------------------------
def bench_fork(d: Path, n: int, size: int) -> list[str]:
    rows = [
        "| step | time | segment bytes delta | resident bytes delta | keys |",
        "|---|---|---|---|---|",
    ]
    store = durable(d / "fork")
    try:
        fill(store, n, size)
        disk0, res0 = disk_bytes(store), store.stats(NS).resident_bytes
        t_snap = time.perf_counter()
        snap = store.snapshot_create(NS)
        t_snap = time.perf_counter() - t_snap
        disk1, res1 = disk_bytes(store), store.stats(NS).resident_bytes
        t_fork = time.perf_counter()
        branch = store.branch_create(NS, snap.id)
        t_fork = time.perf_counter() - t_fork
        disk2, res2 = disk_bytes(store), store.stats(NS).resident_bytes
        rows.append(
            f"| snapshot of {n} x {size // KiB} KiB (in-process) | {t_snap * 1e3:.1f} ms "
            f"| {disk1 - disk0} B | {res1 - res0} B | {snap.keys} |"
        )
        rows.append(
            f"| fork (in-process) | {t_fork * 1e3:.3f} ms | {disk2 - disk1} B "
            f"| {res2 - res1} B | {branch.shared_bytes // size} shared |"
        )
        t_del = timed(lambda: store.snapshot_delete(NS, snap.id))
        rows.append(f"| delete snapshot + branch | {t_del * 1e3:.1f} ms | | | |")
    finally:
        store.close()

    thread, client = start_server(d / "fork-http", "durable")
    try:
        items = [(f"h{i:06d}", block(i, size)) for i in range(n)]
        for start in range(0, n, 512):
            client.put_many(items[start : start + 512])
        s0 = client.stats()
        t_snap = time.perf_counter()
        info = client.snapshot()
        t_snap = time.perf_counter() - t_snap
        t_fork = time.perf_counter()
        br = client.fork(info.id) if info is not None else None
        t_fork = time.perf_counter() - t_fork
        s1 = client.stats()
        if info is None or br is None or s0 is None or s1 is None:
            rows.append("| over HTTP | failed | | | |")
        else:
            rows.append(
                f"| snapshot over HTTP | {t_snap * 1e3:.1f} ms | | "
                f"{s1.resident_bytes - s0.resident_bytes} B (snapshot+fork) | {info.keys} |"
            )
            rows.append(f"| fork over HTTP | {t_fork * 1e3:.2f} ms | | | |")
    finally:
        client.close()
        thread.stop()
    return rows


# -- branch reads -------------------------------------------------------------------------
def start_server(path: Path, backend: str) -> tuple[ServerThread, EpistemicGraphKVBackend]:
    values = {
        "addr": "127.0.0.1:0",
        "resp_addr": "off",
        "backend": backend,
        "persist_dir": str(path),
        "token": [TOKEN],
        "stats_log_interval_s": "0",
        "log_level": "WARNING",
    }
    thread = ServerThread(load_config(values, {}))
    handle = thread.start()
    url = f"http://{handle.http.host}:{handle.http.port}"
    return thread, EpistemicGraphKVBackend(base_url=url, token=TOKEN)


def per_op(fn: Callable[[str], object], keys: list[str], repeat: int) -> float:
    """Best-of-3 seconds per call over `keys` x `repeat`."""
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(repeat):
            for k in keys:
                fn(k)
        best = min(best, (time.perf_counter() - t) / (len(keys) * repeat))
    return best


def bench_branch_reads(d: Path, n: int, size: int) -> list[str]:
    rows = [
        "| path | block | plain GET | branch GET (falls through) | branch GET (overlay) | ratio |",
        "|---|---|---|---|---|---|",
    ]
    store = SharedKvIndex()
    keys = fill(store, n, size)
    snap = store.snapshot_create(NS)
    br = store.branch_create(NS, snap.id)
    overlay = keys[: n // 2]
    for i, k in enumerate(overlay):
        store.branch_put(NS, br.id, k, block(10_000_000 + i, size))
    through = keys[n // 2 :]
    plain = per_op(lambda k: store.get(NS, k), through, 5)
    fall = per_op(lambda k: store.branch_get(NS, br.id, k), through, 5)
    own = per_op(lambda k: store.branch_get(NS, br.id, k), overlay, 5)
    rows.append(
        f"| in-process (memory) | {size // KiB} KiB | {plain * 1e6:.2f} us | {fall * 1e6:.2f} us "
        f"| {own * 1e6:.2f} us | {fall / plain:.2f}x |"
    )
    store.close()

    thread, client = start_server(d / "reads-http", "memory")
    try:
        m = min(n, 2000)
        items = [(f"r{i:06d}", block(i, size)) for i in range(m)]
        client.put_many(items)
        info = client.snapshot(prefix="r")
        assert info is not None
        hb = client.fork(info.id)
        assert hb is not None
        hkeys = [k for k, _ in items]
        h_over = hkeys[: m // 2]
        for k in h_over:
            client.branch_put(hb.id, k, b"o" * size)
        h_through = hkeys[m // 2 :]
        plain = per_op(client.get, h_through, 1)
        fall = per_op(lambda k: client.branch_get(hb.id, k), h_through, 1)
        own = per_op(lambda k: client.branch_get(hb.id, k), h_over, 1)
        rows.append(
            f"| HTTP (memory backend) | {size // KiB} KiB | {plain * 1e6:.0f} us "
            f"| {fall * 1e6:.0f} us | {own * 1e6:.0f} us | {fall / plain:.2f}x |"
        )
    finally:
        client.close()
        thread.stop()
    return rows


# -- retire_stale -------------------------------------------------------------------------
def bench_retire(d: Path, n: int, size: int) -> list[str]:
    rows = [
        "| backend | stale entries | ticks (max_items=1000, budget 50 ms) | time | entries/s |",
        "|---|---|---|---|---|",
    ]
    for name, store in (("memory", SharedKvIndex()), ("durable", durable(d / "retire"))):
        try:
            for start in range(0, n, 256):
                for i in range(start, min(n, start + 256)):
                    store.put(NS, f"s{i:06d}", block(i, size), epoch_scope="ctx")
            store.epoch_bump(NS, "ctx")
            ticks = removed = 0
            t = time.perf_counter()
            while True:
                got = store.retire_stale(max_items=1000, budget_s=0.05)
                ticks += 1
                removed += got
                if got == 0:
                    break
            elapsed = time.perf_counter() - t
            left = store.count(NS)
            rows.append(
                f"| {name} | {removed} (left {left}) | {ticks} | {elapsed * 1e3:.0f} ms "
                f"| {removed / elapsed:,.0f} |"
            )
        finally:
            store.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller volumes")
    ap.add_argument("--dir", default=None, help="scratch directory")
    ap.add_argument("--blocks", type=int, default=10_000, help="blocks in the forked snapshot")
    args = ap.parse_args()
    n = 2000 if args.quick else args.blocks
    size = 4 * KiB if args.quick else 16 * KiB
    d = Path(tempfile.mkdtemp(prefix="kvbench-engine-", dir=args.dir))
    try:
        print(f"# engine benchmark ({os.cpu_count()} cores, scratch {d})\n")
        print(f"## Snapshot and fork of {n} blocks (durable backend)\n")
        print("\n".join(bench_fork(d, n, size)), "\n")
        print("## Branch read overhead vs plain GET\n")
        print("\n".join(bench_branch_reads(d, min(n, 10_000), 4 * KiB)), "\n")
        print("## retire_stale throughput after an epoch bump\n")
        print("\n".join(bench_retire(d, n, 4 * KiB)), "\n")
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
