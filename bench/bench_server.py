"""Wire benchmarks (issue 3): our server vs a real redis-server, same client, one run.

    .venv/bin/python -m bench.bench_server [--quick] [--clients 8]

Starts, on loopback ports picked at run time:
- redis-server with no persistence, and redis-server --appendonly yes --appendfsync always;
- epistemic-kvcache with the memory backend, and with the durable backend;
then drives each with the same load generator (bench/loadgen.py: unique payloads, 8
concurrent connections, one request in flight per connection), for 4 KiB, 256 KiB,
4 MiB and 32 MiB blocks, and prints GB/s, ops/s, p50/p99 and ratios. Also: HTTP vs RESP
on our server, and loopback single-stream TCP bandwidth (iperf3) as the physical limit.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from bench import loadgen
from bench.plots import plot_ratios
from epistemic_kvcache.server.process import ServerProcess

KiB, MiB = 1024, 1024 * 1024
SIZES = [4 * KiB, 256 * KiB, 4 * MiB, 32 * MiB]
TOKEN = "bench-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def human(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"port {port} never opened")


def spawn_redis(
    tmp: Path, args: Sequence[str], tries: int = 5
) -> tuple[subprocess.Popen[bytes], int]:
    """redis-server with `args` on a loopback port -> (its process, the port).

    The port is one the kernel had free a moment ago, so another process may take it
    first: redis-server then exits (address in use), or someone else answers on it. Only
    a server that reports this process's pid (`INFO server`) counts; otherwise another
    port is tried."""
    for _ in range(tries):
        port = free_port()
        d = tmp / f"redis-{port}"
        d.mkdir(exist_ok=True)
        cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d),
               "--protected-mode", "no", *args]  # fmt: skip
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if _redis_pid(p, port) == p.pid:
            return p, port
        p.kill()
        p.wait()
    raise RuntimeError(f"redis-server did not start on any of {tries} ports")


def _redis_pid(p: subprocess.Popen[bytes], port: int, timeout: float = 30.0) -> int | None:
    """The pid of the redis-server answering on `port`, once one does; None if `p` exits
    first or nothing answers within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and p.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), 1.0) as s:
                s.sendall(b"INFO server\r\n")
                got = b""
                while b"process_id:" not in got or not got.endswith(b"\r\n"):
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    got += chunk
            found = re.search(rb"process_id:(\d+)", got)
            return int(found.group(1)) if found else None
        except OSError:
            time.sleep(0.05)
    return None


@contextmanager
def redis_server(
    tmp: Path, *, fsync_always: bool, maxmemory_mib: int = 0, extra: Sequence[str] = ()
) -> Iterator[int]:
    """redis-server on a free loopback port; with `maxmemory_mib` a cache of that size
    (`allkeys-lru`), the way a fleet runs it; `extra` arguments last."""
    args = ["--save", "", "--maxmemory", f"{maxmemory_mib}mb" if maxmemory_mib else "0"]
    if maxmemory_mib:
        args += ["--maxmemory-policy", "allkeys-lru"]
    args += (
        ["--appendonly", "yes", "--appendfsync", "always"]
        if fsync_always
        else ["--appendonly", "no"]
    )
    args += extra
    p, port = spawn_redis(tmp, args)
    try:
        yield port
    finally:
        p.terminate()
        p.wait(10)


@contextmanager
def our_server(
    tmp: Path,
    backend: str,
    *,
    token: str = TOKEN,
    options: Sequence[str] = (
        "--hot-capacity-bytes",
        "6GiB",
        "--warm-capacity-bytes",
        "0",
        "--max-block-bytes",
        "64MiB",
    ),
) -> Iterator[tuple[int, int]]:
    """Our server on free loopback ports -> (http port, resp port) (the package's
    `ServerProcess`: its output drained by a thread for its whole life, so a chatty log
    can never fill the pipe and stall the server mid-benchmark)."""
    with ServerProcess(
        tmp / f"ours-{backend}",
        *("--log-level", "info", *options),
        backend=backend,
        token=token,
        keep_lines=2000,
    ) as srv:
        yield srv.http_port, srv.resp_port


def workload(size: int, budget: int, clients: int) -> tuple[list[bytes], list[bytes]]:
    n = max(clients * 4, min(16_000, budget // size))
    n -= n % clients
    base = os.urandom(size)
    tag = os.urandom(4).hex().encode()
    keys = [b"bench:" + tag + b":%d" % i for i in range(n)]
    payloads = [i.to_bytes(8, "little") + base[8:] for i in range(n)]
    return keys, payloads


def measure_resp(
    port: int, token: str | None, size: int, budget: int, clients: int
) -> tuple[loadgen.Result, loadgen.Result]:
    keys, payloads = workload(size, budget, clients)
    s = loadgen.run(loadgen.run_resp("127.0.0.1", port, token, "set", keys, payloads, clients))
    g = loadgen.run(loadgen.run_resp("127.0.0.1", port, token, "get", keys, payloads, clients))
    return s, g


def measure_resp_sets(
    port: int, token: str | None, size: int, budget: int, clients: int
) -> loadgen.Result:
    """One SET pass of fresh keys (no GET pass)."""
    keys, payloads = workload(size, budget, clients)
    return loadgen.run(loadgen.run_resp("127.0.0.1", port, token, "set", keys, payloads, clients))


def measure_http(
    port: int, size: int, budget: int, clients: int
) -> tuple[loadgen.Result, loadgen.Result]:
    keys, payloads = workload(size, budget, clients)
    s = loadgen.run(loadgen.run_http("127.0.0.1", port, TOKEN, "set", keys, payloads, clients))
    g = loadgen.run(loadgen.run_http("127.0.0.1", port, TOKEN, "get", keys, payloads, clients))
    return s, g


def loopback_bw() -> str:
    if shutil.which("iperf3") is None:
        return "iperf3 not installed"
    port = free_port()
    srv = subprocess.Popen(
        ["iperf3", "-s", "-1", "-p", str(port), "-B", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.5)  # no probe connection: "-1" serves exactly one client
        out = subprocess.run(
            ["iperf3", "-c", "127.0.0.1", "-p", str(port), "-t", "3", "-f", "g"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        m = re.findall(r"([\d.]+) Gbits/sec.*receiver", out)
        return f"{float(m[-1]) / 8:.2f} GB/s" if m else out
    finally:
        srv.kill()
        srv.wait()


def python_socket_bw(total: int = 2 << 30, chunk: int = 32 * MiB) -> str:
    """One loopback stream: sendall of 32 MiB buffers, recv_into a preallocated buffer."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    buf = bytearray(chunk)
    got = 0

    def receive() -> None:
        nonlocal got
        conn, _ = srv.accept()
        view = memoryview(buf)
        while got < total:
            n = conn.recv_into(view)
            if n == 0:
                break
            got += n
        conn.close()

    th = threading.Thread(target=receive)
    th.start()
    data = os.urandom(chunk)
    c = socket.create_connection(srv.getsockname())
    t = time.perf_counter()
    for _ in range(total // chunk):
        c.sendall(data)
    th.join()
    dt = time.perf_counter() - t
    c.close()
    srv.close()
    return f"{got / dt / 1e9:.2f} GB/s"


def fmt(r: loadgen.Result) -> str:
    return f"{r.gbps:.2f} | {r.ops_s:,.0f} | {r.pct(50):.2f} / {r.pct(99):.2f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument(
        "--plot",
        type=Path,
        default=Path(__file__).resolve().parent.parent / "docs" / "bench-ratios-vs-redis.png",
        help="write the ratios against redis-server as a PNG here",
    )
    ap.add_argument("--sizes", default="4KiB,256KiB,4MiB,32MiB", help="of these four")
    ap.add_argument("--budget-mib", type=int, help="bytes per pass (default 256; --quick 96)")
    args = ap.parse_args()
    by_name = {human(s).replace(" ", ""): s for s in SIZES}
    if not set(args.sizes.split(",")) <= set(by_name):
        ap.error(f"--sizes: a comma-separated subset of {','.join(by_name)}")
    sizes = [by_name[name] for name in args.sizes.split(",")]
    budget = (args.budget_mib or (96 if args.quick else 256)) * MiB
    tmp = Path(tempfile.mkdtemp(prefix="kvbench-srv-"))
    c = args.clients
    results: dict[tuple[str, int], tuple[loadgen.Result, loadgen.Result]] = {}
    try:
        print(f"# wire benchmark: {c} clients, one request in flight each, unique payloads\n")
        bw = loopback_bw()
        pybw = python_socket_bw()
        print(
            f"Loopback single-stream TCP, same run: iperf3 **{bw}**; "
            f"Python sendall/recv_into **{pybw}**\n"
        )
        for size in sizes:
            with redis_server(tmp, fsync_always=False) as port:
                results[("redis", size)] = measure_resp(port, None, size, budget, c)
            with our_server(tmp, "memory") as (hport, rport):
                results[("ours-mem", size)] = measure_resp(rport, TOKEN, size, budget, c)
                results[("ours-mem-http", size)] = measure_http(hport, size, budget, c)
            with redis_server(tmp, fsync_always=True) as port:
                results[("redis-aof", size)] = measure_resp(port, None, size, budget, c)
            with our_server(tmp, "durable") as (hport, rport):
                results[("ours-dur", size)] = measure_resp(rport, TOKEN, size, budget, c)
            shutil.rmtree(tmp / "ours-durable", ignore_errors=True)
            print(f"measured {human(size)}", file=sys.stderr)
        print("## RESP wire, memory backend vs redis-server (no persistence)\n")
        print(
            "| block | op | redis GB/s | ops/s | p50/p99 ms | ours GB/s | ops/s | p50/p99 ms | ratio |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for size in sizes:
            for i, op in enumerate(("SET", "GET")):
                r, o = results[("redis", size)][i], results[("ours-mem", size)][i]
                print(
                    f"| {human(size)} | {op} | {fmt(r)} | {fmt(o)} | **{o.gbps / r.gbps:.2f}x** |"
                )
        print(
            "\n## RESP SET, durable backend vs redis-server --appendonly yes --appendfsync always\n"
        )
        print(
            "| block | redis-aof GB/s | ops/s | p50/p99 ms | ours GB/s | ops/s | p50/p99 ms | ratio |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for size in sizes:
            r, o = results[("redis-aof", size)][0], results[("ours-dur", size)][0]
            print(f"| {human(size)} | {fmt(r)} | {fmt(o)} | **{o.gbps / r.gbps:.2f}x** |")
        ratio = {
            name: [results[(ours, s)][i].gbps / results[(peer, s)][i].gbps for s in sizes]
            for name, ours, peer, i in (
                ("SET, memory vs redis", "ours-mem", "redis", 0),
                ("GET, memory vs redis", "ours-mem", "redis", 1),
                ("SET, durable vs redis appendfsync always", "ours-dur", "redis-aof", 0),
            )
        }
        png = plot_ratios(
            ratio,
            [human(s) for s in sizes],
            args.plot,
            title=f"RESP wire, {c} clients: throughput ratio to redis-server in the same run",
        )
        print(f"\nPlot: `{png.name}`")
        print("\n## HTTP vs RESP on our server (memory backend)\n")
        print(
            "| block | op | RESP GB/s | HTTP GB/s | HTTP p50/p99 ms | HTTP/RESP | HTTP GET / loopback |"
        )
        print("|---|---|---|---|---|---|---|")
        lb = float(bw.split()[0]) if bw.endswith("GB/s") else 0.0
        for size in sizes:
            for i, op in enumerate(("PUT", "GET")):
                rr, hh = results[("ours-mem", size)][i], results[("ours-mem-http", size)][i]
                vs_lb = f"{hh.gbps / lb:.2f}" if lb and op == "GET" else ""
                print(
                    f"| {human(size)} | {op} | {rr.gbps:.2f} | {hh.gbps:.2f} | "
                    f"{hh.pct(50):.2f} / {hh.pct(99):.2f} | **{hh.gbps / rr.gbps:.2f}x** | {vs_lb} |"
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
