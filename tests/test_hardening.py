"""Server hardening against hostile or careless clients (findings of the security review).

A real server (`ServerThread`, durable store, two tenants by token file) on 127.0.0.1
port 0, driven by redis-py, urllib3 and raw sockets.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
import urllib3

from epistemic_kvcache.config import load_config
from epistemic_kvcache.errors import ConfigurationError
from epistemic_kvcache.server.app import ServerHandle, ServerThread
from helpers import eventually
from servers import start_server

TOKEN_A = "hardening-token-tenant-a-0123456789"
TOKEN_B = "hardening-token-tenant-b-0123456789"
TOKEN_OPS = "hardening-token-operator-0123456789"


def start(tmp: Any, **overrides: str) -> tuple[ServerThread, ServerHandle]:
    tokens = {TOKEN_A: "tenant-a", TOKEN_B: "tenant-b", TOKEN_OPS: "default"}
    settings = {"backend": "durable", "hot_capacity_bytes": "64MiB", "warm_capacity_bytes": "0"}
    srv = start_server(tmp, tokens=tokens, **{**settings, **overrides})
    return srv.thread, srv.handle


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    thread, handle = start(tmp_path_factory.mktemp("hardening"))
    yield handle
    thread.stop()


def resp_client(server: ServerHandle, token: str = TOKEN_B, **kw: Any) -> redis.Redis:
    assert server.resp is not None
    kw.setdefault("socket_timeout", 30)
    return redis.Redis(server.resp.host, server.resp.port, password=token, **kw)


# -- 1. SCAN MATCH / CONFIG GET: no catastrophic backtracking --------------------------------


@pytest.mark.parametrize(
    "pattern", ["*a*a*a*b", "*a*a*a*a*a*a*a*a*a*a*b", "*" + "?" * 200 + "b*"], ids=range(3)
)
def test_scan_match_pattern_cannot_freeze_the_server(server: ServerHandle, pattern: str) -> None:
    r = resp_client(server)
    try:
        r.set("a" * 1000, b"v")
        started = time.monotonic()
        cursor, keys = r.scan(0, match=pattern, count=10000)
        assert keys == []
        # Milliseconds here. The regex translation `*` -> `.*` takes 37 s (quiet machine)
        # on the first pattern and far longer on the second, past this client's 30 s socket
        # timeout; a third of that leaves a loaded machine ample room.
        assert time.monotonic() - started < 10
        r.set("a" * 998 + "zb", b"v")
        matched: list[bytes] = []
        cursor = 0
        while True:
            cursor, keys = r.scan(cursor, match=pattern, count=10000)
            matched += keys
            if cursor == 0:
                break
        assert matched == [b"a" * 998 + b"zb"]
    finally:
        r.delete("a" * 1000, "a" * 998 + "zb")
        r.close()


def test_scan_and_config_refuse_overlong_patterns(server: ServerHandle) -> None:
    r = resp_client(server)
    try:
        with pytest.raises(redis.ResponseError, match="pattern too long"):
            r.scan(0, match="*" * 257)
        with pytest.raises(redis.ResponseError, match="pattern too long"):
            r.config_get("*" * 257)
        assert r.config_get("max*") == {
            "maxclients": "1024",
            "maxmemory": str(64 * 1024 * 1024),  # the RAM tiers: hot 64 MiB + warm 0
            "maxmemory-policy": "allkeys-lru",
        }
        assert r.ping()  # the connection is still usable
    finally:
        r.close()


def test_server_keeps_answering_during_a_worst_case_scan(server: ServerHandle) -> None:
    writer = resp_client(server, TOKEN_A)
    keys = {f"{'a' * 1000}{i:05d}": b"v" for i in range(2000)}
    writer.mset(keys)
    pattern = "*" + "?a" * 120 + "b*"  # ~0.5 ms of matching per key
    done = threading.Event()
    scanned: list[int] = []

    def scan_all() -> None:
        r = resp_client(server, TOKEN_A)
        cursor = 0
        while True:
            cursor, found = r.scan(cursor, match=pattern, count=10000)
            scanned.append(len(found))
            if cursor == 0:
                break
        r.close()
        done.set()

    th = threading.Thread(target=scan_all)
    started = time.monotonic()
    th.start()
    probe = resp_client(server, TOKEN_B)
    worst = 0.0
    try:
        while not done.is_set():
            t0 = time.monotonic()
            probe.ping()
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.01)
        scan_s = time.monotonic() - started
    finally:
        th.join(60)
        probe.close()
        writer.delete(*keys)
        writer.close()
    assert done.is_set()
    assert sum(scanned) == 0
    # the matching work is cut into bounded calls, each on the thread pool ...
    assert len(scanned) >= 4, f"the SCAN ran in {len(scanned)} calls"
    # ... so a PING waits for one slice, never for the whole scan. The bound is relative
    # to the scan's own duration (a loaded machine slows both), with an absolute floor.
    bound = max(0.25, scan_s / 2)
    assert worst < bound, f"a PING waited {worst:.2f}s behind a SCAN of {scan_s:.2f}s"


# -- 2. bodies and bulks being received share one memory budget --------------------------

MiB = 1024 * 1024


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_header_only_batch_put_does_not_allocate_the_body(server: ServerHandle) -> None:
    before = _rss_kib()
    socks = []
    for _ in range(2):
        s = socket.create_connection((server.http.host, server.http.port))
        s.sendall(
            b"POST /kv/batch/put HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + TOKEN_B.encode()
            + b"\r\nContent-Type: application/x-kvcache-batch\r\nContent-Length: 500000000\r\n\r\n"
        )
        socks.append(s)
    # A delay on purpose: the absence of an allocation cannot be polled for (with
    # `Expect: 100-continue`, the one answer that would say the head was read, the server
    # refuses 500 MB with a 413 at once: another path).
    time.sleep(1.0)
    grown_mib = (_rss_kib() - before) // 1024
    for s in socks:
        s.close()
    assert grown_mib < 64, f"{grown_mib} MiB held for two header-only requests"


def _head(server: ServerHandle, path: str, length: int, token: str = TOKEN_A) -> socket.socket:
    """Open a connection and send a PUT head announcing `length` body bytes."""
    s = socket.create_connection((server.http.host, server.http.port), timeout=10)
    s.sendall(
        f"PUT {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        f"Expect: 100-continue\r\nContent-Length: {length}\r\n\r\n".encode()
    )
    return s


def _read_head(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, rest


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    """A server whose in-flight body budget is 48 MiB (blocks up to 24 MiB)."""
    thread, handle = start(
        tmp_path_factory.mktemp("tight"),
        max_inflight_body_bytes="48MiB",
        max_block_bytes="24MiB",
        max_batch_bytes="24MiB",
        backend="memory",
    )
    yield handle
    thread.stop()


def test_bodies_over_the_inflight_budget_get_503_and_the_budget_comes_back(
    tight: ServerHandle,
) -> None:
    first = _head(tight, "/kv/budget-1", 24 * MiB)
    second = _head(tight, "/kv/budget-2", 24 * MiB)
    try:
        assert _read_head(first)[0] == 100  # accepted: 24 of 48 MiB reserved
        assert _read_head(second)[0] == 100  # 48 of 48 MiB
        third = _head(tight, "/kv/budget-3", 1 * MiB, TOKEN_B)
        status, headers, rest = _read_head(third)
        assert status == 503
        assert headers["retry-after"] == "1"
        assert headers["connection"] == "close"
        assert json.loads(rest[: int(headers["content-length"])])["error"] == "overloaded"
        third.close()
        # RESP draws on the same budget: the bulk is dropped, the connection lives on.
        r = resp_client(tight, TOKEN_B)
        with pytest.raises(redis.ResponseError, match="server busy, retry"):
            r.set("resp-big", b"r" * (1 * MiB))
        assert r.set("resp-small", b"s" * 1000)  # under 32 KiB: not preallocated
        assert r.ping()
        # The first body completes: its reservation is released once it is answered.
        first.sendall(b"x" * (24 * MiB))
        assert _read_head(first)[0] == 201
        assert r.set("resp-big", b"r" * (1 * MiB))
        assert r.get("resp-big") == b"r" * (1 * MiB)
        r.close()
    finally:
        first.close()
        second.close()
    # The second connection died with its body unread: its reservation is back too.
    deadline = time.monotonic() + 5
    while True:
        a, b = _head(tight, "/kv/budget-4", 24 * MiB), _head(tight, "/kv/budget-5", 24 * MiB)
        statuses = (_read_head(a)[0], _read_head(b)[0])
        a.close()
        b.close()
        if statuses == (100, 100) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert statuses == (100, 100)


def test_resp_releases_bulk_reservations_as_commands_complete(tight: ServerHandle) -> None:
    r = resp_client(tight, TOKEN_A)
    blob = os.urandom(12 * MiB)
    try:
        for i in range(6):  # 72 MiB one after the other through a 48 MiB budget
            assert r.set(f"seq-{i}", blob)
        pipe = r.pipeline(transaction=False)
        for i in range(6):
            pipe.set(f"pipe-{i}", blob)
        assert pipe.execute() == [True] * 6
        assert r.strlen("pipe-5") == 12 * MiB
    finally:
        r.close()

    def both_admitted() -> bool:  # the reservations go when the server sees the close
        a, b = _head(tight, "/kv/after-1", 24 * MiB), _head(tight, "/kv/after-2", 24 * MiB)
        try:
            return (_read_head(a)[0], _read_head(b)[0]) == (100, 100)
        finally:
            a.close()
            b.close()

    eventually(both_admitted, timeout=10, interval=0.05, what="both 24 MiB heads admitted")


# -- 3. /metrics (store-wide totals) is for operator tenants only ---------------------------


def test_metrics_do_not_reveal_other_tenants_activity(server: ServerHandle) -> None:
    url = f"http://{server.http.host}:{server.http.port}"
    with urllib3.PoolManager() as pm:
        for token in (TOKEN_A, TOKEN_B):
            r = pm.request("GET", url + "/metrics", headers={"Authorization": f"Bearer {token}"})
            assert r.status == 403
            assert json.loads(r.data)["error"] == "forbidden"
            assert b"kvcache_" not in r.data
        ops = {"Authorization": f"Bearer {TOKEN_OPS}"}  # tenant "default": the operator
        r = pm.request("GET", url + "/metrics", headers=ops)
        assert r.status == 200
        assert b"kvcache_logical_bytes" in r.data


def test_metrics_tenants_setting() -> None:
    assert load_config({}, {}).metrics_tenants == ("default",)
    c = load_config({"metrics_tenants": "ops, prometheus"}, {})
    assert c.metrics_tenants == ("ops", "prometheus")
    assert load_config({"metrics_tenants": ""}, {}).metrics_tenants == ()
    with pytest.raises(ConfigurationError, match="max_inflight_body_bytes"):
        load_config({"max_inflight_body_bytes": "64MiB"}, {})  # < max_block_bytes


# -- 4. unauthenticated connections cannot hold connection slots ---------------------------


@pytest.fixture(scope="module")
def hasty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    """A server whose authentication deadline is 0.5 s."""
    thread, handle = start(tmp_path_factory.mktemp("hasty"), auth_timeout_s="0.5", backend="memory")
    yield handle
    thread.stop()


CLOSED_BY_S = 5.0
"""How soon the hasty server must close an unauthenticated connection: its deadline is
0.5 s, the default one 10 s; half of that is the margin for a loaded machine that still
fails a server falling back to the default (or never closing)."""


def _closed_within(s: socket.socket, seconds: float) -> float | None:
    """Seconds until the peer closed `s` (reading and dropping input), None if it did not."""
    started = time.monotonic()
    s.settimeout(0.05)
    while time.monotonic() - started < seconds:
        try:
            if s.recv(65536) == b"":
                return time.monotonic() - started
        except TimeoutError:
            continue
        except ConnectionResetError:
            return time.monotonic() - started
    return None


def test_http_connection_without_credentials_is_closed_at_the_deadline(
    hasty: ServerHandle,
) -> None:
    silent = socket.create_connection((hasty.http.host, hasty.http.port))
    healthz = socket.create_connection((hasty.http.host, hasty.http.port))
    authed = socket.create_connection((hasty.http.host, hasty.http.port))
    try:
        healthz.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_head(healthz)[0] == 200  # /healthz works, but is no authentication
        auth = f"Authorization: Bearer {TOKEN_A}\r\n".encode()
        authed.sendall(b"GET /kv/stats HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n")
        status, headers, rest = _read_head(authed)
        assert status == 200
        assert len(rest) == int(headers["content-length"])
        assert _closed_within(silent, CLOSED_BY_S) is not None
        assert _closed_within(healthz, CLOSED_BY_S) is not None
        assert _closed_within(authed, 1.0) is None  # authenticated: the idle timeout applies
        authed.sendall(b"GET /kv/stats HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n")
        assert _read_head(authed)[0] == 200
    finally:
        for s in (silent, healthz, authed):
            s.close()


def test_resp_connection_that_only_pings_is_closed_at_the_deadline(hasty: ServerHandle) -> None:
    assert hasty.resp is not None
    pinger = socket.create_connection((hasty.resp.host, hasty.resp.port), timeout=5)
    started = time.monotonic()
    closed = False
    try:
        while time.monotonic() - started < 30.0:  # without a deadline: never closed
            try:
                pinger.sendall(b"PING\r\n")
                if pinger.recv(100) == b"":
                    closed = True
                    break
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.05)
    finally:
        pinger.close()
    assert closed
    assert time.monotonic() - started < CLOSED_BY_S
    r = resp_client(hasty, TOKEN_A)
    try:
        assert r.ping()
        time.sleep(1.0)  # a delay on purpose: past the unauthenticated deadline
        assert r.set("still-here", b"v")  # authenticated: no deadline
    finally:
        r.close()
    raw = socket.create_connection((hasty.resp.host, hasty.resp.port), timeout=5)
    try:
        raw.sendall(f"AUTH {TOKEN_A}\r\n".encode())
        assert raw.recv(100) == b"+OK\r\n"
        time.sleep(0.8)  # a delay on purpose: most of the unauthenticated deadline
        raw.sendall(b"RESET\r\n")  # de-authenticates: the deadline starts again
        assert raw.recv(100) == b"+RESET\r\n"
        assert _closed_within(raw, CLOSED_BY_S) is not None
    finally:
        raw.close()


# -- 5. page-in graphs are parsed off the event loop, within caps ------------------------


def _post(server: ServerHandle, path: str, body: bytes, token: str = TOKEN_A) -> Any:
    with urllib3.PoolManager() as pm:
        return pm.request(
            "POST",
            f"http://{server.http.host}:{server.http.port}{path}",
            body=body,
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            retries=False,
            timeout=60,
        )


def _healthz_latency_while(server: ServerHandle, busy: threading.Thread) -> tuple[float, float]:
    """The slowest /healthz round trip (on its own connection) while `busy` runs, and how
    long `busy` ran."""
    worst = 0.0
    with urllib3.HTTPConnectionPool(server.http.host, server.http.port, maxsize=1) as pool:
        pool.request("GET", "/healthz")
        started = time.monotonic()
        busy.start()
        while busy.is_alive():
            t0 = time.monotonic()
            assert pool.request("GET", "/healthz").status == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.005)
        busy_s = time.monotonic() - started
    busy.join()
    return worst, busy_s


def test_page_in_json_is_not_parsed_on_the_event_loop(server: ServerHandle) -> None:
    body = b'{"node_keys": {}, "budget_bytes": 1, "edges": [' + b",".join([b"[]"] * 5_000_000)
    body += b"]}"  # 15 MB of tiny JSON values: ~1 s of json.loads holding the GIL
    answers: list[Any] = []
    busy = threading.Thread(target=lambda: answers.append(_post(server, "/kv/page-in", body)))
    worst, busy_s = _healthz_latency_while(server, busy)
    # Parsed (on the loop or not: json holds the GIL), /healthz waits for most of the
    # request. The bound is relative to the request's own duration (a loaded machine slows
    # both), with an absolute floor; the message below says the parser never ran.
    bound = max(0.3, busy_s / 2)
    assert worst < bound, f"/healthz waited {worst:.2f}s behind a page-in of {busy_s:.2f}s"
    (r,) = answers
    assert r.status == 400
    assert "graph too large" in json.loads(r.data)["message"]


def test_page_in_caps_edges_nodes_and_body(server: ServerHandle) -> None:
    edges = [[f"n{i % 1000}", f"n{(i + 1) % 1000}"] for i in range(200_001)]
    doc: dict[str, Any] = {"edges": edges, "node_keys": {}, "budget_bytes": 1}
    r = _post(server, "/kv/page-in", json.dumps(doc).encode())
    assert r.status == 400
    assert "too many edges" in json.loads(r.data)["message"]
    ring = [[f"n{i}", f"n{i + 1}"] for i in range(150_000)]  # 150,001 nodes in 150k edges
    extra = {f"m{i}": [] for i in range(60_000)}  # and 60,000 more in node_keys
    doc = {"edges": ring, "node_keys": extra, "budget_bytes": 1}
    r = _post(server, "/kv/page-in", json.dumps(doc).encode())
    assert r.status == 400
    assert "too many nodes" in json.loads(r.data)["message"]
    # Over 16 MiB: refused from the head, before the body is read.
    s = socket.create_connection((server.http.host, server.http.port), timeout=10)
    try:
        s.sendall(
            f"POST /kv/page-in HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN_A}\r\n"
            f"Content-Length: {16 * MiB + 1}\r\n\r\n".encode()
        )
        status, headers, rest = _read_head(s)
    finally:
        s.close()
    assert status == 413
    assert json.loads(rest[: int(headers["content-length"])])["error"] == "body_too_large"
    # A graph within the caps still works.
    small = {"edges": [["a", "b"], ["b", "c", 2.0]], "node_keys": {"c": ["k"]}, "budget_bytes": 9}
    r = _post(server, "/kv/page-in", json.dumps(small).encode())
    assert r.status == 200, r.data
    assert json.loads(r.data)["ranking"][0][0] == "c"


# -- 7. the routes and the store agree on epoch scope lengths ------------------------------


def test_epoch_scope_limit_is_the_stores(server: ServerHandle) -> None:
    from epistemic_kvcache.store.engine import MAX_SCOPE_BYTES

    url = f"http://{server.http.host}:{server.http.port}"
    auth = {"Authorization": f"Bearer {TOKEN_A}"}
    longest = "é" * (MAX_SCOPE_BYTES // 2)  # exactly MAX_SCOPE_BYTES bytes of UTF-8
    with urllib3.PoolManager() as pm:
        for scope, ok in ((longest, True), (longest + "s", False), ("s" * 600, False)):
            r = pm.request("POST", f"{url}/kv/epoch/{quote(scope, safe='')}/bump", headers=auth)
            assert (r.status == 200) is ok, (len(scope.encode()), r.data)
            if not ok:
                doc = json.loads(r.data)
                assert doc["error"] == "bad_request"
                assert f"1..{MAX_SCOPE_BYTES} bytes" in doc["message"]
        for n, status in ((MAX_SCOPE_BYTES, 201), (MAX_SCOPE_BYTES + 1, 400)):
            headers = {**auth, "X-Kv-Epoch-Scope": "x" * n}
            r = pm.request("PUT", f"{url}/kv/scoped-{n}", body=b"v", headers=headers)
            assert r.status == status, r.data
