"""Cluster mode benchmarks: front-ends over a real Redis Cluster, side by side, one run.

    .venv/bin/python -m bench.bench_cluster [--quick] [--seconds S] [--clients 4] [--sizes 4KiB,256KiB,4MiB]

Starts on loopback (free ports): a Redis Cluster of 3 masters (Debian's redis-server,
no replicas, AOF everysec), a single-node server (memory backend), and cluster-mode
front-ends. Every measurement uses the same client library, redis-py with hiredis
(`RedisCluster` for direct access to the cluster, `Redis` for our RESP listener), packing
commands in Python as the front-ends do (hiredis's packer is slow for large values), with
`--clients` threads, unique keys and unique payloads:

1. GET of a block in the front-end's RAM vs GET from the single-node server (both RAM).
2. GET from the cluster through a front-end (one whose RAM tiers are 0 bytes, so every
   GET reads the cluster and verifies the digest) vs a direct GET of the same bytes from
   the cluster.
3. PUT through a front-end vs a direct SET to the cluster.
4. Aggregate GET throughput (from the cluster) with 1, 2 and 3 front-ends, the clients
   spread over them. On a 2-core machine that shares the cores with the cluster and the
   clients this cannot show scaling; it shows what one machine does.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import redis
from redis.cluster import ClusterNode, RedisCluster

from bench.bench_server import TOKEN, our_server
from epistemic_kvcache.store.cluster_conn import connection_class

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from redis_cluster import LocalCluster

KiB, MiB = 1024, 1024 * 1024


def parse_sizes(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        mult = MiB if part.endswith("mib") else KiB if part.endswith("kib") else 1
        out.append(int(part.rstrip("mkib")) * mult)
    return out


def human(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def run_threads(
    clients: int, seconds: float, work: Callable[[int, int], int]
) -> tuple[float, float]:
    """`work(client, i) -> bytes` in `clients` threads for `seconds`: (ops/s, MB/s)."""
    stop = time.perf_counter() + seconds
    ops = [0] * clients
    nbytes = [0] * clients

    def loop(c: int) -> None:
        i = 0
        while time.perf_counter() < stop:
            nbytes[c] += work(c, i)
            ops[c] += 1
            i += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    return sum(ops) / dt, sum(nbytes) / dt / 1e6


@contextmanager
def front_end(
    tmp: Path, cluster: LocalCluster, name: str, *options: str
) -> Iterator[tuple[int, int]]:
    with our_server(
        tmp / name,
        "memory",
        options=(
            "--cluster-url",
            cluster.url,
            "--max-block-bytes",
            "64MiB",
            "--cluster-scrub-interval-s",
            "0",
            "--stats-log-interval-s",
            "0",
            *options,
        ),
    ) as ports:
        yield ports


def resp_client(port: int) -> redis.Redis:
    pool = redis.ConnectionPool(
        connection_class=connection_class(False, None),
        host="127.0.0.1",
        port=port,
        password=TOKEN,
        socket_timeout=60,
    )
    return redis.Redis(connection_pool=pool)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--sizes", default="4KiB,256KiB,4MiB")
    ap.add_argument("--seconds", type=float, help="per measurement (default 5, --quick 2)")
    args = ap.parse_args(argv)
    seconds = args.seconds or (2.0 if args.quick else 5.0)
    sizes = parse_sizes(args.sizes)
    clients = args.clients
    with tempfile.TemporaryDirectory() as d, ExitStack() as stack:
        tmp = Path(d)
        cluster = stack.enter_context(LocalCluster(tmp / "cluster", masters=3, replicas=0))
        rc = RedisCluster(  # packing commands as the front-ends do (see docs/cluster.md)
            url=f"redis://127.0.0.1:{cluster.nodes[0].port}",
            startup_nodes=[ClusterNode("127.0.0.1", n.port) for n in cluster.nodes],
            password=cluster.password,
            socket_timeout=60,
            connection_class=connection_class(False, None),
        )
        stack.callback(rc.close)
        big = ("--hot-capacity-bytes", "4GiB", "--warm-capacity-bytes", "0")
        nocache = ("--hot-capacity-bytes", "0", "--warm-capacity-bytes", "0")
        fe_ram = stack.enter_context(front_end(tmp, cluster, "fe-ram", *big))
        fe_cold = [
            stack.enter_context(front_end(tmp, cluster, f"fe-cold-{i}", *nocache)) for i in range(3)
        ]
        single = stack.enter_context(
            our_server(
                tmp / "single",
                "memory",
                options=(*big, "--max-block-bytes", "64MiB", "--stats-log-interval-s", "0"),
            )
        )
        conns = {
            "ram": [resp_client(fe_ram[1]) for _ in range(clients)],
            "cold": [[resp_client(p[1]) for _ in range(clients)] for p in fe_cold],
            "single": [resp_client(single[1]) for _ in range(clients)],
        }
        print(
            f"# cluster mode, {clients} client threads (redis-py {redis.__version__} + hiredis), "
            f"{seconds:g} s per measurement, cores: {os.cpu_count()}\n"
        )
        print("| size | measurement | ours ops/s | ours MB/s | reference ops/s | ratio |")
        print("|---|---|---|---|---|---|")
        for size in sizes:
            n = max(8, min(2000, (256 * MiB) // size))
            payloads = [os.urandom(size) for _ in range(n)]
            tag = f"s{size}"

            # 3. PUT through a front-end vs direct SET: unique keys and bytes
            fresh = [os.urandom(size) for _ in range(n)]

            def put_fe_unique(c: int, i: int, tag: str = tag, p: list[bytes] = fresh) -> int:
                data = p[(c * 7919 + i) % len(p)]
                data = data[:-8] + (c * 1_000_003 + i).to_bytes(8, "big")
                conns["cold"][0][c].set(f"{tag}-fe-{c}-{i}", data)
                return size

            def set_direct_unique(c: int, i: int, tag: str = tag, p: list[bytes] = fresh) -> int:
                data = p[(c * 7919 + i) % len(p)]
                data = data[:-8] + (c * 1_000_003 + i).to_bytes(8, "big")
                rc.set(f"{tag}-direct-{c}-{i}", data)
                return size

            put_ours = run_threads(clients, seconds, put_fe_unique)
            put_ref = run_threads(clients, seconds, set_direct_unique)
            row(size, "PUT via front-end vs direct SET", put_ours, put_ref)

            # the same bytes stored both ways for the GETs
            keys = [f"{tag}-g-{i}" for i in range(n)]
            with resp_client(fe_ram[1]) as w:
                for k, v in zip(keys, payloads, strict=True):
                    w.set(k, v)  # through the RAM front-end: cached there
                    rc.set(k + "-direct", v)
            with resp_client(single[1]) as w:
                for k, v in zip(keys, payloads, strict=True):
                    w.set(k, v)

            def get_ram(c: int, i: int, k: list[str] = keys) -> int:
                return len(conns["ram"][c].get(k[(c * 7919 + i) % len(k)]) or b"")

            def get_single(c: int, i: int, k: list[str] = keys) -> int:
                return len(conns["single"][c].get(k[(c * 7919 + i) % len(k)]) or b"")

            def get_cold(c: int, i: int, k: list[str] = keys) -> int:
                return len(conns["cold"][0][c].get(k[(c * 7919 + i) % len(k)]) or b"")

            def get_direct(c: int, i: int, k: list[str] = keys) -> int:
                return len(rc.get(k[(c * 7919 + i) % len(k)] + "-direct") or b"")

            for probe in (get_ram, get_cold, get_single, get_direct):
                assert probe(0, 0) == size, probe.__name__
            row(
                size,
                "GET in front-end RAM vs single-node server",
                run_threads(clients, seconds, get_ram),
                run_threads(clients, seconds, get_single),
            )
            row(
                size,
                "GET from cluster via front-end vs direct GET",
                run_threads(clients, seconds, get_cold),
                run_threads(clients, seconds, get_direct),
            )
            # 4. aggregate with 1, 2, 3 front-ends (GET from the cluster)
            for k in (1, 2, 3):

                def get_spread(c: int, i: int, k: int = k, ks: list[str] = keys) -> int:
                    conn = conns["cold"][c % k][c]
                    return len(conn.get(ks[(c * 7919 + i) % len(ks)]) or b"")

                ours = run_threads(clients, seconds, get_spread)
                print(
                    f"| {human(size)} | aggregate GET, {k} front-end(s) | {ours[0]:,.0f} | "
                    f"{ours[1]:,.0f} | | |"
                )
            for node in cluster.nodes:
                with cluster.client(node) as r:
                    r.flushall()


def row(size: int, what: str, ours: tuple[float, float], ref: tuple[float, float]) -> None:
    ratio = ours[0] / ref[0] if ref[0] else 0.0
    print(
        f"| {human(size)} | {what} | {ours[0]:,.0f} | {ours[1]:,.0f} | {ref[0]:,.0f} | "
        f"{ratio:.2f}x |",
        flush=True,
    )


if __name__ == "__main__":
    main()
