"""Engine routes end to end: snapshots, branches, epochs, page-in, key listing.

A real server (`ServerThread`, real sockets) with two tenants from a token file; the
Python client and raw urllib3 requests against it.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3

from epistemic_kvcache.client import EpistemicGraphKVBackend, KvCacheUnavailableError
from epistemic_kvcache.graph import pagerank, rank_order
from epistemic_kvcache.proto.http import quote_key
from epistemic_kvcache.server.app import ServerHandle, ServerThread
from epistemic_kvcache.server.process import ServerProcess, write_token_file
from helpers import eventually
from servers import running_server, server_config

TOKEN_A = "token-tenant-a-0123456789"
TOKEN_B = "token-tenant-b-0123456789"


def _thread(tmp_path: Path, backend: str = "memory", **extra: str) -> ServerThread:
    tokens = {TOKEN_A: "tenant-a", TOKEN_B: "tenant-b"}
    tmp_path.mkdir(parents=True, exist_ok=True)
    return ServerThread(
        server_config(tmp_path, backend=backend, tokens=tokens, resp=False, **extra)
    )


def _url(handle: ServerHandle) -> str:
    return f"http://{handle.http.host}:{handle.http.port}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    tokens = {TOKEN_A: "tenant-a", TOKEN_B: "tenant-b"}
    with running_server(tmp_path_factory.mktemp("engine"), tokens=tokens, resp=False) as srv:
        yield srv.handle


@pytest.fixture
def a(server: ServerHandle) -> Iterator[EpistemicGraphKVBackend]:
    with EpistemicGraphKVBackend(base_url=_url(server), token=TOKEN_A) as c:
        yield c
        # Leave the tenant clean for the next test.
        for snap in c.list_snapshots():
            c.delete_snapshot(snap.id)
        for key in c.list_keys():
            c.delete(key)


@pytest.fixture
def b(server: ServerHandle) -> Iterator[EpistemicGraphKVBackend]:
    with EpistemicGraphKVBackend(base_url=_url(server), token=TOKEN_B) as c:
        yield c


@pytest.fixture
def raw(server: ServerHandle) -> Iterator[urllib3.HTTPConnectionPool]:
    with urllib3.HTTPConnectionPool(server.http.host, server.http.port, retries=False) as pool:
        yield pool


def _req(
    pool: urllib3.HTTPConnectionPool,
    method: str,
    path: str,
    body: bytes | None = None,
    token: str = TOKEN_A,
    **headers: str,
) -> tuple[int, Any, urllib3.BaseHTTPResponse]:
    hdrs = {
        "Authorization": f"Bearer {token}",
        **{k.replace("_", "-"): v for k, v in headers.items()},
    }
    if body is not None:
        hdrs.setdefault("Content-Type", "application/json")
    resp = pool.request(method, path, body=body, headers=hdrs)
    doc: Any = resp.data
    if resp.headers.get("Content-Type", "").startswith("application/json"):
        doc = json.loads(resp.data)
    return resp.status, doc, resp


def _stats(c: EpistemicGraphKVBackend) -> tuple[int, int]:
    s = c.stats()
    assert s is not None
    return s.unique_blocks, s.resident_bytes


# -- feature probe ----------------------------------------------------------------------------
class _OldServer(http.server.BaseHTTPRequestHandler):
    """A server without the engine routes: `/kv/snapshot` is just a key."""

    holds_snapshot_key = False

    def do_GET(self) -> None:
        if self.holds_snapshot_key and self.path == "/kv/snapshot":
            body, status, ctype = b'{"snapshots": []}', 200, "application/octet-stream"
        else:
            body, status, ctype = (
                b'{"error":"not_found","message":"no such key"}',
                404,
                "application/json",
            )
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.send_response(405)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("holds_key", [False, True])
def test_supports_fork_false_against_an_old_server_never_an_error(holds_key: bool) -> None:
    handler = type("H", (_OldServer,), {"holds_snapshot_key": holds_key})
    old = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=old.serve_forever, daemon=True)
    t.start()
    try:
        with EpistemicGraphKVBackend(
            base_url=f"http://127.0.0.1:{old.server_port}", token="x" * 20
        ) as c:
            assert c.supports_fork() is False
            assert c.snapshot(keys=["k"]) is None  # 405: no such route -> fall back
            assert c.fork("abc") is None
    finally:
        old.shutdown()
        old.server_close()


def test_supports_fork_true_and_unreachable_false(a: EpistemicGraphKVBackend) -> None:
    assert a.supports_fork() is True
    with EpistemicGraphKVBackend(
        base_url="http://127.0.0.1:9", token=TOKEN_A, connect_timeout_s=0.5
    ) as down:
        assert down.supports_fork() is False
        assert down.snapshot() is None
        assert down.fork("x") is None
        assert down.branch_get("x", "k") is None
        assert down.branch_put("x", "k", b"v") is False
        assert down.page_in_ranked([], {}, 10) is None
        with pytest.raises(KvCacheUnavailableError):
            down.epoch_bump("scope")
        with pytest.raises(KvCacheUnavailableError):
            down.list_keys("p")


# -- snapshots and branches -------------------------------------------------------------------
def test_branch_writes_stay_in_their_branch(a: EpistemicGraphKVBackend) -> None:
    for i in range(5):
        assert a.put(f"k{i}", f"base-{i}".encode() * 100)
    snap = a.snapshot(keys=[f"k{i}" for i in range(5)] + ["absent"])
    assert snap is not None
    assert (snap.keys, snap.logical_bytes, snap.ns) == (
        5,
        sum(len(f"base-{i}") * 100 for i in range(5)),
        "tenant-a",
    )
    b1, b2 = a.fork(snap.id), a.fork(snap.id)
    assert b1 is not None
    assert b2 is not None
    assert b1.id != b2.id
    assert b1.snapshot_id == snap.id

    assert a.branch_put(b1.id, "k1", b"branch-one" * 100)
    assert a.branch_put(b1.id, "only-in-b1", b"fresh")
    assert a.branch_put(b2.id, "k2", b"branch-two")
    # Each branch sees its own writes, and falls through to the snapshot otherwise.
    assert a.branch_get(b1.id, "k1") == b"branch-one" * 100
    assert a.branch_get(b1.id, "k2") == b"base-2" * 100
    assert a.branch_get(b1.id, "only-in-b1") == b"fresh"
    assert a.branch_get(b2.id, "k1") == b"base-1" * 100
    assert a.branch_get(b2.id, "k2") == b"branch-two"
    assert a.branch_get(b2.id, "only-in-b1") is None
    # Neither the snapshot nor the live namespace sees branch writes.
    assert a.snapshot_get(snap.id, "k1") == b"base-1" * 100
    assert a.snapshot_get(snap.id, "only-in-b1") is None
    assert a.get("k1") == b"base-1" * 100
    assert a.get("only-in-b1") is None
    # Live writes after the snapshot are invisible to it and to its branches.
    assert a.delete("k3")
    assert a.put("k3", b"rewritten")
    assert a.put("late", b"late")
    assert a.snapshot_get(snap.id, "k3") == b"base-3" * 100
    assert a.branch_get(b1.id, "k3") == b"base-3" * 100
    assert a.branch_get(b1.id, "late") is None
    # A write replaces inside the overlay, like everywhere else; the snapshot keeps its bytes.
    assert a.branch_put(b1.id, "k1", b"second")
    assert a.branch_get(b1.id, "k1") == b"second"
    assert a.snapshot_get(snap.id, "k1") == b"base-1" * 100

    info = a.branch_info(b1.id)
    assert info is not None
    assert info.private_keys == 2
    assert info.private_bytes == len(b"second") + len(b"fresh")
    assert info.shared_bytes == snap.logical_bytes
    assert [x.id for x in a.list_branches()] == [b1.id, b2.id]


def test_snapshot_by_prefix_and_whole_namespace(a: EpistemicGraphKVBackend) -> None:
    for key in ("ctx/1", "ctx/2", "ctxz", "other"):
        assert a.put(key, key.encode())
    by_prefix = a.snapshot(prefix="ctx/")
    whole = a.snapshot()
    assert by_prefix is not None
    assert whole is not None
    assert (by_prefix.keys, whole.keys) == (2, 4)
    assert a.snapshot_get(by_prefix.id, "ctx/2") == b"ctx/2"
    assert a.snapshot_get(by_prefix.id, "ctxz") is None
    assert a.snapshot_get(whole.id, "other") == b"other"
    assert [s.id for s in a.list_snapshots()] == [by_prefix.id, whole.id]


def test_deleting_a_snapshot_frees_exactly_the_unshared_blocks(a: EpistemicGraphKVBackend) -> None:
    n = 4096
    blk = {name: name.encode() * (n // len(name)) for name in ("aaaa", "bbbb", "cccc", "dddd")}
    assert _stats(a) == (0, 0)
    for name in ("aaaa", "bbbb", "cccc"):
        assert a.put(name, blk[name])
    assert _stats(a) == (3, 3 * n)
    snap = a.snapshot(keys=["aaaa", "bbbb"])
    assert snap is not None
    assert _stats(a) == (3, 3 * n)  # zero bytes copied
    assert a.delete("aaaa")
    assert a.delete("cccc")
    assert _stats(a) == (2, 2 * n)  # cccc is gone; aaaa is held by the snapshot
    branch = a.fork(snap.id)
    assert branch is not None
    assert a.branch_put(branch.id, "new", blk["dddd"])  # branch-private block
    assert a.branch_put(branch.id, "copy-of-b", blk["bbbb"])  # dedups against bbbb
    assert _stats(a) == (3, 3 * n)
    info = a.branch_info(branch.id)
    assert info is not None
    assert info.private_bytes == n  # the bbbb copy is shared with the snapshot

    assert a.delete_snapshot(snap.id)
    # aaaa (only the snapshot held it) and dddd (only its branch) are freed; bbbb stays.
    assert _stats(a) == (1, n)
    assert a.get("bbbb") == blk["bbbb"]
    assert a.snapshot_info(snap.id) is None
    assert a.branch_info(branch.id) is None
    assert a.branch_get(branch.id, "new") is None
    assert a.delete_snapshot(snap.id) is False
    assert a.delete_branch(branch.id) is False


def test_delete_branch_releases_only_its_overlay(a: EpistemicGraphKVBackend) -> None:
    assert a.put("base", b"B" * 1000)
    snap = a.snapshot(keys=["base"])
    assert snap is not None
    branch = a.fork(snap.id)
    assert branch is not None
    assert a.branch_put(branch.id, "mine", b"M" * 1000)
    assert _stats(a) == (2, 2000)
    assert a.delete_branch(branch.id)
    assert _stats(a) == (1, 1000)
    assert a.snapshot_get(snap.id, "base") == b"B" * 1000
    assert a.branch_put(branch.id, "again", b"x") is False  # 404: the branch is gone


def test_snapshot_ttl_expires(a: EpistemicGraphKVBackend) -> None:
    assert a.put("t", b"t")
    # long enough for the checks below on a loaded machine (0.3 s could pass before them)
    snap = a.snapshot(keys=["t"], ttl_s=3.0)
    assert snap is not None
    assert snap.expires_at is not None
    assert snap.expires_at == pytest.approx(snap.created_at + 3.0)
    assert a.snapshot_info(snap.id) is not None
    # the server's clock is real: poll (the store's own TTL tests use a fake clock)
    eventually(lambda: a.snapshot_info(snap.id) is None, timeout=10, what="snapshot expired")
    assert a.snapshot_get(snap.id, "t") is None
    assert a.fork(snap.id) is None


def test_tenants_cannot_see_each_others_snapshots_or_branches(
    a: EpistemicGraphKVBackend, b: EpistemicGraphKVBackend
) -> None:
    assert a.put("secret", b"a-only")
    snap = a.snapshot(keys=["secret"])
    assert snap is not None
    branch = a.fork(snap.id)
    assert branch is not None
    assert b.list_snapshots() == []
    assert b.list_branches() == []
    assert b.snapshot_info(snap.id) is None
    assert b.snapshot_get(snap.id, "secret") is None
    assert b.fork(snap.id) is None
    assert b.branch_info(branch.id) is None
    assert b.branch_get(branch.id, "secret") is None
    assert b.branch_put(branch.id, "planted", b"x") is False
    assert b.delete_branch(branch.id) is False
    assert b.delete_snapshot(snap.id) is False
    assert b.snapshot() is not None  # B's own (empty) namespace snapshot
    assert a.branch_get(branch.id, "secret") == b"a-only"
    assert a.branch_get(branch.id, "planted") is None
    for s in b.list_snapshots():
        assert b.delete_snapshot(s.id)


def test_snapshot_and_branch_survive_a_restart(tmp_path: Path) -> None:
    thread = _thread(tmp_path, backend="durable")
    handle = thread.start()
    try:
        with EpistemicGraphKVBackend(base_url=_url(handle), token=TOKEN_A) as c:
            assert c.put("k", b"before" * 100)
            snap = c.snapshot(keys=["k"])
            assert snap is not None
            branch = c.fork(snap.id)
            assert branch is not None
            assert c.branch_put(branch.id, "k", b"branch" * 100)
            assert c.delete("k")
            before = _stats(c)
    finally:
        thread.stop()
    thread = _thread(tmp_path, backend="durable")
    handle = thread.start()
    try:
        with EpistemicGraphKVBackend(base_url=_url(handle), token=TOKEN_A) as c:
            assert c.snapshot_info(snap.id) == snap
            assert c.branch_info(branch.id) is not None
            assert c.snapshot_get(snap.id, "k") == b"before" * 100
            assert c.branch_get(branch.id, "k") == b"branch" * 100
            assert c.get("k") is None
            assert _stats(c) == before
            assert c.delete_snapshot(snap.id)
            assert _stats(c) == (0, 0)
    finally:
        thread.stop()


# -- epochs -----------------------------------------------------------------------------------
def test_epoch_bump_makes_scoped_entries_stale(
    a: EpistemicGraphKVBackend, raw: urllib3.HTTPConnectionPool
) -> None:
    scope = "ctxbundle:policy"
    assert a.epoch_get(scope) == 0
    assert a.put("ctxbundle:1", b"bundle-v0", epoch_scope=scope)
    assert a.put("tokens", b"immune")
    assert a.get("ctxbundle:1") == b"bundle-v0"
    stats = a.stats()
    assert stats is not None
    stale_before = stats.stale_missed

    assert a.epoch_bump(scope) == 1
    assert a.epoch_get(scope) == 1
    assert a.get("ctxbundle:1") is None
    assert a.exists("ctxbundle:1") is False
    assert a.get("tokens") == b"immune"  # untagged entries never go stale
    stats = a.stats()
    assert stats is not None
    assert stats.stale_missed == stale_before + 1

    # A PUT over a stale entry replaces it, tagged with the new epoch.
    assert a.put("ctxbundle:1", b"bundle-v1", epoch_scope=scope)
    assert a.get("ctxbundle:1") == b"bundle-v1"
    assert a.epoch_bump(scope) == 2
    assert a.get("ctxbundle:1") is None
    # Scopes are per tenant: B's epoch did not move.
    status, doc, _ = _req(raw, "GET", f"/kv/epoch/{quote_key(scope)}", token=TOKEN_B)
    assert (status, doc) == (200, {"scope": scope, "epoch": 0})
    status, doc, resp = _req(raw, "PUT", "/kv/x", b"v", X_Kv_Epoch_Scope=scope)
    assert status == 201
    assert doc["epoch_scope"] == scope
    assert resp.headers["X-Kv-Outcome"] == "created"


# -- page-in ----------------------------------------------------------------------------------
def test_page_in_over_http_follows_pagerank(a: EpistemicGraphKVBackend) -> None:
    edges = [("n1", "hub"), ("n2", "hub"), ("n3", "hub"), ("hub", "n1"), ("n2", "n3"), ("n4", "n2")]
    node_keys = {n: [f"{n}/c0", f"{n}/c1"] for n in ("hub", "n1", "n2", "n3", "n4")}
    for keys in node_keys.values():
        for key in keys:
            assert a.put(key, key.encode().ljust(8, b"_") * 100)
    size = 800
    result = a.page_in_ranked(edges, node_keys, budget_bytes=5 * size)
    assert result is not None
    order = rank_order(pagerank(edges, nodes=node_keys))
    assert [node for node, _ in result.ranking] == order
    expect = [k for node in order for k in node_keys[node]]
    assert [p.key for p in result.paged] == expect[:5]
    assert result.used_bytes == 5 * size
    assert [(s.key, s.reason) for s in result.skipped] == [(k, "budget") for k in expect[5:]]
    assert result.paged[0].score == 1.0


# -- key listing and reserved names -----------------------------------------------------------
def test_list_keys_pages_and_prefixes(
    a: EpistemicGraphKVBackend, raw: urllib3.HTTPConnectionPool
) -> None:
    keys = ["p", "p/1", "p/2", "p/3", "p+x", "pé", "q", "o", "a/b c"]
    for key in keys:
        assert a.put(key, b"v")
    assert a.list_keys() == sorted(keys)
    assert a.list_keys("p") == sorted(k for k in keys if k.startswith("p"))
    assert a.list_keys("p/") == ["p/1", "p/2", "p/3"]
    assert a.list_keys("p/", after="p/1") == ["p/2", "p/3"]
    assert a.list_keys("p", limit=2) == ["p", "p+x"]
    assert a.list_keys("zz") == []
    status, doc, _ = _req(raw, "GET", "/kv/keys?prefix=p%2F&limit=2")
    assert (status, doc) == (200, {"keys": ["p/1", "p/2"], "next_after": "p/2"})
    status, doc, _ = _req(raw, "GET", "/kv/keys?prefix=p%2F&limit=2&after=p%2F2")
    assert (status, doc) == (200, {"keys": ["p/3"], "next_after": None})
    status, doc, _ = _req(raw, "GET", "/kv/keys", token=TOKEN_B)
    assert (status, doc) == (200, {"keys": [], "next_after": None})


@pytest.mark.parametrize(
    "key", ["snapshot", "branch", "epoch", "page-in", "keys", "fork", "stats", "batch"]
)
def test_keys_named_like_routes_stay_reachable(
    key: str, a: EpistemicGraphKVBackend, raw: urllib3.HTTPConnectionPool
) -> None:
    assert (
        _req(
            raw,
            "PUT",
            f"/kv/{quote_key(key)}",
            key.encode(),
            Content_Type="application/octet-stream",
        )[0]
        == 201
    )
    assert a.get(key) == key.encode()
    assert _req(raw, "GET", f"/kv/{quote_key(key)}")[1] == key.encode()
    snap = a.snapshot(keys=[key])
    assert snap is not None
    assert a.snapshot_get(snap.id, key) == key.encode()
    branch = a.fork(snap.id)
    assert branch is not None
    assert a.branch_get(branch.id, key) == key.encode()
    assert a.branch_put(branch.id, key + "2", b"x")
    assert a.put(key, b"replaced", epoch_scope="s")  # replaced; still reachable
    assert a.get(key) == b"replaced"


# -- refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "path", "body", "status", "code"),
    [
        ("POST", "/kv/snapshot", b'{"keys": ["a"], "prefix": "a"}', 400, "bad_request"),
        ("POST", "/kv/snapshot", b"{not json", 400, "bad_request"),
        ("POST", "/kv/snapshot", b"[]", 400, "bad_request"),
        ("POST", "/kv/snapshot", b'{"keys": "a"}', 400, "bad_request"),
        ("POST", "/kv/snapshot", b'{"keys": [""]}', 400, "bad_key"),
        ("POST", "/kv/snapshot", b'{"ttl_s": -1}', 400, "bad_request"),
        ("POST", "/kv/snapshot", b'{"ttl_s": true}', 400, "bad_request"),
        ("POST", "/kv/snapshot", b'{"bogus": 1}', 400, "bad_request"),
        ("POST", "/kv/page-in", b'{"edges": [], "node_keys": {}}', 400, "bad_request"),
        (
            "POST",
            "/kv/page-in",
            b'{"edges": [["a"]], "node_keys": {}, "budget_bytes": 1}',
            400,
            "bad_request",
        ),
        (
            "POST",
            "/kv/page-in",
            b'{"edges": [["a", "b", 0]], "node_keys": {}, "budget_bytes": 1}',
            400,
            "bad_request",
        ),
        (
            "POST",
            "/kv/page-in",
            b'{"edges": [], "node_keys": {"a": "k"}, "budget_bytes": 1}',
            400,
            "bad_request",
        ),
        (
            "POST",
            "/kv/page-in",
            b'{"edges": [], "node_keys": {}, "budget_bytes": -1}',
            400,
            "bad_request",
        ),
        (
            "POST",
            "/kv/page-in",
            b'{"edges": [], "node_keys": {}, "budget_bytes": 1, "damping": 1}',
            400,
            "bad_request",
        ),
        ("POST", "/kv/page-in", b"", 400, "bad_request"),
        ("GET", "/kv/keys?limit=0", None, 400, "bad_request"),
        ("GET", "/kv/keys?limit=abc", None, 400, "bad_request"),
        ("GET", "/kv/keys?color=red", None, 400, "bad_request"),
        ("GET", "/kv/keys?prefix=a&prefix=b", None, 400, "bad_request"),
        ("GET", "/kv/snapshot/nope", None, 404, "not_found"),
        ("DELETE", "/kv/snapshot/nope", None, 404, "not_found"),
        ("POST", "/kv/snapshot/nope/fork", None, 404, "not_found"),
        ("GET", "/kv/snapshot/nope/k", None, 404, "not_found"),
        ("GET", "/kv/branch/nope", None, 404, "not_found"),
        ("GET", "/kv/branch/nope/k", None, 404, "not_found"),
        ("PUT", "/kv/branch/nope/k", b"x", 404, "not_found"),
        ("PUT", "/kv/snapshot", b"x", 405, "method_not_allowed"),
        ("GET", "/kv/snapshot/x/fork", None, 405, "method_not_allowed"),
        ("DELETE", "/kv/branch/x/k", None, 405, "method_not_allowed"),
        ("GET", "/kv/epoch/s/bump", None, 405, "method_not_allowed"),
        ("GET", "/kv/epoch", None, 404, "not_found"),
        ("GET", "/kv/snapshot/", None, 404, "not_found"),
        ("GET", "/kv/branch/x/%FF", None, 400, "bad_key"),
    ],
)
def test_refusals(
    raw: urllib3.HTTPConnectionPool,
    method: str,
    path: str,
    body: bytes | None,
    status: int,
    code: str,
) -> None:
    got, doc, _ = _req(raw, method, path, body)
    assert (got, doc["error"]) == (status, code), doc


def test_engine_routes_need_credentials(raw: urllib3.HTTPConnectionPool) -> None:
    for method, path in [
        ("GET", "/kv/snapshot"),
        ("POST", "/kv/epoch/s/bump"),
        ("GET", "/kv/keys"),
    ]:
        assert raw.request(method, path).status == 401


def test_epoch_scope_header_is_checked(raw: urllib3.HTTPConnectionPool) -> None:
    status, doc, _ = _req(raw, "PUT", "/kv/h", b"v", X_Kv_Epoch_Scope="")
    assert (status, doc["error"]) == (400, "bad_request")
    hdrs = {"Authorization": f"Bearer {TOKEN_A}", "X-Kv-Epoch-Scope": "\xff"}
    resp = raw.request("PUT", "/kv/h", body=b"v", headers=hdrs)  # latin-1 0xFF: not UTF-8
    assert resp.status == 400


def test_a_bump_in_one_server_process_is_seen_by_another_sharing_the_epoch_dir(
    tmp_path: Path,
) -> None:
    epochs = str(tmp_path / "epochs")
    (tmp_path / "one").mkdir()
    one = _thread(tmp_path / "one", backend="durable", epoch_dir=epochs)
    h1 = one.start()
    two = ServerProcess(
        tmp_path / "two",
        *("--epoch-dir", epochs, "--stats-log-interval-s", "0"),
        backend="durable",
        token_file=write_token_file(tmp_path / "tokens", {TOKEN_A: "tenant-a"}),
        resp=False,
    )
    url2 = two.url()
    try:
        with (
            EpistemicGraphKVBackend(base_url=_url(h1), token=TOKEN_A) as c1,
            EpistemicGraphKVBackend(base_url=url2, token=TOKEN_A) as c2,
        ):
            assert c2.put("bundle", b"v0", epoch_scope="ctx")
            assert c2.get("bundle") == b"v0"
            assert c1.epoch_bump("ctx") == 1
            assert c2.epoch_get("ctx") == 1
            assert c2.get("bundle") is None  # at once, no notification needed
            stats = c2.stats()
            assert stats is not None
            assert stats.stale_missed == 1
            assert c1.put("bundle", b"v1", epoch_scope="ctx")  # tagged with epoch 1
            assert c2.epoch_bump("ctx") == 2
            assert c1.get("bundle") is None
    finally:
        one.stop()
        assert two.stop() == 0


def test_an_http_bump_is_published_to_resp_subscribers_of_the_tenant(tmp_path: Path) -> None:
    redis = pytest.importorskip("redis")
    thread = _thread(tmp_path, resp_addr="127.0.0.1:0")
    handle = thread.start()
    try:
        resp = handle.resp_addrs[0]
        subs = {}
        for name, token in (("a", TOKEN_A), ("b", TOKEN_B)):
            conn = redis.Redis(host=resp.host, port=resp.port, password=token)
            pubsub = conn.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe("kvcache:epochs")
            subs[name] = (conn, pubsub)
        with EpistemicGraphKVBackend(base_url=_url(handle), token=TOKEN_A) as c:
            assert c.epoch_bump("ctxbundle:x") == 1
        deadline = time.monotonic() + 5
        msg = None
        while msg is None and time.monotonic() < deadline:
            msg = subs["a"][1].get_message(timeout=0.2)
        assert msg is not None
        assert msg["channel"] == b"kvcache:epochs"
        assert msg["data"] == b"ctxbundle:x 1"
        assert subs["b"][1].get_message(timeout=0.3) is None  # another tenant hears nothing
        for conn, pubsub in subs.values():
            pubsub.close()
            conn.close()
    finally:
        thread.stop()
