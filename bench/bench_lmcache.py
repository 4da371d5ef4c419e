"""LMCache-shaped load through each L2 path, side by side in one run (issue 4).

    .venv/bin/python -m bench.bench_lmcache [--quick] [--rounds 5] [--backend durable]

Paths (all driven through the same native-connector protocol LMCache's
`NativeConnectorL2Adapter` uses: submit a batch, poll the eventfd, drain completions):
  (a) our `EpistemicGraphL2Connector` -> our HTTP listener
  (b) LMCache's C++ `LMCacheRedisClient` -> our RESP listener
  (c) LMCache's C++ `LMCacheRedisClient` -> a real `redis-server` (no persistence)
Workloads: batches of 16 x 4 MiB and 4 x 32 MiB blocks; each round stores a batch of new
blocks (distinct bytes, so nothing deduplicates) and loads it back into preallocated
buffers (LMCache's L1 buffers are preallocated too). Also the latency of one exists
lookup for a batch of 64 keys. 8 I/O workers per client (LMCache's RESP default).
Servers bind free loopback ports. Prints GB/s, ratios against (c), and a markdown table.
Target (DESIGN/issue): (a) and (b) >= 1.0x (c) for load, >= 0.8x for store (durable).
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import bench_server
from bench.bench_server import redis_server
from epistemic_kvcache.integrations.lmcache.l2_native_connector import EpistemicGraphL2Connector

MiB = 1024 * 1024
TOKEN = "bench-lmcache-token-0123456789abcdef"
WORKERS = 8
WORKLOADS = [(16, 4 * MiB), (4, 32 * MiB)]
EXISTS_KEYS = 64


def our_server(tmp: Path, backend: str) -> AbstractContextManager[tuple[int, int]]:
    """Our server (bench_server's launcher) with a hot tier that holds the whole load."""
    return bench_server.our_server(
        tmp,
        backend,
        token=TOKEN,
        options=("--hot-capacity-bytes", "4GiB", "--max-block-bytes", "64MiB"),
    )


def call(client: Any, fid: int, timeout_s: float = 120.0) -> tuple[bool, str, list[bool] | None]:
    """Wait for one completion, the way LMCache's demux thread does."""
    poller = select.poll()
    poller.register(client.event_fd(), select.POLLIN)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        poller.poll(100)
        for cfid, ok, err, res in client.drain_completions():
            if int(cfid) == fid:
                return bool(ok), str(err), None if res is None else list(res)
    raise TimeoutError(f"future {fid} did not complete")


@dataclass
class PathResult:
    store_s: list[float] = field(default_factory=list)
    load_s: list[float] = field(default_factory=list)
    exists_s: list[float] = field(default_factory=list)
    failures: int = 0

    def gbps(self, which: str, nbytes: int) -> float:
        times = self.store_s if which == "store" else self.load_s
        return nbytes / statistics.median(times) / 1e9 if times else 0.0


def run_path(
    name: str,
    make: Callable[[], Any],
    count: int,
    size: int,
    rounds: int,
    *,
    salt: int,
) -> PathResult:
    """Store then load `rounds` batches of `count` x `size` fresh blocks."""
    client = make()
    result = PathResult()
    base = os.urandom(size)
    sources = [bytearray(base) for _ in range(count)]
    dests = [bytearray(size) for _ in range(count)]
    try:
        for r in range(rounds + 1):  # round 0 warms connections and page-faults buffers
            keys = [f"bench/{name}@{salt:08x}@{r}@{i:04x}" for i in range(count)]
            for i, src in enumerate(sources):
                src[:16] = f"{salt:04x}{r:06x}{i:06x}".encode()  # distinct bytes: no dedup
            t0 = time.perf_counter()
            ok, err, _ = call(
                client, client.submit_batch_set(keys, [memoryview(s) for s in sources])
            )
            t1 = time.perf_counter()
            ok2, err2, res = call(
                client, client.submit_batch_get(keys, [memoryview(d) for d in dests])
            )
            t2 = time.perf_counter()
            if not (ok and ok2) or (res is not None and not all(res)):
                result.failures += 1
                print(f"  {name}: round {r} failed: {err or err2}", file=sys.stderr)
                continue
            if r == 0:
                if dests != sources:
                    raise AssertionError(f"{name}: loaded bytes differ from stored bytes")
                continue
            result.store_s.append(t1 - t0)
            result.load_s.append(t2 - t1)
        # Exists latency, 64 keys (half present).
        present = [f"bench/{name}@{salt:08x}@1@{i:04x}" for i in range(count)]
        probe = (present * (EXISTS_KEYS // max(1, len(present)) + 1))[: EXISTS_KEYS // 2]
        probe += [f"bench/{name}@absent@{i}" for i in range(EXISTS_KEYS - len(probe))]
        for _ in range(5):
            call(client, client.submit_batch_exists(probe))
        for _ in range(50):
            t0 = time.perf_counter()
            call(client, client.submit_batch_exists(probe))
            result.exists_s.append(time.perf_counter() - t0)
    finally:
        client.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds instead of 5")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backend", default="durable", choices=["durable", "memory"])
    args = parser.parse_args()
    rounds = 2 if args.quick else args.rounds
    if shutil.which("redis-server") is None:
        sys.exit("redis-server is not installed (make sysdeps)")
    from lmcache.lmcache_redis import LMCacheRedisClient

    with tempfile.TemporaryDirectory(prefix="bench-lmcache-") as d:
        tmp = Path(d)
        with (
            our_server(tmp, args.backend) as (http_port, resp_port),
            redis_server(tmp, fsync_always=False) as redis_port,
        ):
            paths: dict[str, Callable[[], Any]] = {
                "a: L2 connector -> our HTTP": lambda: EpistemicGraphL2Connector(
                    base_url=f"http://127.0.0.1:{http_port}", token=TOKEN, num_workers=WORKERS
                ),
                "b: LMCacheRedisClient -> our RESP": lambda: LMCacheRedisClient(
                    "127.0.0.1", resp_port, WORKERS, "", TOKEN
                ),
                "c: LMCacheRedisClient -> redis-server": lambda: LMCacheRedisClient(
                    "127.0.0.1", redis_port, WORKERS, "", ""
                ),
            }
            print(f"backend={args.backend} rounds={rounds} workers={WORKERS} (median of rounds)")
            rows: list[str] = []
            for count, size in WORKLOADS:
                nbytes = count * size
                label = f"{count} x {size // MiB} MiB"
                results = {
                    name: run_path(name[0], make, count, size, rounds, salt=size // MiB)
                    for name, make in paths.items()
                }
                ref = results["c: LMCacheRedisClient -> redis-server"]
                for name, res in results.items():
                    store, load = res.gbps("store", nbytes), res.gbps("load", nbytes)
                    rs = store / ref.gbps("store", nbytes) if ref.store_s else 0.0
                    rl = load / ref.gbps("load", nbytes) if ref.load_s else 0.0
                    ex = statistics.median(res.exists_s) * 1e3 if res.exists_s else 0.0
                    ex99 = (
                        sorted(res.exists_s)[int(len(res.exists_s) * 0.99) - 1] * 1e3
                        if res.exists_s
                        else 0.0
                    )
                    print(
                        f"{label:>12} {name:<40} store {store:6.2f} GB/s ({rs:4.2f}x)  "
                        f"load {load:6.2f} GB/s ({rl:4.2f}x)  exists(64) p50 {ex:6.2f} ms "
                        f"p99 {ex99:6.2f} ms  failures {res.failures}"
                    )
                    rows.append(
                        f"| {label} | {name} | {store:.2f} | {rs:.2f}x | {load:.2f} | {rl:.2f}x "
                        f"| {ex:.2f} | {ex99:.2f} |"
                    )
            print()
            print(
                "| batch | path | store GB/s | vs (c) | load GB/s | vs (c) "
                "| exists(64) p50 ms | p99 ms |"
            )
            print("|---|---|---|---|---|---|---|---|")
            print("\n".join(rows))


if __name__ == "__main__":
    main()
