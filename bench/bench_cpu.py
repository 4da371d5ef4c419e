"""Server CPU per request and per GB, ours vs redis-server, and how much of ours holds the GIL.

    .venv/bin/python -m bench.bench_cpu [--sizes 4KiB,256KiB] [--op set] [--repeat 3]
    .venv/bin/python -m bench.bench_cpu --gil [--conns 1,2,4]   # needs py-spy (dev extra)
    .venv/bin/python -m bench.bench_cpu --perf-stat [--sizes 256KiB]  # needs perf, as root

Throughput ratios on a shared 2-core machine move with whatever else runs; the CPU time
the *server process* spends per request (utime + stime from /proc, the load generator
excluded) is steadier and says directly how much work each server does per request. The
same load generator as `bench_server` (bench/loadgen.py: unique payloads, one request in
flight per connection) drives a redis-server without persistence and our memory backend,
one after the other, `--repeat` times; medians are printed.

`--perf-stat` adds, per request, the server's `read` system calls and the page faults
taken in user mode (`perf stat` on the server process during the measured pass; the
faults the kernel takes inside `read`, copying into fresh memory, are not among them):
how many reads a request costs, and whether a payload is copied in user space.

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
import signal
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


def cpu_split(pid: int) -> tuple[float, float]:
    """(utime, stime) of the whole process, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_seconds(pid: int) -> float:
    """utime + stime of the whole process."""
    return sum(cpu_split(pid))


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


PERF_EVENTS = ("syscalls:sys_enter_read", "exceptions:page_fault_user")


def perf_stat(pid: int, out: Path) -> subprocess.Popen[bytes]:
    """`perf stat` of PERF_EVENTS on process `pid` until SIGINT, CSV into `out`."""
    cmd = ["perf", "stat", "-x", ",", "-e", ",".join(PERF_EVENTS), "-p", str(pid), "-o", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)  # attached before the pass starts
    return proc


def perf_counts(proc: subprocess.Popen[bytes], out: Path) -> list[float]:
    """Stop `perf stat` and return the PERF_EVENTS counts (NaN where not counted)."""
    proc.send_signal(signal.SIGINT)
    proc.wait()
    counts = dict.fromkeys(PERF_EVENTS, float("nan"))
    for line in out.read_text().splitlines():
        fields = line.split(",")
        if len(fields) > 2 and fields[2] in counts and fields[0].isdigit():
            counts[fields[2]] = float(fields[0])
    return [counts[e] for e in PERF_EVENTS]


def per_request(args: argparse.Namespace, tmp: Path) -> None:
    if args.perf_stat and shutil.which("perf") is None:
        raise SystemExit("--perf-stat needs perf (Debian: apt-get install linux-perf), as root")
    print(f"# server CPU per {args.op.upper()}, {args.clients} connections, medians of "
          f"{args.repeat} runs\n")  # fmt: skip
    extra = " redis reads/op | ours reads/op | redis user faults/op | ours user faults/op |"
    print("| block | redis-server us/op | ours us/op | ours / redis | redis GB/s | ours GB/s |"
          + (extra if args.perf_stat else ""))  # fmt: skip
    print("|---|---|---|---|---|---|" + ("---|" * 4 if args.perf_stat else ""))
    for size in args.sizes:
        got: dict[str, list[tuple[float, ...]]] = {"redis": [], "ours": []}
        for _ in range(args.repeat):
            for who in ("redis", "ours"):
                cm = redis_server(tmp, fsync_always=False) if who == "redis" else None
                if cm is not None:
                    with cm as port:
                        got[who].append(_one(port, None, args, size, tmp))
                else:
                    with our_server(tmp, "memory") as (_, rport):
                        got[who].append(_one(rport, TOKEN, args, size, tmp))
        r_us = statistics.median(x[0] for x in got["redis"])
        o_us = statistics.median(x[0] for x in got["ours"])
        r_gb = statistics.median(x[1] for x in got["redis"])
        o_gb = statistics.median(x[1] for x in got["ours"])
        # /proc counts CPU in clock ticks (10 ms): a short pass can read 0 (say so, not divide).
        ratio = f"{o_us / r_us:.2f}x" if r_us > 0 else "n/a (under one clock tick)"
        row = f"| {human(size)} | {r_us:.1f} | {o_us:.1f} | {ratio} | {r_gb:.3f} | {o_gb:.3f} |"
        if args.perf_stat:
            for i in (2, 3):  # reads, then user-mode page faults
                for who in ("redis", "ours"):
                    row += f" {statistics.median(x[i] for x in got[who]):.2f} |"
        print(row, flush=True)


def _one(
    port: int, token: str | None, args: argparse.Namespace, size: int, tmp: Path
) -> tuple[float, ...]:
    pid = pid_listening(port)
    keys, payloads = workload(size, args.budget_mib * MiB, args.clients)
    if args.op == "get":
        loadgen.run(loadgen.run_resp("127.0.0.1", port, token, "set", keys, payloads, args.clients))
    stat_out = tmp / "perf-stat.csv"
    stat = perf_stat(pid, stat_out) if args.perf_stat else None
    before = cpu_seconds(pid)
    r = loadgen.run(
        loadgen.run_resp("127.0.0.1", port, token, args.op, keys, payloads, args.clients)
    )
    used = cpu_seconds(pid) - before
    counts = perf_counts(stat, stat_out) if stat is not None else []
    stat_out.unlink(missing_ok=True)
    return (used / r.ops * 1e6, r.gbps, *(c / r.ops for c in counts))


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
    ap.add_argument("--perf-stat", action="store_true", help="reads and user page faults per op")
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
