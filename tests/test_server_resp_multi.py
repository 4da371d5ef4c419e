"""MULTI / EXEC / DISCARD against real peers (redis-py's default transactional pipeline,
redis-cli, raw sockets), on the memory and durable backends, following Redis' semantics:
+QUEUED, EXECABORT after a refused command, per-command runtime errors inside EXEC, the
tenant held alone while EXEC runs, queued bytes counted against the in-flight budget."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from epistemic_kvcache.errors import AuthError
from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.server.context import Identity, ServerLimits
from epistemic_kvcache.server.resp.session import MAX_MULTI_COMMANDS, TenantGates
from epistemic_kvcache.store import SharedKvIndex, SharedKvStoreBackend
from epistemic_kvcache.store.api import SharedKvBackend
from servers import start_listener

TOKENS = {"tok-a": "alpha", "tok-b": "bravo"}


class _Auth:
    def authenticate(self, credential: str) -> Identity:
        tenant = TOKENS.get(credential)
        if tenant is None:
            raise AuthError("invalid token")
        return Identity(tenant=tenant, subject=tenant, method="token")


class _Server:
    """A RESP listener of the shared harness (`servers.start_listener`) and clients."""

    def __init__(self, store: SharedKvBackend, limits: ServerLimits | None = None) -> None:
        self.listener = start_listener("resp", store=store, limits=limits, auth=_Auth())
        self.store = store
        self.ctx = self.listener.ctx
        self.port = self.listener.port
        self.close = self.listener.close

    def client(self, token: str = "tok-a", **kwargs: Any) -> redis.Redis:
        return redis.Redis(port=self.port, password=token, socket_timeout=30, **kwargs)


def _store(kind: str, path: Path) -> SharedKvBackend:
    if kind == "durable":
        return SharedKvStoreBackend(
            path, StoreOptions(map_size_bytes=64 << 20, warm_capacity_bytes=0)
        )
    return SharedKvIndex(StoreOptions(warm_capacity_bytes=0))


@pytest.fixture(params=["durable", "memory"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[_Server]:
    s = _Server(_store(request.param, tmp_path))
    yield s
    s.close()


class _Raw:
    """A raw RESP2 connection (for what redis-py will not send), authenticated."""

    def __init__(self, port: int, token: str = "tok-a") -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.buf = b""
        assert self.call("AUTH", token) == b"+OK"

    def send(self, *args: str | bytes) -> None:
        out = b"*%d\r\n" % len(args)
        for a in args:
            b = a.encode() if isinstance(a, str) else a
            out += b"$%d\r\n%s\r\n" % (len(b), b)
        self.sock.sendall(out)

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def read(self) -> Any:
        """One reply: simple/error lines as bytes with their prefix; arrays as lists."""
        line = self._line()
        if line[:1] == b"*":
            n = int(line[1:])
            return None if n < 0 else [self.read() for _ in range(n)]
        if line[:1] == b"$":
            n = int(line[1:])
            if n < 0:
                return None
            while len(self.buf) < n + 2:
                self.buf += self.sock.recv(65536)
            data, self.buf = self.buf[:n], self.buf[n + 2 :]
            return data
        return line

    def call(self, *args: str | bytes) -> Any:
        self.send(*args)
        return self.read()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def raw(server: _Server) -> Iterator[_Raw]:
    conn = _Raw(server.port)
    yield conn
    conn.close()


# -- redis-py ------------------------------------------------------------------------------


def test_default_pipeline_is_a_transaction_that_applies_and_answers(server: _Server) -> None:
    """redis-py's default pipeline sends MULTI ... EXEC: before, the server answered
    `unknown command 'MULTI'`, applied the SETs anyway, and the caller got an error."""
    r = server.client()
    with r.pipeline() as pipe:  # transaction=True
        pipe.set("a", b"1")
        pipe.set("b", b"2")
        pipe.get("a")
        pipe.mget(["a", "b", "nope"])
        pipe.exists("a", "b", "nope")
        pipe.delete("b")
        pipe.get("b")
        assert pipe.execute() == [True, True, b"1", [b"1", b"2", None], 2, 1, None]
    assert r.get("a") == b"1"
    assert r.get("b") is None


def test_non_transactional_pipeline_still_works(server: _Server) -> None:
    r = server.client()
    with r.pipeline(transaction=False) as pipe:
        for i in range(20):
            pipe.set(f"k{i}", str(i).encode())
        pipe.get("k7")
        assert pipe.execute() == [True] * 20 + [b"7"]


def test_runtime_errors_inside_exec_are_per_command_replies(server: _Server) -> None:
    r = server.client()
    with r.pipeline() as pipe:
        pipe.set("x", b"1")
        pipe.set("y", b"2", ex=10)  # refused when it runs (entries never expire)
        pipe.set("z", b"3")
        out = pipe.execute(raise_on_error=False)
    assert out[0] is True
    assert out[2] is True
    assert isinstance(out[1], redis.ResponseError)
    assert "not supported" in str(out[1])
    assert r.mget(["x", "y", "z"]) == [b"1", None, b"3"]


def test_queuing_error_aborts_and_nothing_applies(server: _Server) -> None:
    r = server.client()
    with r.pipeline() as pipe:
        pipe.set("p", b"1")
        pipe.execute_command("NOSUCHCOMMAND", "x")
        pipe.set("q", b"2")
        with pytest.raises(redis.exceptions.ResponseError) as caught:
            pipe.execute()
    assert "unknown command" in str(caught.value) or "EXECABORT" in str(caught.value)
    assert r.exists("p", "q") == 0


def test_durable_exec_shares_group_commits(tmp_path: Path) -> None:
    s = _Server(_store("durable", tmp_path))
    try:
        r = s.client()
        before = s.store.stats(None).extra.get("commit_batches", 0)
        values = {f"k{i}": os.urandom(4096) for i in range(64)}
        with r.pipeline() as pipe:
            for key, value in values.items():
                pipe.set(key, value)
            assert pipe.execute() == [True] * 64
        assert s.store.stats(None).extra["commit_batches"] - before < 32
        assert r.mget(list(values)) == list(values.values())
    finally:
        s.close()
    # acknowledged by EXEC means on disk: a reopened store has every value
    store = SharedKvStoreBackend(tmp_path, StoreOptions(map_size_bytes=64 << 20))
    try:
        assert [bytes(store.get("alpha", k) or b"") for k in values] == list(values.values())
    finally:
        store.close()


# -- raw protocol: Redis' exact answers ---------------------------------------------------


def test_exec_and_discard_without_multi(raw: _Raw) -> None:
    assert raw.call("EXEC") == b"-ERR EXEC without MULTI"
    assert raw.call("DISCARD") == b"-ERR DISCARD without MULTI"


def test_queued_replies_and_exec_array(raw: _Raw) -> None:
    assert raw.call("MULTI") == b"+OK"
    assert raw.call("SET", "a", "1") == b"+QUEUED"
    assert raw.call("GET", "a") == b"+QUEUED"
    assert raw.call("PING") == b"+QUEUED"
    assert raw.call("EXEC") == [b"+OK", b"1", b"+PONG"]
    assert raw.call("EXEC") == b"-ERR EXEC without MULTI"


def test_nested_multi_is_an_error_that_keeps_the_transaction(raw: _Raw) -> None:
    assert raw.call("MULTI") == b"+OK"
    assert raw.call("SET", "a", "1") == b"+QUEUED"
    assert raw.call("MULTI") == b"-ERR MULTI calls can not be nested"
    assert raw.call("EXEC") == [b"+OK"]


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (("GET", "a", "b"), b"-ERR wrong number of arguments for 'get' command"),
        (("NOSUCH",), b"-ERR unknown command 'NOSUCH', with args beginning with: "),
        (("SUBSCRIBE", "c"), b"-ERR Command not allowed inside a transaction"),
        (("AUTH", "tok-b"), b"-ERR Command not allowed inside a transaction"),
    ],
)
def test_refused_while_queuing_means_execabort(
    raw: _Raw, server: _Server, bad: tuple[str, ...], error: bytes
) -> None:
    assert raw.call("MULTI") == b"+OK"
    assert raw.call("SET", "a", "1") == b"+QUEUED"
    assert raw.call(*bad) == error
    assert raw.call("SET", "b", "2") == b"+QUEUED"
    assert raw.call("EXEC") == b"-EXECABORT Transaction discarded because of previous errors."
    assert server.store.count("alpha") == 0
    assert raw.call("SET", "c", "3") == b"+OK"  # the connection goes on, out of MULTI


def test_discard_drops_the_queue(raw: _Raw, server: _Server) -> None:
    assert raw.call("MULTI") == b"+OK"
    assert raw.call("SET", "a", "1") == b"+QUEUED"
    assert raw.call("DISCARD") == b"+OK"
    assert raw.call("GET", "a") is None
    assert raw.call("EXEC") == b"-ERR EXEC without MULTI"
    assert server.store.count("alpha") == 0


def test_reset_inside_multi_drops_the_transaction(raw: _Raw, server: _Server) -> None:
    assert raw.call("MULTI") == b"+OK"
    assert raw.call("SET", "a", "1") == b"+QUEUED"
    assert raw.call("RESET") == b"+RESET"
    assert raw.call("AUTH", "tok-a") == b"+OK"
    assert raw.call("EXEC") == b"-ERR EXEC without MULTI"
    assert server.store.count("alpha") == 0


def test_pipelined_fast_path_commands_after_multi_are_queued(raw: _Raw, server: _Server) -> None:
    """MULTI and plain SET/GETs in one write: the inline fast path must not run them."""
    payload = b"*1\r\n$5\r\nMULTI\r\n"
    for i in range(10):
        payload += b"*3\r\n$3\r\nSET\r\n$2\r\nk%d\r\n$1\r\n%d\r\n" % (i, i)
    payload += b"*2\r\n$3\r\nGET\r\n$2\r\nk3\r\n"
    raw.sock.sendall(payload)
    assert raw.read() == b"+OK"
    assert [raw.read() for _ in range(11)] == [b"+QUEUED"] * 11
    assert server.store.count("alpha") == 0
    assert raw.call("DISCARD") == b"+OK"
    assert server.store.count("alpha") == 0


def test_exec_holds_the_tenant_alone(server: _Server) -> None:
    """A reader of the same tenant sees the state before EXEC or after it, never between:
    each transaction writes `x` 200 times, ending on the value the writer counts with."""
    writer, reader = server.client(), server.client()
    other = server.client("tok-b")
    writer.set("x", b"0")
    seen: set[bytes] = set()
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            value = reader.get("x")
            assert value is not None
            seen.add(value)
            other.set("x", b"other tenant")  # another tenant is not held up

    t = threading.Thread(target=read)
    t.start()
    try:
        for round_ in range(1, 6):
            with writer.pipeline() as pipe:
                for i in range(200):
                    pipe.set("x", f"{round_}:{i}".encode())
                pipe.set("x", str(round_).encode())
                pipe.execute()
    finally:
        done.set()
        t.join(30)
    assert seen <= {b"0", b"1", b"2", b"3", b"4", b"5"}, sorted(seen)[:5]
    assert writer.get("x") == b"5"


def test_queue_length_is_capped(raw: _Raw, server: _Server) -> None:
    payload = b"*1\r\n$5\r\nMULTI\r\n" + b"*1\r\n$4\r\nPING\r\n" * (MAX_MULTI_COMMANDS + 1)
    raw.sock.sendall(payload)
    assert raw.read() == b"+OK"
    replies = [raw.read() for _ in range(MAX_MULTI_COMMANDS + 1)]
    assert replies[:-1] == [b"+QUEUED"] * MAX_MULTI_COMMANDS
    assert replies[-1].startswith(b"-ERR too many commands queued")
    assert raw.call("EXEC").startswith(b"-EXECABORT")


def test_queued_bytes_count_against_the_budget(tmp_path: Path) -> None:
    limits = ServerLimits(max_tenant_inflight_bytes=1 << 20)
    s = _Server(_store("memory", tmp_path), limits)
    conn = _Raw(s.port)
    try:
        assert conn.call("MULTI") == b"+OK"
        assert conn.call("SET", "a", b"x" * (600 << 10)) == b"+QUEUED"
        assert s.ctx.budget.used_by("alpha") >= 600 << 10
        refused = conn.call("SET", "b", b"y" * (600 << 10))
        assert refused.startswith(b"-ERR this tenant holds its whole share")
        assert conn.call("EXEC").startswith(b"-EXECABORT")
        assert s.store.count("alpha") == 0
        deadline = time.monotonic() + 10
        while s.ctx.budget.used_by("alpha") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.ctx.budget.used_by("alpha") == 0
        # the budget came back: the same transaction now fits
        assert conn.call("MULTI") == b"+OK"
        assert conn.call("SET", "a", b"x" * (600 << 10)) == b"+QUEUED"
        assert conn.call("EXEC") == [b"+OK"]
    finally:
        conn.close()
        s.close()


def test_command_lists_the_transaction_commands(raw: _Raw) -> None:
    names = raw.call("COMMAND", "LIST")
    assert {b"multi", b"exec", b"discard"} <= set(names)
    docs = raw.call("COMMAND", "DOCS", "multi", "exec", "discard")
    assert docs[0::2] == [b"multi", b"exec", b"discard"]  # RESP2: a flat name/doc list
    info = raw.call("COMMAND", "INFO", "exec")
    assert info[0][:2] == [b"exec", b":1"]


# -- redis-cli -----------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli not installed")
def test_redis_cli_transaction_typed_in_one_session(server: _Server) -> None:
    script = "MULTI\nSET cli-a 1\nGET cli-a\nEXEC\nMULTI\nSET cli-b 2\nDISCARD\nGET cli-b\n"
    out = subprocess.run(
        ["redis-cli", "-p", str(server.port), "-a", "tok-a", "--no-auth-warning"],
        input=script,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    assert out == ["OK", "QUEUED", "QUEUED", "OK", "1", "OK", "QUEUED", "OK"], out
    assert bytes(server.store.get("alpha", "cli-a") or b"") == b"1"
    assert server.store.get("alpha", "cli-b") is None


def test_closing_inside_multi_returns_the_queued_bytes(tmp_path: Path) -> None:
    s = _Server(_store("memory", tmp_path))
    conn = _Raw(s.port)
    try:
        assert conn.call("MULTI") == b"+OK"
        assert conn.call("SET", "a", b"x" * (300 << 10)) == b"+QUEUED"
        assert s.ctx.budget.used_by("alpha") >= 300 << 10
        conn.close()
        deadline = time.monotonic() + 10
        while s.ctx.budget.used_by("alpha") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.ctx.budget.used_by("alpha") == 0
        assert s.store.count("alpha") == 0
    finally:
        s.close()


def test_tenant_gates_drain_hold_and_forget() -> None:
    """The gate's own rules, step by step on one event loop (no timing involved)."""

    async def main() -> None:
        gates = TenantGates()
        assert gates.enter_nowait("a")  # a plain command of tenant a runs
        hold = asyncio.ensure_future(gates.hold("a"))
        await asyncio.sleep(0)  # let EXEC run up to its wait
        assert not hold.done()  # it waits for the running command
        assert "a" in gates.held
        assert not gates.enter_nowait("a")  # new commands of a wait ...
        assert gates.enter_nowait("b")  # ... other tenants do not
        gates.leave("b")
        gates.leave("a")
        await hold  # drained: EXEC holds a
        waiter = asyncio.ensure_future(gates.enter("a"))
        await asyncio.sleep(0)
        assert not waiter.done()
        gates.release("a")
        await waiter
        gates.leave("a")
        assert len(gates) == 0  # nothing kept for idle tenants
        assert not gates.held

    asyncio.run(main())


def test_tenant_gates_second_holder_takes_the_live_gate() -> None:
    """Two EXECs (or GETSETs) of one tenant: the second, woken by the first's release,
    must hold the tenant's registered gate. It used to set `held` on the gate `release`
    had just dropped, so plain commands ran beside it and its own waiters never woke."""

    async def main() -> None:
        gates = TenantGates()
        await gates.hold("a")
        second = asyncio.ensure_future(gates.hold("a"))
        await asyncio.sleep(0)
        assert not second.done()
        gates.release("a")
        await second
        assert not gates.enter_nowait("a")  # the second holder keeps plain commands out
        third = asyncio.ensure_future(gates.hold("a"))
        await asyncio.sleep(0)
        gates.release("a")
        await asyncio.wait_for(third, 10)  # woken, not stranded on a dropped gate
        gates.release("a")
        assert len(gates) == 0
        assert not gates.held

    asyncio.run(main())


def test_large_values_inside_exec(server: _Server) -> None:
    """Values over the inline size take the store's blocking path inside EXEC."""
    r = server.client()
    big = [os.urandom(1 << 20), os.urandom((1 << 20) + 3)]
    with r.pipeline() as pipe:
        pipe.set("big0", big[0])
        pipe.set("small", b"s")
        pipe.set("big1", big[1])
        pipe.get("big0")
        pipe.strlen("big1")
        assert pipe.execute() == [True, True, True, big[0], len(big[1])]
    assert r.mget(["big0", "big1", "small"]) == [big[0], big[1], b"s"]


def test_sets_inside_exec_hand_their_receive_buffers_to_the_store(server: _Server) -> None:
    """A SET inside MULTI that the store starts inline (a value the parser received
    into its own buffer, up to the inline size) is kept as received, as outside MULTI:
    the transaction job passed the queued view as it was, and the store copied it."""
    from epistemic_kvcache import buffers

    r = server.client()
    blocks = [os.urandom(64 << 10), os.urandom(256 << 10)]  # (own buffer from 32 KiB)
    with r.pipeline() as pipe:
        pipe.set("mx0", blocks[0])
        pipe.set("mx1", blocks[1], nx=True)
        pipe.set("msmall", b"tiny")
        assert pipe.execute() == [True, True, True]
    for key, block in (("mx0", blocks[0]), ("mx1", blocks[1])):
        kept = server.store.get("alpha", key)
        assert isinstance(kept, memoryview), type(kept)
        assert kept == block
        assert kept.readonly
        assert isinstance(kept.obj, buffers._heap_type), type(kept.obj)  # the buffer itself
    assert server.store.get("alpha", "msmall") == b"tiny"
