"""LMCache-shaped load through each LMCache path into our server and into redis-server.

    .venv/bin/python -m bench.bench_lmcache [--quick] [--rounds 5] [--backend durable]
                                            [--paths mp-native,mp-resp,v1-redis,v1-resp,path-a]

Each path is driven the way LMCache drives it, side by side in one run, and compared
with the same LMCache path into a real redis-server (no persistence):

  mp-native  MP native plugin: our `EpistemicGraphL2Connector` -> our HTTP (native
             protocol: submit, poll the eventfd, drain). No Redis form exists; its
             reference is mp-resp into redis-server, LMCache's fastest path into Redis.
  mp-resp    MP RESP adapter: LMCache's C++ `LMCacheRedisClient` -> RESP.
  v1-redis   v1 `remote_url: redis://`: LMCache's redis-py `RedisConnector`
             (`batched_put`; loads are one `get` per chunk, gathered, as LMCache's
             RemoteBackend does), two keys per chunk.
  v1-resp    v1 `remote_url: resp://`: LMCache's `RESPConnector` (the C++ client).
  path-a     v1 storage plugin: our `EpistemicGraphExternalBackend`
             (`batched_submit_put_task`, `batched_get_blocking`) -> our HTTP. Its
             reference is v1-redis into redis-server (the other v1 path of that kind).

Workloads: batches of 16 x 4 MiB and 4 x 32 MiB chunks; each round stores a batch of new
chunks (distinct bytes, so nothing deduplicates) and loads it back. The v1 paths use
LMCache `MemoryObj`s from a `LocalCPUBackend` (allocation of loaded chunks included, as
in LMCache). 8 I/O workers per client (LMCache's RESP default). Servers bind free loopback
ports. Prints GB/s, ratios against each path's reference, and a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import select
import shutil
import statistics
import sys
import tempfile
import threading
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
HEADS, HEAD_SIZE, TOKENS = 8, 128, 256  # fp16: 4 MiB per layer-pair of 2 x 256 tokens


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


# -- drivers: one per LMCache path -----------------------------------------------------
class NativeDriver:
    """A native connector (ours or LMCache's C++ client): bytearrays in, bytearrays out."""

    def __init__(self, client: Any, count: int, size: int) -> None:
        self.client = client
        base = os.urandom(size)
        self.sources = [bytearray(base) for _ in range(count)]
        self.dests = [bytearray(size) for _ in range(count)]

    def fill(self, tag: str) -> None:
        for i, src in enumerate(self.sources):
            src[:16] = f"{tag}{i:06x}".encode()[-16:].rjust(16, b"0")

    def store(self, keys: list[str]) -> bool:
        ok, _, res = call(
            self.client, self.client.submit_batch_set(keys, [memoryview(s) for s in self.sources])
        )
        return ok and (res is None or all(res))

    def load(self, keys: list[str]) -> bool:
        ok, _, res = call(
            self.client, self.client.submit_batch_get(keys, [memoryview(d) for d in self.dests])
        )
        return ok and (res is None or all(res))

    def verify(self) -> bool:
        return self.dests == self.sources

    def exists(self, keys: list[str]) -> None:
        call(self.client, self.client.submit_batch_exists(keys))

    def close(self) -> None:
        self.client.close()


class V1Engine:
    """What an LMCache v1 engine has: metadata, a LocalCPUBackend, an event loop thread."""

    def __init__(self, config: Any, size: int) -> None:
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        from epistemic_kvcache.integrations.lmcache.checks import cpu_metadata

        layers = size // (2 * TOKENS * HEADS * HEAD_SIZE * 2)
        self.shape = (layers, 2, TOKENS, HEADS, HEAD_SIZE)
        config.chunk_size = TOKENS
        config.max_local_cpu_size = 1.0
        self.config = config
        self.metadata = cpu_metadata("bench/lmcache", self.shape)
        self.local_cpu = LocalCPUBackend(config, self.metadata, dst_device="cpu")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(300)

    def objects(self, count: int) -> list[Any]:
        import torch
        from lmcache.v1.memory_management import MemoryFormat

        layers, two, tokens, heads, head = self.shape
        shape = torch.Size([two, layers, tokens, heads * head])
        out = []
        for _ in range(count):
            obj = self.local_cpu.allocate(shape, torch.float16, MemoryFormat.KV_2LTD)
            if obj is None:
                raise RuntimeError("LocalCPUBackend is full")
            obj.tensor.copy_(torch.randn(shape).to(torch.float16))
            out.append(obj)
        return out

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()
        self.local_cpu.close()


class V1Driver:
    """LMCache v1 keys and MemoryObjs; subclasses store and load."""

    def __init__(self, engine: V1Engine, count: int) -> None:
        self.engine = engine
        self.objs = engine.objects(count)
        self.loaded: list[Any] = []
        self.salt = 0

    def cache_keys(self, keys: list[str]) -> list[Any]:
        import torch
        from lmcache.utils import CacheEngineKey

        return [
            CacheEngineKey("bench/lmcache", 1, 0, hash(k) & ((1 << 62) - 1), torch.float16)
            for k in keys
        ]

    def fill(self, tag: str) -> None:
        for i, obj in enumerate(self.objs):
            obj.byte_array.cast("B")[:16] = f"{tag}{i:06x}".encode()[-16:].rjust(16, b"0")

    def verify(self) -> bool:
        ok = len(self.loaded) == len(self.objs) and all(
            a is not None and bytes(a.byte_array) == bytes(b.byte_array)
            for a, b in zip(self.loaded, self.objs, strict=True)
        )
        return ok

    def release(self, sources: bool = False) -> None:
        for obj in self.loaded + (self.objs if sources else []):
            if obj is not None:
                obj.ref_count_down()
        self.loaded = []


class V1ConnectorDriver(V1Driver):
    """LMCache's remote connector (redis-py `RedisConnector` or `RESPConnector`)."""

    def __init__(self, engine: V1Engine, count: int, url: str) -> None:
        from lmcache.v1.storage_backend.connector import CreateConnector

        super().__init__(engine, count)
        self.conn = CreateConnector(url, engine.loop, engine.local_cpu, engine.config)

    def store(self, keys: list[str]) -> bool:
        for obj in self.objs:
            obj.ref_count_up()  # the connector's put releases one reference
        self.engine.run(self.conn.batched_put(self.cache_keys(keys), self.objs))
        return True

    def load(self, keys: list[str]) -> bool:
        self.release()
        ck = self.cache_keys(keys)
        if self.conn.support_batched_get():
            self.loaded = self.engine.run(self.conn.batched_get(ck))
        else:

            async def each() -> list[Any]:
                return list(await asyncio.gather(*(self.conn.get(k) for k in ck)))

            self.loaded = self.engine.run(each())
        return all(o is not None for o in self.loaded)

    def exists(self, keys: list[str]) -> None:
        self.engine.run(self.conn.batched_async_contains("bench", self.cache_keys(keys)))

    def close(self) -> None:
        from epistemic_kvcache.integrations.lmcache.checks import close_remote_connector

        self.release(sources=True)
        close_remote_connector(self.conn, self.engine.run)
        self.engine.close()


class PathADriver(V1Driver):
    """Our storage plugin, loaded by LMCache's `storage_plugin_launcher`."""

    def __init__(self, engine: V1Engine, count: int) -> None:
        from lmcache.v1.storage_backend import storage_plugin_launcher

        super().__init__(engine, count)
        backends: dict[str, Any] = {}
        storage_plugin_launcher(
            engine.config, engine.metadata, engine.loop, engine.local_cpu, "cpu", backends
        )
        self.backend = backends["epistemic_graph"]

    def store(self, keys: list[str]) -> bool:
        futures = self.backend.batched_submit_put_task(self.cache_keys(keys), self.objs) or []
        return all(all(f.result(300)) for f in futures)

    def load(self, keys: list[str]) -> bool:
        self.release()
        self.loaded = self.backend.batched_get_blocking(self.cache_keys(keys))
        return all(o is not None for o in self.loaded)

    def exists(self, keys: list[str]) -> None:
        self.backend.batched_contains(self.cache_keys(keys))

    def close(self) -> None:
        self.release(sources=True)
        self.backend.close()
        self.engine.close()


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
                if not driver.verify():
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


def v1_config(**extra: Any) -> Any:
    from lmcache.v1.config import LMCacheEngineConfig

    return LMCacheEngineConfig.from_defaults(remote_serde="naive", **extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds instead of 5")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backend", default="durable", choices=["durable", "memory"])
    parser.add_argument("--paths", default="mp-native,mp-resp,v1-redis,v1-resp,path-a")
    args = parser.parse_args()
    rounds = 2 if args.quick else args.rounds
    if shutil.which("redis-server") is None:
        sys.exit("redis-server is not installed (make sysdeps)")
    import logging

    logging.disable(logging.INFO)
    os.environ["LMCACHE_TRACK_USAGE"] = "false"
    from lmcache.lmcache_redis import LMCacheRedisClient

    wanted = args.paths.split(",")
    with tempfile.TemporaryDirectory(prefix="bench-lmcache-") as d:
        tmp = Path(d)
        with (
            our_server(tmp, args.backend) as (http_port, resp_port),
            redis_server(tmp, fsync_always=False) as redis_port,
        ):
            http = f"http://127.0.0.1:{http_port}"
            os.environ["EPISTEMIC_GRAPH_KVCACHE_TOKEN"] = TOKEN

            def native(client: Callable[[], Any]) -> Callable[[int, int], Any]:
                return lambda count, size: NativeDriver(client(), count, size)

            def connector(url: str, password: str) -> Callable[[int, int], Any]:
                def make(count: int, size: int) -> Any:
                    os.environ["LMCACHE_RESP_PASSWORD"] = password
                    extra = {"save_unfull_chunk": False,
                             "extra_config": {"save_chunk_meta": False, "resp_num_threads": WORKERS}}  # fmt: skip
                    config = v1_config(**(extra if url.startswith("resp") else {}))
                    return V1ConnectorDriver(V1Engine(config, size), count, url)

                return make

            def path_a(count: int, size: int) -> Any:
                p = "storage_plugin.epistemic_graph."
                config = v1_config(
                    storage_plugins=["epistemic_graph"],
                    extra_config={
                        p
                        + "module_path": "epistemic_kvcache.integrations.lmcache.external_backend",
                        p + "class_name": "EpistemicGraphExternalBackend",
                        p + "base_url": http,
                        p + "num_workers": WORKERS,
                    },
                )
                return PathADriver(V1Engine(config, size), count)

            # (path, ours, reference) -- each row's ratio is ours / reference.
            redis_py_ref = ("v1-redis: redis-py -> redis-server",
                            connector(f"redis://127.0.0.1:{redis_port}", ""))  # fmt: skip
            c_ref = ("mp-resp: LMCacheRedisClient -> redis-server",
                     native(lambda: LMCacheRedisClient("127.0.0.1", redis_port, WORKERS, "", "")))  # fmt: skip
            pairs = {
                "mp-native": (
                    ("mp-native: L2 connector -> our HTTP",
                     native(lambda: EpistemicGraphL2Connector(base_url=http, token=TOKEN,
                                                              num_workers=WORKERS))),
                    c_ref,
                ),
                "mp-resp": (
                    ("mp-resp: LMCacheRedisClient -> our RESP",
                     native(lambda: LMCacheRedisClient("127.0.0.1", resp_port, WORKERS, "", TOKEN))),
                    c_ref,
                ),
                "v1-redis": (
                    ("v1-redis: redis-py -> our RESP",
                     connector(f"redis://:{TOKEN}@127.0.0.1:{resp_port}", TOKEN)),
                    redis_py_ref,
                ),
                "v1-resp": (
                    ("v1-resp: RESPConnector -> our RESP",
                     connector(f"resp://127.0.0.1:{resp_port}", TOKEN)),
                    ("v1-resp: RESPConnector -> redis-server",
                     connector(f"resp://127.0.0.1:{redis_port}", "")),
                ),
                "path-a": (("path-a: storage plugin -> our HTTP", path_a), redis_py_ref),
            }  # fmt: skip
            print(f"backend={args.backend} rounds={rounds} workers={WORKERS} (median of rounds)")
            rows: list[str] = []
            for count, size in WORKLOADS:
                nbytes = count * size
                label = f"{count} x {size // MiB} MiB"
                done: dict[str, PathResult] = {}
                for key in wanted:
                    for name, make in pairs[key]:
                        if name not in done:
                            done[name] = run_path(
                                name, lambda m=make: m(count, size), count, rounds, size // MiB
                            )
                    (ours, _), (ref_name, _) = pairs[key]
                    res, ref = done[ours], done[ref_name]
                    store, load = res.gbps("store", nbytes), res.gbps("load", nbytes)
                    rstore, rload = ref.gbps("store", nbytes), ref.gbps("load", nbytes)
                    rs = store / rstore if rstore else 0.0
                    rl = load / rload if rload else 0.0
                    ex = statistics.median(res.exists_s) * 1e3 if res.exists_s else 0.0
                    print(
                        f"{label:>12} {ours:<40} store {store:6.2f} GB/s ({rs:4.2f}x of "
                        f"{rstore:5.2f})  load {load:6.2f} GB/s ({rl:4.2f}x of {rload:5.2f})  "
                        f"exists(64) p50 {ex:6.2f} ms  failures {res.failures}"
                    )
                    rows.append(
                        f"| {label} | {ours} | {ref_name} | {store:.2f} | {rstore:.2f} | "
                        f"{rs:.2f}x | {load:.2f} | {rload:.2f} | {rl:.2f}x | {ex:.2f} |"
                    )
                    sys.stdout.flush()
            print()
            print(
                "| batch | path (ours) | reference (redis-server) | store GB/s | ref | ratio "
                "| load GB/s | ref | ratio | exists(64) p50 ms |"
            )
            print("|---|---|---|---|---|---|---|---|---|---|")
            print("\n".join(rows))


if __name__ == "__main__":
    main()
