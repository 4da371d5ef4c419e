"""Several event loops (`--event-loops`): real servers with 2 loops over one store.

Each connection is served by the lightest loop (server/balance.py), but two connections
opened at once may both see the same counts, so the tests that need every loop busy do
not assume where one connection lands: each opens connections until the server's own
per-loop view (`INFO loops`, `/kv/stats` "loops") shows every loop serving some, and
only then checks what it is about. The balancing itself is tested with connections
opened one after another.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from epistemic_kvcache.client import EpistemicGraphKVBackend
from epistemic_kvcache.config import Address, load_config, usable_cores
from epistemic_kvcache.errors import ConfigurationError
from epistemic_kvcache.server import loops
from epistemic_kvcache.server.app import ServerThread
from epistemic_kvcache.server.loops import ListenerError
from epistemic_kvcache.server.resp.session import TenantGates
from epistemic_kvcache.server.runtime import SWITCH_INTERVAL_S, tune_switch_interval
from helpers import eventually
from servers import TOKEN, ServeProcess, running_server, server_config, start_server

LOOPS = 2
MAX_CONNECTIONS = 200
"""Connections a test opens at most while waiting for every loop to get some (the odds
that 200 connections all hash to one of 2 loops are 2^-199)."""
TOKEN_B = "tenant-b-token-0123456789abcdef"


def _loop_counts(info: dict[str, object]) -> list[int]:
    """Open connections per loop, from INFO loops."""
    rows = sorted((k, v) for k, v in info.items() if k.startswith("loop"))
    return [int(v["connections"]) for _, v in rows if isinstance(v, dict)]


def _spread(
    open_one: Callable[[], object],
    counts: Callable[[], list[int]],
    *,
    least: int = 1,
    loops: int = LOOPS,
) -> list[object]:
    """Open connections until every loop serves at least `least` of what `counts` sees."""
    opened: list[object] = []
    while len(opened) < MAX_CONNECTIONS:
        opened.append(open_one())
        seen = counts()
        if len(seen) == loops and min(seen) >= least:
            return opened
    raise AssertionError(f"{MAX_CONNECTIONS} connections never reached every loop: {seen}")


def _resp(srv: object, token: str = TOKEN) -> redis.Redis:
    addr = srv.resp  # type: ignore[attr-defined]
    return redis.Redis(host=addr.host, port=addr.port, password=token)


def _http_request(sock: socket.socket, head: str, body: bytes = b"") -> tuple[int, bytes]:
    """One HTTP/1.1 request on a raw keep-alive socket; (status, body)."""
    sock.sendall(head.encode() + body)
    return _read_response(sock)


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed after {buf!r}")
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    length = next(
        int(v) for k, _, v in (h.partition(":") for h in lines[1:]) if k.lower() == "content-length"
    )
    body = bytearray(rest)
    while len(body) < length:
        chunk = sock.recv(min(1 << 20, length - len(body)))
        if not chunk:
            raise ConnectionError("closed mid-body")
        body += chunk
    return status, bytes(body)


def _get(path: str, token: str = TOKEN) -> str:
    return f"GET {path} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {token}\r\n\r\n"


def _stats_loops(sock: socket.socket) -> list[int]:
    status, body = _http_request(sock, _get("/kv/stats"))
    assert status == 200, body
    return [row["connections"] for row in json.loads(body)["loops"]]


def _no_loop_threads() -> bool:
    return not [t for t in threading.enumerate() if t.name.startswith("kvcache-loop")]


# -- serving -------------------------------------------------------------------------------


def test_both_wires_serve_on_every_loop(tmp_path: Path) -> None:
    with running_server(tmp_path, event_loops=str(LOOPS)) as srv:
        assert srv.handle.event_loops == LOOPS
        # RESP: every counted connection is a RESP client here
        clients: list[redis.Redis] = []

        def open_resp() -> redis.Redis:
            c = _resp(srv)
            c.set(f"r{len(clients)}", f"value {len(clients)}")
            clients.append(c)
            return c

        _spread(open_resp, lambda: _loop_counts(clients[0].info("loops")))
        for i, c in enumerate(clients):  # each loop answers its own clients right
            assert c.get(f"r{i}") == f"value {i}".encode()
        info = clients[0].info("loops")
        assert info["event_loops"] == LOOPS
        assert all(int(info[f"loop{i}"]["requests"]) > 0 for i in range(LOOPS))
        for c in clients:
            c.close()

        # HTTP: once the RESP clients are gone, every counted connection is HTTP
        socks: list[socket.socket] = []
        probe = socket.create_connection((srv.http.host, srv.http.port), timeout=10)
        eventually(lambda: sum(_stats_loops(probe)) == 1, what="RESP connections closed")
        probe.close()

        def open_http() -> socket.socket:
            s = socket.create_connection((srv.http.host, srv.http.port), timeout=10)
            n = len(socks)
            body = f"block {n}".encode()
            put = (
                f"PUT /kv/h{n} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {TOKEN}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            )
            assert _http_request(s, put, body)[0] == 201
            socks.append(s)
            return s

        _spread(open_http, lambda: _stats_loops(socks[-1]))
        for n, s in enumerate(socks):
            assert _http_request(s, _get(f"/kv/h{n}")) == (200, f"block {n}".encode())
            assert _http_request(s, _get(f"/kv/r{n}"))[0] in (200, 404)  # one store
        assert _http_request(socks[0], _get("/kv/r0")) == (200, b"value 0")
        for s in socks:
            s.close()


@pytest.mark.parametrize("loops", [2, 3])
def test_connections_opened_one_by_one_spread_evenly(tmp_path: Path, loops: int) -> None:
    """A few long-lived connections (an LMCache instance's) land on the loops evenly,
    both wires counted together, and a loop that lost its connections gets the next
    ones. (The kernel's SO_REUSEPORT hash alone put 12 connections 4/4/4 on 3 loops in
    6.5% of cases: 12! / 4!^3 / 3^12.)"""
    with running_server(tmp_path, event_loops=str(loops)) as srv:
        clients: list[redis.Redis] = []
        socks: list[socket.socket] = []
        per_loop = 4
        for n in range(per_loop * loops):
            if n % 3 == 2:  # every third an HTTP client: the load is both wires'
                s = socket.create_connection((srv.http.host, srv.http.port), timeout=10)
                assert _http_request(s, _get("/kv/stats"))[0] == 200
                socks.append(s)
            else:
                clients.append(_resp(srv))
                clients[-1].ping()
        counts = _loop_counts(clients[0].info("loops"))
        assert counts == [per_loop] * loops, counts
        # close two RESP connections of one loop (one has at least 2): the next two go there
        where = {c: _client_loop(c) for c in clients}
        emptied = max(range(loops), key=list(where.values()).count)
        closing = [c for c in clients if where[c] == emptied][:2]
        keeper = next(c for c in clients if c not in closing)  # (a closed one reconnects)
        for c in closing:
            c.close()
            clients.remove(c)
        eventually(
            lambda: _loop_counts(keeper.info("loops"))[emptied] == per_loop - 2,
            what="closed connections gone",
        )
        for _ in range(2):
            clients.append(_resp(srv))
            clients[-1].ping()
            assert _client_loop(clients[-1]) == emptied
        assert _loop_counts(keeper.info("loops")) == [per_loop] * loops
        for c in clients:
            c.close()
        for s in socks:
            s.close()


def _client_loop(client: redis.Redis) -> int:
    """The loop serving `client`'s connection (CLIENT INFO's `io-thread=`)."""
    return int(client.client_info()["io-thread"])


def test_tls_on_every_loop(tmp_path: Path) -> None:
    """One TLS context serves the handshakes of every loop's listeners."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ca_file, cert_file, key_file = tmp_path / "ca.pem", tmp_path / "c.pem", tmp_path / "k.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))
    settings = {"tls_cert": str(cert_file), "tls_key": str(key_file)}
    with running_server(tmp_path / "srv", event_loops=str(LOOPS), **settings) as srv:
        clients: list[redis.Redis] = []

        def open_tls() -> redis.Redis:
            c = redis.Redis(
                host=srv.resp.host,
                port=srv.resp.port,
                password=TOKEN,
                ssl=True,
                ssl_ca_certs=str(ca_file),
            )
            c.set(f"t{len(clients)}", b"over tls")
            clients.append(c)
            return c

        _spread(open_tls, lambda: _loop_counts(clients[0].info("loops")))
        assert all(c.get(f"t{i}") == b"over tls" for i, c in enumerate(clients))
        for c in clients:
            c.close()


def test_durable_writes_acknowledged_on_every_loop(tmp_path: Path) -> None:
    """Durable SETs and PUTs wait for the group committer, which resolves each write's
    future from its own thread onto the loop that serves the connection."""
    with running_server(tmp_path, backend="durable", event_loops=str(LOOPS)) as srv:
        clients: list[redis.Redis] = []

        def open_resp() -> redis.Redis:
            clients.append(_resp(srv))
            clients[-1].ping()
            return clients[-1]

        _spread(open_resp, lambda: _loop_counts(clients[0].info("loops")))
        values = {i: os.urandom(64 * 1024 + i) for i in range(len(clients))}
        pipes = []
        for i, c in enumerate(clients):  # every connection's writes in flight at once
            pipe = c.pipeline(transaction=False)
            for j in range(4):
                pipe.set(f"d{i}.{j}", values[i])
            pipe.execute_command("GET", f"d{i}.0")
            pipes.append(pipe)
        for i, pipe in enumerate(pipes):
            assert pipe.execute() == [True] * 4 + [values[i]]
        assert srv.thread.handle is not None
        for i, c in enumerate(clients):
            assert c.get(f"d{i}.3") == values[i]
            c.close()
    # reopened from disk: every acknowledged write is there
    with running_server(tmp_path, backend="durable", event_loops="1") as srv:
        c = _resp(srv)
        assert all(c.get(f"d{i}.3") == v for i, v in values.items())
        c.close()


def test_one_loop_starts_no_loop_thread(tmp_path: Path) -> None:
    with running_server(tmp_path, event_loops="1") as srv:
        assert srv.handle.event_loops == 1
        assert _no_loop_threads()
        c = _resp(srv)
        c.set("k", "v")
        info = c.info("loops")
        assert info["event_loops"] == 1
        assert "loop1" not in info
        c.close()
    with running_server(tmp_path, event_loops=str(LOOPS)) as srv:
        names = {t.name for t in threading.enumerate()}
        assert {f"kvcache-loop-{i}" for i in range(1, LOOPS)} <= names
    assert _no_loop_threads()


def test_a_port_another_reuseport_socket_holds_is_in_use(tmp_path: Path) -> None:
    """SO_REUSEPORT lets sockets of one user share a port: a second server (or anyone)
    already listening there with it set must make the start fail, not split traffic."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        config = server_config(tmp_path, addr=f"127.0.0.1:{port}", event_loops=str(LOOPS))
        with pytest.raises(ListenerError, match=f"--addr 127.0.0.1:{port}: address already in use"):
            ServerThread(config).start()
    assert _no_loop_threads()


def _reuseport_listener(port: int = 0, host: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen()
    except OSError:
        sock.close()
        raise
    return sock


def test_the_listeners_on_a_port_are_listed_whoever_owns_them() -> None:
    with _reuseport_listener() as ours:
        port = ours.getsockname()[1]
        with _reuseport_listener(port) as theirs, socket.socket() as elsewhere:
            elsewhere.bind(("127.0.0.1", 0))  # bound, not listening: not a listener
            found = loops.listeners_on(socket.AF_INET, "127.0.0.1", port)
            mine, other = (os.fstat(s.fileno()).st_ino for s in (ours, theirs))
            assert found == {mine, other}
            with pytest.raises(ListenerError, match="another process started listening"):
                loops.check_unshared("--addr", [Address("127.0.0.1", port)], {mine})
            loops.check_unshared("--addr", [Address("127.0.0.1", port)], {mine, other})
        assert loops.listeners_on(socket.AF_INET, "127.0.0.1", port) == {mine}


def test_the_listeners_on_an_ipv6_port_are_listed() -> None:
    try:
        six = _reuseport_listener(host="::1")
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    with six:
        port = six.getsockname()[1]
        assert loops.listeners_on(socket.AF_INET6, "::1", port) == {os.fstat(six.fileno()).st_ino}


def test_a_listener_that_joins_between_the_probe_and_the_binds_fails_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two servers started at the same moment on one port can both pass the probe (a
    plain bind) before either binds; then both bind with SO_REUSEPORT and the kernel
    would split connections between them. The check after the binds catches it: here
    the probe is skipped, as if the other socket arrived just after it."""
    monkeypatch.setattr(loops, "_probe_unshared", lambda addr: None)
    with _reuseport_listener() as holder:
        port = holder.getsockname()[1]
        config = server_config(tmp_path, addr=f"127.0.0.1:{port}", event_loops=str(LOOPS))
        with pytest.raises(ListenerError, match="another process started listening"):
            ServerThread(config).start()
    assert _no_loop_threads()


# -- stop, SIGTERM, reload, epochs -----------------------------------------------------------


@pytest.mark.parametrize("loops", [1, LOOPS])
def test_stop_drains_every_loop(tmp_path: Path, loops: int) -> None:
    """Stop waits while a response is still being sent on any loop: clients that do not
    read yet still get every byte once they do, and new connections are refused by
    every loop's listener meanwhile. (With one loop too: the drain used to test
    `isinstance(transport, asyncio.WriteTransport)`, false for uvloop's transports, so
    it never waited for a response being sent and cut it when the loop closed.)"""
    size = 64 << 20  # above what the kernel's socket buffers take (tcp_rmem + tcp_wmem max)
    srv = start_server(
        tmp_path,
        event_loops=str(loops),
        shutdown_timeout_s="60",
        max_inflight_body_bytes="16GiB",
        max_tenant_inflight_bytes="16GiB",
    )
    stopper = threading.Thread(target=srv.close)
    socks: list[socket.socket] = []
    try:
        data = os.urandom(size)
        with socket.create_connection((srv.http.host, srv.http.port)) as s:
            put = (
                f"PUT /kv/big HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {TOKEN}\r\n"
                f"Content-Length: {size}\r\n\r\n"
            )
            assert _http_request(s, put, data)[0] == 201

        def open_http() -> socket.socket:
            socks.append(socket.create_connection((srv.http.host, srv.http.port), timeout=60))
            return socks[-1]

        _spread(open_http, lambda: _stats_loops(socks[-1]), loops=loops)
        for s in socks:  # each asks for the block and does not read it yet
            s.sendall(_get("/kv/big").encode())
        stopper.start()

        def refused() -> bool:
            # Refused once no listener is bound; reset when the connection reached a
            # listener's accept queue just before that listener closed (the kernel resets
            # what a closing listener never accepted). Either way no loop serves it.
            try:
                socket.create_connection((srv.http.host, srv.http.port), timeout=5).close()
            except (ConnectionRefusedError, ConnectionResetError):
                return True
            return False

        # SO_REUSEPORT hands each new connection to one open listener, and the loops close
        # theirs one after another: 16 refused in a row means none is open any more
        eventually(lambda: all(refused() for _ in range(16)), timeout=30, what="listeners closed")
        stopper.join(1.0)  # longer than the drain's quiet time (0.25 s)
        assert stopper.is_alive()  # the unread responses hold the stop up
        for s in socks:
            assert _read_response(s) == (200, data)
        stopper.join(60)
        assert not stopper.is_alive()
        assert _no_loop_threads()
    finally:
        for s in socks:
            s.close()
        if not stopper.is_alive() and stopper.ident is None:
            srv.close()


def test_sigterm_stops_every_loop(tmp_path: Path) -> None:
    proc = ServeProcess(tmp_path, "--event-loops", str(LOOPS))
    clients: list[redis.Redis] = []
    try:
        port = proc.ports["resp"]

        def open_resp() -> redis.Redis:
            clients.append(redis.Redis(host="127.0.0.1", port=port, password=TOKEN))
            clients[-1].ping()
            return clients[-1]

        _spread(open_resp, lambda: _loop_counts(clients[0].info("loops")))
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(30) == 0
        assert any("event_loops=2" in line for line in proc.output)
        eventually(lambda: any(" stopped" in line for line in proc.output), what="stopped")
    finally:
        for c in clients:
            c.close()
        proc.stop()


def test_reload_revokes_sessions_on_every_loop(tmp_path: Path) -> None:
    tokens = {TOKEN: "default", TOKEN_B: "b"}
    with running_server(tmp_path, tokens=tokens, event_loops=str(LOOPS)) as srv:
        operator = _resp(srv)
        operator.ping()
        socks: list[socket.socket] = []

        def open_b() -> socket.socket:
            s = socket.create_connection((srv.resp.host, srv.resp.port), timeout=10)
            s.sendall(f"AUTH {TOKEN_B}\r\n".encode())
            assert s.recv(16) == b"+OK\r\n"
            socks.append(s)
            return s

        # the operator's own connection counts too: 2 on each loop means a b client on each
        _spread(open_b, lambda: _loop_counts(operator.info("loops")), least=2)
        (tmp_path / "tokens").write_text(f"{TOKEN} default\n")
        srv.handle.reload()
        for s in socks:
            s.settimeout(30)
            with contextlib.suppress(ConnectionResetError):
                assert s.recv(16) == b""
            s.close()
        assert operator.ping()  # the default tenant's token still verifies
        operator.close()


def test_epoch_notice_reaches_subscribers_on_every_loop(tmp_path: Path) -> None:
    with running_server(tmp_path, event_loops=str(LOOPS)) as srv:
        operator = _resp(srv)
        operator.ping()
        subs: list[tuple[redis.Redis, object]] = []

        def open_sub() -> object:
            c = _resp(srv)
            pubsub = c.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe("kvcache:epochs")
            assert pubsub.get_message(timeout=10) is None  # the subscribe confirmation
            subs.append((c, pubsub))
            return pubsub

        _spread(open_sub, lambda: _loop_counts(operator.info("loops")), least=2)
        with EpistemicGraphKVBackend(base_url=srv.url, token=TOKEN) as client:
            assert client.epoch_bump("scope:x") == 1
        for c, pubsub in subs:  # one bump, one loop: every subscriber, on every loop
            msg = eventually(lambda p=pubsub: p.get_message(timeout=0.2), what="notice")
            assert msg["data"] == b"scope:x 1"
            pubsub.close()
            c.close()
        operator.close()


# -- MULTI/EXEC isolation across loops ------------------------------------------------------


def test_tenant_gates_hold_across_loops() -> None:
    """EXEC on one loop keeps the tenant's commands on another loop out, and its
    release wakes a waiter parked on that other loop."""
    gates = TenantGates()
    other = asyncio.new_event_loop()
    runner = threading.Thread(target=other.run_forever, daemon=True)
    runner.start()
    try:

        async def main() -> None:
            await gates.hold("a")  # this loop holds tenant a
            assert not await asyncio.wrap_future(
                asyncio.run_coroutine_threadsafe(_enter_nowait(gates, "a"), other)
            )
            waiter = asyncio.run_coroutine_threadsafe(gates.enter("a"), other)
            await asyncio.sleep(0.05)
            assert not waiter.done()  # parked on the other loop
            gates.release("a")
            await asyncio.wrap_future(waiter)  # woken across loops
            blocked = asyncio.ensure_future(gates.hold("a"))
            await asyncio.sleep(0.05)
            assert not blocked.done()  # the other loop's command still runs
            other.call_soon_threadsafe(gates.leave, "a")
            await asyncio.wait_for(blocked, 10)
            gates.release("a")
            assert len(gates) == 0

        asyncio.run(main())
    finally:
        other.call_soon_threadsafe(other.stop)
        runner.join(10)
        other.close()


async def _enter_nowait(gates: TenantGates, tenant: str) -> bool:
    return gates.enter_nowait(tenant)


# -- configuration --------------------------------------------------------------------------


def test_event_loops_setting_spellings(tmp_path: Path) -> None:
    assert load_config({"event_loops": "3"}, {}).resolved_event_loops == 3
    env = {"EPISTEMIC_GRAPH_KVCACHE_EVENT_LOOPS": "2"}
    assert load_config({}, env).event_loops == 2
    toml = tmp_path / "c.toml"
    toml.write_text("event_loops = 4\n")
    assert load_config({}, {}, config_file=toml).event_loops == 4
    auto = load_config({}, {})
    assert auto.event_loops == 0
    assert auto.resolved_event_loops == min(usable_cores(), 16)
    with pytest.raises(ConfigurationError, match="invalid event_loops: expected at most 256"):
        load_config({"event_loops": "1000"}, {})
    with pytest.raises(ConfigurationError, match="invalid event_loops"):
        load_config({"event_loops": "-1"}, {})


def test_several_loops_hand_the_gil_over_often() -> None:
    """With 2 loops a busy loop held the GIL for CPython's 5 ms at a time, and every
    callback of the other loop waited that long for it: a quiet tenant's RESP GET p99
    went from ~10 ms to up to 1.3 s under another tenant's pipeline flood
    (tests/test_abuse.py auth_pipeline_flood). Several loops hand it over sooner."""
    before = sys.getswitchinterval()
    try:
        tune_switch_interval(1)
        assert sys.getswitchinterval() == before  # one loop: the interpreter's default
        tune_switch_interval(2)
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
        assert SWITCH_INTERVAL_S <= 0.001
    finally:
        sys.setswitchinterval(before)
