"""LMCache-shaped load through each LMCache path into our server, redis-server and Mooncake.

    .venv/bin/python -m bench.bench_lmcache [--quick] [--rounds 5] [--backend durable]
        [--paths mp-native,mp-resp,v1-redis,v1-resp,path-a,mooncake] [--json OUT.json]

Each path is driven the way LMCache drives it (the drivers are
`epistemic_kvcache.integrations.lmcache.does_it_pay_paths`, shared with `epistemic-kvcache
does-it-pay`), side by side in one run, and compared with the same LMCache path into a
real redis-server (no persistence):

  mp-native  MP native plugin: our `EpistemicGraphL2Connector` -> our HTTP. No Redis form
             exists; its reference is mp-resp into redis-server.
  mp-resp    MP RESP adapter: LMCache's C++ `LMCacheRedisClient` -> RESP.
  v1-redis   v1 `remote_url: redis://`: LMCache's redis-py `RedisConnector`.
  v1-resp    v1 `remote_url: resp://`: LMCache's `RESPConnector` (the C++ client).
  path-a     v1 storage plugin: our `EpistemicGraphExternalBackend` -> our HTTP; its
             reference is v1-redis into redis-server.
  mooncake   the third store: Mooncake Store (`pip install '.[bench-mooncake]'` and
             `apt-get install libibverbs1 ibverbs-providers`) through LMCache's v1 `mooncakestore://`
             connector: a `mooncake_master` (HTTP metadata server inside it) and one storage
             process holding the memory (`global_segment_size`), the engine mounting none,
             TCP transport bound to loopback (`MC_TCP_BIND_ADDRESS`). Compared with ours
             and redis-server through LMCache's v1 `resp://` connector. LMCache 0.5.6 passes
             `master_server_address`, Mooncake 0.3.13 reads `master_server_addr`: the
             setting is given as `mooncake_master_server_addr`. Its `transfer_timeout` is
             raised from LMCache's 1 s, after which a put is reported done while the copy
             goes on.

Workloads: batches of 16 x 4 MiB and 4 x 32 MiB chunks; each round stores a batch of new
chunks (distinct bytes, so nothing deduplicates) and loads it back (the first round is
verified byte for byte and not timed). 8 I/O workers per client. Servers bind free
loopback ports. Prints GB/s, ratios against each path's reference, a markdown table.

Then, with `mooncake` in the paths, what each of the three stores promises, checked
(bench/store_promises.py): does a stored chunk survive the store's processes being
SIGKILLed and restarted, are identical chunks under two keys held once, does a client
without credentials get in. `--json` writes every figure for scripts/gen_does_it_pay.py.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import bench_server
from bench.bench_server import redis_server
from epistemic_kvcache.integrations.lmcache import does_it_pay_paths as dp
from epistemic_kvcache.integrations.lmcache.does_it_pay_paths import (
    WORKERS,
    NativeDriver,
    PathADriver,
    V1ConnectorDriver,
    path_a_config,
    resp_connector_config,
    v1_config,
)
from epistemic_kvcache.integrations.lmcache.l2_native_connector import EpistemicGraphL2Connector

MiB = 1024 * 1024
TOKEN = "bench-lmcache-token-0123456789abcdef"
WORKLOADS = [(16, 4 * MiB), (4, 32 * MiB)]
EXISTS_KEYS = 64
HEADS, HEAD_SIZE, TOKENS = 8, 128, 256  # fp16: 4 MiB per layer-pair of 2 x 256 tokens
MOONCAKE_TRANSFER_TIMEOUT_S = 120

__all__ = ["V1ConnectorDriver", "V1Engine", "v1_config"]  # bench/bench_lookup.py uses them


def V1Engine(config: Any, size: int, count: int = 16) -> dp.V1Engine:
    """An LMCache v1 engine whose chunks are `size` bytes (8 KV heads of 128, 256 tokens)."""
    layers = max(1, size // (2 * TOKENS * HEADS * HEAD_SIZE * 2))
    return dp.V1Engine(config, (layers, 2, TOKENS, HEADS, HEAD_SIZE), "bench/lmcache", count)


def our_server(tmp: Path, backend: str) -> AbstractContextManager[tuple[int, int]]:
    """Our server (bench_server's launcher) with a hot tier that holds the whole load."""
    return bench_server.our_server(
        tmp,
        backend,
        token=TOKEN,
        options=("--hot-capacity-bytes", "4GiB", "--max-block-bytes", "64MiB"),
    )


@dataclass
class PathResult:
    store_s: list[float] = field(default_factory=list)
    load_s: list[float] = field(default_factory=list)
    exists_s: list[float] = field(default_factory=list)
    failures: int = 0

    def gbps(self, which: str, nbytes: int) -> float:
        times = self.store_s if which == "store" else self.load_s
        return nbytes / statistics.median(times) / 1e9 if times else 0.0


def run_path(name: str, make: Callable[[], Any], count: int, rounds: int, salt: int) -> PathResult:
    """Store then load `rounds` batches of `count` fresh chunks through one driver."""
    driver = make()
    result = PathResult()
    tag = name.replace(" ", "")[:4]
    try:
        for r in range(rounds + 1):  # round 0 warms connections and page-faults buffers
            keys = [f"bench/{tag}@{salt:08x}@{r}@{i:04x}" for i in range(count)]
            driver.fill(f"{salt:04x}{r:06x}")  # distinct bytes: no dedup
            t0 = time.perf_counter()
            stored = driver.store(keys)
            t1 = time.perf_counter()
            loaded = driver.load(keys)
            t2 = time.perf_counter()
            if not (stored and loaded):
                result.failures += 1
                print(f"  {name}: round {r} failed (stored={stored}, loaded={loaded})")
                continue
            if r == 0:
                if not driver.verify(count):
                    raise AssertionError(f"{name}: loaded bytes differ from stored bytes")
                continue
            result.store_s.append(t1 - t0)
            result.load_s.append(t2 - t1)
        present = [f"bench/{tag}@{salt:08x}@1@{i:04x}" for i in range(count)]
        probe = (present * (EXISTS_KEYS // max(1, len(present)) + 1))[: EXISTS_KEYS // 2]
        probe += [f"bench/{tag}@absent@{i}" for i in range(EXISTS_KEYS - len(probe))]
        for i in range(25):
            t0 = time.perf_counter()
            driver.exists(probe)
            if i >= 5:
                result.exists_s.append(time.perf_counter() - t0)
    finally:
        driver.close()
    return result


def mooncake_missing() -> str | None:
    """Why Mooncake Store cannot run here (None: it can)."""
    try:
        if importlib.util.find_spec("mooncake") is None:
            return ("mooncake-transfer-engine-non-cuda is not installed (pip install "
                    "'.[bench-mooncake]', and Debian's libibverbs1 and ibverbs-providers)")  # fmt: skip
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as exc:
        return f"mooncake does not import: {exc}"
    return None


def mooncake_config(stack: Any) -> Any:
    """LMCache v1 settings for LMCache's `mooncakestore://` connector to `stack`."""
    return v1_config(
        save_unfull_chunk=False,
        extra_config={
            "save_chunk_meta": False,
            "mooncake_local_hostname": "127.0.0.1",
            "mooncake_metadata_server": stack.metadata_url,
            "mooncake_master_server_addr": f"127.0.0.1:{stack.rpc_port}",
            "mooncake_protocol": "tcp",
            "mooncake_global_segment_size": 0,  # the storage process holds the memory
            "mooncake_local_buffer_size": 512 * MiB,
            "transfer_timeout": MOONCAKE_TRANSFER_TIMEOUT_S,
        },
    )


@contextmanager
def mooncake_store(tmp: Path) -> Iterator[Any]:
    from bench.store_promises import MooncakeStack

    stack = MooncakeStack(tmp, segment_bytes=4096 * MiB)
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds instead of 5")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backend", default="durable", choices=["durable", "memory"])
    parser.add_argument("--paths", default="mp-native,mp-resp,v1-redis,v1-resp,path-a,mooncake")
    parser.add_argument("--json", default=None, help="write every figure here")
    args = parser.parse_args()
    rounds = 2 if args.quick else args.rounds
    if shutil.which("redis-server") is None:
        sys.exit("redis-server is not installed (make sysdeps)")
    dp.lmcache_quiet()
    from lmcache.lmcache_redis import LMCacheRedisClient

    wanted = args.paths.split(",")
    not_measured: list[str] = []
    if "mooncake" in wanted and (why := mooncake_missing()):
        wanted.remove("mooncake")
        not_measured.append(f"Mooncake Store: {why}")
        print(f"mooncake: not measured: {why}")
    load_start = os.getloadavg()
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    rows: list[str] = []
    records: list[dict[str, Any]] = []
    promises: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-lmcache-") as d, ExitStack() as stack:
        tmp = Path(d)
        http_port, resp_port = stack.enter_context(our_server(tmp, args.backend))
        redis_port = stack.enter_context(redis_server(tmp, fsync_always=False))
        moon = stack.enter_context(mooncake_store(tmp)) if "mooncake" in wanted else None
        http = f"http://127.0.0.1:{http_port}"
        os.environ["EPISTEMIC_GRAPH_KVCACHE_TOKEN"] = TOKEN

        def native(client: Callable[[], Any]) -> Callable[[int, int], Any]:
            return lambda count, size: NativeDriver(client(), count, size)

        def connector(url: str, password: str, config: Callable[[], Any] = v1_config) -> Callable[[int, int], Any]:  # fmt: skip
            def make(count: int, size: int) -> Any:
                os.environ["LMCACHE_RESP_PASSWORD"] = password
                config_ = resp_connector_config() if url.startswith("resp") else config()
                return V1ConnectorDriver(V1Engine(config_, size, count), count, url)

            return make

        def path_a(count: int, size: int) -> Any:
            return PathADriver(V1Engine(path_a_config(http, TOKEN), size, count), count)

        # (path, ours, reference) -- each row's ratio is ours / reference.
        redis_py_ref = ("v1-redis: redis-py -> redis-server",
                        connector(f"redis://127.0.0.1:{redis_port}", ""))  # fmt: skip
        c_ref = ("mp-resp: LMCacheRedisClient -> redis-server",
                 native(lambda: LMCacheRedisClient("127.0.0.1", redis_port, WORKERS, "", "")))  # fmt: skip
        resp_ours = ("v1-resp: RESPConnector -> our RESP", connector(f"resp://127.0.0.1:{resp_port}", TOKEN))  # fmt: skip
        pairs = {
            "mp-native": (
                ("mp-native: L2 connector -> our HTTP",
                 native(lambda: EpistemicGraphL2Connector(base_url=http, token=TOKEN, num_workers=WORKERS))),
                c_ref,
            ),
            "mp-resp": (
                ("mp-resp: LMCacheRedisClient -> our RESP",
                 native(lambda: LMCacheRedisClient("127.0.0.1", resp_port, WORKERS, "", TOKEN))),
                c_ref,
            ),
            "v1-redis": (
                ("v1-redis: redis-py -> our RESP", connector(f"redis://:{TOKEN}@127.0.0.1:{resp_port}", TOKEN)),
                redis_py_ref,
            ),
            "v1-resp": (
                resp_ours,
                ("v1-resp: RESPConnector -> redis-server", connector(f"resp://127.0.0.1:{redis_port}", "")),
            ),
            "path-a": (("path-a: storage plugin -> our HTTP", path_a), redis_py_ref),
        }  # fmt: skip
        if moon is not None:
            pairs["mooncake"] = (
                ("v1-mooncake: MooncakestoreConnector -> Mooncake Store",
                 connector(f"mooncakestore://127.0.0.1:{moon.rpc_port}", "", lambda: mooncake_config(moon))),
                resp_ours,
            )  # fmt: skip
        print(f"backend={args.backend} rounds={rounds} workers={WORKERS} (median of rounds); "
              f"load average {load_start[0]:.2f}")  # fmt: skip
        for count, size in WORKLOADS:
            nbytes = count * size
            label = f"{count} x {size // MiB} MiB"
            done: dict[str, PathResult] = {}
            for key in wanted:
                for name, make in pairs[key]:
                    if name not in done:
                        done[name] = run_path(name, lambda m=make: m(count, size), count, rounds, size // MiB)  # fmt: skip
                        res = done[name]
                        records.append({"batch": label, "name": name,
                                        "store_gbps": res.gbps("store", nbytes), "load_gbps": res.gbps("load", nbytes),
                                        "exists_ms": statistics.median(res.exists_s) * 1e3 if res.exists_s else 0.0,
                                        "failures": res.failures})  # fmt: skip
                (ours, _), (ref_name, _) = pairs[key]
                res, ref = done[ours], done[ref_name]
                store, load = res.gbps("store", nbytes), res.gbps("load", nbytes)
                rstore, rload = ref.gbps("store", nbytes), ref.gbps("load", nbytes)
                rs = store / rstore if rstore else 0.0
                rl = load / rload if rload else 0.0
                ex = statistics.median(res.exists_s) * 1e3 if res.exists_s else 0.0
                print(
                    f"{label:>12} {ours:<52} store {store:6.2f} GB/s ({rs:4.2f}x of "
                    f"{rstore:5.2f})  load {load:6.2f} GB/s ({rl:4.2f}x of {rload:5.2f})  "
                    f"exists(64) p50 {ex:6.2f} ms  failures {res.failures}"
                )
                rows.append(
                    f"| {label} | {ours} | {ref_name} | {store:.2f} | {rstore:.2f} | "
                    f"{rs:.2f}x | {load:.2f} | {rload:.2f} | {rl:.2f}x | {ex:.2f} |"
                )
                sys.stdout.flush()
    if "mooncake" in wanted:
        from bench.store_promises import PROMISES, check_all

        with tempfile.TemporaryDirectory(prefix="bench-promises-") as d:
            promises = check_all(Path(d))
        print("\n| store | " + " | ".join(PROMISES) + " |")
        print("|---|" + "---|" * len(PROMISES))
        for store, cells in promises.items():
            print(f"| {store} | " + " | ".join(cells.get(k, "not checked") for k in PROMISES) + " |")  # fmt: skip
    print()
    print(
        "| batch | path (ours) | reference | store GB/s | ref | ratio "
        "| load GB/s | ref | ratio | exists(64) p50 ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    load_end = os.getloadavg()
    print(f"\nload average {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end")
    if args.json:
        from bench.store_promises import PROMISES

        doc = {"command": "python -m bench.bench_lmcache " + " ".join(sys.argv[1:]),
               "started_utc": started, "cpus": os.cpu_count(), "backend": args.backend, "rounds": rounds,
               "load_average_start": list(load_start), "load_average_end": list(load_end),
               "rows": records, "not_measured": not_measured,
               "promise_names": list(PROMISES), "promises": promises}  # fmt: skip
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
