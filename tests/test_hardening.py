"""Server hardening against hostile or careless clients (findings of the security review).

A real server (`ServerThread`, durable store, two tenants by token file) on 127.0.0.1
port 0, driven by redis-py, urllib3 and raw sockets.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from epistemic_kvcache.config import load_config
from epistemic_kvcache.server.app import ServerHandle, ServerThread

TOKEN_A = "hardening-token-tenant-a-0123456789"
TOKEN_B = "hardening-token-tenant-b-0123456789"
TOKEN_OPS = "hardening-token-operator-0123456789"


def start(tmp: Any, **overrides: str) -> tuple[ServerThread, ServerHandle]:
    tokens = tmp / "tokens"
    tokens.write_text(f"{TOKEN_A} tenant-a\n{TOKEN_B} tenant-b\n{TOKEN_OPS} default\n")
    tokens.chmod(0o600)
    values = {
        "addr": "127.0.0.1:0",
        "resp_addr": "127.0.0.1:0",
        "backend": "durable",
        "persist_dir": str(tmp / "data"),
        "token_file": str(tokens),
        "stats_log_interval_s": "0",
        "hot_capacity_bytes": "64MiB",
        "warm_capacity_bytes": "0",
        **overrides,
    }
    thread = ServerThread(load_config(values, {}))
    return thread, thread.start()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    thread, handle = start(tmp_path_factory.mktemp("hardening"))
    yield handle
    thread.stop()


def resp_client(server: ServerHandle, token: str = TOKEN_B, **kw: Any) -> redis.Redis:
    assert server.resp is not None
    kw.setdefault("socket_timeout", 30)
    return redis.Redis(server.resp.host, server.resp.port, password=token, **kw)


# -- 1. SCAN MATCH / CONFIG GET: no catastrophic backtracking --------------------------------


@pytest.mark.parametrize(
    "pattern", ["*a*a*a*b", "*a*a*a*a*a*a*a*a*a*a*b", "*" + "?" * 200 + "b*"], ids=range(3)
)
def test_scan_match_pattern_cannot_freeze_the_server(server: ServerHandle, pattern: str) -> None:
    r = resp_client(server)
    try:
        r.set("a" * 1000, b"v")
        started = time.monotonic()
        cursor, keys = r.scan(0, match=pattern, count=10000)
        assert keys == []
        assert time.monotonic() - started < 0.5
        r.set("a" * 998 + "zb", b"v")
        matched: list[bytes] = []
        cursor = 0
        while True:
            cursor, keys = r.scan(cursor, match=pattern, count=10000)
            matched += keys
            if cursor == 0:
                break
        assert matched == [b"a" * 998 + b"zb"]
    finally:
        r.delete("a" * 1000, "a" * 998 + "zb")
        r.close()


def test_scan_and_config_refuse_overlong_patterns(server: ServerHandle) -> None:
    r = resp_client(server)
    try:
        with pytest.raises(redis.ResponseError, match="pattern too long"):
            r.scan(0, match="*" * 257)
        with pytest.raises(redis.ResponseError, match="pattern too long"):
            r.config_get("*" * 257)
        assert r.config_get("max*") == {
            "maxclients": "1024",
            "maxmemory": "0",
            "maxmemory-policy": "allkeys-lru",
        }
        assert r.ping()  # the connection is still usable
    finally:
        r.close()


def test_server_keeps_answering_during_a_worst_case_scan(server: ServerHandle) -> None:
    writer = resp_client(server, TOKEN_A)
    keys = {f"{'a' * 1000}{i:05d}": b"v" for i in range(2000)}
    writer.mset(keys)
    pattern = "*" + "?a" * 120 + "b*"  # ~0.5 ms of matching per key
    done = threading.Event()
    scanned: list[int] = []

    def scan_all() -> None:
        r = resp_client(server, TOKEN_A)
        cursor = 0
        while True:
            cursor, found = r.scan(cursor, match=pattern, count=10000)
            scanned.append(len(found))
            if cursor == 0:
                break
        r.close()
        done.set()

    th = threading.Thread(target=scan_all)
    th.start()
    probe = resp_client(server, TOKEN_B)
    worst = 0.0
    try:
        while not done.is_set():
            t0 = time.monotonic()
            probe.ping()
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.01)
    finally:
        th.join(60)
        probe.close()
        writer.delete(*keys)
        writer.close()
    assert done.is_set()
    assert sum(scanned) == 0
    assert worst < 0.25, f"a PING waited {worst:.2f}s behind a SCAN"
