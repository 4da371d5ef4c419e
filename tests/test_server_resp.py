"""The RESP listener against real peers: redis-py (sync, asyncio, RESP3), redis-cli,
redis-benchmark and raw sockets, on a real uvloop server in a background thread."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio
from redis.backoff import NoBackoff
from redis.retry import Retry

from epistemic_kvcache.errors import AuthError, DiskFullError, StorageIOError
from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.proto.glob import Glob
from epistemic_kvcache.server.context import Identity, ServerLimits
from epistemic_kvcache.server.resp import RespConnection
from epistemic_kvcache.store import PutResult, SharedKvIndex
from epistemic_kvcache.store.api import Buffer
from helpers import eventually
from servers import start_listener

TOKEN_A = "token-alpha"
TOKEN_B = "token-bravo"
TENANTS = {TOKEN_A: "alpha", TOKEN_B: "bravo"}
MiB = 1024 * 1024
NO_RETRY = Retry(NoBackoff(), 0)


class TokenAuth:
    """Maps bearer tokens to tenants, like the real token table."""

    def __init__(self, tokens: dict[str, str]) -> None:
        self.tokens = tokens

    def authenticate(self, credential: str) -> Identity:
        tenant = self.tokens.get(credential)
        if tenant is None:
            raise AuthError("invalid token")
        return Identity(tenant=tenant, subject=f"sub-{tenant}", method="token")


class ServerThread:
    """A RESP listener of the shared harness (`servers.start_listener`, token auth as
    above) with the helpers these tests need."""

    def __init__(self, limits: ServerLimits | None = None, store: SharedKvIndex | None = None):
        self.listener = start_listener(
            "resp", store=store or SharedKvIndex(), limits=limits, auth=TokenAuth(TENANTS)
        )
        self.store = self.listener.store
        self.ctx = self.listener.ctx
        self.loop = self.listener.loop
        self.port = self.listener.port
        self.close = self.listener.close

    @property
    def protocols(self) -> list[RespConnection]:
        """The open connections."""
        return [p for p in self.ctx.live if isinstance(p, RespConnection)]

    def client(self, token: str = TOKEN_A, protocol: int = 2, **kwargs: object) -> redis.Redis:
        return redis.Redis(
            port=self.port, password=token, protocol=protocol, socket_timeout=30, **kwargs
        )


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    srv = ServerThread()
    yield srv
    srv.close()


@pytest.fixture(params=[2, 3], ids=["resp2", "resp3"])
def r(server: ServerThread, request: pytest.FixtureRequest) -> Iterator[redis.Redis]:
    """A redis-py client of tenant "alpha", in RESP2 (AUTH) and RESP3 (HELLO 3 AUTH)."""
    with server.client(protocol=request.param) as client:
        client.flushall = None  # type: ignore[assignment]  # not supported; make misuse loud
        yield client
        for key in server.store.keys("alpha", limit=100_000):
            server.store.delete("alpha", key)
        for key in server.store.keys("bravo", limit=100_000):
            server.store.delete("bravo", key)


class Raw:
    """A raw socket speaking bytes, for what no client library sends."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv_until(self, marker: bytes, timeout: float = 10) -> bytes:
        return self.recv_match(re.escape(marker), timeout)

    def recv_match(self, pattern: bytes, timeout: float = 10) -> bytes:
        """Read until the bytes received by this call match the regex `pattern`."""
        deadline = time.monotonic() + timeout
        data = b""
        while re.search(pattern, data, re.DOTALL) is None:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data

    def recv_exactly(self, n: int, timeout: float = 30) -> bytes:
        self.sock.settimeout(timeout)
        chunks: list[bytes] = []
        while n:
            chunk = self.sock.recv(min(n, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def read_to_eof(self, timeout: float = 10) -> bytes:
        deadline = time.monotonic() + timeout
        data = b""
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = self.sock.recv(65536)
            except ConnectionResetError:
                return data
            if not chunk:
                return data
            data += chunk
        raise AssertionError(f"connection still open after {timeout}s; got {data[:200]!r}")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def raw(server: ServerThread) -> Iterator[Raw]:
    conn = Raw(server.port)
    yield conn
    conn.close()


# -- redis-py, sync ---------------------------------------------------------------------


def test_basic_commands(r: redis.Redis) -> None:
    assert r.ping() is True
    assert r.echo("hello") == b"hello"
    assert r.set("k1", b"v1") is True
    assert r.get("k1") == b"v1"
    assert r.get("missing") is None
    assert r.exists("k1", "missing", "k1") == 2
    assert r.strlen("k1") == 2
    assert r.strlen("missing") == 0
    assert r.mset({"k2": b"v2", "k3": b"v3"}) is True
    assert r.mget("k1", "k2", "nope", "k3") == [b"v1", b"v2", None, b"v3"]
    assert r.dbsize() == 3
    assert r.delete("k1", "nope") == 1
    assert r.unlink("k2") == 1
    assert r.exists("k1", "k2") == 0
    assert r.dbsize() == 1
    assert r.execute_command("SELECT", 0) in (b"OK", "OK", True)
    with pytest.raises(redis.ResponseError, match="DB index is out of range"):
        r.execute_command("SELECT", 1)


def test_set_replaces_like_redis(r: redis.Redis, server: ServerThread) -> None:
    assert r.set("fw", b"first") is True
    assert r.set("fw", b"second") is True
    assert r.get("fw") == b"second"
    assert r.set("fw", b"bb") is True  # another size: replaced as well
    assert r.get("fw") == b"bb"
    assert server.store.stats("alpha").put_replaced >= 2
    assert r.delete("fw") == 1
    assert r.set("fw", b"third") is True
    assert r.get("fw") == b"third"


def test_set_options(r: redis.Redis) -> None:
    assert r.set("nx", b"a", nx=True) is True
    assert r.set("nx", b"b", nx=True) is None
    assert r.get("nx") == b"a"
    assert r.set("xx", b"a", xx=True) is None
    assert r.exists("xx") == 0
    assert r.set("nx", b"a", xx=True) is True
    assert r.set("nx", b"z", get=True) == b"a"
    assert r.set("fresh", b"z", get=True) is None
    assert r.get("fresh") == b"z"
    assert r.set("nx", b"a", keepttl=True) is True
    with pytest.raises(redis.ResponseError, match="not supported"):
        r.set("ttl", b"a", ex=10)
    with pytest.raises(redis.ResponseError, match="not supported"):
        r.set("ttl", b"a", px=10)
    assert r.exists("ttl") == 0
    with pytest.raises(redis.ResponseError, match="invalid expire time"):
        r.execute_command("SET", "ttl", "a", "EX", "0")
    with pytest.raises(redis.ResponseError, match="syntax error"):
        r.execute_command("SET", "ttl", "a", "NX", "XX")
    with pytest.raises(redis.ResponseError, match="syntax error"):
        r.execute_command("SET", "ttl", "a", "BOGUS")


def test_keys_are_utf8_and_bounded(r: redis.Redis) -> None:
    assert r.set("clé/ü@1", b"x") is True
    assert r.get("clé/ü@1") == b"x"
    with pytest.raises(redis.ResponseError, match="invalid key: not valid UTF-8"):
        r.set(b"\xff\xfe", b"x")
    with pytest.raises(redis.ResponseError, match="invalid key"):
        r.set("k" * 1025, b"x")
    with pytest.raises(redis.ResponseError, match="invalid key"):
        r.get("")


def test_pipeline_of_100_commands(r: redis.Redis) -> None:
    with r.pipeline(transaction=False) as pipe:
        for i in range(50):
            pipe.set(f"p{i}", f"value-{i}".encode())
            pipe.get(f"p{i}")
        results = pipe.execute()
    assert len(results) == 100
    for i in range(50):
        assert results[2 * i] is True
        assert results[2 * i + 1] == f"value-{i}".encode()


def test_pipeline_order_with_big_replies_and_mixed_commands(r: redis.Redis) -> None:
    """Store commands are batched per thread-pool job; big replies split the batch."""
    big = b"B" * (3 * MiB)
    r.set("big3", big)
    with r.pipeline(transaction=False) as pipe:
        for i in range(6):
            pipe.get("big3")
            pipe.echo(f"e{i}")
            pipe.get("big3")
            pipe.exists("big3", "nope")
            pipe.execute_command("HSET", "x", "y", "z")  # an error mid-pipeline
            pipe.dbsize()
        results = pipe.execute(raise_on_error=False)
    assert len(results) == 36
    for i in range(6):
        got = results[6 * i : 6 * i + 6]
        assert got[0] == big
        assert got[1] == f"e{i}".encode()
        assert got[2] == big
        assert got[3] == 1
        assert isinstance(got[4], redis.ResponseError)
        assert got[5] == 1


@pytest.mark.parametrize("size", [8 * MiB, 64 * MiB], ids=["8MiB", "64MiB"])
def test_large_values_bit_exact(r: redis.Redis, size: int) -> None:
    payload = bytes(range(251)) * (size // 251) + b"\x00" * (size % 251)
    assert len(payload) == size
    assert r.set("big", payload) is True
    assert r.strlen("big") == size
    got = r.get("big")
    assert got == payload


def test_pipelined_large_values_without_reading(server: ServerThread, raw: Raw) -> None:
    """Many big SETs pipelined before reading a reply: flow control, then all replies."""
    raw.send(b"AUTH " + TOKEN_A.encode() + b"\r\n")
    assert raw.recv_until(b"\r\n") == b"+OK\r\n"
    n, size = 12, 2 * MiB
    for i in range(n):
        value = bytes([i]) * size
        raw.send(b"*3\r\n$3\r\nSET\r\n$%d\r\npipe%d\r\n$%d\r\n" % (len(b"pipe%d" % i), i, size))
        raw.send(value + b"\r\n")
    raw.send(b"*1\r\n$6\r\nDBSIZE\r\n")
    data = raw.recv_match(rb":\d+\r\n$", timeout=30)
    assert data.startswith(b"+OK\r\n" * n)
    with server.client() as c:
        for i in range(n):
            assert c.get(f"pipe{i}") == bytes([i]) * size
        c.delete(*[f"pipe{i}" for i in range(n)])


def test_scan_match_count(r: redis.Redis) -> None:
    keys = {f"scan:{i:03d}" for i in range(120)} | {f"other:{i}" for i in range(7)}
    r.mset(dict.fromkeys(keys, b"v"))
    assert {k.decode() for k in r.scan_iter(count=17)} == keys
    assert {k.decode() for k in r.scan_iter(match="scan:*", count=50)} == {
        k for k in keys if k.startswith("scan:")
    }
    assert {k.decode() for k in r.scan_iter(match="other:[0-3]")} == {
        f"other:{i}" for i in range(4)
    }
    assert list(r.scan_iter(_type="hash")) == []
    cursor, page = r.scan(0, count=5)
    assert cursor != 0
    assert len(page) == 5
    with pytest.raises(redis.ResponseError, match="invalid cursor"):
        r.scan(123456789)
    with pytest.raises(redis.ResponseError, match="invalid cursor"):
        r.execute_command("SCAN", "abc")


def test_scan_cursor_is_per_tenant(server: ServerThread, r: redis.Redis) -> None:
    r.mset({f"t{i}": b"v" for i in range(5)})
    cursor, _ = r.scan(0, count=2)
    with server.client(TOKEN_B) as other, pytest.raises(redis.ResponseError, match="invalid"):
        other.scan(cursor, count=2)


def test_info(r: redis.Redis, server: ServerThread) -> None:
    r.set("i1", b"12345")
    info = r.info()
    assert info["redis_version"] == "7.0.0"
    assert info["redis_mode"] == "standalone"
    # this tenant's own connections only: the server-wide count would reveal the others'
    with server.client(TOKEN_B) as other:
        other.ping()
        assert info["connected_clients"] == 1
        assert r.info("clients")["connected_clients"] == 1
    assert info["maxclients"] >= 1
    assert info["db0"]["keys"] == 1
    assert info["unique_blocks"] == 1
    assert info["logical_bytes"] == 5
    assert "tier_hot_blocks" in info
    assert set(r.info("keyspace")) == {"db0"}
    assert r.info("nosuchsection") == {}


def test_client_config_command(r: redis.Redis, server: ServerThread) -> None:
    assert r.client_setname("worker-1") is True
    assert r.client_getname() == "worker-1" or r.client_getname() == b"worker-1"
    assert isinstance(r.client_id(), int)
    with pytest.raises(redis.ResponseError, match="cannot contain spaces"):
        r.client_setname("bad name")
    assert r.execute_command("CLIENT", "SETINFO", "LIB-NAME", "x") in (b"OK", True)
    with pytest.raises(redis.ResponseError, match="No such client"):
        r.execute_command("CLIENT", "KILL", "x")
    with pytest.raises(redis.ResponseError, match="unknown subcommand"):
        r.execute_command("CLIENT", "PAUSE", "10")
    cfg = r.config_get("save")
    assert cfg == {"save": ""}
    assert r.config_get("append*") == {"appendonly": "no", "appendfsync": "no"}
    assert r.config_get("maxclients") == {"maxclients": "1024"}
    with pytest.raises(redis.ResponseError, match="unknown subcommand"):
        r.execute_command("CONFIG", "SET", "save", "")
    count = r.command_count()
    assert count >= 20
    table = r.command()  # redis-py parses COMMAND's reply into a dict
    assert len(table) == count
    assert table["get"]["arity"] == 2
    assert table["mset"]["step_count"] == 2
    assert "readonly" in table["get"]["flags"]


def test_command_info_raw(raw: Raw) -> None:
    raw.send(b"AUTH " + TOKEN_A.encode() + b"\r\nCOMMAND INFO get nosuch\r\n")
    data = raw.recv_until(b"$-1\r\n")
    assert data.startswith(b"+OK\r\n*2\r\n*10\r\n$3\r\nget\r\n:2\r\n")
    assert data.endswith(b"*0\r\n$-1\r\n")
    raw.send(b"COMMAND DOCS ping nosuch\r\n")
    assert raw.recv_until(b"connection\r\n") == (
        b"*2\r\n$4\r\nping\r\n*6\r\n$7\r\nsummary\r\n$16\r\nPing the server.\r\n"
        b"$5\r\nsince\r\n$5\r\n1.0.0\r\n$5\r\ngroup\r\n$10\r\nconnection\r\n"
    )


def test_unknown_command_wording(r: redis.Redis) -> None:
    with pytest.raises(redis.ResponseError) as info:
        r.execute_command("NOSUCH", "h", "f", "v")
    assert str(info.value) == ("unknown command 'NOSUCH', with args beginning with: 'h' 'f' 'v' ")
    with pytest.raises(redis.ResponseError, match="wrong number of arguments for 'get'"):
        r.execute_command("GET")


def test_tenant_isolation(server: ServerThread) -> None:
    with server.client(TOKEN_A) as a, server.client(TOKEN_B) as b:
        a.set("shared-name", b"alpha-bytes")
        a.set("only-alpha", b"x")
        assert b.get("shared-name") is None
        assert b.exists("shared-name", "only-alpha") == 0
        assert b.dbsize() == 0
        assert list(b.scan_iter()) == []
        b.set("shared-name", b"bravo-bytes")
        assert a.get("shared-name") == b"alpha-bytes"
        assert b.get("shared-name") == b"bravo-bytes"
        assert a.dbsize() == 2
        assert b.dbsize() == 1
        assert b.delete("only-alpha") == 0
        assert a.exists("only-alpha") == 1
        assert b.info()["db0"]["keys"] == 1
        a.delete("shared-name", "only-alpha")
        b.delete("shared-name")


def test_resp_writes_share_the_store(r: redis.Redis, server: ServerThread) -> None:
    """A block SET over RESP is the same entry HTTP sees (namespace = tenant)."""
    block = b"\x01\x02" * 5000
    before = server.store.stats("alpha").dedup_hits
    r.set("model@00000000@0@abc", block)
    r.set("model@00000000@0@def", block)  # same bytes, other key: deduplicated
    assert server.store.get("alpha", "model@00000000@0@abc") == block
    stats = server.store.stats("alpha")
    assert stats.dedup_hits == before + 1
    assert stats.unique_blocks == 1
    server.store.put("alpha", "from-http", b"http-bytes")
    assert r.get("from-http") == b"http-bytes"


def test_auth_with_username(server: ServerThread) -> None:
    with redis.Redis(port=server.port, username="lmcache", password=TOKEN_A) as c:
        assert c.set("u", b"1") is True
    with server.client() as c:
        assert c.get("u") == b"1"
        c.delete("u")


def test_wrongpass(server: ServerThread) -> None:
    with (
        redis.Redis(port=server.port, password="nope", protocol=2, retry=NO_RETRY) as c,
        pytest.raises(redis.AuthenticationError),
    ):
        c.ping()
    with (
        redis.Redis(port=server.port, password="nope", protocol=3, retry=NO_RETRY) as c,
        pytest.raises(redis.AuthenticationError),
    ):
        c.ping()


def test_noauth_before_auth(server: ServerThread, raw: Raw) -> None:
    with (
        redis.Redis(port=server.port, protocol=2, retry=NO_RETRY) as c,
        pytest.raises(redis.AuthenticationError),
    ):
        c.get("k")
    with (
        redis.Redis(port=server.port, protocol=3, retry=NO_RETRY) as c,
        pytest.raises(
            redis.AuthenticationError, match="HELLO must be called with the client already"
        ),
    ):
        c.ping()  # like Redis with requirepass: HELLO 3 without AUTH is refused
    raw.send(b"PING\r\n*2\r\n$3\r\nGET\r\n$1\r\nk\r\nHSET a b c\r\nHELLO 3\r\nAUTH bad\r\n")
    raw.send(b"AUTH " + TOKEN_A.encode() + b"\r\nDBSIZE\r\n")
    data = raw.recv_match(rb"\r\n:\d+\r\n$")
    lines = data.split(b"\r\n")
    assert lines[0] == b"-NOAUTH Authentication required."  # PING too, as redis-server
    assert lines[1] == b"-NOAUTH Authentication required."
    assert lines[2] == b"-NOAUTH Authentication required."
    assert lines[3].startswith(b"-NOAUTH HELLO must be called")
    assert lines[4] == b"-WRONGPASS invalid username-password pair or user is disabled."
    assert lines[5] == b"+OK"
    assert lines[6].startswith(b":")


def test_reset_and_quit(raw: Raw) -> None:
    raw.send(b"AUTH " + TOKEN_A.encode() + b"\r\nRESET\r\nDBSIZE\r\nQUIT\r\nPING\r\n")
    data = raw.read_to_eof()
    assert data == b"+OK\r\n+RESET\r\n-NOAUTH Authentication required.\r\n+OK\r\n"


def test_inline_commands(raw: Raw) -> None:
    raw.send(b"AUTH " + TOKEN_A.encode() + b"\r\n")
    raw.send(b'SET inline "hello world"\r\nGET inline\r\nDEL inline\r\nPING\n')
    data = raw.recv_until(b"+PONG\r\n")
    assert data == b"+OK\r\n+OK\r\n$11\r\nhello world\r\n:1\r\n+PONG\r\n"


def test_unauthenticated_argument_limits(server: ServerThread) -> None:
    lim = server.ctx.limits
    cases = [
        (b"*%d\r\n" % (lim.resp_unauthenticated_max_args + 1), b"unauthenticated multibulk length"),
        (
            b"*2\r\n$4\r\nAUTH\r\n$%d\r\n" % (lim.resp_unauthenticated_max_bulk_bytes + 1),
            b"unauthenticated bulk length",
        ),
    ]
    for data, message in cases:
        conn = Raw(server.port)
        try:
            conn.send(data)
            reply = conn.read_to_eof()
        finally:
            conn.close()
        assert reply == b"-ERR Protocol error: " + message + b"\r\n"
    # Inside the limits, before AUTH: read and answered (a wrong credential here).
    conn = Raw(server.port)
    try:
        conn.send(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n" % lim.resp_unauthenticated_max_bulk_bytes)
        conn.send(b"x" * lim.resp_unauthenticated_max_bulk_bytes + b"\r\n")
        assert (
            conn.recv_until(b"\r\n")
            == b"-WRONGPASS invalid username-password pair or user is disabled.\r\n"
        )
    finally:
        conn.close()


PROTOCOL_ERRORS = [
    (b"*3000000000\r\n", b"invalid multibulk length"),
    (b"*-10\r\n", b"invalid multibulk length"),
    (b"*1\r\n$-10\r\n", b"invalid bulk length"),
    (b"*1\r\n$2000000000\r\n", b"invalid bulk length"),
    (b"*1\r\n$blabla\r\n", b"invalid bulk length"),
    (b"*3\r\n$3\r\nSET\r\n$1\r\nx\r\nfooz\r\n", b"expected '$', got 'f'"),
    (b"*1\r\nfoo\r\n", b"expected '$', got 'f'"),
    (b'set """test-key""" test-value\r\nping\r\n', b"unbalanced quotes in request"),
    (b"\xff\x00garbage" * 8000, b"too big inline request"),
    (b"*1\r\n$3\r\nfoobar\r\n", b"expected '\\r\\n' after bulk data"),
]


def test_protocol_errors_close_only_the_offender(server: ServerThread) -> None:
    stop = threading.Event()
    errors: list[BaseException] = []
    ops = [0]

    def well_behaved() -> None:
        try:
            with server.client() as c:
                i = 0
                while not stop.is_set():
                    c.set(f"wb{i % 10}", b"v%d" % (i % 10))
                    assert c.get(f"wb{i % 10}") == b"v%d" % (i % 10)
                    ops[0] += 1
                    i += 1
                c.delete(*[f"wb{j}" for j in range(10)])
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=well_behaved)
    worker.start()
    try:
        for data, message in PROTOCOL_ERRORS:
            conn = Raw(server.port)
            try:
                conn.send(b"AUTH " + TOKEN_A.encode() + b"\r\n")
                assert conn.recv_until(b"\r\n") == b"+OK\r\n"
                before = ops[0]
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    conn.send(data)
                reply = conn.read_to_eof()
            finally:
                conn.close()
            assert reply.startswith(b"-ERR Protocol error: " + message + b"\r\n"), (data, reply)
            deadline = time.monotonic() + 5
            while ops[0] == before and time.monotonic() < deadline and not errors:
                time.sleep(0.01)
            assert ops[0] > before, "the well-behaved client stalled"
    finally:
        stop.set()
        worker.join(30)
    assert not errors
    with server.client() as c:
        assert c.ping() is True


def test_commands_before_the_bad_bytes_are_answered(raw: Raw) -> None:
    raw.send(b"AUTH " + TOKEN_A.encode() + b"\r\nPING\r\n*1\r\n$-10\r\n")
    assert raw.read_to_eof() == b"+OK\r\n+PONG\r\n-ERR Protocol error: invalid bulk length\r\n"


def test_empty_multibulk_is_ignored(raw: Raw) -> None:
    raw.send(b"*0\r\n*-1\r\nAUTH " + TOKEN_A.encode() + b"\r\n*0\r\nPING\r\n")
    assert raw.recv_until(b"+PONG\r\n") == b"+OK\r\n+PONG\r\n"


# -- RESP3 --------------------------------------------------------------------------------


def test_resp3_with_redis_py(server: ServerThread) -> None:
    with server.client(protocol=3) as c:
        assert c.set("r3", b"v") is True
        assert c.get("r3") == b"v"
        assert c.mget("r3", "none") == [b"v", None]
        assert c.config_get("save") == {b"save": b""} or c.config_get("save") == {"save": ""}
        info = c.info()
        assert info["redis_version"] == "7.0.0"
        assert c.delete("r3") == 1


def test_resp3_wire_format(raw: Raw) -> None:
    raw.send(b"HELLO 3 AUTH default " + TOKEN_A.encode() + b" SETNAME raw3\r\n")
    hello = raw.recv_until(b"modules\r\n*0\r\n")
    assert hello.startswith(b"%7\r\n")
    assert b"$5\r\nproto\r\n:3\r\n" in hello
    raw.send(b"GET nothing\r\nCLIENT GETNAME\r\nHELLO 2\r\nGET nothing\r\n")
    data = raw.recv_until(b"$-1\r\n")
    assert data.startswith(b"_\r\n$4\r\nraw3\r\n*14\r\n")
    assert data.endswith(b"$-1\r\n")


def test_hello_errors(raw: Raw) -> None:
    raw.send(b"HELLO 4 AUTH x " + TOKEN_A.encode() + b"\r\nHELLO abc\r\nHELLO 3 BOGUS\r\n")
    data = raw.recv_until(b"BOGUS'\r\n")
    assert data == (
        b"-NOPROTO unsupported protocol version\r\n"
        b"-ERR Protocol version is not an integer or out of range\r\n"
        b"-ERR Syntax error in HELLO option 'BOGUS'\r\n"
    )


# -- redis-py asyncio ---------------------------------------------------------------------


def test_asyncio_client(server: ServerThread) -> None:
    async def main() -> None:
        client = redis.asyncio.Redis(port=server.port, password=TOKEN_A)
        try:
            await client.set("a1", b"async")
            assert await client.get("a1") == b"async"
            values = await asyncio.gather(*(client.get("a1") for _ in range(50)))
            assert values == [b"async"] * 50
            async with client.pipeline(transaction=False) as pipe:
                for i in range(20):
                    pipe.set(f"ap{i}", b"%d" % i)
                    pipe.exists(f"ap{i}")
                res = await pipe.execute()
            assert res == [True, 1] * 20
            assert await client.delete("a1", *[f"ap{i}" for i in range(20)]) == 21
        finally:
            await client.aclose()

    asyncio.run(main())


# -- real Redis tools ---------------------------------------------------------------------


@pytest.mark.redis
@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli not installed")
def test_redis_cli(server: ServerThread) -> None:
    base = ["redis-cli", "-h", "127.0.0.1", "-p", str(server.port), "-a", TOKEN_A]
    base.append("--no-auth-warning")
    out = subprocess.run([*base, "SET", "cli-key", "cli value"], capture_output=True, timeout=30)
    assert out.returncode == 0
    assert out.stdout.strip() == b"OK"
    out = subprocess.run([*base, "GET", "cli-key"], capture_output=True, timeout=30)
    assert out.stdout.strip() == b"cli value"
    out = subprocess.run([*base, "--scan"], capture_output=True, timeout=30)
    assert b"cli-key" in out.stdout.split()
    out = subprocess.run([*base, "-3", "GET", "cli-key"], capture_output=True, timeout=30)
    assert out.stdout.strip() == b"cli value"
    out = subprocess.run([*base, "DEL", "cli-key"], capture_output=True, timeout=30)
    assert out.stdout.strip() == b"1"
    bad = ["redis-cli", "-p", str(server.port), "-a", "wrong", "--no-auth-warning", "GET", "x"]
    out = subprocess.run(bad, capture_output=True, timeout=30)
    assert b"WRONGPASS" in out.stdout + out.stderr


@pytest.mark.redis
@pytest.mark.skipif(shutil.which("redis-benchmark") is None, reason="redis-benchmark missing")
def test_redis_benchmark(server: ServerThread) -> None:
    cmd = ["redis-benchmark", "-h", "127.0.0.1", "-p", str(server.port), "-a", TOKEN_A]
    cmd += ["-t", "set,get", "-n", "2000", "-q", "-d", "4096"]
    out = subprocess.run(cmd, capture_output=True, timeout=120)
    text = out.stdout.decode() + out.stderr.decode()
    assert out.returncode == 0, text
    assert "Error" not in text, text
    for name in ("SET", "GET"):
        m = re.search(rf"{name}: ([0-9.]+) requests per second", text)
        assert m, text
        assert float(m.group(1)) > 0
    with server.client() as c:
        assert c.strlen("key:__rand_int__") == 4096
        c.delete("key:__rand_int__")


# -- limits, timeouts, metrics ------------------------------------------------------------


def test_connection_cap_and_idle_timeout() -> None:
    # 2 s: a and b must still be open when c comes, on a loaded machine too
    srv = ServerThread(ServerLimits(max_connections=2, idle_timeout_s=2.0))
    try:
        a, b = Raw(srv.port), Raw(srv.port)
        a.send(b"AUTH " + TOKEN_A.encode() + b"\r\n")
        b.send(b"AUTH " + TOKEN_B.encode() + b"\r\n")
        assert a.recv_until(b"\r\n") == b"+OK\r\n"
        assert b.recv_until(b"\r\n") == b"+OK\r\n"
        # Full of authenticated connections: a new one is refused.
        c = Raw(srv.port)
        assert c.read_to_eof() == b"-ERR max number of clients reached\r\n"
        c.close()
        # Idle connections are closed after idle_timeout_s, freeing their slots.
        assert a.read_to_eof(timeout=10) == b""
        assert b.read_to_eof(timeout=10) == b""
        a.close()
        b.close()
        d = Raw(srv.port)
        d.send(b"AUTH " + TOKEN_A.encode() + b"\r\n")
        assert d.recv_until(b"\r\n") == b"+OK\r\n"
        d.close()
    finally:
        srv.close()
    assert srv.ctx.open_connections["resp"] == 0


def test_slow_sender_is_cut_off() -> None:
    srv = ServerThread(ServerLimits(request_timeout_s=0.4, idle_timeout_s=30))
    try:
        conn = Raw(srv.port)
        conn.send(b"AUTH " + TOKEN_A.encode() + b"\r\n")
        assert conn.recv_until(b"\r\n") == b"+OK\r\n"
        conn.send(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$100\r\nonly-a-few-bytes")
        started = time.monotonic()
        assert conn.read_to_eof(timeout=20) == b""
        # At the 0.4 s request deadline; the next timer that would close it is the idle
        # timeout, 30 s.
        assert time.monotonic() - started < 10
        conn.close()
    finally:
        srv.close()


def test_block_too_large() -> None:
    srv = ServerThread(ServerLimits(max_block_bytes=1 * MiB))
    srv.store.max_block_bytes = 1000
    try:
        with srv.client() as c:
            with pytest.raises(redis.ResponseError, match="block too large"):
                c.set("big", b"x" * 1001)
            assert c.set("ok", b"x" * 1000) is True
        conn = Raw(srv.port)
        conn.send(b"AUTH " + TOKEN_A.encode() + b"\r\n*3\r\n$3\r\nSET\r\n$1\r\nk\r\n")
        conn.send(b"$%d\r\n" % (MiB + 1))
        assert conn.read_to_eof() == b"+OK\r\n-ERR Protocol error: invalid bulk length\r\n"
        conn.close()
    finally:
        srv.close()


def test_metrics_observed(server: ServerThread, r: redis.Redis) -> None:
    r.get("m")
    r.get("m")
    with contextlib.suppress(redis.ResponseError):
        r.execute_command("NOPE")
    text = server.ctx.metrics.render()[0].decode()
    get_line = re.search(
        r'kvcache_requests_total\{[^}]*route="get"[^}]*status="ok"[^}]*wire="resp"[^}]*\} (\S+)',
        text,
    ) or re.search(
        r'kvcache_requests_total\{wire="resp",route="get",status="ok"[^}]*\} (\S+)', text
    )
    assert get_line, text
    assert float(get_line.group(1)) >= 2
    assert 'route="unknown"' in text


def test_glob_semantics() -> None:
    cases = [
        (b"*", b"anything", True),
        (b"a?c", b"abc", True),
        (b"a?c", b"ac", False),
        (b"h[ae]llo", b"hallo", True),
        (b"h[^e]llo", b"hello", False),
        (b"h[a-b]llo", b"hbllo", True),
        (b"h\\*llo", b"h*llo", True),
        (b"h\\*llo", b"hello", False),
        (b"k.y", b"kxy", False),
    ]
    for pattern, key, expected in cases:
        assert Glob(pattern).match(key) is expected, (pattern, key)


class FailingDiskStore(SharedKvIndex):
    """PUTs of keys starting `full` / `eio` fail like a broken disk (messages with paths)."""

    def put(self, ns: str, key: str, data: Buffer, **kw: Any) -> PutResult:
        if key.startswith("full"):
            raise DiskFullError("disk full under /srv/kv-secret-dir: nothing was stored")
        if key.startswith("eio"):
            raise StorageIOError("write to /srv/kv-secret-dir failed: [Errno 5] EIO")
        return super().put(ns, key, data, **kw)


def test_disk_errors_reach_clients_without_server_paths(
    caplog: pytest.LogCaptureFixture,
) -> None:
    srv = ServerThread(store=FailingDiskStore())
    r = srv.client()
    try:
        with pytest.raises(redis.ResponseError) as full:
            r.set("full-1", b"v")
        assert str(full.value) == "disk full, nothing was stored"
        with pytest.raises(redis.ResponseError) as eio:
            r.set("eio-1", b"v" * 100_000)  # through the thread pool, not the fast path
        assert str(eio.value) == "storage I/O error, nothing was stored"
        assert r.set("fine", b"v")
        logged = [rec.getMessage() for rec in caplog.records]
        assert any("/srv/kv-secret-dir" in m and "EIO" in m for m in logged), logged
    finally:
        r.close()
        srv.close()


class GatedStore(SharedKvIndex):
    """A store whose PUTs wait for `gate`: a slow command for flow-control tests."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()

    def put(self, ns: str, key: str, data: Buffer, **kw: Any) -> PutResult:
        self.entered.set()
        self.gate.wait(30)
        return super().put(ns, key, data, **kw)


def test_reading_pauses_while_a_slow_command_runs() -> None:
    """Pipelined input is not read without bound while the first command is stuck."""
    store = GatedStore()
    srv = ServerThread(store=store)
    conn = Raw(srv.port)
    try:
        conn.send(b"AUTH " + TOKEN_A.encode() + b"\r\n")
        assert conn.recv_until(b"\r\n") == b"+OK\r\n"
        n, size = 40, MiB
        wire = b"".join(
            b"*3\r\n$3\r\nSET\r\n$4\r\nk%03d\r\n$%d\r\n" % (i, size) + b"v" * size + b"\r\n"
            for i in range(n)
        )
        sender = threading.Thread(target=conn.send, args=(wire,))
        sender.start()
        assert store.entered.wait(10)
        (proto,) = [p for p in srv.protocols if p._transport is not None]
        eventually(lambda: proto._st.backpressure, what="reading paused")
        # At most the high-water mark, one command and one read chunk are held.
        assert proto._parser.buffered_bytes <= 4 * MiB + size + 512 * 1024
        assert sender.is_alive()  # the client is blocked: the server stopped reading
        store.gate.set()
        assert conn.recv_exactly(5 * n) == b"+OK\r\n" * n
        sender.join(10)
        assert store.count("alpha") == n
    finally:
        store.gate.set()
        conn.close()
        srv.close()


@pytest.mark.parametrize("backend", ["memory", "durable"])
def test_set_and_mset_hand_their_receive_buffers_to_the_store(backend: str, tmp_path: Any) -> None:
    """The zero-copy path of the wire, explicit (`Handover`): a large SET's or MSET's
    bulk is kept as it was received, and handed out read-only; a small one (bytes) is
    kept as it is."""
    import os

    from epistemic_kvcache import buffers
    from epistemic_kvcache.store import SharedKvStoreBackend

    store: SharedKvIndex = (
        SharedKvIndex()
        if backend == "memory"
        else SharedKvStoreBackend(tmp_path / "d", StoreOptions(map_size_bytes=64 * MiB))  # type: ignore[assignment]
    )
    srv = ServerThread(store=store)
    try:
        blocks = [os.urandom(256 * 1024) for _ in range(3)]
        with srv.client() as c:
            assert c.set("one", blocks[0]) is True
            assert c.mset({"m1": blocks[1], "m2": blocks[2]}) is True
            assert c.set("small", b"tiny") is True
            assert c.get("one") == blocks[0]
        for key, block in (("one", blocks[0]), ("m1", blocks[1]), ("m2", blocks[2])):
            kept = store.get("alpha", key)
            assert isinstance(kept, memoryview)
            assert kept == block
            assert kept.readonly
            assert isinstance(kept.obj, buffers._heap_type)  # the receive buffer itself
            with pytest.raises(TypeError):
                kept[0] = 0
        assert store.get("alpha", "small") == b"tiny"
        assert store.check(deep=True).ok
    finally:
        srv.close()
