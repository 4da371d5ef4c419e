"""WATCH / UNWATCH: Redis's optimistic locking (issue 40, item 7).

`EXEC` answers nil (a null array, nothing run) when a watched key was written since
WATCH: by any write on either wire (RESP SET, MSET, DEL, ..., HTTP PUT, DELETE, batch
PUT, an epoch bump), on any event loop, on the memory and the durable backend. So
redis-py's `pipe.watch()` and `transaction()` work. Everything is checked with real
clients (redis-py, http.client, raw sockets) against a real server; the semantics next
to them were read off a real redis-server 7 (`SET` of the same bytes counts as a write,
a refused `SET NX` or a `DEL` of an absent key does not, `WATCH` inside `MULTI` is
refused without aborting the transaction).
"""

from __future__ import annotations

import asyncio
import http.client
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from epistemic_kvcache.proto.http import encode_batch_put_request
from epistemic_kvcache.server.resp import COMMANDS
from epistemic_kvcache.server.writes import TenantGates
from epistemic_kvcache.store import SharedKvIndex
from helpers import eventually
from servers import RunningServer, running_listener, running_server

TOKEN = "watch-token-0123456789"
OTHER = "watch-other-tenant-0123456789"


@pytest.fixture(scope="module", params=["memory", "durable"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    with running_server(
        tmp_path_factory.mktemp(f"watch-{request.param}"),
        backend=request.param,
        tokens={TOKEN: "default", OTHER: "other"},
        event_loops="2",
    ) as srv:
        yield srv


def resp(srv: RunningServer, token: str = TOKEN, **kw: Any) -> redis.Redis:
    assert srv.resp is not None
    return redis.Redis(port=srv.resp.port, password=token, **kw)


def http_call(
    srv: RunningServer, method: str, path: str, body: bytes | list[Any] = b"", **headers: str
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(srv.http.host, srv.http.port, timeout=30)
    try:
        data = b"".join(bytes(b) for b in body) if isinstance(body, list) else body
        conn.request(
            method, path, body=data, headers={"Authorization": f"Bearer {TOKEN}", **headers}
        )
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def exec_after(
    srv: RunningServer, key: str, write: Callable[[], object], *, resp3: bool = False
) -> object:
    """WATCH `key` on one connection, run `write`, then MULTI/SET/EXEC there: EXEC's reply."""
    with resp(srv, protocol=3 if resp3 else 2, single_connection_client=True) as r:
        r.set(key, b"before")
        assert r.execute_command("WATCH", key)
        write()
        r.execute_command("MULTI")
        r.execute_command("SET", key, b"from-the-transaction")
        return r.execute_command("EXEC")


# -- what invalidates a watch -------------------------------------------------------------------

RESP_WRITES: dict[str, tuple[str, ...]] = {
    "set": ("SET", "{k}", "new"),
    "set-same-bytes": ("SET", "{k}", "before"),  # Redis too: a SET is a write
    "set-get": ("SET", "{k}", "new", "GET"),
    "setnx": ("SETNX", "{k}-fresh", "x"),  # (watched below: the fresh key itself)
    "getset": ("GETSET", "{k}", "new"),
    "getdel": ("GETDEL", "{k}"),
    "mset": ("MSET", "other", "1", "{k}", "new"),
    "del": ("DEL", "nope", "{k}"),
    "unlink": ("UNLINK", "{k}"),
    "flushdb": ("FLUSHDB",),
}
"""One write per RESP command that writes (`COMMANDS` with the `write` flag)."""
RESP_NOT_WRITES: dict[str, tuple[str, ...]] = {
    "get": ("GET", "{k}"),
    "exists": ("EXISTS", "{k}"),
    "set-nx-refused": ("SET", "{k}", "new", "NX"),
    "setnx-refused": ("SETNX", "{k}", "new"),
    "del-absent": ("DEL", "{k}-absent"),
    "getdel-absent": ("GETDEL", "{k}-absent"),
    "getex-persist": ("GETEX", "{k}", "PERSIST"),
    "persist": ("PERSIST", "{k}"),
    "another-key": ("SET", "{k}-other", "new"),
}


def test_every_resp_write_command_is_covered() -> None:
    writing = {name.decode() for name, spec in COMMANDS.items() if "write" in spec.flags}
    covered = {args[0].lower() for args in RESP_WRITES.values()}
    assert writing - covered == {"getex", "persist"}  # they write nothing here (no TTLs)
    assert {"getex", "persist"} <= {args[0].lower() for args in RESP_NOT_WRITES.values()}


def _watched_key(case: str) -> str:
    return f"w-{case}-fresh" if case == "setnx" else f"w-{case}"


@pytest.mark.parametrize("case", sorted(RESP_WRITES))
def test_a_resp_write_on_another_connection_makes_exec_nil(
    case: str, server: RunningServer
) -> None:
    key = _watched_key(case).removesuffix("-fresh")
    args = [a.format(k=key) for a in RESP_WRITES[case]]
    with resp(server) as other:
        other.delete(f"{key}-fresh")
        if case == "setnx":
            watched = f"{key}-fresh"
            with resp(server, single_connection_client=True) as r:
                assert r.execute_command("WATCH", watched)
                assert other.execute_command(*args) == 1
                r.execute_command("MULTI")
                r.execute_command("SET", watched, b"t")
                assert r.execute_command("EXEC") is None
            return
        assert exec_after(server, key, lambda: other.execute_command(*args)) is None


@pytest.mark.parametrize("case", sorted(RESP_NOT_WRITES))
def test_what_writes_nothing_leaves_the_watch(case: str, server: RunningServer) -> None:
    key = f"n-{case}"
    args = [a.format(k=key) for a in RESP_NOT_WRITES[case]]
    with resp(server) as other:
        assert exec_after(server, key, lambda: other.execute_command(*args)) == [b"OK"]
        assert other.get(key) == b"from-the-transaction"


def test_a_write_in_another_transaction_makes_exec_nil(server: RunningServer) -> None:
    def write() -> None:
        with resp(server) as other, other.pipeline(transaction=True) as p:
            p.set("other-key", b"1")
            p.set("t-key", b"theirs")
            assert p.execute() == [True, True]

    assert exec_after(server, "t-key", write) is None


def test_the_connections_own_write_makes_exec_nil(server: RunningServer) -> None:
    with resp(server, single_connection_client=True) as r:
        r.execute_command("WATCH", "own")
        r.set("own", b"mine")
        r.execute_command("MULTI")
        r.execute_command("SET", "own", b"t")
        assert r.execute_command("EXEC") is None


HTTP_WRITES: dict[str, Callable[[RunningServer, str], tuple[int, bytes]]] = {
    "PUT": lambda s, k: http_call(s, "PUT", f"/kv/{k}", b"http"),
    "PUT same bytes": lambda s, k: http_call(s, "PUT", f"/kv/{k}", b"before"),
    "PUT If-Match": lambda s, k: http_call(s, "PUT", f"/kv/{k}", b"http", **{"If-Match": "*"}),
    "PUT with epoch scope": lambda s, k: http_call(
        s, "PUT", f"/kv/{k}", b"http", **{"X-Kv-Epoch-Scope": "model-a"}
    ),
    "DELETE": lambda s, k: http_call(s, "DELETE", f"/kv/{k}"),
    "batch PUT": lambda s, k: http_call(
        s,
        "POST",
        "/kv/batch/put",
        encode_batch_put_request(["x1", k], [b"1", b"2"]),
        **{"Content-Type": "application/x-kvcache-batch"},
    ),
    "epoch bump": lambda s, k: http_call(s, "POST", "/kv/epoch/model-a/bump"),
}


NOT_KEY_WRITES = {
    ("/kv/batch/get", "POST"),  # reads
    ("/kv/batch/exists", "POST"),
    ("/kv/page-in", "POST"),  # promotes blocks to faster tiers: no value changes
    ("/kv/snapshot", "POST"),  # snapshots and branches are not the live keys
    ("/kv/snapshot/{id}", "DELETE"),
    ("/kv/snapshot/{id}/fork", "POST"),
    ("/kv/branch/{id}", "DELETE"),
    ("/kv/branch/{id}/{key}", "PUT"),
}
"""HTTP routes that take PUT/POST/DELETE but write none of a tenant's live keys."""
KEY_WRITES = {
    ("/kv/{key}", "PUT"): ("PUT", "PUT same bytes", "PUT If-Match", "PUT with epoch scope"),
    ("/kv/{key}", "DELETE"): ("DELETE",),
    ("/kv/batch/put", "POST"): ("batch PUT",),
    ("/kv/epoch/{scope}/bump", "POST"): ("epoch bump",),
}
"""The HTTP routes that write keys, and the cases below that show they invalidate."""


def test_every_http_route_that_writes_is_covered() -> None:
    from epistemic_kvcache.server.http.routes import ROUTES

    writing = {
        (template, method)
        for template, route in ROUTES.items()
        for method in route.methods
        if method in ("PUT", "POST", "DELETE")
    }
    assert writing == set(KEY_WRITES) | NOT_KEY_WRITES  # a new write route: add it here
    assert {c for cases in KEY_WRITES.values() for c in cases} == set(HTTP_WRITES)


@pytest.mark.parametrize("case", sorted(HTTP_WRITES))
def test_an_http_write_makes_exec_nil(case: str, server: RunningServer) -> None:
    key = "h-" + case.replace(" ", "-").lower()
    results: list[tuple[int, bytes]] = []
    got = exec_after(server, key, lambda: results.append(HTTP_WRITES[case](server, key)))
    assert results[0][0] < 300, results
    assert got is None


def test_an_http_write_that_writes_nothing_leaves_the_watch(server: RunningServer) -> None:
    refused: list[int] = []
    assert exec_after(
        server,
        "h-refused",
        lambda: refused.append(
            http_call(server, "PUT", "/kv/h-refused", b"x", **{"If-None-Match": "*"})[0]
        ),
    ) == [b"OK"]
    assert refused[0] in (409, 412)
    assert exec_after(
        server, "h-absent", lambda: refused.append(http_call(server, "DELETE", "/kv/h-nope")[0])
    ) == [b"OK"]
    assert refused[1] == 404


def test_another_tenants_write_to_the_same_name_leaves_the_watch(server: RunningServer) -> None:
    with resp(server, OTHER) as theirs:
        assert exec_after(server, "shared-name", lambda: theirs.set("shared-name", b"x")) == [b"OK"]


def _loop_of(r: redis.Redis) -> int:
    info = r.execute_command("CLIENT", "INFO").decode()
    return int(info.split("io-thread=")[1].split()[0])


def test_a_write_served_by_another_event_loop_makes_exec_nil(server: RunningServer) -> None:
    watcher = resp(server, single_connection_client=True)
    others: list[redis.Redis] = []
    try:
        mine = _loop_of(watcher)
        for _ in range(64):  # connections land on the loops as the kernel spreads them
            o = resp(server, single_connection_client=True)
            others.append(o)
            if _loop_of(o) != mine:
                break
        writer = others[-1]
        assert _loop_of(writer) != mine, "no connection landed on the other loop"
        watcher.set("x-loop", b"a")
        watcher.execute_command("WATCH", "x-loop")
        writer.set("x-loop", b"b")  # answered inline by the other loop's fast path
        watcher.execute_command("MULTI")
        watcher.execute_command("SET", "x-loop", b"t")
        assert watcher.execute_command("EXEC") is None
    finally:
        watcher.close()
        for o in others:
            o.close()


# -- the reply, the commands around it ----------------------------------------------------------


def _raw(srv: RunningServer) -> socket.socket:
    assert srv.resp is not None
    s = socket.create_connection((srv.resp.host, srv.resp.port), timeout=30)
    s.sendall(f"AUTH {TOKEN}\r\n".encode())
    assert s.recv(100) == b"+OK\r\n"
    return s


def _ask(s: socket.socket, line: str, want: bytes) -> None:
    s.sendall(line.encode() + b"\r\n")
    got = b""
    while len(got) < len(want):
        chunk = s.recv(1000)
        assert chunk
        got += chunk
    assert got == want, (line, got)


@pytest.mark.parametrize(("hello", "nil"), [("HELLO 2", b"*-1\r\n"), ("HELLO 3", b"_\r\n")])
def test_exec_answers_a_null_array(hello: str, nil: bytes, server: RunningServer) -> None:
    with _raw(server) as s, resp(server) as other:
        s.sendall(hello.encode() + b"\r\n")
        assert s.recv(1000)
        _ask(s, "WATCH nil-key", b"+OK\r\n")
        other.set("nil-key", b"x")
        _ask(s, "MULTI", b"+OK\r\n")
        _ask(s, "SET nil-key y", b"+QUEUED\r\n")
        _ask(s, "EXEC", nil)
        _ask(s, "GET nil-key", b"$1\r\nx\r\n")  # nothing of the transaction ran


def test_watch_inside_multi_is_refused_and_the_transaction_goes_on(server: RunningServer) -> None:
    with _raw(server) as s:
        _ask(s, "MULTI", b"+OK\r\n")
        _ask(s, "WATCH k", b"-ERR WATCH inside MULTI is not allowed\r\n")
        _ask(s, "SET in-multi v", b"+QUEUED\r\n")
        _ask(s, "UNWATCH", b"+QUEUED\r\n")
        _ask(s, "EXEC", b"*2\r\n+OK\r\n+OK\r\n")
        _ask(s, "WATCH", b"-ERR wrong number of arguments for 'watch' command\r\n")
        _ask(s, "UNWATCH x", b"-ERR wrong number of arguments for 'unwatch' command\r\n")


@pytest.mark.parametrize("clear", ["UNWATCH", "EXEC", "DISCARD", "RESET"])
def test_unwatch_exec_discard_and_reset_forget_the_watch(clear: str, server: RunningServer) -> None:
    with _raw(server) as s, resp(server) as other:
        _ask(s, "WATCH cleared", b"+OK\r\n")
        if clear == "EXEC":
            _ask(s, "MULTI", b"+OK\r\n")
            _ask(s, "EXEC", b"*0\r\n")
        elif clear == "DISCARD":
            _ask(s, "MULTI", b"+OK\r\n")
            _ask(s, "DISCARD", b"+OK\r\n")
        elif clear == "RESET":
            _ask(s, "RESET", b"+RESET\r\n")
            _ask(s, f"AUTH {TOKEN}", b"+OK\r\n")
        else:
            _ask(s, "UNWATCH", b"+OK\r\n")
        other.set("cleared", b"written after")
        _ask(s, "MULTI", b"+OK\r\n")
        _ask(s, "SET cleared t", b"+QUEUED\r\n")
        _ask(s, "EXEC", b"*1\r\n+OK\r\n")


def test_exec_after_execabort_forgets_the_watch(server: RunningServer) -> None:
    with _raw(server) as s, resp(server) as other:
        _ask(s, "WATCH aborted", b"+OK\r\n")
        _ask(s, "MULTI", b"+OK\r\n")
        s.sendall(b"NOSUCH\r\n")
        assert s.recv(1000).startswith(b"-ERR unknown command")
        _ask(s, "EXEC", b"-EXECABORT Transaction discarded because of previous errors.\r\n")
        other.set("aborted", b"x")
        _ask(s, "MULTI", b"+OK\r\n")
        _ask(s, "EXEC", b"*0\r\n")


# -- redis-py ------------------------------------------------------------------------------------


def test_redis_py_pipe_watch(server: RunningServer) -> None:
    with resp(server) as r, resp(server) as other:
        r.set("counter", b"1")
        with r.pipeline() as pipe:
            pipe.watch("counter")
            value = int(pipe.get("counter"))
            other.set("counter", b"5")
            pipe.multi()
            pipe.set("counter", value + 1)
            with pytest.raises(redis.WatchError):
                pipe.execute()
        with r.pipeline() as pipe:  # untouched: it goes through
            pipe.watch("counter")
            value = int(pipe.get("counter"))
            pipe.multi()
            pipe.set("counter", value + 1)
            assert pipe.execute() == [True]
        assert r.get("counter") == b"6"


@pytest.mark.parametrize("protocol", [2, 3])
def test_concurrent_transactions_lose_no_increment(protocol: int, server: RunningServer) -> None:
    """8 clients on both event loops increment one counter with `transaction()` (WATCH,
    GET, MULTI/SET/EXEC, retried on WatchError): every increment lands exactly once."""
    key = f"race-{protocol}"
    per_client, clients = 40, 8
    with resp(server) as r:
        r.set(key, b"0")
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            with resp(server, protocol=protocol) as c:
                for _ in range(per_client):

                    def incr(pipe: Any) -> None:
                        value = int(pipe.get(key))
                        pipe.multi()
                        pipe.set(key, value + 1)

                    c.transaction(incr, key)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    with resp(server) as r:
        assert int(r.get(key)) == per_client * clients


# -- the write path's gate and the table's bounds -----------------------------------------------


def test_an_http_write_waits_while_a_transaction_holds_the_tenant() -> None:
    with running_listener("http", tokens={TOKEN: "default"}) as lst:
        gates = lst.ctx.writes.gates
        asyncio.run_coroutine_threadsafe(gates.hold("default"), lst.loop).result(10)
        done: list[int] = []

        def put() -> None:
            conn = lst.conn(timeout=30)
            conn.request(
                "PUT", "/kv/gated", body=b"v", headers={"Authorization": f"Bearer {TOKEN}"}
            )
            done.append(conn.getresponse().status)

        t = threading.Thread(target=put)
        t.start()
        eventually(lambda: bool(gates._gates["default"].waiters), what="the PUT waits at the gate")
        assert lst.store.get("default", "gated") is None
        assert not done
        lst.loop.call_soon_threadsafe(gates.release, "default")
        t.join(30)
        assert done == [201]
        assert bytes(lst.store.get("default", "gated") or b"") == b"v"


class GateRecordingStore(SharedKvIndex):
    """The memory store, noting at each inline PUT whether the writer is inside the
    tenant's gate (an EXEC taking the tenant must wait for it)."""

    gates: TenantGates | None = None
    inside: list[int]

    def put_nowait(self, ns: str, key: str, data: Any, cond: Any = None) -> Any:
        assert self.gates is not None
        self.inside.append(self.gates.active(ns))
        return super().put_nowait(ns, key, data, cond=cond)


def test_an_inline_set_lands_inside_the_tenants_gate() -> None:
    """A pipeline of plain SETs answered in the read callback (the fast path) used to
    write outside the gate, checking only a hint first: a transaction taking the tenant
    on another event loop meanwhile could have SETs land between its check of the
    watched keys and its own writes."""
    store = GateRecordingStore()
    store.inside = []
    with running_listener("resp", store=store, tokens={TOKEN: "default"}) as lst:
        store.gates = lst.ctx.writes.gates
        with redis.Redis(port=lst.port, password=TOKEN) as r, r.pipeline(False) as p:
            for i in range(20):
                p.set(f"inline{i}", b"v")
            assert p.execute() == [True] * 20
        assert len(store.inside) == 20
        assert all(n >= 1 for n in store.inside), store.inside
        assert lst.ctx.writes.gates.active("default") == 0  # left once they landed


def test_a_closed_connection_forgets_its_watches() -> None:
    with running_listener("resp", tokens={TOKEN: "default"}) as lst:
        watches = lst.ctx.writes.watches
        with redis.Redis(port=lst.port, password=TOKEN, single_connection_client=True) as r:
            r.execute_command("WATCH", "a", "b", "c")
            assert watches.count == 3
        eventually(lambda: watches.count == 0, what="the closed connection's watches gone")


def test_a_connection_watches_at_most_its_share() -> None:
    with running_listener("resp", tokens={TOKEN: "default"}) as lst:
        share = lst.ctx.writes.watches.per_connection
        with redis.Redis(port=lst.port, password=TOKEN) as r:
            assert r.execute_command("WATCH", *[f"k{i}" for i in range(share)])
            with pytest.raises(redis.ResponseError, match=f"at most {share} keys may be watched"):
                r.execute_command("WATCH", "one-more")
            r.execute_command("UNWATCH")
            assert lst.ctx.writes.watches.count == 0


def test_a_nil_exec_is_counted_ok() -> None:
    with running_listener("resp", tokens={TOKEN: "default"}) as lst:
        with redis.Redis(port=lst.port, password=TOKEN, single_connection_client=True) as r:
            r.execute_command("WATCH", "m")
            r.set("m", b"1")
            r.execute_command("MULTI")
            assert r.execute_command("EXEC") is None
        text = lst.ctx.metrics.render()[0].decode()
        assert 'route="exec",status="ok",wire="resp"} 1.0' in text
        assert 'route="exec",status="error"' not in text
