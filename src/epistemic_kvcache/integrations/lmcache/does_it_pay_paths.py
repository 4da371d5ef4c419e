"""The KV paths `does-it-pay` and bench/bench_lmcache.py drive, each the way LMCache does.

A driver holds `count` source chunks of `size` bytes (distinct bytes: a 16-byte tag
each, so nothing deduplicates) and `count` destinations, and offers `fill(tag)`,
`store(keys, at)` (the sources from index `at` on), `exists(keys)` (the lookup),
`load(keys)`, `verify(n)`, `host(n)` (the loaded chunks as CPU torch tensors, for the
copy to the device) and `close()`; `keys` may be fewer than `count` (the first chunks).

  mp-native  MP native plugin: our `EpistemicGraphL2Connector`, driven as LMCache's
             `NativeConnectorL2Adapter` drives it (submit, poll the eventfd, drain),
             into pinned buffers when CUDA is present -> our HTTP. Needs no lmcache.
  mp-resp    MP RESP adapter: LMCache's C++ `LMCacheRedisClient` -> RESP.
  path-a     v1 storage plugin: our `EpistemicGraphExternalBackend`, loaded by LMCache's
             `storage_plugin_launcher` (`batched_contains`, `batched_get_blocking`).
  v1-resp    v1 `remote_url: resp://`: LMCache's `RESPConnector` (the C++ client).
  v1-redis   v1 `remote_url: redis://`: LMCache's redis-py `RedisConnector` (loads are one
             `get` per chunk, gathered, as LMCache's RemoteBackend does).
  client     our Python client alone (`get_many_into` into pinned buffers, `exists_many`),
             no LMCache: what a deployment without LMCache's clients gets.

The v1 paths use LMCache `MemoryObj`s from a `LocalCPUBackend` (allocation of loaded
chunks included, as in LMCache). lmcache and torch are imported inside the functions.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from epistemic_kvcache.client.backend import EpistemicGraphKVBackend
from epistemic_kvcache.errors import ConfigurationError
from epistemic_kvcache.integrations.lmcache.l2_native_connector import EpistemicGraphL2Connector

WORKERS = 8
"""I/O workers per client (LMCache's RESP default)."""
PATHS = ("mp-native", "mp-resp", "path-a", "v1-resp", "v1-redis", "client")
NEEDS_LMCACHE = frozenset({"mp-resp", "path-a", "v1-resp", "v1-redis"})
NEEDS_RESP = frozenset({"mp-resp", "v1-resp", "v1-redis"})
LABELS = {
    "mp-native": "MP native plugin (our L2 connector, driven as LMCache's adapter drives it) "
    "-> our HTTP",
    "mp-resp": "MP RESP adapter (LMCache's C++ LMCacheRedisClient) -> our RESP",
    "path-a": "v1 Path A (our storage plugin, loaded by LMCache) -> our HTTP",
    "v1-resp": "v1 resp:// (LMCache's RESPConnector) -> our RESP",
    "v1-redis": "v1 redis:// (LMCache's redis-py RedisConnector) -> our RESP",
    "client": "our Python client alone (no LMCache) -> our HTTP",
}


def call(client: Any, fid: int, timeout_s: float = 300.0) -> tuple[bool, str, list[bool] | None]:
    """Wait for one completion of a native connector, the way LMCache's demux thread does."""
    poller = select.poll()
    poller.register(client.event_fd(), select.POLLIN)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        poller.poll(100)
        for cfid, ok, err, res in client.drain_completions():
            if int(cfid) == fid:
                return bool(ok), str(err), None if res is None else list(res)
    raise TimeoutError(f"future {fid} did not complete in {timeout_s} s")


def _tag(tag: str, i: int) -> bytes:
    return f"{tag}{i:06x}".encode()[-16:].rjust(16, b"0")


class _Buffers:
    """Distinct source chunks (bytearrays) and destinations (torch uint8 tensors, pinned
    when `pin`), shared by the drivers that load into caller-given buffers."""

    def __init__(self, count: int, size: int, pin: bool) -> None:
        import torch

        base = os.urandom(size)
        self.sources = [bytearray(base) for _ in range(count)]
        self.dests = [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for _ in range(count)]
        self.views = [d.numpy().data for d in self.dests]

    def fill(self, tag: str) -> None:
        for i, src in enumerate(self.sources):
            src[:16] = _tag(tag, i)

    def verify(self, n: int) -> bool:
        return all(self.views[i] == memoryview(self.sources[i]) for i in range(n))

    def host(self, n: int) -> list[Any]:
        return self.dests[:n]


class NativeDriver(_Buffers):
    """A native connector (ours or LMCache's C++ one): submit, poll, drain."""

    def __init__(self, client: Any, count: int, size: int, pin: bool = False) -> None:
        super().__init__(count, size, pin)
        self.client = client

    def store(self, keys: list[str], at: int = 0) -> bool:
        srcs = [memoryview(s) for s in self.sources[at : at + len(keys)]]
        ok, _, res = call(self.client, self.client.submit_batch_set(keys, srcs))
        return ok and (res is None or all(res))

    def load(self, keys: list[str]) -> bool:
        ok, _, res = call(self.client, self.client.submit_batch_get(keys, self.views[: len(keys)]))
        return ok and (res is None or all(res))

    def exists(self, keys: list[str]) -> list[bool] | None:
        return call(self.client, self.client.submit_batch_exists(keys))[2]

    def close(self) -> None:
        self.client.close()


class ClientDriver(_Buffers):
    """Our Python client alone: batch routes over pooled keep-alive connections."""

    def __init__(self, backend: EpistemicGraphKVBackend, count: int, size: int, pin: bool) -> None:
        super().__init__(count, size, pin)
        self.backend = backend

    def store(self, keys: list[str], at: int = 0) -> bool:
        outcomes = self.backend.put_many(zip(keys, self.sources[at:], strict=False))
        return len(outcomes) == len(keys) and all(outcomes)

    def load(self, keys: list[str]) -> bool:
        sizes = self.backend.get_many_into(keys, self.views[: len(keys)])
        return all(s is not None for s in sizes)

    def exists(self, keys: list[str]) -> list[bool]:
        return self.backend.exists_many(keys)

    def close(self) -> None:
        self.backend.close()


class V1Engine:
    """What an LMCache v1 engine has: metadata, a LocalCPUBackend, an event loop thread.
    `kv_shape` is (layers, 2, tokens per chunk, KV heads, head size), float16."""

    def __init__(
        self, config: Any, kv_shape: tuple[int, int, int, int, int], model: str, count: int
    ) -> None:
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        from epistemic_kvcache.integrations.lmcache.checks import cpu_metadata

        layers, two, tokens, heads, head = kv_shape
        self.shape = kv_shape
        self.model = model
        config.chunk_size = tokens
        chunk = layers * two * tokens * heads * head * 2
        # sources + loaded copies + LMCache's slack, in GB as LMCache counts it
        config.max_local_cpu_size = max(0.05, (2 * count + 2) * chunk / 1e9 * 1.1)
        self.config = config
        self.metadata = cpu_metadata(model, kv_shape)
        self.local_cpu = LocalCPUBackend(config, self.metadata, dst_device="cpu")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(600)

    def objects(self, count: int) -> list[Any]:
        import torch
        from lmcache.v1.memory_management import MemoryFormat

        layers, two, tokens, heads, head = self.shape
        shape = torch.Size([two, layers, tokens, heads * head])
        out = []
        for _ in range(count):
            obj = self.local_cpu.allocate(shape, torch.float16, MemoryFormat.KV_2LTD)
            if obj is None:
                raise RuntimeError("LMCache's LocalCPUBackend is full")
            obj.tensor.copy_(torch.randn(shape).to(torch.float16))
            out.append(obj)
        return out

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()
        self.local_cpu.close()


class V1Driver:
    """LMCache v1 keys and MemoryObjs; subclasses store, look up and load."""

    def __init__(self, engine: V1Engine, count: int) -> None:
        self.engine = engine
        self.objs = engine.objects(count)
        self.loaded: list[Any] = []

    def cache_keys(self, keys: list[str]) -> list[Any]:
        import torch
        from lmcache.utils import CacheEngineKey

        def chunk_hash(k: str) -> int:
            return int.from_bytes(hashlib.blake2b(k.encode(), digest_size=7).digest(), "big")

        return [CacheEngineKey(self.engine.model, 1, 0, chunk_hash(k), torch.float16) for k in keys]

    def fill(self, tag: str) -> None:
        for i, obj in enumerate(self.objs):
            obj.byte_array.cast("B")[:16] = _tag(tag, i)

    def verify(self, n: int) -> bool:
        return len(self.loaded) >= n and all(
            a is not None and bytes(a.byte_array) == bytes(b.byte_array)
            for a, b in zip(self.loaded[:n], self.objs[:n], strict=True)
        )

    def host(self, n: int) -> list[Any]:
        return [o.tensor for o in self.loaded[:n]]

    def release(self, sources: bool = False) -> None:
        for obj in self.loaded + (self.objs if sources else []):
            if obj is not None:
                obj.ref_count_down()
        self.loaded = []


class V1ConnectorDriver(V1Driver):
    """LMCache's remote connector for `url` (redis-py, RESP, Mooncake, ...)."""

    def __init__(self, engine: V1Engine, count: int, url: str) -> None:
        from lmcache.v1.storage_backend.connector import CreateConnector

        super().__init__(engine, count)
        self.conn = CreateConnector(url, engine.loop, engine.local_cpu, engine.config)

    def store(self, keys: list[str], at: int = 0) -> bool:
        objs = self.objs[at : at + len(keys)]
        for obj in objs:
            obj.ref_count_up()  # the connector's put releases one reference
        self.engine.run(self.conn.batched_put(self.cache_keys(keys), objs))
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

    def exists(self, keys: list[str]) -> int:
        return int(self.engine.run(self.conn.batched_async_contains("dip", self.cache_keys(keys))))

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

    def store(self, keys: list[str], at: int = 0) -> bool:
        objs = self.objs[at : at + len(keys)]
        futures = self.backend.batched_submit_put_task(self.cache_keys(keys), objs) or []
        return all(all(f.result(600)) for f in futures)

    def load(self, keys: list[str]) -> bool:
        self.release()
        self.loaded = self.backend.batched_get_blocking(self.cache_keys(keys))
        return all(o is not None for o in self.loaded)

    def exists(self, keys: list[str]) -> int:
        return int(self.backend.batched_contains(self.cache_keys(keys)))

    def close(self) -> None:
        self.release(sources=True)
        self.backend.close()
        self.engine.close()


def v1_config(**extra: Any) -> Any:
    from lmcache.v1.config import LMCacheEngineConfig

    return LMCacheEngineConfig.from_defaults(remote_serde="naive", **extra)


def resp_connector_config(workers: int = WORKERS) -> Any:
    """LMCache v1 settings for `resp://` as the shipped deploy/lmcache YAML has them."""
    return v1_config(
        save_unfull_chunk=False,
        extra_config={"save_chunk_meta": False, "resp_num_threads": workers},
    )


def path_a_config(url: str, token: str, workers: int = WORKERS, **params: Any) -> Any:
    """LMCache v1 settings loading our storage plugin; `params`: more plugin settings."""
    p = "storage_plugin.epistemic_graph."
    settings = {
        "module_path": "epistemic_kvcache.integrations.lmcache.external_backend",
        "class_name": "EpistemicGraphExternalBackend",
        "base_url": url,
        "token": token,
        "num_workers": workers,
        **params,
    }
    return v1_config(
        storage_plugins=["epistemic_graph"], extra_config={p + k: v for k, v in settings.items()}
    )


@dataclass(frozen=True, slots=True)
class Target:
    """Where the paths go: our HTTP base URL, our RESP listener (host, port), a token."""

    url: str
    resp: tuple[str, int] | None
    token: str
    workers: int = WORKERS
    timeout_s: float | None = None
    """Our clients' transfer and lookup timeouts (None: their defaults, as deployed)."""

    def ours(self) -> dict[str, Any]:
        """Our clients' settings: URL, token and the timeouts when given."""
        t = (
            {}
            if self.timeout_s is None
            else {"timeout_s": self.timeout_s, "lookup_timeout_s": self.timeout_s}
        )
        return {"base_url": self.url, "token": self.token, **t}

    def client(self) -> dict[str, Any]:
        """`EpistemicGraphKVBackend`'s settings: URL, token and the timeouts when given."""
        t = (
            {}
            if self.timeout_s is None
            else {"read_timeout_s": self.timeout_s, "lookup_timeout_s": self.timeout_s}
        )
        return {"base_url": self.url, "token": self.token, **t}


def unavailable(path: str, target: Target, lmcache_missing: str | None) -> str | None:
    """Why `path` cannot be driven here (None: it can)."""
    if path not in PATHS:
        raise ConfigurationError(f"invalid path {path!r}: expected some of {', '.join(PATHS)}")
    if path in NEEDS_LMCACHE and lmcache_missing:
        return lmcache_missing
    if path in NEEDS_RESP and target.resp is None:
        return "no RESP address given (--resp-addr)"
    return None


def make_driver(
    path: str,
    target: Target,
    *,
    count: int,
    size: int,
    kv_shape: tuple[int, int, int, int, int],
    model: str,
    pin: bool,
) -> Any:
    """A driver of `path` holding `count` chunks of `size` bytes (`kv_shape` for the v1
    paths: (layers, 2, tokens, KV heads, head size), float16, `size` bytes)."""
    if path == "mp-native":
        conn = EpistemicGraphL2Connector(num_workers=target.workers, **target.ours())
        return NativeDriver(conn, count, size, pin)
    if path == "client":
        return ClientDriver(EpistemicGraphKVBackend(**target.client()), count, size, pin)
    host, port = target.resp or ("", 0)
    if path == "mp-resp":
        from lmcache.lmcache_redis import LMCacheRedisClient

        return NativeDriver(
            LMCacheRedisClient(host, port, target.workers, "", target.token), count, size, pin
        )
    if path == "path-a":
        ours = target.ours()
        config = path_a_config(ours.pop("base_url"), ours.pop("token"), target.workers, **ours)
        return PathADriver(V1Engine(config, kv_shape, model, count), count)
    if path == "v1-resp":
        os.environ["LMCACHE_RESP_PASSWORD"] = target.token
        engine = V1Engine(resp_connector_config(target.workers), kv_shape, model, count)
        return V1ConnectorDriver(engine, count, f"resp://{host}:{port}")
    if path == "v1-redis":
        engine = V1Engine(v1_config(), kv_shape, model, count)
        return V1ConnectorDriver(engine, count, f"redis://:{target.token}@{host}:{port}")
    raise ConfigurationError(f"invalid path {path!r}")


def lmcache_quiet() -> Callable[[], None]:
    """Silence LMCache's INFO logs and usage tracking; returns the undo."""
    import logging

    os.environ["LMCACHE_TRACK_USAGE"] = "false"
    logging.disable(logging.INFO)
    return lambda: logging.disable(logging.NOTSET)
