"""Block-store benchmarks (issue 2): one run, side by side with the machine's own limits.

    .venv/bin/python -m bench.bench_store [--quick] [--dir DIR]

Prints markdown tables: hot PUT/GET (memory backend), 100%-duplicate PUT, durable PUT with
1 and 16 writers as a ratio of the disk's sequential write+fdatasync bandwidth measured in
the same run, fsyncs per PUT, cold GET with digest verification, the warm codec on
bf16-shaped data, index memory per block and reopen time for 100,000 blocks.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.bench_cpu import parse_size
from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.server.runtime import tune_allocator
from epistemic_kvcache.store import SharedKvIndex, SharedKvStoreBackend, WarmCodec

KiB, MiB = 1024, 1024 * 1024
SIZES = [4 * KiB, 256 * KiB, 4 * MiB, 32 * MiB]


def human(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def bf16_block(size: int, seed: int) -> bytes:
    """KV-like data: normally distributed values truncated to bfloat16."""
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal(size // 2) * 0.05).astype(np.float32)
    return (a.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def count_for(size: int, budget: int) -> int:
    return max(8, min(20_000, budget // size))


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run_threads(n: int, work: Callable[[int], None]) -> float:
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t


def disk_write_fsync_bw(
    d: Path, total: int, chunk: int = 4 * MiB, sync_every: int = 4 * MiB
) -> float:
    """Sequential 4 MiB writes + one fdatasync per `sync_every` bytes."""
    buf = os.urandom(chunk)
    p = d / "ddtest"
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    t = time.perf_counter()
    for i in range(total // chunk):
        os.write(fd, buf)
        if (i + 1) * chunk % sync_every == 0:
            os.fdatasync(fd)
    os.fdatasync(fd)
    dt = time.perf_counter() - t
    os.close(fd)
    p.unlink()
    return total / dt


def bench_hot(budget: int, sizes: list[int]) -> list[str]:
    rows = [
        "| block | PUT GB/s | PUT ops/s | dup PUT GB/s | dup PUT ops/s | GET GB/s | GET ops/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for size in sizes:
        n = count_for(size, budget)
        base = os.urandom(size)
        blocks = [i.to_bytes(8, "little") + base[8:] for i in range(n)]
        keys = [f"k{i}" for i in range(n)]
        store = SharedKvIndex(StoreOptions(hot_capacity_bytes=4 * budget, warm_capacity_bytes=0))
        t_put = timed(lambda: [store.put("b", k, v) for k, v in zip(keys, blocks, strict=True)])
        same = blocks[0]
        t_dup = timed(lambda: [store.put("b", f"d{i}", same) for i in range(n)])
        t_get = timed(lambda: [store.get("b", k) for k in keys])
        store.close()
        gbs = lambda t: n * size / t / 1e9  # noqa: E731
        rows.append(
            f"| {human(size)} | {gbs(t_put):.2f} | {n / t_put:,.0f} | {gbs(t_dup):.2f} | "
            f"{n / t_dup:,.0f} | {gbs(t_get):.2f} | {n / t_get:,.0f} |"
        )
    return rows


def bench_durable(d: Path, budget: int, sizes: list[int]) -> list[str]:
    disk_small = disk_write_fsync_bw(d, min(budget, 512 * MiB))
    disk_bw = disk_write_fsync_bw(d, min(budget, 512 * MiB), sync_every=64 * MiB)
    rows = [
        f"Disk, same run, sequential 4 MiB writes: fdatasync every 4 MiB "
        f"**{disk_small / 1e9:.2f} GB/s**, every 64 MiB **{disk_bw / 1e9:.2f} GB/s** "
        "(the ratio column divides by the latter, the disk's streaming write+sync bandwidth)",
        "",
        "| block | writers | PUT GB/s | ratio to disk | PUT ops/s | fsyncs/PUT | cold GET GB/s (verified) |",
        "|---|---|---|---|---|---|---|",
    ]
    for size in sizes:
        n = max(64, count_for(size, budget))  # >= 4 PUTs per writer at 16 writers
        base = os.urandom(size)
        for writers in (1, 16):
            path = d / f"dur-{size}-{writers}"
            store = SharedKvStoreBackend(
                path,
                StoreOptions(
                    hot_capacity_bytes=0, warm_capacity_bytes=0, cold_capacity_bytes=1 << 40
                ),
            )
            per = max(1, n // writers)

            # unique bytes per key (the first 8 bytes vary), made before the clock starts
            datas = [
                [(w * per + i).to_bytes(8, "little") + base[8:] for i in range(per)]
                for w in range(writers)
            ]

            def work(
                w: int, store: SharedKvStoreBackend = store, datas: list[list[bytes]] = datas
            ) -> None:
                for i, data in enumerate(datas[w]):
                    store.put("b", f"k{w}-{i}", data)

            dt = run_threads(writers, work)
            extra = store.stats(None).extra
            total = per * writers
            fsyncs = extra["fsyncs"] / total
            cold = ""
            if writers == 16:
                keys = [f"k{w}-{i}" for w in range(writers) for i in range(per)]
                # page cache warm: read once, then time the second pass
                for k in keys:
                    store.get("b", k)
                t = timed(lambda keys=keys, store=store: [store.get("b", k) for k in keys])
                cold = f"{total * size / t / 1e9:.2f}"
            del datas
            store.close()
            shutil.rmtree(path)
            bw = total * size / dt
            rows.append(
                f"| {human(size)} | {writers} | {bw / 1e9:.2f} | {bw / disk_bw:.2f} | "
                f"{total / dt:,.0f} | {fsyncs:.3f} | {cold} |"
            )
    return rows


def bench_codec() -> list[str]:
    rows = ["| codec | block | ratio | compress GB/s | decompress GB/s |", "|---|---|---|---|---|"]
    for name in ("lz4", "zstd"):
        codec = WarmCodec(name)  # type: ignore[arg-type]
        for size in (256 * KiB, 4 * MiB, 32 * MiB):
            data = bf16_block(size, 1)
            reps = max(1, (64 * MiB) // size)
            comp = codec.compress(data)
            assert comp is not None
            tc = timed(
                lambda data=data, codec=codec, reps=reps: [
                    codec.compress(data) for _ in range(reps)
                ]
            )
            td = timed(
                lambda comp=comp, reps=reps: [WarmCodec.decompress(comp) for _ in range(reps)]
            )
            rows.append(
                f"| {name} + bitshuffle | {human(size)} | {len(comp) / size:.3f} | "
                f"{reps * size / tc / 1e9:.2f} | {reps * size / td / 1e9:.2f} |"
            )
    return rows


def bench_index(d: Path, n: int) -> list[str]:
    path = d / "index"
    key = "meta-llama/Llama-3.1-8B-Instruct@00000000@0@{:016x}"
    store = SharedKvStoreBackend(path, StoreOptions(hot_capacity_bytes=0, warm_capacity_bytes=0))
    batch = 1000
    t_fill = 0.0
    for start in range(0, n, batch):
        items = [(key.format(i), i.to_bytes(8, "little") * 8) for i in range(start, start + batch)]
        t_fill += timed(lambda items=items: store.put_many("b", items))
    store.close()
    gc.collect()
    t_open = timed(lambda: SharedKvStoreBackend(path, StoreOptions(hot_capacity_bytes=0)).close())
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    # a second open, under tracemalloc (slow), only to measure RAM
    globals()["_s"] = SharedKvStoreBackend(
        path, StoreOptions(hot_capacity_bytes=0, warm_capacity_bytes=0)
    )
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    used = sum(s.size_diff for s in after.compare_to(before, "filename"))
    s = globals().pop("_s")
    ok = s.count("b") == n
    s.close()
    shutil.rmtree(path)
    return [
        f"{n:,} blocks (LMCache-shaped keys of {len(key.format(0))} bytes), filled in "
        f"{t_fill:.1f} s with put_many batches of {batch}",
        "",
        "| metric | value |",
        "|---|---|",
        f"| reopen time | {t_open:.2f} s ({t_open / n * 1e6:.1f} µs per block; no blob is read) |",
        f"| RAM per block after reopen (index + blob table, tracemalloc) | {used / n:.0f} bytes |",
        f"| all keys present after reopen | {ok} |",
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller volumes")
    ap.add_argument("--dir", default=None, help="scratch directory on the disk to measure")
    ap.add_argument("--index-blocks", type=int, default=100_000)
    ap.add_argument("--budget-mib", type=int, help="bytes per size (default 512; --quick 128)")
    ap.add_argument("--sizes", default=",".join(human(s).replace(" ", "") for s in SIZES))
    args = ap.parse_args()
    sizes = [parse_size(x) for x in args.sizes.split(",")]
    budget = (args.budget_mib or (128 if args.quick else 512)) * MiB
    # the server process runs with this (server/app.py); measure the store the same way
    tune_allocator()
    d = Path(tempfile.mkdtemp(prefix="kvbench-", dir=args.dir))
    try:
        print(f"# store benchmark ({os.cpu_count()} cores, scratch {d})\n")
        print("## Hot tier (memory backend, in-process, one thread)\n")
        print("\n".join(bench_hot(budget, sizes)), "\n")
        print("## Durable PUT and cold GET\n")
        print("\n".join(bench_durable(d, budget, sizes)), "\n")
        print("## Warm codec on bf16-shaped data\n")
        print("\n".join(bench_codec()), "\n")
        print("## Index memory and reopen\n")
        print("\n".join(bench_index(d, args.index_blocks)), "\n")
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
