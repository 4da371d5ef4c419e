"""What a Redis operator reads from a running server (issue 28): `INFO memory`'s
`used_memory` is the process's resident memory (the tenant's stored bytes have their own
field) and `CONFIG GET *` gives every setting with its source, to operators only; driven
with redis-py and redis-cli against a real server."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from epistemic_kvcache.config import load_config
from epistemic_kvcache.server.app import ServerHandle, ServerThread

OPS = "operators-token-0123456789abcdef"
TENANT = "tenant-token-0123456789abcdefgh"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    tmp = tmp_path_factory.mktemp("ops")
    tokens = tmp / "tokens"
    tokens.write_text(f"{OPS} ops\n{TENANT} tenant-a\n")
    tokens.chmod(0o600)
    toml = tmp / "kv.toml"
    toml.write_text('warm_capacity_bytes = "32MiB"\n')
    config = load_config(
        {
            "addr": "127.0.0.1:0",
            "resp_addr": "127.0.0.1:0",
            "backend": "memory",
            "token_file": str(tokens),
            "metrics_tenants": "ops",
            "stats_log_interval_s": "0",
            "config": str(toml),
        },
        {"EPISTEMIC_GRAPH_KVCACHE_HOT_CAPACITY_BYTES": "64MiB"},
    )
    with ServerThread(config) as handle:
        assert handle.resp is not None
        yield handle


def _client(server: ServerHandle, token: str) -> redis.Redis:
    assert server.resp is not None
    return redis.Redis(server.resp.host, server.resp.port, password=token)


def _rss() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_info_memory_used_memory_is_the_process_rss(server: ServerHandle) -> None:
    with _client(server, TENANT) as r:
        r.set("k", b"x" * 10_000)
        before = _rss()
        info = r.info("memory")
        after = _rss()
    # the server runs in this process: its RSS, not the tenant's 10 kB
    assert min(before, after) * 0.8 <= info["used_memory"] <= max(before, after) * 1.2
    assert info["used_memory"] > 10 * 1024 * 1024
    assert info["used_memory_rss"] == info["used_memory"]
    assert info["used_memory_peak"] >= info["used_memory"]
    human = str(info["used_memory_human"])  # Redis's form: 81.23M, 1.02G
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[human[-1]]
    assert abs(float(human[:-1]) * scale - info["used_memory"]) <= 0.01 * scale
    assert 10_000 <= info["tenant_resident_bytes"] < 20_000
    assert info["maxmemory"] == 96 * 1024 * 1024  # hot 64 MiB + warm 32 MiB


def test_config_get_star_gives_settings_and_sources_to_operators(server: ServerHandle) -> None:
    with _client(server, OPS) as r:
        table = r.config_get("*")
        assert table["hot_capacity_bytes"] == "64MiB"
        assert (
            table["hot_capacity_bytes.source"] == "env EPISTEMIC_GRAPH_KVCACHE_HOT_CAPACITY_BYTES"
        )
        assert table["warm_capacity_bytes"] == "32MiB"
        assert table["warm_capacity_bytes.source"].startswith("file ")
        assert table["backend"] == "memory"
        assert table["backend.source"] == "flag --backend"
        assert table["cold_capacity_bytes.source"] == "default"
        assert table["maxmemory"] == str(96 * 1024 * 1024)  # the Redis names stay
        assert OPS not in str(table)
        assert TENANT not in str(table)
        assert r.config_get("*.source")["dedup_scope.source"] == "default"
        assert r.config_get("hot_capacity*") == {
            "hot_capacity_bytes": "64MiB",
            "hot_capacity_bytes.source": "env EPISTEMIC_GRAPH_KVCACHE_HOT_CAPACITY_BYTES",
        }


def test_config_get_gives_tenants_only_the_redis_names(server: ServerHandle) -> None:
    with _client(server, TENANT) as r:
        table = r.config_get("*")
    assert "maxmemory" in table
    assert "appendonly" in table
    assert not [k for k in table if "_" in k or "." in k], table


@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli not installed")
def test_redis_cli_config_get_and_info_memory(server: ServerHandle) -> None:
    assert server.resp is not None
    base = ["redis-cli", "-h", server.resp.host, "-p", str(server.resp.port), "--no-auth-warning"]
    out = subprocess.run(
        [*base, "-a", OPS, "CONFIG", "GET", "hot_capacity_bytes*"],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout.split()  # fmt: skip
    assert out == [
        "hot_capacity_bytes", "64MiB",
        "hot_capacity_bytes.source", "env", "EPISTEMIC_GRAPH_KVCACHE_HOT_CAPACITY_BYTES",
    ]  # fmt: skip
    info = subprocess.run(
        [*base, "-a", TENANT, "INFO", "memory"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert "used_memory_human:" in info
    assert "tenant_resident_bytes:" in info
