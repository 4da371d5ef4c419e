"""Which cluster client for cluster mode: measured from a synchronous caller.

    .venv/bin/python -m bench.bench_cluster_clients [--seconds 1.5]

The store API is synchronous (the server calls it on a thread pool), so each candidate is
driven the way the store would drive it: redis-py's `RedisCluster` directly; redis-py's
asyncio `RedisCluster` and coredis's `RedisCluster` through an event loop thread
(`run_coroutine_threadsafe`), one call at a time, GET and SET of 4 KiB, 256 KiB and
4 MiB against a 3-master loopback cluster. coredis is optional (`pip install coredis`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import redis
import redis.asyncio.cluster as aredis_cluster
from redis.cluster import ClusterNode, RedisCluster

from epistemic_kvcache.store.cluster_conn import connection_class

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from redis_cluster import LocalCluster

SIZES = [4 << 10, 256 << 10, 4 << 20]


def rate(fn: Callable[[], object], seconds: float) -> float:
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return n / (time.perf_counter() - t0)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.5)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d, LocalCluster(Path(d), replicas=0) as c:
        ports = [n.port for n in c.nodes]
        sync = RedisCluster(
            startup_nodes=[ClusterNode("127.0.0.1", p) for p in ports], password=c.password
        )
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()

        def arun(coro: Coroutine[Any, Any, Any]) -> Any:
            return asyncio.run_coroutine_threadsafe(coro, loop).result()

        async def make_async() -> Any:
            return aredis_cluster.RedisCluster(
                startup_nodes=[aredis_cluster.ClusterNode("127.0.0.1", p) for p in ports],
                password=c.password,
            )

        async def awaited(x: Any) -> Any:
            return await x

        packed = RedisCluster(
            url=f"redis://127.0.0.1:{ports[0]}",
            startup_nodes=[ClusterNode("127.0.0.1", p) for p in ports],
            password=c.password,
            connection_class=connection_class(False, None),
        )
        clients: dict[str, tuple[Callable[[str], Any], Callable[[str, bytes], Any]]] = {
            "redis-py RedisCluster (sync), hiredis packer": (sync.get, sync.set),
            "redis-py RedisCluster (sync), Python packer (cluster mode)": (
                packed.get,
                packed.set,
            ),
        }
        a = arun(make_async())
        clients["redis-py asyncio RedisCluster, from a thread"] = (
            lambda k: arun(a.get(k)),
            lambda k, v: arun(a.set(k, v)),
        )
        try:
            import coredis

            async def make_coredis() -> Any:
                cl = coredis.RedisCluster("127.0.0.1", ports[0], password=c.password)
                await cl.__aenter__()
                return cl

            cd = arun(make_coredis())
            clients["coredis RedisCluster, from a thread"] = (
                lambda k: arun(awaited(cd.get(k))),
                lambda k, v: arun(awaited(cd.set(k, v))),
            )
        except ImportError:
            print("(coredis not installed: pip install coredis to include it)")
        print(f"redis-py {redis.__version__}; ops/s, one caller, {args.seconds} s each\n")
        print("| client | " + " | ".join(f"GET {s >> 10} KiB | SET {s >> 10} KiB" for s in SIZES))
        print("|---" * (1 + 2 * len(SIZES)) + "|")
        for name, (get, put) in clients.items():
            cells = []
            for size in SIZES:
                data = os.urandom(size)
                sync.set("k{a}", data)
                cells.append(f"{rate(lambda g=get: g('k{a}'), args.seconds):,.0f}")
                cells.append(f"{rate(lambda p=put, d=data: p('k{a}', d), args.seconds):,.0f}")
            print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
        loop.call_soon_threadsafe(loop.stop)


if __name__ == "__main__":
    main()
