"""How each LMCache path behaves when our server stalls, restarts, or lacks a key.

    .venv/bin/python -m bench.bench_failures [--paths a,redis,resp,mp-native,mp-resp]
                                             [--limit-s 45] [--deploy-dir deploy/lmcache]

One real server process (durable backend, on the ports the kernel picks at its first
start, so it can be restarted on the same ports with its data) and LMCache 0.5.6's
real objects for each path:

  a          Path A: our storage plugin, loaded by LMCache's `storage_plugin_launcher`
             from `path-a-storage-plugin.yaml` (lookup = `batched_contains`, load =
             `get_blocking`, as LMCache's storage manager calls them)
  redis      v1 `remote_url: redis://...`: LMCache's `RemoteBackend` + redis-py connector
  resp       v1 `remote_url: resp://...`: LMCache's `RemoteBackend` + C++ RESP client
  mp-native  MP mode: `NativeConnectorL2Adapter` over our native plugin, built by
             LMCache's factory from `mp-native-plugin.json` (lookup = lookup-and-lock
             task, load = load task)
  mp-resp    MP mode: LMCache's RESP L2 adapter (C++ client) from `mp-resp.json`

Scenarios, each on a fresh path object:
  stalled   store K; SIGSTOP the server; time a lookup of K (first, then second), a load
            of K, and close(); SIGCONT.
  restart   store K; SIGKILL the server; time a lookup and a load while it is down;
            restart it (same ports and data); time until a lookup of K hits again.
  missing   time a lookup and a load of a key that was never stored.

Every operation runs in a thread and is given up on after `--limit-s` (reported as
`> limit`; C++ client operations have no timeout and finish only when the server
resumes). Prints one markdown table. Run it against another checkout's code with
`PYTHONPATH=<checkout>/src ... --deploy-dir <checkout>/deploy/lmcache` (the "before"
numbers in docs/lmcache.md were taken that way).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from epistemic_kvcache.server.process import ServerProcess
from helpers import sigstop  # tests/helpers.py

TOKEN = "bench-failures-token-0123456789abcdef"
REPO = Path(__file__).resolve().parent.parent
MODEL = "bench/failures"
CHUNK_TOKENS = 16
KV_SHAPE = (2, 2, CHUNK_TOKENS, 2, 64)  # layers, k/v, tokens, heads, head size: 16 KiB/chunk


class Server:
    """Our server (durable backend, TOKEN), restartable on the same ports and data: the
    first start takes the ports the kernel picks, a restart asks for the same ones."""

    def __init__(self, data: Path) -> None:
        self.data = data
        self.http_port = self.resp_port = 0
        self.process: ServerProcess | None = None

    def start(self) -> None:
        self.process = ServerProcess(
            self.data,
            backend="durable",
            token=TOKEN,
            addr=f"127.0.0.1:{self.http_port}",
            resp=f"127.0.0.1:{self.resp_port}",
        )
        self.http_port, self.resp_port = self.process.http_port, self.process.resp_port

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def signal(self, sig: int) -> None:
        assert self.process is not None
        self.process.signal(sig)

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


@dataclass
class Outcome:
    seconds: float
    result: str

    def cell(self, limit_s: float) -> str:
        if self.result == "timeout":
            return f"> {limit_s:.0f} s (hung)"
        return f"{self.seconds:.2f} s {self.result}"


_pending: list[threading.Thread] = []


def drain_pending(limit_s: float) -> None:
    """Wait (at most `limit_s` in all) for operations given up on; LMCache's v1
    `RemoteBackend.close()` deadlocks its own event loop, so some never finish."""
    deadline = time.monotonic() + limit_s
    for t in _pending:
        t.join(max(0.0, deadline - time.monotonic()))
    _pending.clear()


def timed(fn: Callable[[], Any], limit_s: float, describe: Callable[[Any], str]) -> Outcome:
    """Run `fn` in a thread; give up waiting after `limit_s` (the thread keeps running)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except Exception as exc:
            box["error"] = f"{type(exc).__name__}: {exc}"[:80]

    t = threading.Thread(target=run, daemon=True)
    t0 = time.perf_counter()
    t.start()
    t.join(limit_s)
    elapsed = time.perf_counter() - t0
    if t.is_alive():
        _pending.append(t)
        return Outcome(elapsed, "timeout")
    if "error" in box:
        return Outcome(elapsed, f"raised {box['error']}")
    return Outcome(elapsed, describe(box["value"]))


def hit_or_miss(value: Any) -> str:
    return "hit" if value else "miss"


def loaded_or_not(value: Any) -> str:
    if value == "wrong":
        return "WRONG BYTES reported as loaded"
    return "loaded" if value else "not loaded"


# -- path drivers ------------------------------------------------------------------------
class Driver:
    """One LMCache path: store / lookup / load one chunk by id, close."""

    def store(self, ident: int) -> None:
        raise NotImplementedError

    def lookup(self, ident: int) -> bool:
        raise NotImplementedError

    def load(self, ident: int) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


# This benchmark also runs against older checkouts (PYTHONPATH=<checkout>/src, for the
# "before" numbers), so it builds LMCache objects itself instead of importing helpers
# that only newer versions of the package have.
def _metadata() -> Any:
    import torch
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(
        model_name=MODEL,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.float16,
        kv_shape=KV_SHAPE,
        chunk_size=CHUNK_TOKENS,
    )


class _V1Driver(Driver):
    """Shared by the v1 paths: LMCache keys, MemoryObjs from a LocalCPUBackend."""

    def __init__(self, config: Any) -> None:
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        config.chunk_size = CHUNK_TOKENS
        config.max_local_cpu_size = 0.05
        self.config = config
        self.metadata = _metadata()
        self.local_cpu = LocalCPUBackend(config, self.metadata, dst_device="cpu")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.blocks: dict[int, bytes] = {}
        self.backend: Any = None

    def key(self, ident: int) -> Any:
        import torch
        from lmcache.utils import CacheEngineKey

        return CacheEngineKey(MODEL, 1, 0, 7_000_000 + ident, torch.float16)

    def _obj(self, ident: int) -> Any:
        import torch
        from lmcache.v1.memory_management import MemoryFormat

        shape = torch.Size([KV_SHAPE[1], KV_SHAPE[0], CHUNK_TOKENS, KV_SHAPE[3] * KV_SHAPE[4]])
        obj = self.local_cpu.allocate(shape, torch.float16, MemoryFormat.KV_2LTD)
        assert obj is not None
        obj.tensor.copy_(torch.randn(shape, dtype=torch.float32).to(torch.float16))
        self.blocks[ident] = bytes(obj.byte_array)
        return obj

    def store(self, ident: int) -> None:
        obj = self._obj(ident)
        futures = self.backend.batched_submit_put_task([self.key(ident)], [obj])
        for f in futures or ():
            f.result(60)
        deadline = time.monotonic() + 30
        while self.backend.exists_in_put_tasks(self.key(ident)):
            if time.monotonic() > deadline:
                raise RuntimeError("store did not finish")
            time.sleep(0.01)
        obj.ref_count_down()

    def lookup(self, ident: int) -> bool:
        return bool(self.backend.batched_contains([self.key(ident)]))

    def load(self, ident: int) -> bool | str:
        obj = self.backend.get_blocking(self.key(ident))
        if obj is None:
            return False
        ok = bytes(obj.byte_array) == self.blocks.get(ident)
        obj.ref_count_down()
        return True if ok else "wrong"

    def decoy(self) -> None:
        """Leave unrelated bytes in the CPU allocator's next free buffer, so a load that
        "succeeds" without reading anything shows up as wrong bytes."""
        self._obj(10**6).ref_count_down()

    def close(self) -> None:
        self.backend.close()

    def release(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class PathADriver(_V1Driver):
    def __init__(self, server: Server, deploy: Path) -> None:
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.storage_backend import storage_plugin_launcher

        os.environ["EPISTEMIC_GRAPH_KVCACHE_TOKEN"] = TOKEN
        config = LMCacheEngineConfig.from_file(str(deploy / "path-a-storage-plugin.yaml"))
        config.extra_config["storage_plugin.epistemic_graph.base_url"] = (
            f"http://127.0.0.1:{server.http_port}"
        )
        super().__init__(config)
        backends: OrderedDict[str, Any] = OrderedDict()
        storage_plugin_launcher(config, self.metadata, self.loop, self.local_cpu, "cpu", backends)
        self.backend = backends["epistemic_graph"]


class RemoteDriver(_V1Driver):
    """LMCache's own RemoteBackend (redis-py or the C++ RESP client)."""

    def __init__(self, server: Server, deploy: Path, scheme: str) -> None:
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.storage_backend.remote_backend import RemoteBackend

        name = "path-b-remote-url.yaml" if scheme == "redis" else "path-b-resp-url.yaml"
        config = LMCacheEngineConfig.from_file(str(deploy / name))
        if scheme == "redis":
            config.remote_url = f"redis://:{TOKEN}@127.0.0.1:{server.resp_port}"
        else:
            os.environ["LMCACHE_RESP_PASSWORD"] = TOKEN
            config.remote_url = f"resp://127.0.0.1:{server.resp_port}"
        super().__init__(config)
        self.backend = RemoteBackend(config, self.metadata, self.loop, self.local_cpu, "cpu")

    def store(self, ident: int) -> None:
        obj = self._obj(ident)
        self.backend.submit_put_task(self.key(ident), obj).result(60)
        obj.ref_count_down()

    def lookup(self, ident: int) -> bool:
        return bool(self.backend.contains(self.key(ident)))


class MPDriver(Driver):
    """MP mode: an L2 adapter built by LMCache's factory from a shipped JSON file."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from lmcache.v1.distributed.l2_adapters import create_l2_adapter
        from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

        args = argparse.Namespace(l2_adapter=[json.dumps(spec)])
        self.adapter = create_l2_adapter(parse_args_to_l2_adapters_config(args).adapters[0])
        self.blocks: dict[int, bytes] = {}

    @staticmethod
    def key(ident: int) -> Any:
        from lmcache.v1.distributed.api import ObjectKey

        return ObjectKey(
            chunk_hash=ident.to_bytes(16, "big"), model_name=MODEL, kv_rank=0, cache_salt=""
        )

    @staticmethod
    def _obj(data: bytes) -> Any:
        import torch
        from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        meta = MemoryObjMetadata(
            shape=torch.Size([len(data)]),
            dtype=torch.uint8,
            address=0,
            phy_size=len(data),
            ref_count=1,
        )
        return TensorMemoryObj(raw_data=raw, metadata=meta, parent_allocator=None)

    @staticmethod
    def _poll(get: Callable[[], Any]) -> Any:
        while True:
            value = get()
            if value is not None:
                return value
            time.sleep(0.002)

    def store(self, ident: int) -> None:
        data = os.urandom(64 * 1024)
        self.blocks[ident] = data
        source = self._obj(data)  # must outlive the store (the connector reads it later)
        task = self.adapter.submit_store_task([self.key(ident)], [source])
        done: dict[int, Any] = {}

        def get() -> Any:
            done.update(self.adapter.pop_completed_store_tasks())
            return done.get(task)

        result = self._poll(get)
        del source
        if not result.is_successful():
            raise RuntimeError("store failed")

    def lookup(self, ident: int) -> bool:
        task = self.adapter.submit_lookup_and_lock_task([self.key(ident)], {})
        bitmap = self._poll(lambda: self.adapter.query_lookup_and_lock_result(task))
        hit = bool(bitmap.test(0))
        if hit:
            self.adapter.submit_unlock([self.key(ident)])
        return hit

    def load(self, ident: int) -> bool | str:
        target = self._obj(bytes(len(self.blocks.get(ident, b"\0" * 65536))))
        task = self.adapter.submit_load_task([self.key(ident)], [target])
        bitmap = self._poll(lambda: self.adapter.query_load_result(task))
        if not bitmap.test(0):
            return False
        return True if bytes(target.byte_array) == self.blocks.get(ident) else "wrong"

    def close(self) -> None:
        self.adapter.close()

    def release(self) -> None:
        pass


def make_driver(path: str, server: Server, deploy: Path) -> Any:
    if path == "a":
        return PathADriver(server, deploy)
    if path in ("redis", "resp"):
        return RemoteDriver(server, deploy, path)
    if path == "mp-native":
        spec = json.loads((deploy / "mp-native-plugin.json").read_text())
        spec["adapter_params"]["base_url"] = f"http://127.0.0.1:{server.http_port}"
        os.environ["EPISTEMIC_GRAPH_KVCACHE_TOKEN"] = TOKEN
        return MPDriver(spec)
    if path == "mp-resp":
        spec = json.loads((deploy / "mp-resp.json").read_text())
        spec["port"] = server.resp_port
        spec["password"] = TOKEN
        return MPDriver(spec)
    raise ValueError(path)


# -- scenarios ---------------------------------------------------------------------------
@contextmanager
def fresh(path: str, server: Server, deploy: Path) -> Iterator[Any]:
    driver = make_driver(path, server, deploy)
    try:
        yield driver
    finally:
        driver.release()


def stalled(path: str, server: Server, deploy: Path, limit: float) -> dict[str, Outcome]:
    out: dict[str, Outcome] = {}
    with fresh(path, server, deploy) as d:
        d.store(1)
        if not d.lookup(1):
            raise RuntimeError(f"{path}: stored chunk not found")
        sigstop(server.pid)  # every thread stopped, not only the stop queued
        try:
            out["lookup 1"] = timed(lambda: d.lookup(1), limit, hit_or_miss)
            out["lookup 2"] = timed(lambda: d.lookup(1), limit, hit_or_miss)
            out["load"] = timed(lambda: d.load(1), limit, loaded_or_not)
            out["close"] = timed(d.close, limit, lambda _: "closed")
        finally:
            server.signal(signal.SIGCONT)
        drain_pending(limit)
    return out


def restart(path: str, server: Server, deploy: Path, limit: float) -> dict[str, Outcome]:
    out: dict[str, Outcome] = {}
    with fresh(path, server, deploy) as d:
        d.store(2)
        if hasattr(d, "decoy"):
            d.decoy()
        server.kill()
        out["lookup (down)"] = timed(lambda: d.lookup(2), limit, hit_or_miss)
        out["load (down)"] = timed(lambda: d.load(2), limit, loaded_or_not)
        server.start()

        def until_hit() -> bool:
            deadline = time.monotonic() + limit
            while time.monotonic() < deadline:
                if d.lookup(2):
                    return True
                time.sleep(0.05)
            return False

        out["hit again after restart"] = timed(until_hit, limit + 5, hit_or_miss)
        out["load (after)"] = timed(lambda: d.load(2), limit, loaded_or_not)
        timed(d.close, limit, lambda _: "closed")
        drain_pending(limit)
    return out


def missing(path: str, server: Server, deploy: Path, limit: float) -> dict[str, Outcome]:
    out: dict[str, Outcome] = {}
    with fresh(path, server, deploy) as d:
        d.store(3)  # so loads know the chunk size
        out["lookup missing"] = timed(lambda: d.lookup(999), limit, hit_or_miss)
        d.blocks[999] = os.urandom(len(d.blocks[3]))  # never stored: any "hit" is wrong
        out["load missing"] = timed(lambda: d.load(999), limit, loaded_or_not)
        timed(d.close, limit, lambda _: "closed")
        drain_pending(limit)
    return out


SCENARIOS = {"stalled": stalled, "restart": restart, "missing": missing}
PATHS = ["a", "redis", "resp", "mp-native", "mp-resp"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--limit-s", type=float, default=45.0)
    parser.add_argument("--deploy-dir", type=Path, default=REPO / "deploy" / "lmcache")
    args = parser.parse_args()
    import logging

    logging.disable(logging.WARNING)  # LMCache and the client log every failed call
    rows: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-failures-") as d:
        server = Server(Path(d) / "data")
        server.start()
        try:
            for path in args.paths.split(","):
                for name in args.scenarios.split(","):
                    t0 = time.perf_counter()
                    try:
                        res = SCENARIOS[name](path, server, args.deploy_dir, args.limit_s)
                    except Exception as exc:
                        res = {"error": Outcome(0.0, f"{type(exc).__name__}: {exc}"[:120])}
                    cells = "; ".join(f"{k}: {v.cell(args.limit_s)}" for k, v in res.items())
                    print(f"{path:<9} {name:<8} {cells}  [{time.perf_counter() - t0:.0f} s]")
                    sys.stdout.flush()
                    rows.append(f"| {path} | {name} | {cells} |")
                    if not server.running:
                        server.start()
        finally:
            server.stop()
    print()
    print("| path | scenario | measured |")
    print("|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
