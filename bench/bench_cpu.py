"""Server CPU per request and per GB, ours vs redis-server, and how much of ours holds the GIL.

    .venv/bin/python -m bench.bench_cpu [--sizes 4KiB,256KiB] [--op set] [--repeat 3]
    .venv/bin/python -m bench.bench_cpu --gil [--conns 1,2,4]   # needs py-spy (dev extra)

Throughput ratios on a shared 2-core machine move with whatever else runs; the CPU time
the *server process* spends per request (utime + stime from /proc, the load generator
excluded) is steadier and says directly how much work each server does per request. The
same load generator as `bench_server` (bench/loadgen.py: unique payloads, one request in
flight per connection) drives a redis-server without persistence and our memory backend,
one after the other, `--repeat` times; medians are printed.

`--gil` instead runs only our server, at 1, 2 and 4 connections, and reports CPU seconds
per GB stored: in the kernel (stime: the socket copies, page faults), by thread (event
loop vs the others: the thread pool and BLAKE3's hashing threads), and an estimate of
the GIL's share: py-spy samples only the thread holding the GIL (`--gil`), so samples /
rate estimates the seconds it was held and the rest of the CPU ran without it (uvloop
makes its reads and epoll waits with the GIL released; BLAKE3 hashes blocks >= 1 MiB on
its own threads). The sampler is not exact (in a busy VM it has over-counted, hence the
cap at the CPU time), so read the GIL columns as a share, and the thread and kernel
columns (from /proc) as the firm numbers.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import loadgen
from bench.bench_server import TOKEN, human, our_server, redis_server, workload

KiB, MiB = 1024, 1024 * 1024
PYSPY_RATE = 250


def parse_size(text: str) -> int:
    t = text.strip().lower()
    for suffix, mult in (("kib", KiB), ("mib", MiB), ("k", KiB), ("m", MiB)):
        if t.endswith(suffix):
            return int(t[: -len(suffix)]) * mult
    return int(t)


def pid_listening(port: int) -> int:
    """The pid of the process listening on loopback `port` (from `ss`)."""
    out = subprocess.run(
        ["ss", "-Htlnp", f"sport = :{port}"], capture_output=True, text=True, check=True
    ).stdout
    for part in out.split("pid=")[1:]:
        return int(part.split(",")[0])
    raise RuntimeError(f"nobody listens on port {port}")


def cpu_seconds(pid: int) -> float:
    """utime + stime of the whole process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[str, tuple[float, float]]:
    """(utime, stime) per thread id."""
    out: dict[str, tuple[float, float]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            text = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = text.rsplit(")", 1)[1].split()
        tick = os.sysconf("SC_CLK_TCK")
        out[tid] = (int(fields[11]) / tick, int(fields[12]) / tick)
    return out


def per_request(args: argparse.Namespace, tmp: Path) -> None:
    print(f"# server CPU per {args.op.upper()}, {args.clients} connections, medians of "
          f"{args.repeat} runs\n")  # fmt: skip
    print("| block | redis-server us/op | ours us/op | ours / redis | redis GB/s | ours GB/s |")
    print("|---|---|---|---|---|---|")
    for size in args.sizes:
        got: dict[str, list[tuple[float, float]]] = {"redis": [], "ours": []}
        for _ in range(args.repeat):
            for who in ("redis", "ours"):
                cm = redis_server(tmp, fsync_always=False) if who == "redis" else None
                if cm is not None:
                    with cm as port:
                        got[who].append(_one(port, None, args, size))
                else:
                    with our_server(tmp, "memory") as (_, rport):
                        got[who].append(_one(rport, TOKEN, args, size))
        r_us = statistics.median(x[0] for x in got["redis"])
        o_us = statistics.median(x[0] for x in got["ours"])
        r_gb = statistics.median(x[1] for x in got["redis"])
        o_gb = statistics.median(x[1] for x in got["ours"])
        print(f"| {human(size)} | {r_us:.1f} | {o_us:.1f} | {o_us / r_us:.2f}x | "
              f"{r_gb:.3f} | {o_gb:.3f} |", flush=True)  # fmt: skip


def _one(port: int, token: str | None, args: argparse.Namespace, size: int) -> tuple[float, float]:
    pid = pid_listening(port)
    keys, payloads = workload(size, args.budget_mib * MiB, args.clients)
    if args.op == "get":
        loadgen.run(loadgen.run_resp("127.0.0.1", port, token, "set", keys, payloads, args.clients))
    before = cpu_seconds(pid)
    r = loadgen.run(
        loadgen.run_resp("127.0.0.1", port, token, args.op, keys, payloads, args.clients)
    )
    return (cpu_seconds(pid) - before) / r.ops * 1e6, r.gbps


def gil_split(args: argparse.Namespace, tmp: Path) -> None:
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy is None:
        raise SystemExit("--gil needs py-spy (pip install 'epistemic-kvcache[dev]')")
    print(f"# our server (memory backend), SET, {args.seconds:.0f} s per cell: CPU seconds "
          "per GB stored\n")  # fmt: skip
    print("| block | conns | GB/s | CPU-s/GB | in the kernel | holding the GIL (py-spy) | "
          "without the GIL | event-loop thread | other threads |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes:
        for conns in args.conns:
            with our_server(tmp, "memory") as (_, rport):
                pid = pid_listening(rport)
                raw = tmp / f"gil-{size}-{conns}.txt"
                t0 = thread_cpu(pid)
                started = time.time()
                sampler = subprocess.Popen(
                    [spy, "record", "--pid", str(pid), "--gil", "--nonblocking",
                     "-r", str(PYSPY_RATE), "-d", str(int(args.seconds)),
                     "--format", "raw", "-o", str(raw)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
                nbytes = 0
                while time.time() - started < args.seconds:
                    keys, payloads = workload(size, 64 * MiB, conns)
                    r = loadgen.run(
                        loadgen.run_resp("127.0.0.1", rport, TOKEN, "set", keys, payloads, conns)
                    )
                    nbytes += r.nbytes
                wall = time.time() - started
                t1 = thread_cpu(pid)
                sampler.wait()
            delta = {
                k: (u - t0.get(k, (0.0, 0.0))[0], st - t0.get(k, (0.0, 0.0))[1])
                for k, (u, st) in t1.items()
            }
            loop_cpu = sum(delta.get(str(pid), (0.0, 0.0)))
            other = sum(u + st for k, (u, st) in delta.items() if k != str(pid))
            kernel = sum(st for _, st in delta.values())
            total = loop_cpu + other
            samples = 0
            if raw.exists():
                for line in raw.read_text().splitlines():
                    if line.strip():
                        samples += int(line.rsplit(" ", 1)[1])
            held = min(samples / PYSPY_RATE, wall, total)
            gb = nbytes / 1e9
            print(f"| {human(size)} | {conns} | {gb / wall:.2f} | {total / gb:.2f} | "
                  f"{kernel / gb:.2f} ({100 * kernel / total:.0f}%) | "
                  f"{held / gb:.2f} | {(total - held) / gb:.2f} ({100 * (total - held) / total:.0f}%) "
                  f"| {loop_cpu / gb:.2f} | {other / gb:.2f} |", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4KiB,256KiB,4MiB,32MiB")
    ap.add_argument("--op", choices=("set", "get"), default="set")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--budget-mib", type=int, default=160, help="bytes per pass")
    ap.add_argument("--gil", action="store_true", help="CPU per GB and the GIL's share")
    ap.add_argument("--conns", default="1,2,4", help="with --gil")
    ap.add_argument("--seconds", type=float, default=6.0, help="with --gil, per cell")
    args = ap.parse_args()
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    args.conns = [int(c) for c in args.conns.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="kvbench-cpu-"))
    try:
        if args.gil:
            gil_split(args, tmp)
        else:
            per_request(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
