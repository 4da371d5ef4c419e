"""LMCache's real MP server (`lmcache server`, CPU) with our native L2 plugin.

- The admin API's `DELETE /cache/objects` reaches `NativeConnectorL2Adapter.delete` ->
  our `submit_batch_delete`, and the key is gone from our server (before this plugin
  had a delete, LMCache answered `{"deleted": 1, "ok": true}` and deleted nothing).
- A wrong token stops `lmcache server` at start with one clear error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("lmcache")

from epistemic_kvcache.client import EpistemicGraphKVBackend
from helpers import held_port as free_port
from servers import TOKEN, ServeProcess

pytestmark = [pytest.mark.lmcache, pytest.mark.slow]

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "lmcache"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    s = ServeProcess(tmp_path_factory.mktemp("kv"))
    yield s
    s.stop()


def lmcache_server_cmd(kv_url: str, http_port: int) -> list[str]:
    """`lmcache server` with the shipped mp-native-plugin.json (base_url changed)."""
    spec = json.loads((DEPLOY / "mp-native-plugin.json").read_text())
    spec["adapter_params"]["base_url"] = kv_url
    lmcache = str(Path(sys.executable).parent / "lmcache")
    return [lmcache, "server", "--host", "127.0.0.1", "--port", str(free_port()),
            "--http-host", "127.0.0.1", "--http-port", str(http_port),
            "--l1-size-gb", "0.1", "--eviction-policy", "LRU",
            "--l2-adapter", json.dumps(spec), "--disable-observability"]  # fmt: skip


def env(token: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("EPISTEMIC_GRAPH_")}
    return {**base, "EPISTEMIC_GRAPH_KVCACHE_TOKEN": token, "LMCACHE_DISABLE_BANNER": "1",
            "LMCACHE_TRACK_USAGE": "false", "PYTHONWARNINGS": "ignore"}  # fmt: skip


def call(url: str, method: str = "GET", doc: object = None) -> tuple[int, bytes]:
    data = None if doc is None else json.dumps(doc).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_admin_delete_reaches_our_server(server: ServeProcess, tmp_path: Path) -> None:
    http_port = free_port()
    log = (tmp_path / "lmcache.log").open("w")
    proc = subprocess.Popen(
        lmcache_server_cmd(server.url(), http_port),
        env=env(TOKEN),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        admin = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                status, body = call(f"{admin}/config/adapters")
                if status == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None, (tmp_path / "lmcache.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "lmcache server did not start"
            time.sleep(0.5)
        assert json.loads(body)["adapters"][0]["type_name"] == "native_plugin"
        # Two chunks as the native plugin names them (LMCache's ObjectKey serialisation).
        hashes = [os.urandom(16).hex() for _ in range(2)]
        keys = [f"org/model@00000000@0@{h}@tenant" for h in hashes]
        with EpistemicGraphKVBackend(base_url=server.url(), token=TOKEN) as kv:
            for k in keys:
                assert kv.put(k, os.urandom(4096))
            status, body = call(
                f"{admin}/cache/objects",
                "DELETE",
                {"keys": [{"chunk_hash_hex": hashes[0], "model_name": "org/model",
                           "kv_rank": 0, "cache_salt": "tenant"}], "tier": "l2"},
            )  # fmt: skip
            assert status == 200, body
            assert json.loads(body) == {"deleted": 1, "skipped": 0, "ok": True}
            assert kv.exists_many(keys) == [False, True]  # really gone; the other stays
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def test_wrong_token_stops_lmcache_at_start_with_one_clear_error(server: ServeProcess) -> None:
    done = subprocess.run(
        lmcache_server_cmd(server.url(), free_port()),
        env=env("wrong-token-wrong-token"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "refused the token (401); check EPISTEMIC_GRAPH_KVCACHE_TOKEN" in out
    assert out.count("Traceback") == 1
