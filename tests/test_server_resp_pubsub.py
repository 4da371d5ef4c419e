"""Epoch bump notifications on the Redis wire: SUBSCRIBE kvcache:epochs.

A real RESP listener on uvloop in a background thread; subscribers are redis-py
`pubsub()` clients in RESP2 and RESP3 (push frames) and raw sockets for the exact bytes.
Bumps arrive through `ServerContext.notify_epoch` (what the HTTP bump route calls) and,
for bumps made by another process sharing the epoch registry, through the watcher task
(`watch_epochs_forever`) polling the registry.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from epistemic_kvcache.errors import AuthError
from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.server.app import retire_forever, watch_epochs_forever
from epistemic_kvcache.server.context import Identity
from epistemic_kvcache.store import SharedKvBackend, SharedKvIndex, SharedKvStoreBackend
from helpers import eventually
from servers import start_listener

TENANTS = {"token-alpha": "alpha", "token-bravo": "bravo"}
CHANNEL = "kvcache:epochs"
BUMPER = Path(__file__).with_name("epoch_bumper.py")
SRC = str(Path(__file__).resolve().parent.parent / "src")


class TokenAuth:
    def authenticate(self, credential: str) -> Identity:
        tenant = TENANTS.get(credential)
        if tenant is None:
            raise AuthError("invalid token")
        return Identity(tenant=tenant, subject=tenant, method="token")


class Server:
    """A RESP listener of the shared harness (`servers.start_listener`, token auth as
    above) with the pub/sub helpers these tests need."""

    def __init__(self, store: SharedKvBackend) -> None:
        self.listener = start_listener("resp", store=store, auth=TokenAuth())
        self.store = store
        self.ctx = self.listener.ctx
        self.loop = self.listener.loop
        self.port = self.listener.port
        self.call = self.listener.call
        self.close = self.listener.close
        self.tasks: list[asyncio.Task[Any]] = []

    def bump(self, tenant: str, scope: str) -> int:
        """What the HTTP bump route does: bump in the store, then notify."""
        epoch = self.store.epoch_bump(tenant, scope)
        self.call(self.ctx.notify_epoch, tenant, scope, epoch)
        return epoch

    def start_task(self, coro_fn: Callable[..., Any], *args: Any) -> None:
        """Run `coro_fn(*args)` as a task on the listener's loop (cancelled at close)."""

        async def start() -> None:
            self.tasks.append(asyncio.ensure_future(coro_fn(*args)))

        asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)

    def client(self, token: str = "token-alpha", protocol: int = 2) -> redis.Redis:
        return redis.Redis(port=self.port, password=token, protocol=protocol, socket_timeout=10)


@pytest.fixture
def server() -> Iterator[Server]:
    srv = Server(SharedKvIndex())
    yield srv
    srv.close()


def next_message(p: Any, timeout_s: float = 5.0) -> dict[str, Any] | None:
    """The next `message` (skipping confirmations), or None when none comes in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        msg = p.get_message(timeout=max(0.01, deadline - time.monotonic()))
        if msg is not None and msg["type"] == "message":
            return dict(msg)
    return None


def subscribed(srv: Server, tenant: str, n: int = 1) -> None:
    """Wait until `n` connections of `tenant` listen (SUBSCRIBE is processed async)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        subs = srv.call(lambda: len(srv.ctx.epochs.subscribers.get(tenant, ())))
        if subs == n:
            return
        time.sleep(0.01)
    raise AssertionError(f"{tenant} never had {n} subscribers")


@pytest.mark.parametrize("protocol", [2, 3], ids=["resp2", "resp3"])
def test_redis_py_pubsub_hears_its_tenants_bumps_only(server: Server, protocol: int) -> None:
    with (
        server.client("token-alpha", protocol) as ra,
        server.client("token-bravo", protocol) as rb,
    ):
        pa, pb = ra.pubsub(), rb.pubsub()
        pa.subscribe(CHANNEL)
        pb.subscribe(CHANNEL)
        confirm = pa.get_message(timeout=5)
        assert confirm is not None
        assert (confirm["type"], confirm["channel"], confirm["data"]) == (
            "subscribe",
            CHANNEL.encode(),
            1,
        )
        subscribed(server, "alpha")
        subscribed(server, "bravo")

        assert server.bump("alpha", "ctxbundle:docs") == 1
        msg = next_message(pa)
        assert msg is not None
        assert (msg["channel"], msg["data"]) == (CHANNEL.encode(), b"ctxbundle:docs 1")
        assert next_message(pb, 0.3) is None  # bravo hears nothing of alpha

        assert server.bump("bravo", "ctxbundle:docs") == 1
        msg = next_message(pb)
        assert msg is not None
        assert msg["data"] == b"ctxbundle:docs 1"
        assert next_message(pa, 0.3) is None

        # the subscriber's connection still serves PING
        pa.ping()
        pong = pa.get_message(timeout=5)
        assert pong is not None
        assert pong["type"] == "pong"

        pa.unsubscribe(CHANNEL)
        assert pa.get_message(timeout=5)["type"] == "unsubscribe"  # type: ignore[index]
        server.call(lambda: None)  # let the loop settle
        server.bump("alpha", "ctxbundle:docs")
        assert next_message(pa, 0.3) is None
        pa.close()
        pb.close()


def test_each_epoch_is_published_once(server: Server) -> None:
    with server.client() as r:
        p = r.pubsub()
        p.subscribe(CHANNEL)
        subscribed(server, "alpha")
        server.call(server.ctx.notify_epoch, "alpha", "s", 1)
        server.call(server.ctx.notify_epoch, "alpha", "s", 1)  # same epoch again
        server.call(server.ctx.notify_epoch, "alpha", "s", 0)  # an older one
        server.call(server.ctx.notify_epoch, "alpha", "s", 3)
        got = [next_message(p, 0.5) for _ in range(3)]
        assert [m["data"] if m else None for m in got] == [b"s 1", b"s 3", None]
        p.close()


def raw(port: int, *lines: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    for line in lines:
        sock.sendall(line)
    return sock


def read_exact(sock: socket.socket, expected: bytes) -> None:
    buf = b""
    while len(buf) < len(expected):
        chunk = sock.recv(65536)
        assert chunk, f"closed after {buf!r}"
        buf += chunk
    assert buf == expected


def read_hello(sock: socket.socket) -> None:
    """Consume a RESP3 HELLO map (it ends with the empty `modules` array)."""
    buf = b""
    while not buf.endswith(b"$7\r\nmodules\r\n*0\r\n"):
        chunk = sock.recv(65536)
        assert chunk, f"closed after {buf!r}"
        buf += chunk
    assert buf.startswith(b"%7\r\n")


def test_resp2_subscribed_mode_exact_bytes(server: Server) -> None:
    with raw(server.port, b"AUTH token-alpha\r\n") as sock:
        read_exact(sock, b"+OK\r\n")
        sock.sendall(b"SUBSCRIBE kvcache:epochs other\r\n")
        read_exact(
            sock,
            b"*3\r\n$9\r\nsubscribe\r\n$14\r\nkvcache:epochs\r\n:1\r\n"
            b"*3\r\n$9\r\nsubscribe\r\n$5\r\nother\r\n:2\r\n",
        )
        sock.sendall(b"GET k\r\nPING\r\nPING hi\r\n")
        read_exact(
            sock,
            b"-ERR Can't execute 'get': only (P|S)SUBSCRIBE / (P|S)UNSUBSCRIBE / PING / "
            b"QUIT / RESET are allowed in this context\r\n"
            b"*2\r\n$4\r\npong\r\n$0\r\n\r\n"
            b"*2\r\n$4\r\npong\r\n$2\r\nhi\r\n",
        )
        subscribed(server, "alpha")
        server.call(server.ctx.notify_epoch, "alpha", "docs", 7)
        read_exact(sock, b"*3\r\n$7\r\nmessage\r\n$14\r\nkvcache:epochs\r\n$6\r\ndocs 7\r\n")
        sock.sendall(b"UNSUBSCRIBE\r\n")
        read_exact(
            sock,
            b"*3\r\n$11\r\nunsubscribe\r\n$14\r\nkvcache:epochs\r\n:1\r\n"
            b"*3\r\n$11\r\nunsubscribe\r\n$5\r\nother\r\n:0\r\n",
        )
        sock.sendall(b"UNSUBSCRIBE\r\nGET k\r\n")
        read_exact(sock, b"*3\r\n$11\r\nunsubscribe\r\n$-1\r\n:0\r\n$-1\r\n")
    assert server.call(lambda: dict(server.ctx.epochs.subscribers)) == {}


def test_resp3_push_frames_and_commands_while_subscribed(server: Server) -> None:
    with raw(server.port, b"HELLO 3 AUTH default token-alpha\r\n") as sock:
        read_hello(sock)
        sock.sendall(b"SUBSCRIBE kvcache:epochs\r\n")
        read_exact(sock, b">3\r\n$9\r\nsubscribe\r\n$14\r\nkvcache:epochs\r\n:1\r\n")
        sock.sendall(b"SET k v\r\nGET k\r\nPING\r\n")  # RESP3: any command is allowed
        read_exact(sock, b"+OK\r\n$1\r\nv\r\n+PONG\r\n")
        subscribed(server, "alpha")
        server.call(server.ctx.notify_epoch, "alpha", "docs", 2)
        read_exact(sock, b">3\r\n$7\r\nmessage\r\n$14\r\nkvcache:epochs\r\n$6\r\ndocs 2\r\n")
        sock.sendall(b"RESET\r\n")
        read_exact(sock, b"+RESET\r\n")
    assert server.call(lambda: dict(server.ctx.epochs.subscribers)) == {}


def test_subscribe_needs_auth_and_a_channel(server: Server) -> None:
    with raw(server.port, b"SUBSCRIBE kvcache:epochs\r\n") as sock:
        read_exact(sock, b"-NOAUTH Authentication required.\r\n")
        sock.sendall(b"AUTH token-alpha\r\nSUBSCRIBE\r\n")
        read_exact(sock, b"+OK\r\n-ERR wrong number of arguments for 'subscribe' command\r\n")


def test_auth_as_another_tenant_moves_the_subscription(server: Server) -> None:
    with raw(server.port, b"HELLO 3 AUTH default token-alpha\r\n") as sock:
        read_hello(sock)
        sock.sendall(b"SUBSCRIBE kvcache:epochs\r\n")
        read_exact(sock, b">3\r\n$9\r\nsubscribe\r\n$14\r\nkvcache:epochs\r\n:1\r\n")
        sock.sendall(b"AUTH token-bravo\r\n")
        read_exact(sock, b"+OK\r\n")
        subscribed(server, "bravo")
        assert server.call(lambda: "alpha" in server.ctx.epochs.subscribers) is False
        server.call(server.ctx.notify_epoch, "alpha", "a", 1)
        server.call(server.ctx.notify_epoch, "bravo", "b", 1)
        read_exact(sock, b">3\r\n$7\r\nmessage\r\n$14\r\nkvcache:epochs\r\n$3\r\nb 1\r\n")


# -- bumps made by another process: the watcher -------------------------------------------


class Peer:
    """`epoch_bumper.py`: another store process on the same epoch registry."""

    def __init__(self, persist_dir: Path, epoch_dir: Path) -> None:
        env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, str(BUMPER), str(persist_dir), str(epoch_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "READY"

    def ask(self, *words: str) -> str:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(" ".join(words) + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.close()
        assert self.proc.wait(30) == 0
        self.proc.stdout.close()


def test_watcher_publishes_bumps_made_by_another_process(tmp_path: Path) -> None:
    epochs = tmp_path / "epochs"
    srv = Server(
        SharedKvStoreBackend(
            tmp_path / "here", StoreOptions(map_size_bytes=1 << 26), epoch_dir=epochs
        )
    )
    peer = Peer(tmp_path / "peer", epochs)
    try:
        srv.start_task(watch_epochs_forever, srv.ctx, 0.05)
        assert peer.ask("bump", "alpha", "docs") == "1"  # before this server knew the scope
        srv.call(srv.ctx.watch_epoch, "alpha", "docs")  # e.g. a tagged PUT came through here
        srv.call(srv.ctx.watch_epoch, "bravo", "docs")
        with srv.client("token-alpha", 3) as r:
            p = r.pubsub()
            p.subscribe(CHANNEL)
            subscribed(srv, "alpha")
            eventually(  # the watcher's first read is a baseline, not news
                lambda: srv.call(lambda: srv.ctx.epochs.known.get(("alpha", "docs"))) is not None,
                what="the watcher's baseline",
            )
            assert next_message(p, 0.2) is None
            t0 = time.monotonic()
            assert peer.ask("bump", "alpha", "docs") == "2"
            msg = next_message(p, 30)
            assert msg is not None
            assert msg["data"] == b"docs 2"
            # On one of the next polls (every 0.05 s; the server's default is about once a
            # second): well within 10 s on a loaded machine too.
            assert time.monotonic() - t0 < 10
            # a bump through this server is published once, not again by the watcher
            assert srv.bump("alpha", "docs") == 3
            assert next_message(p, 5)["data"] == b"docs 3"  # type: ignore[index]
            assert next_message(p, 0.3) is None
            # other tenants' bumps stay with them
            assert peer.ask("bump", "bravo", "docs") == "1"
            assert next_message(p, 0.3) is None
            p.close()
    finally:
        peer.close()
        srv.close()


def test_retire_task_reclaims_stale_entries(server: Server) -> None:
    store = server.store
    for i in range(50):
        store.put("alpha", f"k{i}", b"v%d" % i, epoch_scope="docs")
    store.epoch_bump("alpha", "docs")
    assert store.stats("alpha").unique_blocks == 50
    server.start_task(retire_forever, server.ctx, 0.02)
    deadline = time.monotonic() + 5
    while store.stats("alpha").unique_blocks and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.stats("alpha").unique_blocks == 0
    assert store.count("alpha") == 0


@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli not installed")
def test_redis_cli_subscribe(server: Server) -> None:
    proc = subprocess.Popen(
        [
            *("redis-cli", "-p", str(server.port), "--no-auth-warning", "-a", "token-alpha"),
            *("SUBSCRIBE", CHANNEL),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        subscribed(server, "alpha")
        server.call(server.ctx.notify_epoch, "alpha", "ctxbundle:docs", 5)
        lines = [proc.stdout.readline().strip() for _ in range(6)]
        assert lines == ["subscribe", CHANNEL, "1", "message", CHANNEL, "ctxbundle:docs 5"]
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
