"""Wire features on a real in-process server (uvloop thread, both listeners, real clients):
write conditions and statuses, FLUSHDB, TYPE / MEMORY USAGE / CONFIG GET maxmemory,
readiness, per-tenant shares of in-flight memory, per-connection buffer limits, random
client ids, and JSON that is too deep to parse."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
import urllib3
import uvloop

from epistemic_kvcache.errors import AuthError
from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.server.context import Identity, ServerContext, ServerLimits
from epistemic_kvcache.server.http import make_http_factory
from epistemic_kvcache.server.metrics import Metrics
from epistemic_kvcache.server.resp import make_resp_factory
from epistemic_kvcache.store import SharedKvIndex
from epistemic_kvcache.store.api import StoreHealth

MiB = 1024 * 1024
TOKENS = {"tok-a": "tenant-a", "tok-b": "tenant-b", "tok-f": "fww"}


class TokenAuth:
    def authenticate(self, credential: str) -> Identity:
        tenant = TOKENS.get(credential)
        if tenant is None:
            raise AuthError("invalid token")
        return Identity(tenant, f"user-{tenant}", "token")


class SwitchableHealthIndex(SharedKvIndex):
    """The real in-RAM store whose readiness a test can switch off."""

    not_ready: str | None = None

    def health(self) -> StoreHealth:
        if self.not_ready is not None:
            return StoreHealth(ready=False, writable=False, reason=self.not_ready)
        return super().health()


@dataclass
class Srv:
    ctx: ServerContext
    loop: asyncio.AbstractEventLoop
    servers: list[asyncio.AbstractServer]
    thread: threading.Thread
    http_port: int
    resp_port: int
    pools: list[urllib3.HTTPConnectionPool] = field(default_factory=list)

    def redis(self, token: str = "tok-a", **kw: Any) -> redis.Redis:
        return redis.Redis(port=self.resp_port, password=token, socket_timeout=30, **kw)

    def http(self) -> urllib3.HTTPConnectionPool:
        pool = urllib3.HTTPConnectionPool("127.0.0.1", self.http_port, retries=False, timeout=30)
        self.pools.append(pool)
        return pool

    def stop(self) -> None:
        for pool in self.pools:  # an open keep-alive connection would keep the loop busy
            pool.close()

        async def shutdown() -> None:
            for s in self.servers:
                s.close()
            await asyncio.sleep(0.05)  # teardown: a moment for closing handlers to run
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
        self.ctx.executor.shutdown(wait=True)
        self.ctx.store.close()


def start(limits: ServerLimits | None = None, **store_kw: Any) -> Srv:
    options = StoreOptions(hot_capacity_bytes=256 * MiB, warm_capacity_bytes=0, **store_kw)
    store = SwitchableHealthIndex(options)
    ctx = ServerContext(
        store=store,
        auth=TokenAuth(),
        limits=limits or ServerLimits(),
        metrics=Metrics(store),
        executor=concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="test-store"),
    )
    loop = uvloop.new_event_loop()

    async def listen() -> list[asyncio.AbstractServer]:
        http = await loop.create_server(make_http_factory(ctx), "127.0.0.1", 0)
        resp = await loop.create_server(make_resp_factory(ctx), "127.0.0.1", 0)
        return [http, resp]

    servers = loop.run_until_complete(listen())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    ports = [s.sockets[0].getsockname()[1] for s in servers]
    return Srv(ctx, loop, servers, thread, ports[0], ports[1])


@pytest.fixture(scope="module")
def srv() -> Iterator[Srv]:
    s = start(first_write_wins=frozenset({"fww"}))
    yield s
    s.stop()


def auth(token: str = "tok-a") -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# -- write semantics on both wires -----------------------------------------------------------


def test_set_conditions_and_get_option(srv: Srv) -> None:
    with srv.redis() as r:
        r.delete("c1")
        assert r.set("c1", b"one", xx=True) is None  # replace-only, absent: not set
        assert r.get("c1") is None
        assert r.set("c1", b"one", nx=True) is True
        assert r.set("c1", b"two", nx=True) is None  # create-only, present: not set
        assert r.get("c1") == b"one"
        assert r.set("c1", b"two", xx=True) is True
        assert r.get("c1") == b"two"
        assert r.set("c1", b"three", get=True) == b"two"  # GET returns the old value
        assert r.set("c1", b"four", nx=True, get=True) == b"three"  # not set, old value
        assert r.get("c1") == b"three"
        assert r.set("c1", b"bigger value") is True  # plain SET replaces, any size
        assert r.get("c1") == b"bigger value"


def test_first_write_wins_tenant_refuses_overwrites(srv: Srv) -> None:
    with srv.redis("tok-f") as r:
        r.delete("fw")
        assert r.set("fw", b"first") is True
        assert r.set("fw", b"first") is True  # same bytes: a duplicate, fine
        assert r.set("fw", b"second") is None  # refused: nil, like a failed NX
        assert r.get("fw") == b"first"
    pool = srv.http()
    resp = pool.request("PUT", "/kv/fw", body=b"third", headers=auth("tok-f"))
    doc = json.loads(resp.data)
    assert (resp.status, doc["error"], doc["outcome"]) == (409, "conflict", "conflict")
    assert resp.reason == "Conflict"  # http.HTTPStatus's phrase, not "Unknown"
    assert resp.headers["X-Kv-Outcome"] == "conflict"
    assert pool.request("GET", "/kv/fw", headers=auth("tok-f")).data == b"first"


def test_http_statuses_and_preconditions(srv: Srv) -> None:
    pool = srv.http()
    pool.request("DELETE", "/kv/p1", headers=auth())
    r = pool.request("PUT", "/kv/p1", body=b"x", headers={**auth(), "If-Match": "*"})
    assert (r.status, json.loads(r.data)["error"]) == (412, "precondition_failed")
    assert r.reason == "Precondition Failed"  # http.HTTPStatus's phrase, not "Unknown"
    assert r.headers["X-Kv-Outcome"] == "missing"
    assert pool.request("GET", "/kv/p1", headers=auth()).status == 404
    r = pool.request("PUT", "/kv/p1", body=b"x", headers={**auth(), "If-None-Match": "*"})
    assert (r.status, r.headers["X-Kv-Outcome"]) == (201, "created")
    r = pool.request("PUT", "/kv/p1", body=b"y", headers={**auth(), "If-None-Match": "*"})
    assert (r.status, r.headers["X-Kv-Outcome"]) == (412, "conflict")
    assert pool.request("GET", "/kv/p1", headers=auth()).data == b"x"
    r = pool.request("PUT", "/kv/p1", body=b"y", headers={**auth(), "If-Match": "*"})
    assert (r.status, r.headers["X-Kv-Outcome"]) == (200, "replaced")
    r = pool.request("PUT", "/kv/p1", body=b"y", headers=auth())
    assert (r.status, r.headers["X-Kv-Outcome"]) == (200, "duplicate")
    r = pool.request("PUT", "/kv/p1", body=b"zz", headers=auth())
    assert (r.status, r.headers["X-Kv-Outcome"]) == (200, "replaced")
    assert pool.request("GET", "/kv/p1", headers=auth()).data == b"zz"
    for bad in ({"If-None-Match": '"etag"'}, {"If-Match": "*", "If-None-Match": "*"}):
        r = pool.request("PUT", "/kv/p1", body=b"q", headers={**auth(), **bad})
        assert r.status == 400, r.data
    # the epoch-scoped PUT honours the same preconditions
    scoped = {**auth(), "X-Kv-Epoch-Scope": "s1", "If-None-Match": "*"}
    r = pool.request("PUT", "/kv/p1", body=b"w", headers=scoped)
    assert r.status == 412


def test_flushdb_is_per_tenant_and_flushall_is_refused(srv: Srv) -> None:
    with srv.redis("tok-a") as a, srv.redis("tok-b") as b:
        a.mset({"fa1": b"1", "fa2": b"2"})
        b.mset({"fb1": b"1"})
        with pytest.raises(redis.ResponseError, match="unsupported command 'FLUSHALL': it would"):
            a.flushall()
        assert a.exists("fa1", "fa2") == 2
        assert a.flushdb() is True
        assert a.dbsize() == 0
        assert b.get("fb1") == b"1"  # the other tenant keeps its keys
        assert b.execute_command("FLUSHDB", "ASYNC") in (b"OK", True)
        assert b.dbsize() == 0
        with pytest.raises(redis.ResponseError, match="syntax"):
            b.execute_command("FLUSHDB", "NOW")


# -- Redis tooling ----------------------------------------------------------------------------


def test_type_memory_usage_and_maxmemory(srv: Srv) -> None:
    with srv.redis() as r:
        r.set("t1", b"v" * 1000)
        assert r.type("t1") == b"string"
        assert r.type("absent") == b"none"
        usage = r.memory_usage("t1")
        assert usage is not None
        assert 1000 < usage < 2000
        assert r.execute_command("MEMORY", "USAGE", "t1", "SAMPLES", "0") == usage
        assert r.memory_usage("absent") is None
        with pytest.raises(redis.ResponseError, match="unknown subcommand"):
            r.execute_command("MEMORY", "DOCTOR")
        assert r.config_get("maxmemory") == {"maxmemory": str(256 * MiB)}  # hot + warm
        info = r.info("memory")
        assert info["maxmemory"] == 256 * MiB
        assert info["used_memory"] >= 1000


# -- readiness --------------------------------------------------------------------------------


def test_readyz_and_info_readiness(srv: Srv) -> None:
    pool = srv.http()
    r = pool.request("GET", "/readyz")  # no credentials needed, like /healthz
    doc = json.loads(r.data)
    assert (r.status, doc["status"], doc["writable"]) == (200, "ready", True)
    with srv.redis() as rc:
        info = rc.info("server")
        assert (info["ready"], info["ready_reason"]) == (1, "ok")
        store = srv.ctx.store
        assert isinstance(store, SwitchableHealthIndex)
        store.not_ready = "store fault: read-only until restarted"
        try:
            r = pool.request("GET", "/readyz")
            doc = json.loads(r.data)
            assert (r.status, doc["status"], doc["writable"]) == (503, "not_ready", False)
            assert doc["reason"] == "store fault: read-only until restarted"
            assert pool.request("HEAD", "/readyz").status == 503
            assert pool.request("GET", "/healthz").status == 200  # liveness is unaffected
            info = rc.info("server")
            assert info["ready"] == 0
            assert info["ready_reason"] == "store fault: read-only until restarted"
        finally:
            store.not_ready = None
    assert pool.request("GET", "/readyz").status == 200


# -- ids --------------------------------------------------------------------------------------


def test_client_ids_are_random_per_connection(srv: Srv) -> None:
    ids = set()
    for _ in range(5):
        with srv.redis() as r:
            ids.add(r.client_id())
    assert len(ids) == 5
    assert min(ids) > 1_000_000  # not a counter: no rate of other tenants' connections
    with srv.redis(protocol=3) as r3:
        hello = r3.execute_command("HELLO", "3", "AUTH", "x", "tok-a")
        assert hello[b"id"] == r3.client_id()


# -- JSON too deep ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "content_type"),
    [
        ("/kv/batch/exists", "application/json"),
        ("/kv/batch/get", "application/json"),
        ("/kv/snapshot", "application/json"),
        ("/kv/page-in", "application/json"),
    ],
)
def test_deeply_nested_json_is_a_400(srv: Srv, path: str, content_type: str) -> None:
    body = b"[" * 200_000 + b"]" * 200_000
    r = srv.http().request(
        "POST", path, body=body, headers={**auth(), "Content-Type": content_type}
    )
    doc = json.loads(r.data)
    assert r.status == 400, r.data
    assert doc["error"] == "bad_request"
    assert "Traceback" not in doc["message"]


def test_deeply_nested_batch_put_header_is_a_400(srv: Srv) -> None:
    header = b"[" * 200_000 + b"]" * 200_000
    body = len(header).to_bytes(4, "big") + header
    r = srv.http().request(
        "POST",
        "/kv/batch/put",
        body=body,
        headers={**auth(), "Content-Type": "application/x-kvcache-batch"},
    )
    assert r.status in (400, 413), r.data
    assert json.loads(r.data)["error"] in ("bad_request", "batch_too_large")


# -- per-tenant shares and per-connection limits ----------------------------------------------


def _put_head(port: int, key: str, length: int, token: str) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(
        f"PUT /kv/{key} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        f"Expect: 100-continue\r\nContent-Length: {length}\r\n\r\n".encode()
    )
    return s


def _status(s: socket.socket) -> int:
    data = b""
    while b"\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ", 2)[1])


def test_a_tenant_at_its_share_gets_its_own_error() -> None:
    limits = ServerLimits(
        max_block_bytes=16 * MiB,
        max_batch_bytes=16 * MiB,
        max_inflight_body_bytes=64 * MiB,
        max_tenant_inflight_bytes=32 * MiB,
    )
    s = start(limits)
    heads: list[socket.socket] = []
    try:
        for i in range(2):  # tenant a holds its whole share with header-only PUTs
            heads.append(_put_head(s.http_port, f"held-{i}", 16 * MiB, "tok-a"))
            assert _status(heads[-1]) == 100
        third = _put_head(s.http_port, "held-2", 1 * MiB, "tok-a")
        heads.append(third)
        data = third.recv(4096)
        assert b" 429 " in data
        assert b"tenant_busy" in data
        assert b"Retry-After: 1" in data
        with s.redis("tok-a") as a:  # RESP draws on the same share
            with pytest.raises(redis.ResponseError, match="share of in-flight memory"):
                a.set("big", b"x" * MiB)
            assert a.set("small", b"x" * 1000)  # small arguments are no bulk reservation
        # tenant b does not notice
        b_head = _put_head(s.http_port, "b-1", 16 * MiB, "tok-b")
        heads.append(b_head)
        assert _status(b_head) == 100
        with s.redis("tok-b") as b:
            assert b.set("big", b"y" * MiB)
        assert s.ctx.budget.used_by("tenant-a") == 32 * MiB
    finally:
        for h in heads:
            h.close()
        s.stop()


def test_resp_query_buffer_limit_disconnects_and_frees() -> None:
    s = start(ServerLimits(resp_max_query_buffer_bytes=1 * MiB))
    try:
        raw = socket.create_connection(("127.0.0.1", s.resp_port), timeout=10)
        raw.sendall(b"AUTH tok-a\r\n")
        assert raw.recv(100) == b"+OK\r\n"
        raw.sendall(b"*1000000\r\n")
        chunk = (b"$100\r\n" + b"x" * 100 + b"\r\n") * 1000
        got = b""
        try:
            for _ in range(100):  # ~10 MiB offered; the server stops at 1 MiB
                raw.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        raw.settimeout(5)
        try:
            while True:
                data = raw.recv(65536)
                if not data:
                    break
                got += data
        except (ConnectionResetError, TimeoutError):
            pass
        raw.close()
        assert b"query buffer limit" in got
        with s.redis() as r:
            assert r.ping()
        deadline = time.monotonic() + 5
        while s.ctx.budget.used and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.ctx.budget.used_by("tenant-a") < 256 * 1024  # given back
    finally:
        s.stop()


def test_unread_replies_over_the_output_limit_disconnect() -> None:
    s = start(ServerLimits(client_output_buffer_limit_bytes=2 * MiB))
    raw = socket.socket()
    try:
        with s.redis() as r:
            r.set("sixteen", b"f" * (16 * MiB))
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting
        raw.settimeout(10)
        raw.connect(("127.0.0.1", s.resp_port))
        raw.sendall(b"AUTH tok-a\r\n")
        assert raw.recv(5) == b"+OK\r\n"
        raw.sendall(b"GET sixteen\r\n" * 4)  # and never read
        deadline = time.monotonic() + 10
        while s.ctx.open_connections["resp"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.ctx.open_connections["resp"] == 0  # dropped: over the output limit
        assert s.ctx.budget.used == 0  # and everything it held was counted back
        with s.redis() as r:  # others are served
            assert r.strlen("sixteen") == 16 * MiB
    finally:
        raw.close()
        s.stop()


def test_a_tenant_at_its_key_quota_gets_its_own_error() -> None:
    s = start(max_keys_per_tenant=3)
    try:
        with s.redis("tok-a") as a, s.redis("tok-b") as b:
            for i in range(3):
                assert a.set(f"q{i}", b"v")
            with pytest.raises(redis.ResponseError, match="quota exceeded"):
                a.set("q3", b"v")
            assert a.set("q0", b"replaced")  # replacing a key needs no new one
            assert b.set("q3", b"v")  # the other tenant does not notice
        r = s.http().request("PUT", "/kv/q4", body=b"v", headers=auth("tok-a"))
        doc = json.loads(r.data)
        assert (r.status, doc["error"]) == (507, "quota_exceeded")
        assert "keys" in doc["message"]
    finally:
        s.stop()


def test_concurrent_snapshots_cannot_pass_the_quota() -> None:
    s = start(max_snapshots_per_tenant=5)
    try:
        with s.redis("tok-a") as a:
            a.mset({f"s{i}": b"v" * 100 for i in range(20)})
        statuses: list[int] = []
        lock = threading.Lock()

        def create() -> None:
            with urllib3.HTTPConnectionPool("127.0.0.1", s.http_port, retries=False) as pool:
                r = pool.request("POST", "/kv/snapshot", body=b"{}", headers=auth("tok-a"))
                with lock:
                    statuses.append(r.status)

        threads = [threading.Thread(target=create) for _ in range(24)]
        latencies: list[float] = []
        for t in threads:
            t.start()
        with s.redis("tok-b") as b:  # the other tenant meanwhile
            b.set("probe", b"p" * 4096)
            while any(t.is_alive() for t in threads):
                t0 = time.perf_counter()
                assert b.get("probe") == b"p" * 4096
                latencies.append(time.perf_counter() - t0)
        for t in threads:
            t.join(30)
        assert sorted(set(statuses)) == [201, 507]
        assert statuses.count(201) == 5  # exactly the quota, never more
        listed = json.loads(s.http().request("GET", "/kv/snapshot", headers=auth("tok-a")).data)
        assert len(listed["snapshots"]) == 5
        r = s.http().request("POST", "/kv/snapshot", body=b"{}", headers=auth("tok-b"))
        assert r.status == 201  # tenant b has its own quota
        assert max(latencies, default=0.0) < 1.0
    finally:
        s.stop()
