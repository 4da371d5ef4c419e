"""The RESP fast path (GET/SET answered inline, durable SETs awaited as group-commit
futures) against redis-py over real sockets, on the durable and memory backends."""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import hangup
from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.server.context import Identity
from epistemic_kvcache.server.resp.dispatch import Dispatcher
from epistemic_kvcache.store import SharedKvIndex, SharedKvStoreBackend
from epistemic_kvcache.store.api import SharedKvBackend
from servers import start_listener

TOKEN = "fast-token"


class _Auth:
    def authenticate(self, credential: str) -> Identity:
        from epistemic_kvcache.errors import AuthError

        if credential != TOKEN:
            raise AuthError("invalid token")
        return Identity(tenant="t", subject="s", method="token")


class _Server:
    """A RESP listener of the shared harness (`servers.start_listener`) and a client."""

    def __init__(self, store: SharedKvBackend) -> None:
        self.listener = start_listener("resp", store=store, auth=_Auth())
        self.store = store
        self.ctx = self.listener.ctx
        self.port = self.listener.port
        self.close = self.listener.close

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=TOKEN, socket_timeout=30)


@pytest.fixture(params=["durable", "memory"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[_Server]:
    store: SharedKvBackend
    if request.param == "durable":
        store = SharedKvStoreBackend(
            tmp_path, StoreOptions(map_size_bytes=64 << 20, warm_capacity_bytes=0)
        )
    else:
        store = SharedKvIndex(StoreOptions(warm_capacity_bytes=0))
    s = _Server(store)
    yield s
    s.close()


def test_pipelined_mix_keeps_order_across_inline_pool_and_commit_paths(server: _Server) -> None:
    r = server.client()
    big = os.urandom(300 << 10)  # above the inline size: runs on the thread pool
    r.set("cold", b"c" * 5000)
    if isinstance(server.store, SharedKvStoreBackend):
        assert server.store.evict("t", "cold")  # its GET must read the disk (pool)
    p = r.pipeline(transaction=False)
    p.set("a", b"1")
    p.get("a")
    p.set("big", big)
    p.get("cold")
    p.set("a", b"2")  # replaces b"1"
    p.ping()
    p.get("a")
    p.get("missing")
    p.set("b", b"3", nx=True)  # not a plain SET: the general path
    p.get("big")
    p.execute_command("GeT", "b")  # type: ignore[no-untyped-call]  # mixed case
    assert p.execute() == [True, b"1", True, b"c" * 5000, True, True, b"2", None, True, big, b"3"]


def test_pipelined_plain_sets_share_group_commits(server: _Server) -> None:
    r = server.client()
    before = server.store.stats(None).extra.get("commit_batches", 0)
    p = r.pipeline(transaction=False)
    values = {f"k{i}": os.urandom(4096) for i in range(64)}
    for key, value in values.items():
        p.set(key, value)
    assert p.execute() == [True] * 64
    if isinstance(server.store, SharedKvStoreBackend):
        assert server.store.stats(None).extra["commit_batches"] - before < 32
    assert r.mget(list(values)) == list(values.values())


def test_a_4k_set_is_dispatched_once(server: _Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """One attempt per SET on both backends: the read callback's inline dispatcher
    starts it (a durable one as a group-commit future the connection's task awaits);
    nothing looks at it again. Counted on the real server: every entry into a
    dispatcher (`run_fast`, `execute`) that sees the SET, and the store's `put_nowait`.
    (Before: a durable SET was looked at by the read callback's fast path twice, gave
    up twice, then went through `execute`: three attempts.)"""
    r = server.client()
    r.ping()  # connected and authenticated
    seen: list[str] = []
    real_run_fast = Dispatcher.run_fast
    real_execute = Dispatcher.execute

    def run_fast(self: Dispatcher, *args: Any) -> int:
        framed = self.queue.peek()
        if framed is not None and bytes(framed[0]).upper() == b"SET":
            seen.append("run_fast")
        return real_run_fast(self, *args)

    async def execute(self: Dispatcher, cmd: Any) -> list[object]:
        if bytes(cmd[0]).upper() == b"SET":
            seen.append("execute")
        return await real_execute(self, cmd)

    puts: list[str] = []
    real_put_nowait = server.store.put_nowait

    def put_nowait(*args: Any, **kwargs: Any) -> Any:
        puts.append(args[1])
        return real_put_nowait(*args, **kwargs)

    monkeypatch.setattr(Dispatcher, "run_fast", run_fast)
    monkeypatch.setattr(Dispatcher, "execute", execute)
    monkeypatch.setattr(server.store, "put_nowait", put_nowait)
    # A SET that arrives before the connection's task is parked again (a loaded machine
    # can run the read callback first) is the task's, through `execute`: also one
    # attempt. So each SET must be seen exactly once, and SETs are sent until one is
    # taken on the inline path (the first, unless the machine interferes).
    paths: list[list[str]] = []
    for i in range(50):
        seen.clear()
        puts.clear()
        value = os.urandom(4096)
        assert r.set(f"once{i}", value) is True
        assert len(seen) == 1, seen
        assert puts == [f"once{i}"]
        assert r.get(f"once{i}") == value
        paths.append(list(seen))
        if seen == ["run_fast"]:
            break
    assert ["run_fast"] in paths, paths


def test_inline_errors_are_replies_not_disconnects(server: _Server) -> None:
    r = server.client()
    with pytest.raises(redis.ResponseError, match="invalid key"):
        r.get(b"\xff\xfe")
    with pytest.raises(redis.ResponseError, match="invalid key"):
        r.set(b"", b"x")
    assert r.set("ok", b"v") is True
    assert r.get("ok") == b"v"


def test_concurrent_clients_over_the_fast_path(server: _Server) -> None:
    def work(n: int) -> None:
        c = server.client()
        for i in range(50):
            c.set(f"c{n}:{i}", f"{n}:{i}".encode() * 100)
        for i in range(50):
            assert c.get(f"c{n}:{i}") == f"{n}:{i}".encode() * 100

    threads = [threading.Thread(target=work, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert server.store.stats("t").put_new == 300


def test_clients_hanging_up_mid_large_set_release_everything(server: _Server) -> None:
    """A SET cut off right after its header, inside its large bulk (begun straight from
    the first read), or before its final CRLF, behind answered GET/SETs in the same
    read: its buffer and its share of the in-flight budget go with the connection,
    nothing is stored, and the next client is served."""
    value = os.urandom(3 << 20)
    head = b"*3\r\n$3\r\nSET\r\n$6\r\ncut-me\r\n$%d\r\n" % len(value)
    first = b"*3\r\n$3\r\nSET\r\n$2\r\nok\r\n$1\r\nv\r\n*2\r\n$3\r\nGET\r\n$2\r\nok\r\n"
    auth = b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(TOKEN), TOKEN.encode())
    for cut in (0, 1000, 60_000, len(value) // 2, len(value)):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        sock.sendall(auth)
        assert sock.recv(100) == b"+OK\r\n"
        sock.sendall(first + head + value[:cut])
        hangup.reset(sock)  # RST mid-command
    assert hangup.wait_released(server.ctx.budget) == 0
    r = server.client()
    assert r.get("ok") == b"v"
    assert r.exists("cut-me") == 0
    assert r.set("cut-me", value)
    assert r.get("cut-me") == value


def test_lookups_are_answered_inline_while_the_thread_pool_is_busy(server: _Server) -> None:
    """EXISTS (one key or many, a key counted per mention) and STRLEN never wait for the
    thread pool: the store's index is in RAM. With every worker held, they still answer
    (before, each one was a thread-pool job: LMCache's per-chunk lookups queued behind
    loads, at a quarter of redis-server's rate)."""
    r = server.client()
    r.set("present", b"x" * 1000)
    r.set("other", b"y")
    executor = server.ctx.executor
    release = threading.Event()
    held = [executor.submit(release.wait, 60) for _ in range(executor._max_workers)]
    try:
        quick = redis.Redis(port=server.port, password=TOKEN, socket_timeout=20)
        assert quick.exists("present") == 1
        assert quick.exists("present", "absent", "present", "other") == 3
        assert quick.exists("absent") == 0
        assert quick.strlen("present") == 1000
        assert quick.strlen("absent") == 0
        assert quick.get("other") == b"y"
        pipe = quick.pipeline(transaction=False)
        for i in range(200):
            pipe.exists("present", f"absent-{i}")
            pipe.strlen("other")
        assert pipe.execute() == [1, 1] * 200
        assert quick.execute_command("exists", "other") == 1  # any spelling
        assert quick.execute_command("StrLen", "present") == 1000
        quick.close()
    finally:
        release.set()
        for f in held:
            f.result(10)
    counted = {route: server.ctx.metrics.series("resp", route, "ok").count
               for route in ("exists", "strlen")}  # fmt: skip
    assert counted == {"exists": 204, "strlen": 203}


def test_lmcache_c_client_lookup_is_answered_while_the_thread_pool_is_busy(
    server: _Server,
) -> None:
    """LMCache 0.5.6's C++ `LMCacheRedisClient` (MP RESP adapter, v1 `resp://`) looks
    keys up with one single-key EXISTS per key over its worker connections; with every
    thread-pool worker held, its batch lookup still completes (before EXISTS took the
    fast path it waited for the pool)."""
    lmcache_redis = pytest.importorskip("lmcache.lmcache_redis")
    r = server.client()
    keys = [f"lmc/{i:02d}" for i in range(16)]
    r.mset(dict.fromkeys(keys, b"kv"))
    r.close()
    client = lmcache_redis.LMCacheRedisClient("127.0.0.1", server.port, 4, "", TOKEN)

    def lookup(names: list[str], timeout_s: float) -> list[bool] | None:
        fid = int(client.submit_batch_exists(names))
        poller = select.poll()
        poller.register(client.event_fd(), select.POLLIN)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            poller.poll(100)
            for cfid, ok, err, res in client.drain_completions():
                if int(cfid) == fid:
                    assert ok, err
                    return [bool(x) for x in res]
        return None

    executor = server.ctx.executor
    release = threading.Event()
    held: list[Any] = []
    try:
        assert lookup(keys[:1], 30) == [True]  # connections and AUTH done before the hold
        held = [executor.submit(release.wait, 60) for _ in range(executor._max_workers)]
        names = [*keys, "lmc/absent", *keys[:4]]
        assert lookup(names, 20) == [True] * 16 + [False] + [True] * 4
    finally:
        release.set()
        for f in held:
            f.result(10)
        client.close()
