"""Our LMCache plugins driven by the real lmcache package against the real server.

- MP mode: `NativeConnectorL2Adapter` built by LMCache's own `native_plugin` factory from
  `deploy/lmcache/mp-native-plugin.json`, store -> lookup -> load with `TensorMemoryObj`s.
- v1 mode: `ConnectorClientBase` over our connector; `EpistemicGraphExternalBackend`
  loaded by LMCache's `storage_plugin_launcher` from `deploy/lmcache/path-a-*.yaml`.
- Path B: LMCache's C++ `LMCacheRedisClient` against our RESP listener; keys written via
  Path A are hits via Path B, and re-writing them is a dedup hit (one store).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

lmcache = pytest.importorskip("lmcache")
torch = pytest.importorskip("torch")

from lmcache.lmcache_redis import LMCacheRedisClient  # noqa: E402
from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.distributed.api import ObjectKey  # noqa: E402
from lmcache.v1.distributed.l2_adapters import create_l2_adapter  # noqa: E402
from lmcache.v1.distributed.l2_adapters.config import (  # noqa: E402
    parse_args_to_l2_adapters_config,
)

from epistemic_kvcache.client import EpistemicGraphKVBackend  # noqa: E402
from epistemic_kvcache.integrations.lmcache.checks import cpu_metadata, tensor_obj  # noqa: E402
from epistemic_kvcache.integrations.lmcache.l2_native_connector import (  # noqa: E402
    EpistemicGraphL2Connector,
)
from servers import TOKEN, ServeProcess  # noqa: E402

pytestmark = [
    pytest.mark.lmcache,
    # LMCache's lazy adapter loader imports its cloud adapters (Google Bigtable SDK, which
    # warns about the Python version) before it reaches `native_plugin`.
    pytest.mark.filterwarnings("ignore::FutureWarning:google.*"),
]

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "lmcache"
MODEL = "meta-llama/Llama-3-8B"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    s = ServeProcess(tmp_path_factory.mktemp("kv"))
    yield s
    s.stop()


@pytest.fixture
def http(server: ServeProcess) -> Iterator[EpistemicGraphKVBackend]:
    with EpistemicGraphKVBackend(base_url=server.url(), token=TOKEN) as c:
        yield c


def wait_for(fd: int, get: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    """Poll an event fd until `get()` returns something other than None."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = get()
        if result is not None:
            return result
        poller.poll(100)
    raise AssertionError("no completion in time")


def native_call(client: Any, fid: int) -> tuple[bool, str, list[bool] | None]:
    """Wait for one completion of a native connector (ours or LMCache's C++ one)."""
    seen: dict[int, tuple[bool, str, list[bool] | None]] = {}

    def get() -> tuple[bool, str, list[bool] | None] | None:
        for cfid, ok, err, res in client.drain_completions():
            seen[int(cfid)] = (bool(ok), str(err), None if res is None else list(res))
        return seen.pop(fid, None)

    return wait_for(client.event_fd(), get)  # type: ignore[no-any-return]


def test_native_plugin_through_lmcache_factory(
    server: ServeProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = json.loads((DEPLOY / "mp-native-plugin.json").read_text())
    spec["adapter_params"]["base_url"] = server.url()
    spec["adapter_params"]["num_workers"] = 4
    # The token comes from the environment, so it never appears in LMCache's config/logs.
    monkeypatch.setenv("EPISTEMIC_GRAPH_KVCACHE_TOKEN", TOKEN)
    # What `lmcache server --l2-adapter '<json>'` parses (add_l2_adapters_args would import
    # every adapter module, cloud SDKs included, only to list their names in --help).
    args = argparse.Namespace(l2_adapter=[json.dumps(spec)])
    config = parse_args_to_l2_adapters_config(args)
    adapter = create_l2_adapter(config.adapters[0])
    try:
        assert type(adapter).__name__ == "NativeConnectorL2Adapter"
        blocks = [os.urandom(256 * 1024 + i) for i in range(6)]
        keys = [
            ObjectKey(chunk_hash=os.urandom(16), model_name=MODEL, kv_rank=i, cache_salt="t1")
            for i in range(len(blocks))
        ]
        # LMCache keeps the objects alive until the store completes (their memoryviews
        # are raw pointers); so does this test.
        sources = [tensor_obj(b) for b in blocks]
        task = adapter.submit_store_task(keys, sources)
        pending: dict[int, Any] = {}

        def store_done() -> Any:
            pending.update(adapter.pop_completed_store_tasks())
            return pending.pop(task, None)

        result = wait_for(adapter.get_store_event_fd(), store_done)
        assert int(result) == sum(len(b) for b in blocks)  # success, bytes transferred

        missing = ObjectKey(chunk_hash=os.urandom(16), model_name=MODEL, kv_rank=0)
        salted_other = ObjectKey(
            chunk_hash=keys[0].chunk_hash, model_name=MODEL, kv_rank=0, cache_salt="t2"
        )
        lookup_keys = [*keys, missing, salted_other]
        task = adapter.submit_lookup_and_lock_task(lookup_keys, {})
        bitmap = wait_for(
            adapter.get_lookup_and_lock_event_fd(),
            lambda: adapter.query_lookup_and_lock_result(task),
        )
        assert [bitmap.test(i) for i in range(len(lookup_keys))] == [True] * len(keys) + [
            False,
            False,
        ]

        targets = [tensor_obj(bytes(len(b))) for b in blocks]
        targets[2] = tensor_obj(bytes(len(blocks[2]) - 1))  # wrong size: must not load
        task = adapter.submit_load_task(keys, targets)
        bitmap = wait_for(adapter.get_load_event_fd(), lambda: adapter.query_load_result(task))
        loaded = [bitmap.test(i) for i in range(len(keys))]
        assert loaded == [True, True, False, True, True, True]
        for i, (obj, block) in enumerate(zip(targets, blocks, strict=True)):
            if i != 2:
                assert bytes(obj.byte_array) == block
        adapter.submit_unlock(keys)
        # The keys on the server are LMCache's serialisation, model name with its '/'.
        assert http_key(keys[0]).startswith(f"{MODEL}@00000000@0@")
        assert http_key(keys[0]).endswith("@t1")
        with EpistemicGraphKVBackend(base_url=server.url(), token=TOKEN) as c:
            assert c.get(http_key(keys[1])) == blocks[1]
    finally:
        adapter.close()


def http_key(key: ObjectKey) -> str:
    from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (
        _object_key_to_string,
    )

    return str(_object_key_to_string(key))


def test_connector_client_base_protocol(server: ServeProcess) -> None:
    from lmcache.v1.storage_backend.native_clients.connector_client_base import (
        ConnectorClientBase,
    )

    async def scenario() -> None:
        conn = EpistemicGraphL2Connector(base_url=server.url(), token=TOKEN, num_workers=2)
        client = ConnectorClientBase(conn)
        try:
            keys = [f"{MODEL}@00000000@0@ccb{i}" for i in range(4)]
            blocks = [os.urandom(10_000 * (i + 1)) for i in range(4)]
            await client.batch_set(keys, [memoryview(b) for b in blocks])
            assert await client.batch_exists([*keys, "absent"]) == [True] * 4 + [False]
            assert await client.exists(keys[0])
            bufs = [bytearray(len(b)) for b in blocks]
            await client.batch_get(keys, [memoryview(b) for b in bufs])
            assert bufs == blocks
            with pytest.raises(RuntimeError, match="not found"):
                await client.get("absent", memoryview(bytearray(10)))
        finally:
            client.close()

    asyncio.run(scenario())


def test_path_b_lmcache_redis_client_against_resp(
    server: ServeProcess, http: EpistemicGraphKVBackend
) -> None:
    resp = LMCacheRedisClient("127.0.0.1", server.ports["resp"], 2, "", TOKEN)
    try:
        keys = [f"{MODEL}@00000000@0@resp{i}" for i in range(3)]
        # LMCacheRedisClient wants one buffer size per batch (as LMCache's chunks are):
        # mixed sizes fail with "buffer size mismatch" against redis-server too.
        blocks = [os.urandom(1024 * 1024) for _ in range(3)]
        ok, err, _ = native_call(resp, resp.submit_batch_set(keys, [memoryview(b) for b in blocks]))
        assert ok, err
        ok, err, found = native_call(resp, resp.submit_batch_exists([*keys, "absent"]))
        assert ok, err
        assert found == [True, True, True, False]
        bufs = [bytearray(len(b)) for b in blocks]
        ok, err, _ = native_call(resp, resp.submit_batch_get(keys, [memoryview(b) for b in bufs]))
        assert ok, err
        assert bufs == blocks
        # Written over RESP, read over HTTP: one store.
        assert http.get_many(keys) == blocks
    finally:
        resp.close()


# -- Path A: the v1 storage plugin, loaded the way LMCache loads it -----------------------
CHUNK_TOKENS = 16
KV_SHAPE = (2, 2, CHUNK_TOKENS, 2, 8)  # layers, k/v, tokens, heads, head size


@contextmanager
def path_a_backend(url: str) -> Iterator[tuple[Any, Any]]:
    """Our storage plugin as LMCache's `storage_plugin_launcher` loads it from
    `path-a-storage-plugin.yaml` (the token from the environment), with its CPU backend."""
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.storage_backend import storage_plugin_launcher
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    config = LMCacheEngineConfig.from_file(str(DEPLOY / "path-a-storage-plugin.yaml"))
    config.extra_config["storage_plugin.epistemic_graph.base_url"] = url
    config.chunk_size = CHUNK_TOKENS
    config.max_local_cpu_size = 0.02
    metadata = cpu_metadata("test/model", KV_SHAPE)
    local_cpu = LocalCPUBackend(config, metadata, dst_device="cpu")
    loop = asyncio.new_event_loop()
    backends: OrderedDict[str, Any] = OrderedDict()
    storage_plugin_launcher(config, metadata, loop, local_cpu, "cpu", backends)
    assert list(backends) == ["epistemic_graph"], "LMCache did not load the plugin"
    backend = backends["epistemic_graph"]
    try:
        yield backend, local_cpu
    finally:
        backend.close()
        local_cpu.close()
        loop.close()


@pytest.fixture
def path_a(server: ServeProcess, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any]]:
    monkeypatch.setenv("EPISTEMIC_GRAPH_KVCACHE_TOKEN", TOKEN)
    with path_a_backend(server.url()) as pair:
        yield pair


def _filled(local_cpu: Any, tokens: int = CHUNK_TOKENS) -> Any:
    from lmcache.v1.memory_management import MemoryFormat

    shape = torch.Size([KV_SHAPE[1], KV_SHAPE[0], tokens, KV_SHAPE[3] * KV_SHAPE[4]])
    obj = local_cpu.allocate(shape, torch.float16, MemoryFormat.KV_2LTD)
    assert obj is not None
    obj.tensor.copy_(torch.randn(shape, dtype=torch.float32).to(torch.float16))
    return obj


def test_path_a_storage_plugin_and_path_b_share_keys(
    path_a: tuple[Any, Any], server: ServeProcess, http: EpistemicGraphKVBackend
) -> None:
    from lmcache.v1.storage_backend.abstract_backend import StorageBackendInterface

    backend, local_cpu = path_a
    assert isinstance(backend, StorageBackendInterface)
    keys = [CacheEngineKey("test/model", 1, 0, 1000 + i, torch.float16) for i in range(3)]
    objs = [_filled(local_cpu) for _ in keys]
    objs.append(_filled(local_cpu, tokens=5))  # the last, partial chunk of a prompt
    keys.append(CacheEngineKey("test/model", 1, 0, 2000, torch.float16))
    expected = [bytes(o.byte_array) for o in objs]
    completed: list[Any] = []
    futures = backend.batched_submit_put_task(keys, objs, on_complete_callback=completed.append)
    assert futures is not None
    for f in futures:
        assert f.result(30) == [True] * len(keys)
    assert completed == keys
    assert not backend.exists_in_put_tasks(keys[0])

    missing = CacheEngineKey("test/model", 1, 0, 999_999, torch.float16)
    assert backend.contains(keys[0])
    assert not backend.contains(missing)
    assert backend.batched_contains([*keys, missing]) == len(keys)
    assert backend.batched_contains([missing, *keys]) == 0

    got = backend.get_blocking(keys[1])
    assert got is not None
    assert bytes(got.byte_array) == expected[1]
    partial = backend.get_blocking(keys[3])
    assert partial is not None
    assert partial.meta.shape[2] == 5
    assert bytes(partial.byte_array) == expected[3]
    batch = backend.batched_get_blocking([keys[0], missing, keys[2]])
    assert batch[1] is None
    assert bytes(batch[0].byte_array) == expected[0]
    assert bytes(batch[2].byte_array) == expected[2]
    assert backend.get_blocking(missing) is None
    future = backend.get_non_blocking(keys[0])
    assert bytes(future.result(30).byte_array) == expected[0]

    for obj in [*objs, got, partial, batch[0], batch[2], future.result()]:
        obj.ref_count_down()

    # Path B sees the same keys and bytes: one store. (LMCacheRedisClient wants one buffer
    # size per batch, so the partial chunk is left out.)
    resp = LMCacheRedisClient("127.0.0.1", server.ports["resp"], 1, "", TOKEN)
    try:
        names = [k.to_string() for k in keys[:3]]
        ok, err, found = native_call(resp, resp.submit_batch_exists(names))
        assert ok, err
        assert found == [True] * 3
        bufs = [bytearray(len(e)) for e in expected[:3]]
        ok, err, _ = native_call(resp, resp.submit_batch_get(names, [memoryview(b) for b in bufs]))
        assert ok, err
        assert bufs == expected[:3]
        before = http.stats()
        assert before is not None
        ok, err, _ = native_call(resp, resp.submit_batch_set(names[:1], [memoryview(bufs[0])]))
        assert ok, err
        after = http.stats()
        assert after is not None
        assert after.dedup_hits == before.dedup_hits + 1
        assert after.unique_blocks == before.unique_blocks
        assert after.resident_bytes == before.resident_bytes
    finally:
        resp.close()

    assert backend.remove(keys[0])
    assert not backend.contains(keys[0])


def test_path_a_async_lookups(path_a: tuple[Any, Any]) -> None:
    backend, local_cpu = path_a
    keys = [CacheEngineKey("test/model", 1, 0, 3000 + i, torch.float16) for i in range(2)]
    objs = [_filled(local_cpu) for _ in keys]
    expected = [bytes(o.byte_array) for o in objs]
    futures = backend.batched_submit_put_task(keys, objs)
    assert futures is not None
    assert futures[0].result(30) == [True, True]
    for obj in objs:
        obj.ref_count_down()

    async def scenario() -> None:
        assert await backend.batched_async_contains("req-1", keys) == 2
        loaded = await backend.batched_get_non_blocking("req-1", keys)
        assert [bytes(o.byte_array) for o in loaded] == expected
        for obj in loaded:
            obj.ref_count_down()

    asyncio.run(scenario())
