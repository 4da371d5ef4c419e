"""store/cluster_conn.py on its own, against a real Redis Cluster (3 masters, no
replicas): routing, NOSCRIPT, errors that are and are not retried, an unknown outcome,
WAIT, the up/down state and the deployment check."""

from __future__ import annotations

import time

import pytest

import redis_cluster as rc
from epistemic_kvcache.errors import (
    ClusterUnavailableError,
    ConfigurationError,
    StoreClosedError,
    StoreError,
)
from epistemic_kvcache.store import cluster_lua as L
from epistemic_kvcache.store.cluster_conn import Unknown

pytestmark = rc.redis_marks()


cluster = rc.module_cluster()
parts = rc.parts_fixture("c")


def test_commands_reach_the_node_of_every_slot(parts: rc.Parts) -> None:
    conn = parts.conn
    keys = [f"{parts.prefix}:k{i}".encode() for i in range(30)]  # spread over the masters
    for i, k in enumerate(keys):
        assert conn.exec(k, [("SET", k, str(i)), ("GET", k)]) == [True, str(i).encode()]
    assert conn.reads([("GET", k) for k in keys]) == [str(i).encode() for i in range(30)]
    assert conn.reads([("GET", keys[0])]) == [b"0"]
    assert len({conn.node_of(k).name for k in keys}) == 3


def test_a_flushed_script_cache_is_loaded_again(parts: rc.Parts, cluster: rc.LocalCluster) -> None:
    conn = parts.conn
    tk = L.TenantKeys.of(parts.prefix, "t")
    for node in cluster.masters_now():
        with cluster.client(node) as r:
            r.script_flush()
    assert conn.script(L.ENTRY_GET, [tk.entries, tk.epochs], [b"absent"]) == [None]


def test_an_error_answer_is_not_retried(parts: rc.Parts) -> None:
    conn = parts.conn
    k = f"{parts.prefix}:str".encode()
    conn.exec(k, [("SET", k, "text")])
    before = conn.counts["retries"]
    with pytest.raises(StoreError, match="cluster error: ResponseError"):
        conn.exec(k, [("INCR", k)])
    assert conn.counts["retries"] == before


def test_a_reply_lost_after_sending_is_unknown_unless_safe(cluster: rc.LocalCluster) -> None:
    """A command that outlives the socket timeout was sent: unsafe -> `Unknown` at once;
    safe -> retried until the window is spent, then the cluster is down."""
    p = rc.cluster_parts(cluster.url, "lost", socket_timeout_s=0.5)
    conn = p.conn
    k = b"lost:empty"  # BLPOP on it blocks 2 s on the server: past the socket timeout
    try:
        with pytest.raises(Unknown):
            conn.exec(k, [("BLPOP", k, 2)], safe=False)
        with pytest.raises(ClusterUnavailableError, match="did not answer in time"):
            conn.exec(k, [("BLPOP", k, 2)], window_s=1.0)
        assert conn.down_since is not None
        assert "Timeout" in (conn.down_reason or "")
        assert conn.exec(k, [("EXISTS", k)]) == [0]  # an answer clears the state
        assert conn.down_since is None
    finally:
        p.close()


def test_down_fails_at_once_after_the_window_and_the_probe_clears_it(parts: rc.Parts) -> None:
    conn = parts.conn
    conn.retry_window_s = 30.0  # what failing only after the window would cost
    conn.mark_down("test: cut off")
    conn.down_since = time.monotonic() - 2 * conn.retry_window_s  # down for long
    k = f"{parts.prefix}:x".encode()
    retries = conn.counts["retries"]
    t0 = time.monotonic()
    with pytest.raises(ClusterUnavailableError, match="test: cut off"):
        conn.exec(k, [("GET", k)])
    # At once: refused before any round trip (none retried; the cluster is up, so one
    # would have answered), not after waiting out the retry window.
    assert conn.counts["retries"] == retries
    assert time.monotonic() - t0 < conn.retry_window_s / 3
    assert conn.exec(k, [("GET", k)], window_s=1.0) == [None]  # a flush's own window
    conn.mark_down("test: cut off")
    conn.probe()  # every slot served: up
    assert conn.down_since is None
    assert conn.exec(k, [("GET", k)]) == [None]


def test_wait_without_enough_replicas_is_unavailable(cluster: rc.LocalCluster) -> None:
    p = rc.cluster_parts(cluster.url, "wait", wait_replicas=1, wait_timeout_s=0.1)
    try:
        k = b"wait:k"
        assert p.conn.exec(k, [("SET", k, "v")], durable=False) == [True]
        with pytest.raises(ClusterUnavailableError, match="acknowledged by 0 of 1"):
            p.conn.exec(k, [("SET", k, "v")], durable=True)
    finally:
        p.close()


def test_hscan_pages_through_a_hash(parts: rc.Parts) -> None:
    conn = parts.conn
    h = f"{{{parts.prefix}}}:h".encode()
    fields = {f"f{i}".encode(): str(i).encode() for i in range(1200)}
    conn.exec(h, [("HSET", h, *[x for kv in fields.items() for x in kv])])
    seen: dict[bytes, bytes] = {}
    cursor, steps = 0, 0
    while True:
        cursor, page = conn.hscan(h, cursor)
        seen.update(page)
        steps += 1
        if cursor == 0:
            break
    assert seen == fields
    assert steps > 1


def test_the_deployment_check(parts: rc.Parts) -> None:
    conn = parts.conn
    assert conn.check(parts.prefix, "namespace") >= 0
    assert conn.check(parts.prefix, "namespace") >= 0  # the same scope again: fine
    with pytest.raises(ConfigurationError, match="every front-end of one cluster"):
        conn.check(parts.prefix, "global")
    assert conn.server_ms(parts.prefix) > 1_600_000_000_000


def test_a_closed_connection_refuses_commands(cluster: rc.LocalCluster) -> None:
    p = rc.cluster_parts(cluster.url, "closed")
    p.close()
    with pytest.raises(StoreClosedError):
        p.conn.exec(b"closed:k", [("GET", b"closed:k")])
