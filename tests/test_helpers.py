"""The test helpers themselves (tests/helpers.py): polling, port reservations, fake clock.

The port tests reproduce the race that made a cluster test fail on a loaded machine: a
port released between a server's death and its restart is taken by another process.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

from helpers import FakeClock, eventually, eventually_async, held_port, reserve_port
from redis_cluster import LocalCluster


def test_eventually_returns_the_first_truthy_value_and_names_what_it_waited_for() -> None:
    calls = iter([0, None, "", 7])
    assert eventually(lambda: next(calls), timeout=5, interval=0) == 7
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"not within 0.2 s: the moon; last: 0"):
        eventually(lambda: 0, timeout=0.2, interval=0.01, what="the moon")
    assert time.monotonic() - t0 < 5

    def not_yet() -> bool:
        raise AssertionError("inner")

    with pytest.raises(AssertionError, match="last: AssertionError"):
        eventually(not_yet, timeout=0.05, interval=0.01)


def test_eventually_async_awaits_async_and_sync_predicates() -> None:
    async def main() -> None:
        n = 0

        async def ready() -> bool:
            nonlocal n
            n += 1
            return n >= 3

        assert await eventually_async(ready, timeout=5, interval=0) is True
        assert await eventually_async(lambda: "sync", timeout=1) == "sync"
        with pytest.raises(AssertionError, match="not within"):
            await eventually_async(lambda: False, timeout=0.05, interval=0.01)

    asyncio.run(main())


def test_fake_clock_moves_only_when_told() -> None:
    clock = FakeClock(100.0)
    assert clock() == 100.0
    clock.advance(0.5)
    assert clock() == 100.5


def test_a_reserved_port_is_nobody_elses_but_a_reuseaddr_server_may_listen_on_it() -> None:
    with reserve_port() as held:
        with socket.socket() as other, pytest.raises(OSError) as err:
            other.bind(("127.0.0.1", held.port))
        assert err.value.errno == errno.EADDRINUSE

        async def serve_twice() -> None:  # a server, stopped, and started again on it
            for _ in range(2):
                srv = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", held.port)
                _r, w = await asyncio.open_connection("127.0.0.1", held.port)
                w.close()
                srv.close()
                await srv.wait_closed()

        asyncio.run(serve_twice())
    assert held._sock.fileno() == -1  # given back when closed


def test_a_held_port_refuses_connections() -> None:
    port = held_port()
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.1", port))


@pytest.mark.redis
def test_a_killed_redis_server_restarts_on_its_port_and_nobody_takes_it_meanwhile(
    tmp_path: Path,
) -> None:
    """Before: the port was released before redis-server started (bind 0, close), so
    after a SIGKILL anything could take it, and the restart failed."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (make sysdeps)")
    with reserve_port() as held:
        cmd = ["redis-server", "--port", str(held.port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--dir", str(tmp_path)]  # fmt: skip

        def pong() -> bool:
            with redis.Redis(port=held.port, socket_connect_timeout=1) as r:
                try:
                    return bool(r.ping())
                except redis.ConnectionError:
                    return False

        for _ in range(2):
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                eventually(pong, timeout=30, what="redis-server answers")
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
                with socket.socket() as thief, pytest.raises(OSError):
                    thief.bind(("127.0.0.1", held.port))  # the port stays ours while it is down
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)


@pytest.mark.redis
@pytest.mark.slow
def test_local_cluster_holds_its_nodes_ports_across_a_kill(tmp_path: Path) -> None:
    with LocalCluster(tmp_path, masters=3, replicas=0) as cluster:
        node = cluster.nodes[0]
        cluster.kill(node)
        for port in (node.port, node.bus_port):
            with socket.socket() as thief, pytest.raises(OSError):
                thief.bind(("127.0.0.1", port))
        cluster.restart(node)
        cluster.wait_healthy()
    assert all(h._sock.fileno() == -1 for h in node.held)  # given back with the cluster
