"""The files in deploy/lmcache work as shipped, credentials from the environment.

Each file is loaded by LMCache's own loader (for v1: `lmcache_get_or_create_config`, what
vLLM's LMCache connector calls: the YAML, then `LMCACHE_<SETTING>` variables over it),
then a chunk is stored and read back through LMCache's own objects. Only the server's
address differs from the file (the test server listens on free ports); the token never
appears in a file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache")
torch = pytest.importorskip("torch")

from epistemic_kvcache.errors import ConfigurationError  # noqa: E402
from epistemic_kvcache.integrations.lmcache.checks import (  # noqa: E402
    close_remote_connector,
    cpu_metadata,
    tensor_obj,
)
from servers import TOKEN, ServeProcess  # noqa: E402
from test_lmcache import native_call, wait_for  # noqa: E402

pytestmark = [
    pytest.mark.lmcache,
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "lmcache"
KV_SHAPE = (2, 2, 16, 2, 16)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    s = ServeProcess(tmp_path_factory.mktemp("kv"))
    yield s
    s.stop()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.startswith(("EPISTEMIC_GRAPH_", "LMCACHE_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("LMCACHE_TRACK_USAGE", "false")
    return monkeypatch


def vllm_config(file: Path, env: pytest.MonkeyPatch) -> Any:
    """What vLLM's LMCache connector loads: LMCACHE_CONFIG_FILE, then LMCACHE_* vars."""
    from lmcache.integration.vllm import utils

    env.setenv("LMCACHE_CONFIG_FILE", str(file))
    utils._config_instance = None  # the loader caches one config per process
    try:
        return utils.lmcache_get_or_create_config()
    finally:
        utils._config_instance = None


def remote_round_trip(config: Any) -> tuple[bool, bool]:
    """LMCache's RemoteBackend from `config`: store a chunk, look it up, read it back."""
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    config.chunk_size = KV_SHAPE[2]
    config.max_local_cpu_size = 0.02
    metadata = cpu_metadata("deploy/model", KV_SHAPE)
    local_cpu = LocalCPUBackend(config, metadata, dst_device="cpu")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        backend = RemoteBackend(config, metadata, loop, local_cpu, "cpu")
        shape = torch.Size([KV_SHAPE[1], KV_SHAPE[0], KV_SHAPE[2], KV_SHAPE[3] * KV_SHAPE[4]])
        obj = local_cpu.allocate(shape, torch.float16, MemoryFormat.KV_2LTD)
        obj.tensor.copy_(torch.randn(shape).to(torch.float16))
        data = bytes(obj.byte_array)
        key = CacheEngineKey("deploy/model", 1, 0, int.from_bytes(os.urandom(7), "big"),
                             torch.float16)  # fmt: skip
        with contextlib.suppress(Exception):  # no password: LMCache logs it; lookups miss
            backend.submit_put_task(key, obj).result(30)
        found = backend.contains(key)
        got = backend.get_blocking(key)
        same = got is not None and bytes(got.byte_array) == data
        if got is not None:
            got.ref_count_down()
        # Not backend.close(): LMCache 0.5.6's RemoteBackend.close() deadlocks its own
        # event loop for redis:// and resp:// (docs/lmcache.md).
        close_remote_connector(
            backend.connection,
            lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(10),
        )
        return found, same
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
        local_cpu.close()


def test_remote_url_file_takes_the_password_from_lmcache_remote_url(
    server: ServeProcess, clean_env: pytest.MonkeyPatch
) -> None:
    url = f"redis://:{TOKEN}@127.0.0.1:{server.ports['resp']}"
    clean_env.setenv("LMCACHE_REMOTE_URL", url)
    config = vllm_config(DEPLOY / "path-b-remote-url.yaml", clean_env)
    assert config.remote_url == url  # the variable wins over the file
    assert remote_round_trip(config) == (True, True)


def test_remote_url_without_the_variable_has_no_password(
    server: ServeProcess, clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # As shipped but without LMCACHE_REMOTE_URL: LMCache starts, and every call fails
    # authentication (what the file's header warns about).
    text = (DEPLOY / "path-b-remote-url.yaml").read_text()
    local = tmp_path / "remote.yaml"
    local.write_text(text.replace("127.0.0.1:6379", f"127.0.0.1:{server.ports['resp']}"))
    assert remote_round_trip(vllm_config(local, clean_env)) == (False, False)
    # And LMCache does not expand variables inside the file: ${...} stays literal.
    clean_env.setenv("KV_TOKEN", TOKEN)
    templated = tmp_path / "templated.yaml"
    templated.write_text(text.replace('"redis://127.0.0.1:6379"', '"redis://:${KV_TOKEN}@h:1"'))
    assert vllm_config(templated, clean_env).remote_url == "redis://:${KV_TOKEN}@h:1"


def test_resp_url_file_takes_the_password_from_lmcache_resp_password(
    server: ServeProcess, clean_env: pytest.MonkeyPatch
) -> None:
    clean_env.setenv("LMCACHE_RESP_PASSWORD", TOKEN)
    clean_env.setenv("LMCACHE_REMOTE_URL", f"resp://127.0.0.1:{server.ports['resp']}")
    config = vllm_config(DEPLOY / "path-b-resp-url.yaml", clean_env)
    assert config.save_unfull_chunk is False
    assert remote_round_trip(config) == (True, True)


def test_path_a_file_takes_the_token_from_the_environment(
    server: ServeProcess, clean_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from lmcache.v1.storage_backend import storage_plugin_launcher
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    text = (DEPLOY / "path-a-storage-plugin.yaml").read_text()
    assert TOKEN not in text
    assert "token:" not in text.replace("# storage", "")
    clean_env.setenv("EPISTEMIC_GRAPH_KVCACHE_TOKEN", TOKEN)
    config = vllm_config(DEPLOY / "path-a-storage-plugin.yaml", clean_env)
    config.extra_config["storage_plugin.epistemic_graph.base_url"] = server.url()
    config.chunk_size = KV_SHAPE[2]
    config.max_local_cpu_size = 0.02
    metadata = cpu_metadata("deploy/model", KV_SHAPE)
    local_cpu = LocalCPUBackend(config, metadata, dst_device="cpu")
    backends: dict[str, Any] = {}
    loop = asyncio.new_event_loop()
    try:
        storage_plugin_launcher(config, metadata, loop, local_cpu, "cpu", backends)
        backend = backends["epistemic_graph"]
        assert backend.client.config.token == TOKEN
        assert backend.client.config.lookup_timeout_s == 1.0  # the fast defaults
        assert backend.client.config.read_timeout_s == 2.0
        backend.close()
        # Without the token the plugin refuses to start with one clear message;
        # LMCache 0.5.6's launcher logs it once and goes on without the plugin.
        clean_env.delenv("EPISTEMIC_GRAPH_KVCACHE_TOKEN")
        with pytest.raises(ConfigurationError, match="no token"):
            type(backend)(config, metadata, local_cpu, loop)
        caplog.clear()
        backends.clear()
        storage_plugin_launcher(config, metadata, loop, local_cpu, "cpu", backends)
        assert backends == {}
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert len(errors) == 1
        assert "Failed to create backend epistemic_graph" in errors[0]
        assert "no token" in errors[0]
        assert "EPISTEMIC_GRAPH_KVCACHE_TOKEN" in errors[0]
    finally:
        loop.close()
        local_cpu.close()


def _mp_adapter(spec: dict[str, Any]) -> Any:
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    args = argparse.Namespace(l2_adapter=[json.dumps(spec)])
    return create_l2_adapter(parse_args_to_l2_adapters_config(args).adapters[0])


def _mp_store_and_lookup(adapter: Any) -> bool:
    from lmcache.v1.distributed.api import ObjectKey

    key = ObjectKey(chunk_hash=os.urandom(16), model_name="deploy/model", kv_rank=0)
    task = adapter.submit_store_task([key], [tensor_obj(os.urandom(4096))])
    done: dict[int, Any] = {}

    def stored() -> Any:
        done.update(adapter.pop_completed_store_tasks())
        return done.get(task)

    assert wait_for(adapter.get_store_event_fd(), stored).is_successful()
    task = adapter.submit_lookup_and_lock_task([key], {})
    bitmap = wait_for(
        adapter.get_lookup_and_lock_event_fd(),
        lambda: adapter.query_lookup_and_lock_result(task),
    )
    return bool(bitmap.test(0))


def test_mp_json_files_take_credentials_from_the_environment(
    server: ServeProcess, clean_env: pytest.MonkeyPatch
) -> None:
    native = json.loads((DEPLOY / "mp-native-plugin.json").read_text())
    resp = json.loads((DEPLOY / "mp-resp.json").read_text())
    assert "token" not in native["adapter_params"]
    assert "timeout_s" not in native["adapter_params"]  # the fast defaults apply
    assert resp["password"] == ""
    native["adapter_params"]["base_url"] = server.url()
    resp["port"] = server.ports["resp"]
    clean_env.setenv("EPISTEMIC_GRAPH_KVCACHE_TOKEN", TOKEN)
    clean_env.setenv("LMCACHE_RESP_PASSWORD", TOKEN)
    for spec in (native, resp):
        adapter = _mp_adapter(spec)
        try:
            assert _mp_store_and_lookup(adapter)
        finally:
            adapter.close()
    # The RESP adapter's own client authenticates with the password from the variable.
    from lmcache.lmcache_redis import LMCacheRedisClient

    client = LMCacheRedisClient("127.0.0.1", server.ports["resp"], 1, "", TOKEN)
    try:
        ok, err, _ = native_call(client, client.submit_batch_exists(["deploy/absent"]))
        assert ok, err
    finally:
        client.close()
