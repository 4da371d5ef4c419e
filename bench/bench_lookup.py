"""Lookups (EXISTS) on the Redis wire: our server (memory, durable) side by side with redis-server.

    .venv/bin/python -m bench.bench_lookup [--src TREE]... [--backends memory,durable]
        [--requests 10000] [--lookups 100] [--rounds 2] [--keys 64] [--loops 0,1] [--floor]

All servers run at once; `--rounds` rounds visit them in turn (so a burst of load from the
neighbours hits them alike) and each figure is the best round's. Per server and round:

  (a) `redis-benchmark -c 1` and `-c 8` `EXISTS k` (a present key): requests/s, p50, and
      the server's CPU per request from /proc/<pid>/stat (utime+stime of every thread,
      read before and after). On a loaded machine the rates swing with the neighbours;
      CPU per request barely does, so it is the robust figure.
  (b) a lookup of `--keys` present keys, timed `--lookups` times (after 10 warm-ups): p50,
      p99 and the server's CPU per key, through LMCache 0.5.6's own clients, which send
      one single-key `EXISTS` per key and nothing else on a lookup (checked with MONITOR):
        mp-resp   the C++ `LMCacheRedisClient` (`submit_batch_exists`, then the eventfd
                  and `drain_completions`, as LMCache's MP RESP adapter does; v1
                  `resp://` drives the same client through `RESPConnector`)
        v1-resp   `RESPConnector.batched_async_contains` on an LMCache event loop
        v1-redis  redis-py `RedisConnector.batched_async_contains` (one `EXISTS
                  <key>metadata` per key, sequentially, stopping at the first miss)
      and, for reference, our HTTP batch lookup (`EpistemicGraphKVBackend.exists_many`,
      one `POST` for all keys; no Redis form).
      The keys are written with redis-py `SET` (a lookup never reads the value).

`--floor` adds `bench_floor`'s server (uvloop, our compiled framer, a dict; no auth,
store or metrics): what any Python server on uvloop spends, so the gap between ours and
redis-server splits into what our code adds and what the platform costs.

`--src TREE` (repeatable) runs our server from another checkout (its `src/` first on
PYTHONPATH), e.g. the tree before a change, so before and after share one redis-server and
one load. Prints one markdown table; ratios are against redis-server (for rates ours /
redis, for latency and CPU ours / redis: lower is better).
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.bench_cpu import cpu_seconds, pid_listening
from epistemic_kvcache.server.process import ServerProcess

TOKEN = "bench-lookup-token-0123456789abcdef"
WORKERS = 8
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Server:
    label: str
    pid: int
    port: int
    password: str
    http: str = ""


@contextmanager
def our_server(
    tmp: Path, src: Path, backend: str, label: str, loops: str = "0"
) -> Iterator[Server]:
    """Our server from tree `src` on free loopback ports, `loops` event loops (0: the
    default, one per core); its output drained by a thread."""
    with ServerProcess(
        tmp / f"ours-{label}",
        *("--log-level", "info", "--hot-capacity-bytes", "256MiB"),
        backend=backend,
        token=TOKEN,
        event_loops=None if loops == "0" else int(loops),
        cwd=tmp,
        pythonpath=src / "src",
        start_timeout_s=90,
    ) as p:
        yield Server(label, p.pid, p.resp_port, TOKEN, p.url())


@contextmanager
def redis_server(tmp: Path) -> Iterator[Server]:
    from bench.bench_server import spawn_redis

    p, port = spawn_redis(tmp, ["--save", "", "--appendonly", "no"])
    try:
        yield Server("redis-server", p.pid, port, "")
    finally:
        p.terminate()
        p.wait(10)


@contextmanager
def floor_server() -> Iterator[Server]:
    """bench/bench_floor.py's floor server: the least a Python server on uvloop does per
    request (our compiled framer, a dict, no auth, store or metrics)."""
    from bench.bench_floor import floor_server as floor

    with floor() as port:
        yield Server("floor", pid_listening(port), port, "")


@dataclass
class Row:
    server: str
    bench_rps: dict[int, float] = field(default_factory=dict)
    bench_p50_ms: dict[int, float] = field(default_factory=dict)
    bench_cpu_us: dict[int, float] = field(default_factory=dict)
    lookup_ms: dict[str, list[float]] = field(default_factory=dict)
    lookup_cpu_us: dict[str, float] = field(default_factory=dict)

    def merge(self, other: Row) -> None:
        """Keep the better round: the higher rate, the lower p50, the lower CPU."""
        for c, rps in other.bench_rps.items():
            if rps > self.bench_rps.get(c, 0.0):
                self.bench_rps[c] = rps
                self.bench_p50_ms[c] = other.bench_p50_ms[c]
            self.bench_cpu_us[c] = min(self.bench_cpu_us.get(c, 1e9), other.bench_cpu_us[c])
        for p, times in other.lookup_ms.items():
            mine = self.lookup_ms.get(p)
            if mine is None or statistics.median(times) < statistics.median(mine):
                self.lookup_ms[p] = times
            cpu = other.lookup_cpu_us[p]
            self.lookup_cpu_us[p] = min(self.lookup_cpu_us.get(p, cpu), cpu)


def redis_benchmark(srv: Server, clients: int, requests: int, row: Row) -> None:
    cmd = ["redis-benchmark", "-p", str(srv.port), "-c", str(clients), "-n", str(requests),
           "--csv"]  # fmt: skip
    if srv.password:
        cmd += ["-a", srv.password]
    c0 = cpu_seconds(srv.pid)
    out = subprocess.run([*cmd, "EXISTS", "k"], capture_output=True, text=True, timeout=120)
    c1 = cpu_seconds(srv.pid)
    last = [ln for ln in out.stdout.splitlines() if ln.startswith('"EXISTS')]
    if not last:
        raise RuntimeError(f"redis-benchmark against {srv.label}: {out.stdout}{out.stderr}")
    cols = [c.strip('"') for c in last[-1].split(",")]
    row.bench_rps[clients] = float(cols[1])
    row.bench_p50_ms[clients] = float(cols[4])
    row.bench_cpu_us[clients] = (c1 - c0) * 1e6 / requests


def wait_one(client: Any, fid: int, timeout_s: float = 60.0) -> list[bool]:
    """One completion, the way LMCache's adapter waits: poll the eventfd, drain."""
    poller = select.poll()
    poller.register(client.event_fd(), select.POLLIN)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        poller.poll(100)
        for cfid, ok, err, res in client.drain_completions():
            if int(cfid) == fid:
                if not ok:
                    raise RuntimeError(f"lookup failed: {err}")
                return list(res)
    raise TimeoutError(f"future {fid} did not complete")


def timed(name: str, srv: Server, lookup: Callable[[], int], keys: int, n: int, row: Row) -> None:
    for _ in range(10):
        lookup()
    times: list[float] = []
    c0 = cpu_seconds(srv.pid)
    for _ in range(n):
        t0 = time.perf_counter()
        hits = lookup()
        times.append(time.perf_counter() - t0)
        if hits != keys:
            raise AssertionError(f"{name} against {srv.label}: {hits} of {keys} keys found")
    row.lookup_cpu_us[name] = (cpu_seconds(srv.pid) - c0) * 1e6 / (n * keys)
    row.lookup_ms[name] = times


def lmcache_lookups(srv: Server, nkeys: int, n: int, row: Row, paths: list[str]) -> None:
    import redis
    from lmcache.lmcache_redis import LMCacheRedisClient

    from bench.bench_lmcache import V1ConnectorDriver, V1Engine, v1_config

    r = redis.Redis(port=srv.port, password=srv.password or None)
    names = [f"bench/lookup/{i:04d}" for i in range(nkeys)]
    r.mset(dict.fromkeys(names, b"v"))
    r.set("k", b"v")
    if "mp-resp" in paths:
        client = LMCacheRedisClient("127.0.0.1", srv.port, WORKERS, "", srv.password)
        try:
            timed("mp-resp", srv,
                  lambda: sum(wait_one(client, client.submit_batch_exists(names))),
                  nkeys, n, row)  # fmt: skip
        finally:
            client.close()
    for path in ("v1-resp", "v1-redis"):
        if path not in paths:
            continue
        if path == "v1-resp":
            os.environ["LMCACHE_RESP_PASSWORD"] = srv.password
            url = f"resp://127.0.0.1:{srv.port}"
            extra = {"save_unfull_chunk": False,
                     "extra_config": {"save_chunk_meta": False, "resp_num_threads": WORKERS}}  # fmt: skip
            config = v1_config(**extra)
            suffix = ""
        else:
            auth = f":{srv.password}@" if srv.password else ""
            url = f"redis://{auth}127.0.0.1:{srv.port}"
            config = v1_config()
            suffix = "metadata"
        driver = V1ConnectorDriver(V1Engine(config, 1024 * 1024), 0, url)
        try:
            ck = driver.cache_keys(names)
            r.mset({k.to_string() + suffix: b"v" for k in ck})

            def contains(d: Any = driver, ck: Any = ck) -> int:
                return int(d.engine.run(d.conn.batched_async_contains("bench", ck)))

            timed(path, srv, contains, nkeys, n, row)
        finally:
            driver.close()
    if srv.http and "http" in paths:
        from epistemic_kvcache.client.backend import EpistemicGraphKVBackend

        http = EpistemicGraphKVBackend(base_url=srv.http, token=TOKEN)
        timed("http", srv, lambda: sum(http.exists_many(names)), nkeys, n, row)
    r.close()


def pct(times: list[float], q: float) -> float:
    s = sorted(times)
    return s[min(len(s) - 1, int(q * len(s)))] * 1e3


def table(rows: list[Row], paths: list[str]) -> str:
    ref = rows[-1]
    head = ["server"]
    for c in (1, 8):
        head += [f"EXISTS -c {c} req/s", "ratio", "p50 ms", "CPU us/req", "ratio"]
    for p in paths:
        head += [f"{p} p50 ms", "ratio", "p99 ms", "CPU us/key"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b else "-"

    for row in rows:
        cells = [row.server]
        for c in (1, 8):
            cells += [f"{row.bench_rps[c]:.0f}", ratio(row.bench_rps[c], ref.bench_rps[c]),
                      f"{row.bench_p50_ms[c]:.3f}", f"{row.bench_cpu_us[c]:.1f}",
                      ratio(row.bench_cpu_us[c], ref.bench_cpu_us[c])]  # fmt: skip
        for p in paths:
            if p not in row.lookup_ms:
                cells += ["-", "-", "-", "-"]
                continue
            p50 = statistics.median(row.lookup_ms[p]) * 1e3
            ref_p50 = statistics.median(ref.lookup_ms[p]) * 1e3 if p in ref.lookup_ms else 0.0
            cells += [f"{p50:.2f}", ratio(p50, ref_p50) if p != "http" else "-",
                      f"{pct(row.lookup_ms[p], 0.99):.2f}", f"{row.lookup_cpu_us[p]:.1f}"]  # fmt: skip
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", action="append", default=[], help="tree to run our server from")
    parser.add_argument("--backends", default="memory,durable")
    parser.add_argument("--requests", type=int, default=10000, help="redis-benchmark -n")
    parser.add_argument("--lookups", type=int, default=100, help="timed lookups per round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over all servers")
    parser.add_argument("--keys", type=int, default=64, help="keys per lookup")
    parser.add_argument("--paths", default="mp-resp,v1-resp,v1-redis,http")
    parser.add_argument(
        "--loops", default="0", help="our servers' --event-loops, e.g. 0,1 (0: the default)"
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="add bench_floor's server: what any Python server on uvloop spends per lookup",
    )
    args = parser.parse_args()
    for tool in ("redis-server", "redis-benchmark"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is not installed (make sysdeps)")
    logging.disable(logging.WARNING)
    os.environ["LMCACHE_TRACK_USAGE"] = "false"
    paths = args.paths.split(",")
    trees = [Path(s).resolve() for s in args.src] or [ROOT]
    rows: list[Row] = []
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-lookup-") as d:
        tmp = Path(d)
        plan: list[Callable[[], Any]] = []
        for i, tree in enumerate(trees):
            # the last commit that changed src/: the code the server runs
            rev = subprocess.run(["git", "-C", str(tree), "log", "-1", "--format=%h", "--", "src"],
                                 capture_output=True, text=True).stdout.strip() or tree.name  # fmt: skip
            for backend in args.backends.split(","):
                for loops in args.loops.split(","):
                    label = f"ours {backend} @{rev}" + (f" loops={loops}" if loops != "0" else "")
                    plan.append(lambda t=tree, b=backend, i=i, n=loops:
                                our_server(tmp, t, b, f"{b}-{i}-{n}", n))  # fmt: skip
                    rows.append(Row(label))
        if args.floor:
            plan.append(floor_server)
            rows.append(Row("floor (uvloop + framer + dict)"))
        plan.append(lambda: redis_server(tmp))
        rows.append(Row("redis-server"))
        with ExitStack() as stack:
            servers = [stack.enter_context(make()) for make in plan]
            for srv, row in zip(servers, rows, strict=True):
                srv.label = row.server
            # Rounds interleave the servers, so a burst of load from the neighbours hits
            # them alike; each figure is the best round's.
            for rnd in range(args.rounds):
                for srv, row in zip(servers, rows, strict=True):
                    this = Row(row.server)
                    lmcache_lookups(srv, args.keys, args.lookups, this, paths)
                    for c in (1, 8):
                        redis_benchmark(srv, c, args.requests, this)
                    row.merge(this)
                    print(f"round {rnd + 1}: {row.server} done "
                          f"({time.monotonic() - t_start:.0f} s)", flush=True)  # fmt: skip
    load = os.getloadavg()
    print(f"\nbest of {args.rounds} interleaved rounds; redis-benchmark -n {args.requests} "
          f"EXISTS k; {args.lookups} lookups of "
          f"{args.keys} present keys per client, {WORKERS} workers; load average "
          f"{load[0]:.1f} on {os.cpu_count()} CPUs\n")  # fmt: skip
    print(table(rows, paths))


if __name__ == "__main__":
    main()
