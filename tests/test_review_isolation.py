"""Review: tenant isolation holds against a hostile second tenant (real server, real sockets).

Tenant B knows tenant A's snapshot and branch ids and the layout of the internal
namespaces (`tenant NUL s NUL id`); none of that lets B read, probe, list, fork, write or
delete A's data, over HTTP or RESP, and keys containing NUL never alias an internal
namespace (in RAM or in the LMDB rows, also after a reopen).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import urllib3

from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.proto.http import quote_key
from epistemic_kvcache.server.app import ServerHandle
from epistemic_kvcache.store.durable import SharedKvStoreBackend
from epistemic_kvcache.store.engine import branch_ns, snapshot_ns
from epistemic_kvcache.store.index import _longkey, split_key_row
from epistemic_kvcache.store.index import key_row as _key_row
from servers import running_server

TOKEN_A = "review-token-tenant-a-0123456789"
TOKEN_B = "review-token-tenant-b-0123456789"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    with running_server(
        tmp_path_factory.mktemp("review"),
        backend="durable",
        tokens={TOKEN_A: "tenant-a", TOKEN_B: "tenant-b"},
    ) as srv:
        yield srv.handle


@pytest.fixture(scope="module")
def http() -> Iterator[urllib3.PoolManager]:
    with urllib3.PoolManager() as pm:
        yield pm


def _req(
    pm: urllib3.PoolManager,
    server: ServerHandle,
    token: str,
    method: str,
    path: str,
    body: bytes | None = None,
) -> urllib3.BaseHTTPResponse:
    url = f"http://{server.http.host}:{server.http.port}{path}"
    headers = {"Authorization": f"Bearer {token}", "Content-Length": str(len(body or b""))}
    return pm.request(method, url, body=body or b"", headers=headers, retries=False)


@pytest.fixture(scope="module")
def a_objects(server: ServerHandle, http: urllib3.PoolManager) -> tuple[str, str]:
    """Tenant A stores a secret, snapshots it and forks the snapshot: (snapshot id, branch id)."""
    r = _req(http, server, TOKEN_A, "PUT", "/kv/secret", b"A-SECRET")
    assert r.status == 201
    r = _req(http, server, TOKEN_A, "POST", "/kv/snapshot", b"{}")
    assert r.status == 201
    sid = json.loads(r.data)["id"]
    r = _req(http, server, TOKEN_A, "POST", f"/kv/snapshot/{sid}/fork")
    assert r.status == 201
    bid = json.loads(r.data)["id"]
    r = _req(http, server, TOKEN_A, "PUT", f"/kv/branch/{bid}/private", b"A-BRANCH")
    assert r.status == 201
    return sid, bid


@pytest.mark.parametrize(
    ("method", "template"),
    [
        ("GET", "/kv/snapshot/{sid}"),
        ("GET", "/kv/snapshot/{sid}/secret"),
        ("HEAD", "/kv/snapshot/{sid}/secret"),
        ("POST", "/kv/snapshot/{sid}/fork"),
        ("DELETE", "/kv/snapshot/{sid}"),
        ("GET", "/kv/branch/{bid}"),
        ("GET", "/kv/branch/{bid}/private"),
        ("GET", "/kv/branch/{bid}/secret"),
        ("HEAD", "/kv/branch/{bid}/private"),
        ("PUT", "/kv/branch/{bid}/planted"),
        ("DELETE", "/kv/branch/{bid}"),
    ],
)
def test_other_tenant_cannot_touch_snapshots_or_branches(
    server: ServerHandle,
    http: urllib3.PoolManager,
    a_objects: tuple[str, str],
    method: str,
    template: str,
) -> None:
    sid, bid = a_objects
    body = b"B-PLANTED" if method == "PUT" else None
    r = _req(http, server, TOKEN_B, method, template.format(sid=sid, bid=bid), body)
    assert r.status == 404
    assert b"A-SECRET" not in r.data
    assert b"A-BRANCH" not in r.data
    # A still sees everything intact, and nothing B tried landed in A's branch.
    assert _req(http, server, TOKEN_A, "GET", f"/kv/snapshot/{sid}/secret").data == b"A-SECRET"
    assert _req(http, server, TOKEN_A, "GET", f"/kv/branch/{bid}/private").data == b"A-BRANCH"
    assert _req(http, server, TOKEN_A, "GET", f"/kv/branch/{bid}/planted").status == 404


def test_listings_and_stats_show_only_the_callers_tenant(
    server: ServerHandle, http: urllib3.PoolManager, a_objects: tuple[str, str]
) -> None:
    assert json.loads(_req(http, server, TOKEN_B, "GET", "/kv/snapshot").data) == {"snapshots": []}
    assert json.loads(_req(http, server, TOKEN_B, "GET", "/kv/branch").data) == {"branches": []}
    keys = json.loads(_req(http, server, TOKEN_B, "GET", "/kv/keys").data)["keys"]
    assert "secret" not in keys
    stats = json.loads(_req(http, server, TOKEN_B, "GET", "/kv/stats").data)
    assert stats["namespace"] == "tenant-b"
    sizes = [
        int(_req(http, server, TOKEN_B, "HEAD", "/kv/" + quote_key(k)).headers["Content-Length"])
        for k in keys
    ]
    assert stats["logical_bytes"] == sum(sizes)  # none of A's blocks are counted for B


def test_nul_keys_do_not_reach_internal_namespaces(
    server: ServerHandle, http: urllib3.PoolManager, a_objects: tuple[str, str]
) -> None:
    sid, bid = a_objects
    spellings = [
        snapshot_ns("tenant-a", sid),
        snapshot_ns("tenant-a", sid) + "secret",
        branch_ns("tenant-a", bid) + "private",
        "\x00s\x00" + sid + "secret",
        "\x00b\x00" + bid + "private",
    ]
    for token in (TOKEN_A, TOKEN_B):
        for key in spellings:
            r = _req(http, server, token, "GET", "/kv/" + quote_key(key))
            assert r.status == 404, (token, key)
    # A NUL key written by B is B's own key, nothing more.
    key = "\x00s\x00" + sid + "secret"
    assert _req(http, server, TOKEN_B, "PUT", "/kv/" + quote_key(key), b"B-NUL").status == 201
    assert _req(http, server, TOKEN_B, "GET", "/kv/" + quote_key(key)).data == b"B-NUL"
    assert _req(http, server, TOKEN_A, "GET", f"/kv/snapshot/{sid}/secret").data == b"A-SECRET"
    assert _req(http, server, TOKEN_A, "GET", "/kv/" + quote_key(key)).status == 404


def test_key_rows_with_nul_round_trip_and_never_collide() -> None:
    rows = {
        _key_row(ns, key): (ns, key)
        for ns, key in [
            ("t", "\x00s\x00abc"),
            ("t\x00s\x00abc", ""),
            ("t", "\x00b\x00abck"),
            ("t\x00b\x00abc", "k"),
            ("t\x00s\x00abc", "k\x00"),
            ("t", "L" * 1024),  # a hashed row: the key travels in the row value
            ("t\x00s\x00abc", "L" * 1024),
        ]
    }
    assert len(rows) == 7
    for row, pair in rows.items():
        assert split_key_row(row, _longkey(*pair)) == pair


def test_durable_nul_keys_stay_apart_across_reopen(tmp_path: Path) -> None:
    store = SharedKvStoreBackend(
        tmp_path, StoreOptions(hot_capacity_bytes=1 << 20, warm_capacity_bytes=0)
    )
    store.put("a", "k", b"A")
    sid = store.snapshot_create("a").id
    store.put("b", f"\x00s\x00{sid}k", b"B")
    store.put("a", f"\x00s\x00{sid}k", b"A2")
    store.close()
    store = SharedKvStoreBackend(
        tmp_path, StoreOptions(hot_capacity_bytes=1 << 20, warm_capacity_bytes=0)
    )
    try:
        assert store.snapshot_get("a", sid, "k") == b"A"
        assert store.get("b", f"\x00s\x00{sid}k") == b"B"
        assert store.get("a", f"\x00s\x00{sid}k") == b"A2"
        assert store.snapshot_get("b", sid, "k") is None
        assert store.check().ok
    finally:
        store.close()


def test_resp_refuses_everything_but_auth_before_auth(server: ServerHandle) -> None:
    assert server.resp is not None
    with socket.create_connection((server.resp.host, server.resp.port), timeout=5) as s:
        s.sendall(
            b"SUBSCRIBE kvcache:epochs\r\nGET secret\r\nSCAN 0\r\nINFO\r\nCONFIG GET *\r\n"
            b"ECHO x\r\nCLIENT ID\r\nDBSIZE\r\nPING\r\n"
        )
        # PING too, as redis-server with requirepass answers it
        expected = b"-NOAUTH Authentication required.\r\n" * 9
        got = b""
        while len(got) < len(expected):
            chunk = s.recv(4096)
            assert chunk
            got += chunk
        assert got == expected


def test_scan_cursor_of_one_tenant_is_invalid_for_another(server: ServerHandle) -> None:
    assert server.resp is not None
    ra = redis.Redis(server.resp.host, server.resp.port, password=TOKEN_A)
    rb = redis.Redis(server.resp.host, server.resp.port, password=TOKEN_B)
    try:
        for i in range(5):
            ra.set(f"scan-{i}", b"x")
        cursor, _ = ra.scan(0, count=2)
        assert cursor != 0
        with pytest.raises(redis.ResponseError, match="invalid cursor"):
            rb.scan(cursor, count=2)
        assert rb.get("secret") is None
        b_keys = list(rb.scan_iter(count=100))
        assert rb.dbsize() == len(b_keys)
        assert b"secret" not in b_keys
        assert not any(k.startswith(b"scan-") for k in b_keys)
    finally:
        ra.close()
        rb.close()
