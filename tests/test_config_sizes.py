"""Sizes read as redis.conf reads them: `1k` = 1000, `1kb` = 1024, `1m` = 10**6,
`1mb` = 1024**2, `1g` = 10**9, `1gb` = 1024**3, case-insensitive; `KiB`/`MiB`/`GiB`
still powers of 1024.

Before, `--hot-capacity-bytes 4gb` meant 4 * 10**9, where redis.conf (and an operator
copying `maxmemory 4gb` from it) means 4 GiB. The table is checked against a real
redis-server too: what `CONFIG SET maxmemory <size>` stores is what we parse.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from epistemic_kvcache.config import effective_settings, load_config, parse_size
from helpers import eventually

REDIS_CONF_UNITS = [
    ("1k", 1000),
    ("1kb", 1024),
    ("1m", 1000**2),
    ("1mb", 1024**2),
    ("1g", 1000**3),
    ("1gb", 1024**3),
    ("4gb", 4 << 30),
    ("4GB", 4 << 30),
    ("4Gb", 4 << 30),
    ("4gB", 4 << 30),
    ("4G", 4 * 1000**3),
    ("512MB", 512 << 20),
    ("64KB", 64 << 10),
    ("100", 100),
]


@pytest.mark.parametrize(("text", "expected"), REDIS_CONF_UNITS)
def test_sizes_read_as_redis_conf(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4GiB", 4 << 30), ("512MiB", 512 << 20), ("64KiB", 64 << 10), ("1TiB", 1 << 40),
     ("1.5GiB", 3 << 29), ("2Gi", 2 << 30), ("1t", 10**12), ("1tb", 1 << 40)],
)  # fmt: skip
def test_iec_units_still_work(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_hot_capacity_4gb_is_4_gib() -> None:
    config = load_config({"hot_capacity_bytes": "4gb"}, {})
    assert config.store.hot_capacity_bytes == 4 << 30
    shown = {name: value for name, value, _ in effective_settings(config)}
    assert shown["hot_capacity_bytes"] == "4GiB"
    env = {"EPISTEMIC_GRAPH_KVCACHE_WARM_CAPACITY_BYTES": "512mb"}
    assert load_config({}, env).store.warm_capacity_bytes == 512 << 20


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[redis.Redis]:
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server")
    sock = tmp_path / "redis.sock"
    proc = subprocess.Popen(
        ["redis-server", "--port", "0", "--unixsocket", str(sock), "--save", "",
         "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        eventually(sock.exists, timeout=30, what="redis-server's socket")
        client = redis.Redis(unix_socket_path=str(sock))
        eventually(client.ping, timeout=30, what="redis-server answers")
        yield client
        client.close()
    finally:
        proc.terminate()
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # waiting for the process to exit, bounded
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.redis
def test_the_units_are_redis_servers(redis_server: redis.Redis) -> None:
    for text, expected in REDIS_CONF_UNITS:
        redis_server.config_set("maxmemory", text)
        theirs = int(redis_server.config_get("maxmemory")["maxmemory"])
        assert theirs == expected == parse_size(text), text
