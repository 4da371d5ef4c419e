"""Pipelines as Redis serves them: a client may write a whole pipeline before it reads.

redis-server keeps reading and running commands while a client has not read its replies,
queueing them up to the client's output buffer limit, past which it disconnects the
client. So do we (server/resp/connection.py `_may_run_ahead`), within two bounds that
keep memory in check: `client_output_buffer_limit_bytes` per connection (over it: the
client is disconnected and the refusal logged) and the tenant's share of buffered bytes
(`max_tenant_inflight_bytes`; spent: the connection waits until its peer reads, and
stops reading). Real sockets and redis-py against a real RESP listener; redis-server
runs the same pipelines in the same test where its answer is the reference.
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from epistemic_kvcache.server.context import ServerLimits
from epistemic_kvcache.server.resp import RespConnection
from epistemic_kvcache.store import SharedKvIndex
from helpers import eventually
from servers import Listener, start_listener

TOKEN = "resp-pipeline-token-0123456789"
KiB, MiB = 1024, 1024 * 1024


def cmd(*args: bytes) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def _listener(**limits: int) -> Listener:
    return start_listener(
        "resp", store=SharedKvIndex(), limits=ServerLimits(**limits), tokens={TOKEN: "alpha"}
    )


@pytest.fixture
def listener() -> Iterator[Listener]:
    srv = _listener()
    yield srv
    srv.close()


def _set_get_pipeline(n: int, size: int) -> tuple[bytes, bytes]:
    """n x (SET k<i> <size bytes>, GET k<i>), and the replies redis-server gives."""
    wire, replies = [cmd(b"AUTH", TOKEN.encode())], [b"+OK\r\n"]
    for i in range(n):
        value = bytes([i % 251]) * size
        wire += [cmd(b"SET", b"k%d" % i, value), cmd(b"GET", b"k%d" % i)]
        replies += [b"+OK\r\n", b"$%d\r\n%s\r\n" % (size, value)]
    return b"".join(wire), b"".join(replies)


def _send_all_then_read(target: int | socket.socket, wire: bytes, expect: int) -> bytes:
    """Write `wire` whole before reading anything (as a pipelining client does), then read
    `expect` bytes, on a new connection to port `target` or on the socket given. The
    send has a generous timeout: a server that stops reading while its replies are unread
    blocks it, and the test fails there instead of hanging."""
    if isinstance(target, int):
        with socket.create_connection(("127.0.0.1", target), timeout=60) as sock:
            return _send_all_then_read(sock, wire, expect)
    target.sendall(wire)
    got = bytearray()
    while len(got) < expect:
        chunk = target.recv(1 << 20)
        if not chunk:
            break
        got += chunk
    return bytes(got)


@pytest.mark.parametrize("n", [200, 400])
def test_a_pipeline_written_before_reading_completes(listener: Listener, n: int) -> None:
    """N x (SET 64 KiB, GET) written in one go before reading (12.5 MiB at N=200: far
    more than the socket buffers hold). Before, the server stopped running commands once
    the peer's socket buffer filled, then stopped reading: the client's send blocked."""
    wire, replies = _set_get_pipeline(n, 64 * KiB)
    assert _send_all_then_read(listener.port, wire, len(replies)) == replies


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_redis_server_runs_the_same_pipeline(tmp_path: Path) -> None:
    """The reference: redis-server answers the same pipeline the same way (on a unix
    socket: no TCP port to pick)."""
    path = tmp_path / "redis.sock"
    proc = subprocess.Popen(
        ["redis-server", "--port", "0", "--unixsocket", str(path), "--save", "",
         "--appendonly", "no", "--dir", str(tmp_path), "--requirepass", TOKEN],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        eventually(path.exists, what="redis-server's socket")
        wire, replies = _set_get_pipeline(200, 64 * KiB)
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(60)
            eventually(lambda: sock.connect_ex(str(path)) == 0, what="redis-server accepts")
            assert _send_all_then_read(sock, wire, len(replies)) == replies
    finally:
        proc.terminate()
        proc.wait(10)


def test_redis_py_pipeline_of_5000_commands(listener: Listener) -> None:
    """redis-py's `pipeline(transaction=False)` packs every command, sends them all, then
    reads: 5,000 commands (2,500 SETs and GETs of 16 KiB) ended in "Timeout writing to
    socket" before."""
    client = redis.Redis(port=listener.port, password=TOKEN, socket_timeout=30)
    try:
        pipe = client.pipeline(transaction=False)
        for i in range(2500):
            pipe.set(f"p{i}", bytes([i % 251]) * 16384)
            pipe.get(f"p{i}")
        results = pipe.execute()
        assert len(results) == 5000
        for i in range(2500):
            assert results[2 * i] is True
            assert results[2 * i + 1] == bytes([i % 251]) * 16384
    finally:
        client.close()


def test_a_client_over_its_output_limit_is_disconnected_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Redis's rule past the limit: replies unread beyond `client_output_buffer_limit_bytes`
    disconnect the client (logged as a refusal); the server serves others meanwhile."""
    srv = _listener(client_output_buffer_limit_bytes=2 * MiB)
    try:
        srv.store.put("alpha", "big", b"b" * (256 * KiB))
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * KiB)
            with caplog.at_level(logging.WARNING, logger="epistemic_kvcache"):
                sock.sendall(cmd(b"AUTH", TOKEN.encode()) + cmd(b"GET", b"big") * 200)
                eventually(
                    lambda: any(
                        "client_output_buffer_limit_bytes" in r.message for r in caplog.records
                    ),
                    what="the refusal logged",
                )
            # what the server wrote before it cut the client, then the end of the stream
            assert _read_until_closed(sock) < 200 * 256 * KiB
        eventually(lambda: not _protocols(srv), what="the connection gone")
        client = redis.Redis(port=srv.port, password=TOKEN, socket_timeout=30)
        assert client.get("big") == b"b" * (256 * KiB)  # others are served
        client.close()
    finally:
        srv.close()


def test_a_client_that_does_not_read_is_not_served_past_its_tenant_share() -> None:
    """With the tenant's share of buffered bytes held by unread replies, the connection
    runs nothing more and stops reading; the memory it holds stays near the share, and
    every reply comes once it reads."""
    share = 8 * MiB
    srv = _listener(max_tenant_inflight_bytes=share, client_output_buffer_limit_bytes=64 * MiB)
    size, n = MiB, 64
    try:
        srv.store.put("alpha", "wp", b"w" * size)
        hits0 = srv.store.stats("alpha").get_hits
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * KiB)
        try:
            sock.sendall(cmd(b"AUTH", TOKEN.encode()))
            assert sock.recv(5) == b"+OK\r\n"
            sock.sendall(cmd(b"GET", b"wp") * n)
            eventually(  # the share is held by replies: the server waits for us
                lambda: srv.ctx.budget.used_by("alpha") >= share - size, what="share spent"
            )
            served = srv.store.stats("alpha").get_hits - hits0
            assert served < n, served
            assert srv.ctx.budget.used_by("alpha") <= share + 2 * size
            reply = b"$%d\r\n" % size + b"w" * size + b"\r\n"
            got = bytearray()
            while len(got) < len(reply) * n:
                chunk = sock.recv(1 << 20)
                assert chunk, "connection closed"
                got += chunk
            assert bytes(got) == reply * n
            assert srv.store.stats("alpha").get_hits - hits0 == n
        finally:
            sock.close()
    finally:
        srv.close()


def _read_until_closed(sock: socket.socket) -> int:
    """Bytes read until the server closed the connection (EOF or reset)."""
    got = 0
    try:
        while chunk := sock.recv(1 << 20):
            got += len(chunk)
    except ConnectionResetError:
        pass
    return got


def _protocols(srv: Listener) -> list[RespConnection]:
    return [p for p in srv.ctx.live if isinstance(p, RespConnection)]


def test_pipelines_on_many_connections_at_once(listener: Listener) -> None:
    """Several clients each write a pipeline before reading, at the same time: all
    complete (none holds another up)."""
    wire, replies = _set_get_pipeline(100, 32 * KiB)
    results: list[bool] = []

    def one() -> None:
        results.append(_send_all_then_read(listener.port, wire, len(replies)) == replies)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [True] * 4
