"""The per-path checks of `epistemic-kvcache validate-adapter`, driven by LMCache itself.

Each check stores a random chunk through one LMCache path, looks it up (and a key that
was never written), loads it back and compares the bytes, deletes it through the same
path and looks again. lmcache and torch are imported only inside the functions, so the
command runs (and reports these paths as skipped) where LMCache is not installed.

- `check_native`: LMCache's real `NativeConnectorL2Adapter` over our
  `EpistemicGraphL2Connector` (MP mode's `native_plugin`): store / lookup-and-lock /
  load tasks with `TensorMemoryObj`s, `delete`. Without LMCache, the connector is driven
  the way that adapter drives it (submit, poll the eventfd, drain completions).
- `check_resp`: LMCache's C++ `LMCacheRedisClient` (the MP `resp` adapter and v1
  `resp://`) against our RESP listener: SET, EXISTS, GET, DEL.
- `check_path_a`: our v1 storage plugin, loaded by LMCache's `storage_plugin_launcher`
  from the same settings as `deploy/lmcache/path-a-storage-plugin.yaml`.
- `check_redis_url`: LMCache's v1 redis-py connector (`remote_url: redis://...`).

A check never raises for a failed step; it records it and stops that path.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import select
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from epistemic_kvcache.client.backend import EpistemicGraphKVBackend
from epistemic_kvcache.client.stats import KvCacheStats
from epistemic_kvcache.install import pip_hint
from epistemic_kvcache.integrations.lmcache.l2_native_connector import EpistemicGraphL2Connector


@dataclass(slots=True)
class PathReport:
    """The checks of one path; `skipped` says why a path was not checked."""

    name: str
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    skipped: str | None = None
    note: str | None = None
    stats: list[tuple[str, KvCacheStats]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Checked, and every check passed."""
        return self.skipped is None and bool(self.checks) and all(p for _, p, _ in self.checks)

    def check(self, name: str, passed: bool, detail: str = "") -> bool:
        """Record one check; returns `passed`."""
        self.checks.append((name, passed, detail))
        return passed


def lmcache_missing() -> str | None:
    """Why LMCache cannot be driven here (None when it can)."""
    for module in ("lmcache", "torch"):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError, AttributeError):  # blocked in sys.modules
            found = False
        if not found:
            return f"{module} is not installed ({pip_hint('lmcache')})"
    return None


def _poll(get: Callable[[], Any], fd: int, timeout_s: float) -> Any:
    """Poll `fd` until `get()` returns something other than None (None on timeout)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout_s
    while True:
        value = get()
        if value is not None:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        poller.poll(min(100, int(left * 1000) + 1))


def _native_call(client: Any, fid: int, timeout_s: float) -> tuple[bool, str, list[bool]]:
    """One completion of a native connector (ours or LMCache's C++ one)."""
    seen: dict[int, tuple[bool, str, list[bool]]] = {}

    def get() -> tuple[bool, str, list[bool]] | None:
        for cfid, ok, err, res in client.drain_completions():
            seen[int(cfid)] = (bool(ok), str(err), [bool(r) for r in (res or [])])
        return seen.pop(fid, None)

    got = _poll(get, client.event_fd(), timeout_s)
    return got if got is not None else (False, f"no completion within {timeout_s} s", [])


def tensor_obj(data: bytes) -> Any:
    """A real LMCache `TensorMemoryObj` (flat uint8 tensor) holding a copy of `data`."""
    import torch
    from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

    raw = torch.empty(len(data), dtype=torch.uint8)
    meta = MemoryObjMetadata(
        shape=torch.Size([len(data)]),
        dtype=torch.uint8,
        address=0,
        phy_size=len(data),
        ref_count=1,
    )
    obj = TensorMemoryObj(raw_data=raw, metadata=meta, parent_allocator=None)
    obj.byte_array.cast("B")[:] = data
    return obj


def _stats_after(report: PathReport, client: EpistemicGraphKVBackend, label: str) -> Any:
    """`/kv/stats` now, recorded in the report (None, and a failed check, if unreachable)."""
    stats = client.stats()
    if report.check(f"stats {label}", stats is not None) and stats is not None:
        report.stats.append((label, stats))
    return stats


def _compare(
    report: PathReport,
    old: KvCacheStats,
    new: KvCacheStats,
    rules: list[tuple[str, str, Callable[[int, int], bool]]],
) -> None:
    for label, name, holds in rules:
        a, b = getattr(old, name), getattr(new, name)
        report.check(label, holds(a, b), f"{a} -> {b}")


def _stats_checks(
    report: PathReport,
    client: EpistemicGraphKVBackend,
    store_again: Callable[[], bool],
    before: KvCacheStats,
    block_bytes: int,
) -> None:
    """unique_blocks / logical_bytes rose; a second identical store is a dedup hit."""
    first = _stats_after(report, client, "after first store")
    if first is None:
        return
    _compare(report, before, first, [
        ("unique_blocks rose", "unique_blocks", lambda a, b: b > a),
        ("logical_bytes rose by the block", "logical_bytes", lambda a, b: b >= a + block_bytes),
    ])  # fmt: skip
    if not report.check("second identical store accepted", store_again()):
        return
    second = _stats_after(report, client, "after second store")
    if second is None:
        return
    _compare(report, first, second, [
        ("dedup_hits rose", "dedup_hits", lambda a, b: b > a),
        ("resident_bytes flat (stored once)", "resident_bytes", lambda a, b: a == b),
    ])  # fmt: skip


# -- MP mode: the native plugin --------------------------------------------------------
def check_native(
    connector: EpistemicGraphL2Connector,
    client: EpistemicGraphKVBackend,
    report: PathReport,
    *,
    model: str,
    block_bytes: int,
    timeout_s: float,
) -> None:
    """Through LMCache's `NativeConnectorL2Adapter` when LMCache is installed."""
    before = client.stats()
    if not report.check("stats reachable", before is not None, client.config.base_url):
        return
    assert before is not None
    report.stats.append(("before", before))
    run = _NativeRun(connector, client, report, before, os.urandom(block_bytes), model, timeout_s)
    if lmcache_missing() is None:
        _native_through_lmcache(run)
    else:
        report.note = "LMCache not installed: drove the connector the way its adapter does"
        _native_direct(run)


@dataclass(frozen=True, slots=True)
class _NativeRun:
    connector: EpistemicGraphL2Connector
    client: EpistemicGraphKVBackend
    report: PathReport
    before: KvCacheStats
    block: bytes
    model: str
    timeout_s: float


def _native_through_lmcache(run: _NativeRun) -> None:
    connector, client, report = run.connector, run.client, run.report
    block, model, timeout_s = run.block, run.model, run.timeout_s
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (
        NativeConnectorL2Adapter,
    )

    adapter = NativeConnectorL2Adapter(connector)  # closes the connector when closed
    report.note = "LMCache's NativeConnectorL2Adapter over EpistemicGraphL2Connector"
    key = ObjectKey(chunk_hash=os.urandom(16), model_name=model, kv_rank=0)
    absent = ObjectKey(chunk_hash=os.urandom(16), model_name=model, kv_rank=0)
    source = tensor_obj(block)

    def store() -> bool:
        task = adapter.submit_store_task([key], [source])
        done: dict[int, Any] = {}

        def get() -> Any:
            done.update(adapter.pop_completed_store_tasks())
            return done.get(task)

        result = _poll(get, adapter.get_store_event_fd(), timeout_s)
        return result is not None and bool(result.is_successful())

    def lookup(keys: list[Any]) -> list[bool] | None:
        task = adapter.submit_lookup_and_lock_task(keys, {})
        bitmap = _poll(
            lambda: adapter.query_lookup_and_lock_result(task),
            adapter.get_lookup_and_lock_event_fd(),
            timeout_s,
        )
        if bitmap is None:
            return None
        found = [bool(bitmap.test(i)) for i in range(len(keys))]
        adapter.submit_unlock([k for k, f in zip(keys, found, strict=True) if f])
        return found

    try:
        if not report.check("store (submit_store_task)", store()):
            return
        _stats_checks(report, client, store, run.before, len(block))
        found = lookup([key, absent])
        report.check("lookup: stored key found, absent key missing", found == [True, False])
        target = tensor_obj(bytes(len(block)))
        task = adapter.submit_load_task([key], [target])
        bitmap = _poll(
            lambda: adapter.query_load_result(task), adapter.get_load_event_fd(), timeout_s
        )
        report.check("load (submit_load_task)", bitmap is not None and bool(bitmap.test(0)))
        report.check("bytes identical", bytes(target.byte_array) == block, f"{len(block)} bytes")
        adapter.delete([key])  # LMCache's eviction / admin DELETE path
        report.check("delete: gone afterwards", lookup([key]) == [False])
    finally:
        adapter.close()


def _native_direct(run: _NativeRun) -> None:
    connector, client, report = run.connector, run.client, run.report
    block, model, timeout_s = run.block, run.model, run.timeout_s
    key = f"{model}@00000000@0@{os.urandom(16).hex()}"
    absent = f"{model}@00000000@0@{os.urandom(16).hex()}"
    try:

        def store() -> bool:
            ok, _, _ = _native_call(
                connector, connector.submit_batch_set([key], [memoryview(block)]), timeout_s
            )
            return ok

        if not report.check("store (submit_batch_set)", store()):
            return
        _stats_checks(report, client, store, run.before, len(block))
        _batch_round_trip(
            connector, report, key, absent, block, timeout_s,
            ("exists: stored key found, absent key missing", "read back (submit_batch_get)",
             "delete (submit_batch_delete)", "gone after delete"),
            check_loaded=True,
        )  # fmt: skip
    finally:
        connector.close()


def _batch_round_trip(
    client: Any,
    report: PathReport,
    key: str,
    absent: str,
    block: bytes,
    timeout_s: float,
    names: tuple[str, str, str, str],
    *,
    check_loaded: bool,
) -> None:
    """After the store of `key`: EXISTS (`key` and `absent`), GET into a buffer and
    compare, DELETE, EXISTS again. Our native connector and LMCache's C++ RESP client
    take the same batch calls. `names`: the report's names of the exists, get, delete and
    gone-afterwards checks; `check_loaded`: the get must also report the key found.
    (No GET of the absent key: LMCache 0.5.6's C++ client waits forever for a missing
    key's reply, against redis-server too. See docs/lmcache.md.)"""
    exists, get, delete, gone = names
    _, err, found = _native_call(client, client.submit_batch_exists([key, absent]), timeout_s)
    report.check(exists, found == [True, False], err)
    buf = bytearray(len(block))
    ok, err, loaded = _native_call(
        client, client.submit_batch_get([key], [memoryview(buf)]), timeout_s
    )
    report.check(get, ok and (loaded == [True] or not check_loaded), err)
    report.check("bytes identical", buf == block, f"{len(block)} bytes")
    ok, err, deleted = _native_call(client, client.submit_batch_delete([key]), timeout_s)
    report.check(delete, ok and deleted == [True], err)
    _, _, found = _native_call(client, client.submit_batch_exists([key]), timeout_s)
    report.check(gone, found == [False])


# -- RESP: LMCache's C++ client --------------------------------------------------------
def check_resp(
    host: str,
    port: int,
    token: str | None,
    report: PathReport,
    *,
    model: str,
    block_bytes: int,
    timeout_s: float,
) -> None:
    """LMCache's `LMCacheRedisClient` against our RESP listener (SET/EXISTS/GET/DEL)."""
    from lmcache.lmcache_redis import LMCacheRedisClient

    report.note = f"LMCache's LMCacheRedisClient -> {host}:{port}"
    try:
        client = LMCacheRedisClient(host, port, 1, "", token or "")
    except Exception as exc:
        report.check("connect and AUTH", False, f"{type(exc).__name__}: {exc}")
        return
    key = f"{model}@00000000@0@{os.urandom(16).hex()}"
    absent = f"{model}@00000000@0@{os.urandom(16).hex()}"
    block = os.urandom(block_bytes)
    try:
        ok, err, _ = _native_call(
            client, client.submit_batch_set([key], [memoryview(block)]), timeout_s
        )
        if not report.check("SET", ok, err):
            return
        _batch_round_trip(
            client, report, key, absent, block, timeout_s,
            ("EXISTS: stored key found, absent key missing", "GET", "DEL", "gone after DEL"),
            check_loaded=False,
        )  # fmt: skip
    finally:
        client.close()


# -- v1 paths: Path A and redis:// -----------------------------------------------------
CHUNK_TOKENS = 16
KV_SHAPE = (2, 2, CHUNK_TOKENS, 4, 64)  # layers, k/v, tokens, heads, head size: 32 KiB


def cpu_metadata(model: str, kv_shape: tuple[int, ...]) -> Any:
    """LMCache's `LMCacheMetadata` for one float16 CPU worker; `kv_shape` is (layers,
    k/v, tokens per chunk, heads, head size)."""
    import torch
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(
        model_name=model,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.float16,
        kv_shape=kv_shape,
        chunk_size=kv_shape[2],
    )


@contextmanager
def _v1_engine(config: Any, model: str) -> Iterator[tuple[Any, Any, asyncio.AbstractEventLoop]]:
    """LMCache metadata, a LocalCPUBackend and an event loop thread, as the engine has."""
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    config.chunk_size = CHUNK_TOKENS
    config.max_local_cpu_size = 0.05
    metadata = cpu_metadata(model, KV_SHAPE)
    local_cpu = LocalCPUBackend(config, metadata, dst_device="cpu")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="validate-loop", daemon=True)
    thread.start()
    try:
        yield metadata, local_cpu, loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        local_cpu.close()


def _chunk(local_cpu: Any) -> Any:
    import torch
    from lmcache.v1.memory_management import MemoryFormat

    shape = torch.Size([KV_SHAPE[1], KV_SHAPE[0], CHUNK_TOKENS, KV_SHAPE[3] * KV_SHAPE[4]])
    obj = local_cpu.allocate(shape, torch.float16, MemoryFormat.KV_2LTD)
    if obj is None:
        raise RuntimeError("LMCache's CPU backend could not allocate a chunk")
    obj.tensor.copy_(torch.randn(shape, dtype=torch.float32).to(torch.float16))
    return obj


def _engine_key(model: str) -> Any:
    import torch
    from lmcache.utils import CacheEngineKey

    return CacheEngineKey(model, 1, 0, int.from_bytes(os.urandom(7), "big"), torch.float16)


def check_path_a(
    client: EpistemicGraphKVBackend,
    report: PathReport,
    *,
    model: str,
    timeout_s: float,
) -> None:
    """Our storage plugin as LMCache's `storage_plugin_launcher` loads it."""
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.storage_backend import storage_plugin_launcher

    from epistemic_kvcache.integrations.lmcache.external_backend import PLUGIN_NAME

    cfg = client.config
    prefix = f"storage_plugin.{PLUGIN_NAME}."
    extra: dict[str, Any] = {
        prefix + "module_path": "epistemic_kvcache.integrations.lmcache.external_backend",
        prefix + "class_name": "EpistemicGraphExternalBackend",
        prefix + "base_url": cfg.base_url,
    }
    for name in ("token", "ca_file", "client_cert", "client_key"):
        value = getattr(cfg, name)
        if value:
            extra[prefix + name] = value
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK_TOKENS, storage_plugins=[PLUGIN_NAME], extra_config=extra
    )
    report.note = "EpistemicGraphExternalBackend via LMCache's storage_plugin_launcher"
    with _v1_engine(config, model) as (metadata, local_cpu, loop):
        backends: OrderedDict[str, Any] = OrderedDict()
        try:
            storage_plugin_launcher(config, metadata, loop, local_cpu, "cpu", backends)
        except Exception as exc:
            report.check("LMCache loads the plugin", False, f"{type(exc).__name__}: {exc}")
            return
        if not report.check(
            "LMCache loads the plugin", PLUGIN_NAME in backends, str(list(backends))
        ):
            return
        backend = backends[PLUGIN_NAME]
        try:
            key, absent = _engine_key(model), _engine_key(model)
            obj = _chunk(local_cpu)
            block = bytes(obj.byte_array)
            futures = backend.batched_submit_put_task([key], [obj]) or []
            stored = all(f.result(timeout_s) == [True] for f in futures) and bool(futures)
            obj.ref_count_down()
            if not report.check("store (batched_submit_put_task)", stored):
                return
            report.check("lookup: stored key found", backend.contains(key))
            report.check("lookup: absent key missing", not backend.contains(absent))
            got = backend.get_blocking(key)
            report.check("load (get_blocking)", got is not None)
            if got is not None:
                report.check("bytes identical", bytes(got.byte_array) == block)
                got.ref_count_down()
            report.check("remove", backend.remove(key))
            report.check("gone after remove", not backend.contains(key))
        finally:
            backend.close()


def check_redis_url(
    host: str,
    port: int,
    token: str | None,
    report: PathReport,
    *,
    model: str,
    timeout_s: float,
) -> None:
    """LMCache's v1 redis-py connector (`remote_url: redis://...`) against our RESP."""
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.storage_backend.connector import CreateConnector

    report.note = f"LMCache's redis-py RedisConnector -> redis://{host}:{port}"
    auth = f":{token}@" if token else ""
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK_TOKENS, remote_serde="naive")
    with _v1_engine(config, model) as (_, local_cpu, loop):

        def run(coro: Any) -> Any:
            return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s)

        try:
            conn = CreateConnector(f"redis://{auth}{host}:{port}", loop, local_cpu, config)
        except Exception as exc:
            report.check("connect", False, f"{type(exc).__name__}: {exc}")
            return
        try:
            key, absent = _engine_key(model), _engine_key(model)
            obj = _chunk(local_cpu)
            block = bytes(obj.byte_array)
            try:
                run(conn.put(key, obj))  # takes over the reference to `obj`
                stored = True
                detail = ""
            except Exception as exc:
                stored, detail = False, f"{type(exc).__name__}: {exc}"
            if not report.check("put (SET metadata + kv_bytes)", stored, detail):
                return
            report.check("exists: stored key found", bool(run(conn.exists(key))))
            report.check("exists: absent key missing", not run(conn.exists(absent)))
            got = run(conn.get(key))
            report.check("get", got is not None)
            if got is not None:
                report.check("bytes identical", bytes(got.byte_array) == block)
                got.ref_count_down()
        finally:
            close_remote_connector(conn, run)


def close_remote_connector(conn: Any, run: Callable[[Any], Any]) -> None:
    """Close one of LMCache's v1 remote connectors (redis-py or RESP) without its own
    `close()`, which deadlocks in 0.5.6: it blocks the event loop on a future scheduled
    on that same loop. `run(coro)` runs a coroutine on the connector's loop."""
    inner = conn.getWrappedConnector() if hasattr(conn, "getWrappedConnector") else conn
    steps: list[Callable[[], Any]] = [lambda: run(inner.pq_executor.shutdown_async(wait=False))]
    if hasattr(inner, "connection"):  # redis-py: connections in use after an error too
        steps.append(lambda: run(inner.connection.connection_pool.disconnect()))
        steps.append(lambda: run(inner.connection.aclose()))
    if hasattr(inner, "client"):  # the C++ RESP client's asyncio wrapper
        steps.append(inner.client.close)
    for step in steps:
        try:
            step()
        except Exception:  # best effort: the process is about to drop it anyway
            return
