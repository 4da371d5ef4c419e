"""Aggregate GET/SET throughput with 1, 2, 4, 8 event loops, beside redis-server (issue 26).

    .venv/bin/python -m bench.bench_loops [--sizes 256KiB,4MiB] [--loops 1,2] \
        [--procs 2] [--conns 8] [--budget-mib 256] [--repeat 1]

Each configuration is a fresh server: ours on the memory backend with `--event-loops
L` for every L of `--loops`, then `redis-server` (no persistence) and `redis-server
--io-threads 4 --io-threads-do-reads yes`, all on loopback. The load comes from
`--procs` generator processes (bench/loadgen.py: unique payloads, one request in
flight per connection, `--conns` connections each), which start each pass together
at a barrier: first a SET pass of `--budget-mib` MiB of fresh keys per process, then a
GET pass reading them back. The parent times each pass between barriers and reads the
server process's CPU time (utime + stime from /proc, the generators excluded) before
and after it.

Reported per configuration and pass: aggregate GB/s, server CPU seconds per GB moved,
cores the server used (CPU seconds / wall seconds), and GB/s per server core
(= 1 / CPU per GB): on a machine whose cores are shared with the load generators (and
here with other work) the absolute GB/s says little, the CPU per GB and the ratios say
how the server scales. Ratios are to our 1-loop server and to plain redis-server.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import loadgen
from bench.bench_cpu import cpu_seconds, parse_size, pid_listening
from bench.bench_server import TOKEN, human, our_server, redis_server, workload

MiB = 1024 * 1024


@contextmanager
def redis(tmp: Path, io_threads: int) -> Iterator[int]:
    """redis-server without persistence on a free loopback port (`io_threads` > 1: its
    I/O threads, reads included)."""
    extra = ["--io-threads", str(io_threads), "--io-threads-do-reads", "yes"]
    with redis_server(tmp, fsync_always=False, extra=extra if io_threads > 1 else ()) as port:
        yield port


def _generator(
    index: int, port: int, token: str | None, size: int, budget: int, conns: int, barrier: Any
) -> None:
    """One load-generator process: SET pass, then GET pass, each started at the barrier."""
    keys, payloads = workload(size, budget, conns)
    keys = [b"p%d:" % index + k for k in keys]
    barrier.wait()
    loadgen.run(loadgen.run_resp("127.0.0.1", port, token, "set", keys, payloads, conns))
    barrier.wait()
    loadgen.run(loadgen.run_resp("127.0.0.1", port, token, "get", keys, payloads, conns))
    barrier.wait()


@dataclass
class Pass:
    gbps: float
    cpu_per_gb: float
    cores: float


def measure(port: int, token: str | None, size: int, args: argparse.Namespace) -> dict[str, Pass]:
    """One SET and one GET pass from `args.procs` processes against the server on `port`."""
    pid = pid_listening(port)
    budget = args.budget_mib * MiB
    n = len(workload(size, budget, args.conns)[0])
    moved = n * size * args.procs / 1e9
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(args.procs + 1)
    procs = [
        ctx.Process(target=_generator, args=(i, port, token, size, budget, args.conns, barrier))
        for i in range(args.procs)
    ]
    for p in procs:
        p.start()
    out: dict[str, Pass] = {}
    try:
        barrier.wait(timeout=300)
        for op in ("set", "get"):
            cpu0, t0 = cpu_seconds(pid), time.monotonic()
            barrier.wait(timeout=600)
            wall, cpu = time.monotonic() - t0, cpu_seconds(pid) - cpu0
            out[op] = Pass(moved / wall, cpu / moved, cpu / wall)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError("a load generator failed")
    return out


def _median(runs: list[Pass]) -> Pass:
    return Pass(
        statistics.median(p.gbps for p in runs),
        statistics.median(p.cpu_per_gb for p in runs),
        statistics.median(p.cores for p in runs),
    )


def configurations(args: argparse.Namespace, tmp: Path) -> Iterator[tuple[str, int, str | None]]:
    """(name, RESP port, token) of each server in turn, started and stopped around use."""
    for loops in args.loops:
        options = ("--hot-capacity-bytes", "12GiB", "--warm-capacity-bytes", "0",
                   "--max-block-bytes", "64MiB", "--event-loops", str(loops),
                   "--stats-log-interval-s", "0")  # fmt: skip
        with our_server(tmp, "memory", options=options) as (_, rport):
            yield f"ours, {loops} loop{'s' if loops > 1 else ''}", rport, TOKEN
    if not args.no_redis:
        with redis(tmp, 1) as port:
            yield "redis-server", port, None
        with redis(tmp, args.redis_io_threads) as port:
            yield f"redis-server --io-threads {args.redis_io_threads}", port, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="256KiB,4MiB")
    ap.add_argument("--loops", default="1,2")
    ap.add_argument("--procs", type=int, default=2, help="load generator processes")
    ap.add_argument("--conns", type=int, default=8, help="connections per process")
    ap.add_argument("--budget-mib", type=int, default=256, help="MiB each process writes")
    ap.add_argument("--repeat", type=int, default=1, help="runs per configuration (medians)")
    ap.add_argument("--redis-io-threads", type=int, default=4)
    ap.add_argument("--no-redis", action="store_true")
    args = ap.parse_args()
    args.loops = [int(x) for x in args.loops.split(",")]
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    load = os.getloadavg()
    print(f"# {os.cpu_count()} cores, load average {load[0]:.2f} at start; "
          f"{args.procs} generator processes x {args.conns} connections, "
          f"{args.budget_mib} MiB per process per pass, medians of {args.repeat}\n")  # fmt: skip
    print(
        "| block | server | SET GB/s | SET CPU s/GB | SET cores | GET GB/s | GET CPU s/GB "
        "| GET cores | GET GB/s per core | GET vs 1 loop | GET vs redis | SET vs 1 loop |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="bench-loops-") as d:
        tmp = Path(d)
        for size in sizes:
            rows: dict[str, dict[str, list[Pass]]] = {}
            for _ in range(args.repeat):
                for name, port, token in configurations(args, tmp):
                    got = measure(port, token, size, args)
                    for op, p in got.items():
                        rows.setdefault(name, {}).setdefault(op, []).append(p)
            med = {
                name: {op: _median(runs) for op, runs in ops.items()} for name, ops in rows.items()
            }
            base = next(iter(med.values()))
            plain = med.get("redis-server")
            for name, m in med.items():
                s, g = m["set"], m["get"]
                vs_redis = f"{g.gbps / plain['get'].gbps:.2f}x" if plain else "-"
                print(f"| {human(size)} | {name} | {s.gbps:.3f} | {s.cpu_per_gb:.3f} | "
                      f"{s.cores:.2f} | {g.gbps:.3f} | {g.cpu_per_gb:.3f} | {g.cores:.2f} | "
                      f"{1 / g.cpu_per_gb if g.cpu_per_gb else math.inf:.2f} | {g.gbps / base['get'].gbps:.2f}x | {vs_redis} | "
                      f"{s.gbps / base['set'].gbps:.2f}x |", flush=True)  # fmt: skip
    load = os.getloadavg()
    print(f"\n# load average {load[0]:.2f} at the end")


if __name__ == "__main__":
    main()
