"""Durable store benchmarks: SET against redis-server with the same promise, reopen and
rebuild times, and the disk bound under churn.

    .venv/bin/python -m bench.bench_durable [--quick] [--clients 8] [--blocks 100000]

1. RESP SET, durable backend vs `redis-server --appendonly yes --appendfsync always`
   (both acknowledge a write only once it is fsynced), 8 concurrent connections, unique
   payloads, in alternating rounds in one run; the ratio of the median throughputs.
2. Reopen of a store of N blocks (index checkpoint + log tail), reopen after SIGKILL with
   the index a full checkpoint interval behind, and a rebuild of the index from the log.
3. Disk use under churn with restarts: rounds of writes, deletes and restarts; segment
   bytes on disk against live bytes; and the peak against `cold_capacity_bytes`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from bench import loadgen
from bench.bench_server import TOKEN, human, our_server, redis_server, workload
from epistemic_kvcache.options import StoreOptions

KiB, MiB = 1024, 1024 * 1024


def set_ratio(tmp: Path, size: int, budget: int, clients: int, rounds: int) -> str:
    ours: list[loadgen.Result] = []
    theirs: list[loadgen.Result] = []
    for _ in range(rounds):
        keys, payloads = workload(size, budget, clients)
        with redis_server(tmp, fsync_always=True) as port:
            theirs.append(
                loadgen.run(
                    loadgen.run_resp("127.0.0.1", port, None, "set", keys, payloads, clients)
                )
            )
        with our_server(tmp, "durable") as (_h, rport):
            ours.append(
                loadgen.run(
                    loadgen.run_resp("127.0.0.1", rport, TOKEN, "set", keys, payloads, clients)
                )
            )
        shutil.rmtree(tmp / "ours-durable", ignore_errors=True)
    o = statistics.median(r.gbps for r in ours)
    t = statistics.median(r.gbps for r in theirs)
    oo = statistics.median(r.ops_s for r in ours)
    to = statistics.median(r.ops_s for r in theirs)
    op99 = statistics.median(r.pct(99) for r in ours)
    tp99 = statistics.median(r.pct(99) for r in theirs)
    return (
        f"| {human(size)} | {t:.3f} | {to:,.0f} | {tp99:.2f} | {o:.3f} | {oo:,.0f} | "
        f"{op99:.2f} | **{o / t:.2f}x** |"
    )


def reopen_times(tmp: Path, n: int) -> list[str]:
    from epistemic_kvcache.store import SharedKvStoreBackend
    from epistemic_kvcache.store.tools import rebuild_index

    path = tmp / "reopen"
    opts = StoreOptions(hot_capacity_bytes=64 * MiB, warm_capacity_bytes=0)
    t0 = time.perf_counter()
    with SharedKvStoreBackend(path, opts) as store:
        batch = []
        for i in range(n):
            batch.append((f"model@{i:08x}@0@{i:016x}", os.urandom(4096)))
            if len(batch) == 1000:
                store.put_many("bench", batch)
                batch = []
        if batch:
            store.put_many("bench", batch)
    fill_s = time.perf_counter() - t0
    seg_bytes = sum(p.stat().st_size for p in (path / "segments").iterdir())
    t0 = time.perf_counter()
    with SharedKvStoreBackend(path, opts) as store:
        reopen = store.open_seconds
        assert store.count("bench") == n
    total = time.perf_counter() - t0
    # SIGKILL with the index lagging (no checkpoint for an hour): the tail is replayed
    script = textwrap.dedent(
        f"""
        import os, sys
        from epistemic_kvcache.options import StoreOptions
        from epistemic_kvcache.store import SharedKvStoreBackend
        s = SharedKvStoreBackend(sys.argv[1], StoreOptions(checkpoint_interval_s=3600,
                                 hot_capacity_bytes={64 * MiB}, warm_capacity_bytes=0))
        b = [(f"tail@{{i:08x}}", os.urandom(4096)) for i in range(20000)]
        for j in range(0, len(b), 1000):
            s.put_many("bench", b[j:j + 1000])
        print("DONE", flush=True)
        import time; time.sleep(600)
        """
    )
    with subprocess.Popen(
        [sys.executable, "-c", script, str(path)], stdout=subprocess.PIPE, text=True
    ) as p:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "DONE"
        p.send_signal(signal.SIGKILL)
        p.wait()
    with SharedKvStoreBackend(path, opts) as store:
        tail_reopen = store.open_seconds
        assert store.count("bench") == n + 20000
    shutil.rmtree(path / "index")
    rebuilt = rebuild_index(path, opts)
    return [
        f"Store of {n:,} blocks of 4 KiB ({seg_bytes / MiB:.0f} MiB of segments, filled in "
        f"{fill_s:.1f} s):",
        "",
        "| open | seconds |",
        "|---|---|",
        f"| reopen after a clean close (index rows only) | {reopen:.2f} (whole constructor {total:.2f}) |",
        f"| reopen after SIGKILL, 20,000 blocks (82 MiB) of log after the checkpoint | {tail_reopen:.2f} |",
        f"| `store rebuild-index` (every record read, every block re-hashed), {n + 20000:,} blocks | {rebuilt.seconds:.2f} |",
    ]


def churn(tmp: Path, rounds: int) -> list[str]:
    from epistemic_kvcache.store import SharedKvStoreBackend

    path = tmp / "churn"
    opts = StoreOptions(hot_capacity_bytes=16 * MiB, warm_capacity_bytes=0)
    live: dict[str, int] = {}
    rows = []
    for r in range(rounds):
        with SharedKvStoreBackend(path, opts) as store:
            for i in range(160):
                key = f"r{r}-{i}"
                store.put("bench", key, os.urandom(256 * KiB))
                live[key] = 256 * KiB
            for key in sorted(live)[: max(0, len(live) - 40)]:
                store.delete("bench", key)
                del live[key]
            time.sleep(2)  # idle: the committer compacts
        on_disk = sum(p.stat().st_size for p in (path / "segments").iterdir())
        rows.append((r, sum(live.values()), on_disk))
    out = [
        "| round | live MiB | segment files MiB | ratio |",
        "|---|---|---|---|",
    ]
    out += [f"| {r} | {lv / MiB:.1f} | {d / MiB:.1f} | {d / lv:.2f} |" for r, lv, d in rows]
    # the cold capacity bound: 64 MiB, 300 MiB written
    cap_path = tmp / "cap"
    peak = 0
    with SharedKvStoreBackend(
        cap_path, StoreOptions(cold_capacity_bytes=64 * MiB, hot_capacity_bytes=0)
    ) as store:
        for i in range(1200):
            store.put("bench", f"k{i}", os.urandom(256 * KiB))
            if i % 10 == 0:
                peak = max(peak, sum(p.stat().st_size for p in (cap_path / "segments").iterdir()))
        ev = store.stats(None).evictions
    out += [
        "",
        f"`--cold-capacity-bytes 64MiB`, 300 MiB written in 256 KiB blocks: peak segment files "
        f"**{peak / MiB:.1f} MiB** (sampled every 10 PUTs), {ev} blocks evicted.",
    ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--skip", default="", help="comma-separated: set,reopen,churn")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    tmp = Path(tempfile.mkdtemp(prefix="kvbench-dur-"))
    try:
        if "set" not in skip:
            rounds = 1 if args.quick else 3
            print(
                f"## RESP SET, durable backend vs redis-server --appendfsync always "
                f"({args.clients} clients, median of {rounds} alternating rounds)\n"
            )
            print("| block | redis GB/s | ops/s | p99 ms | ours GB/s | ops/s | p99 ms | ratio |")
            print("|---|---|---|---|---|---|---|---|")
            sizes = [4 * KiB, 256 * KiB, 4 * MiB] + ([] if args.quick else [32 * MiB])
            for size in sizes:
                budget = (32 if size <= 4 * KiB else 128 if args.quick else 256) * MiB
                print(set_ratio(tmp, size, budget, args.clients, rounds), flush=True)
        if "reopen" not in skip:
            print("\n## Reopen and rebuild\n")
            blocks = min(args.blocks, 20_000) if args.quick else args.blocks
            print("\n".join(reopen_times(tmp, blocks)), flush=True)
        if "churn" not in skip:
            print("\n## Disk use under churn with restarts\n")
            print("\n".join(churn(tmp, 4 if args.quick else 10)), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
