"""Cluster mode against a real Redis Cluster (Debian's redis-server, 3 masters + 3
replicas on loopback, `redis-cli --cluster create`) and real front-end processes.

Every cluster is started by the test that needs it (tests/redis_cluster.py) and stopped
by PID; front-ends are `python -m epistemic_kvcache serve --cluster-url ...` on free
ports. The destructive tests (failover, resharding, losing the cluster) get a cluster of
their own.
"""

from __future__ import annotations

import os
import random
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from epistemic_kvcache.client import EpistemicGraphKVBackend
from epistemic_kvcache.errors import (
    ClusterUnavailableError,
    ConfigurationError,
    QuotaExceededError,
)
from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.store import SharedKvIndex
from epistemic_kvcache.store import cluster_lua as L
from epistemic_kvcache.store.api import PutOutcome
from epistemic_kvcache.store.cluster import ClusterBackend, parse_cluster_url
from epistemic_kvcache.store.engine import digest_of
from helpers import eventually, held_port
from redis_cluster import LocalCluster
from servers import TOKEN, ServeProcess

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]

TOKEN_B = "cluster-test-token-tenant-b-0123456789"


def front_end(tmp: Path, cluster: LocalCluster, *extra: str) -> ServeProcess:
    """A front-end process over `cluster`: tenant `default` (TOKEN) and tenant `b`."""
    tmp.mkdir(parents=True, exist_ok=True)
    tokens = tmp / "tokens"
    tokens.write_text(f"{TOKEN_B} b\n")
    return ServeProcess(
        tmp,
        "--cluster-url",
        cluster.url,
        "--token-file",
        str(tokens),
        "--cluster-scrub-interval-s",
        "0",
        *extra,
    )


def resp(srv: ServeProcess, token: str = TOKEN, **kw: Any) -> redis.Redis:
    return redis.Redis(
        host="127.0.0.1", port=srv.ports["resp"], password=token, socket_timeout=30, **kw
    )


def http(srv: ServeProcess, token: str = TOKEN) -> EpistemicGraphKVBackend:
    return EpistemicGraphKVBackend(base_url=srv.url(), token=token)


def blob_keys(cluster: LocalCluster) -> list[bytes]:
    out: list[bytes] = []
    for node in cluster.masters_now():
        with cluster.client(node) as r:
            out += list(r.scan_iter(match=b"kvc:b:*", count=1000))
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


@pytest.fixture(scope="module")
def fleet(
    cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[ServeProcess]]:
    base = tmp_path_factory.mktemp("fe")
    servers: list[ServeProcess] = []
    try:
        for name in ("a", "b", "c"):
            servers.append(front_end(base / name, cluster))
        yield servers
    finally:
        for s in servers:
            s.stop()


# -- configuration (no cluster) ---------------------------------------------------------
def test_cluster_url_parsing(tmp_path: Path) -> None:
    t = parse_cluster_url("rediss://kv:s%40cret@10.0.0.1:6379,[::1]:7000")
    assert t.nodes == (("10.0.0.1", 6379), ("::1", 7000))
    assert (t.username, t.password, t.tls) == ("kv", "s@cret", True)
    pw = tmp_path / "pw"
    pw.write_text("from-file\n")
    assert parse_cluster_url("redis://h:1", password_file=pw).password == "from-file"
    assert "from-file" not in repr(parse_cluster_url("redis://h:1", password_file=pw))
    for bad in ("http://h:1", "redis://h", "redis://h:0", "redis://:1", "h:1"):
        with pytest.raises(ConfigurationError, match="cluster_url"):
            parse_cluster_url(bad)
    with pytest.raises(ConfigurationError, match="cluster_password_file"):
        parse_cluster_url("redis://h:1", password_file=tmp_path / "absent")


def test_unreachable_cluster_is_a_clear_startup_error() -> None:
    port = held_port()  # reserved, nothing listens: connections are refused
    with pytest.raises(ConfigurationError, match="cannot reach the cluster"):
        ClusterBackend(f"redis://127.0.0.1:{port}", StoreOptions(cluster_retry_window_s=0.5))


def test_tls_cluster_with_a_ca_file_and_a_password_file(tmp_path: Path) -> None:
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    files = (tmp_path / "ca.pem", tmp_path / "cert.pem", tmp_path / "key.pem")
    ca.cert_pem.write_to_path(str(files[0]))
    cert.private_key_and_cert_chain_pem.write_to_path(str(files[1]))
    cert.private_key_pem.write_to_path(str(files[2]))
    with LocalCluster(tmp_path / "cluster", masters=3, replicas=0, tls=files) as cluster:
        hosts = cluster.url.split("@", 1)[1]
        pw = tmp_path / "cluster-password"
        pw.write_text(cluster.password + "\n")
        with pytest.raises(ConfigurationError, match=r"cannot reach|verify|certificate"):
            ClusterBackend(
                f"rediss://default@{hosts}",
                StoreOptions(cluster_retry_window_s=1),
                password_file=pw,
            )
        with pytest.raises(ConfigurationError, match="credentials"):
            ClusterBackend(
                f"rediss://default:wrong@{hosts}",
                StoreOptions(cluster_retry_window_s=1),
                tls_ca=files[0],
            )
        srv = front_end(
            tmp_path / "fe",
            cluster,
            "--cluster-url",
            f"rediss://default@{hosts}",
            "--cluster-password-file",
            str(pw),
            "--cluster-tls-ca",
            str(files[0]),
        )
        try:
            assert "cluster-secret" not in "".join(srv.output)  # the password is not logged
            with resp(srv) as r:
                assert r.set("over-tls", b"t" * 70_000)
                assert r.get("over-tls") == b"t" * 70_000
        finally:
            srv.stop()


# -- two wires, several front-ends --------------------------------------------------------
def test_put_through_a_get_through_b_on_both_wires(fleet: list[ServeProcess]) -> None:
    a, b, c = fleet
    block = os.urandom(300_000)
    with http(a) as ha, http(b) as hb:
        assert ha.put("wire-http", block)
        assert hb.get("wire-http") == block
    with resp(a) as ra, resp(b) as rb, resp(c) as rc:
        assert ra.set("wire-resp", block)
        assert rb.get("wire-resp") == block
        assert rc.get("wire-http") == block  # written over HTTP through another front-end
        assert rb.strlen("wire-resp") == len(block)
        # Redis write semantics across front-ends: SET NX refused, plain SET replaces
        assert rb.set("wire-resp", b"other", nx=True) is None
        assert rc.set("wire-resp", b"newer")
        assert ra.get("wire-resp") == b"newer"
        assert rb.delete("wire-resp") == 1
        assert rc.get("wire-resp") is None
        assert ra.exists("wire-resp") == 0


def test_dedup_across_front_ends(fleet: list[ServeProcess], cluster: LocalCluster) -> None:
    a, b, _ = fleet
    block = os.urandom(200_000)
    digest = digest_of(block)
    with resp(a) as ra, resp(b) as rb:
        ra.set("dedup-1", block)
        rb.set("dedup-2", block)
        rb.set("dedup-3", block)
    mine = [k for k in blob_keys(cluster) if digest.hex().encode() in k]
    assert len(mine) == 1, mine  # one copy in the cluster for three keys from two front-ends
    with cluster.client(cluster.master_of_slot(_slot(cluster, mine[0]))) as r:
        assert int(r.hget(mine[0], "r")) == 3
    with resp(a) as ra:
        ra.delete("dedup-1", "dedup-2", "dedup-3")
    assert not [k for k in blob_keys(cluster) if digest.hex().encode() in k]  # reclaimed


def _slot(cluster: LocalCluster, key: bytes) -> int:
    with cluster.client(cluster.masters_now()[0]) as r:
        return int(r.execute_command("CLUSTER KEYSLOT", key))


def test_tenants_isolated_through_every_front_end(fleet: list[ServeProcess]) -> None:
    secret = os.urandom(50_000)
    with resp(fleet[0]) as ra:
        ra.set("tenant-secret", secret)
    for srv in fleet:
        with resp(srv, TOKEN_B) as rb:
            assert rb.get("tenant-secret") is None
            assert rb.exists("tenant-secret") == 0
            assert rb.strlen("tenant-secret") == 0
            assert "tenant-secret" not in [k.decode() for k in rb.scan_iter(count=1000)]
            # the same bytes are a new block for tenant b (namespace dedup scope)
            assert rb.set(f"mine-{srv.http_port}", secret)
        with http(srv, TOKEN_B) as hb:
            assert hb.get("tenant-secret") is None
            assert not hb.exists("tenant-secret")
    with resp(fleet[1], TOKEN_B) as rb:
        assert rb.dbsize() == len(fleet)
    with resp(fleet[2]) as ra:
        assert ra.get("tenant-secret") == secret


def test_epoch_bump_through_a_reaches_a_resp_subscriber_on_b(fleet: list[ServeProcess]) -> None:
    a, b, _ = fleet
    with resp(b) as rb:
        ps = rb.pubsub()
        ps.subscribe("kvcache:epochs")
        eventually(  # the server's confirmation: subscribed before the bump
            lambda: (ps.get_message(timeout=0.1) or {}).get("type") == "subscribe", timeout=10
        )
        with http(a) as ha:
            epoch = ha.epoch_bump("fleet-scope")
        deadline = time.monotonic() + 10
        msg = None
        while time.monotonic() < deadline and msg is None:
            msg = ps.get_message(timeout=0.5)
        ps.close()
    assert msg is not None, "no epoch notice reached the subscriber on the other front-end"
    assert msg["data"] == f"fleet-scope {epoch}".encode()
    with http(b) as hb:
        assert hb.epoch_get("fleet-scope") == epoch


def test_epoch_scoped_entries_go_stale_fleet_wide(fleet: list[ServeProcess]) -> None:
    a, b, _ = fleet
    with http(a) as ha, http(b) as hb:
        assert ha.put("scoped-key", b"x" * 1000, epoch_scope="doc-7")
        assert hb.get("scoped-key") == b"x" * 1000
        hb.epoch_bump("doc-7")
        assert ha.get("scoped-key") is None
        assert ha.put("scoped-key", b"y" * 1000, epoch_scope="doc-7")
        assert hb.get("scoped-key") == b"y" * 1000


def test_stats_are_fleet_wide(fleet: list[ServeProcess]) -> None:
    with http(fleet[0], TOKEN_B) as h:
        before = h.stats()
    assert before is not None
    with resp(fleet[1], TOKEN_B) as rb:
        for i in range(5):
            rb.set(f"stats-{i}", os.urandom(1000))
            rb.get(f"stats-{i}")

    def counted() -> tuple[int, int] | None:  # they reach the cluster within a second or so
        with http(fleet[2], TOKEN_B) as h:
            after = h.stats()
        assert after is not None
        grew = (after.get_hits - before.get_hits, after.total_refs - before.total_refs)
        assert grew[0] <= 5, grew
        return None if grew != (5, 5) else grew

    eventually(counted, timeout=30, interval=0.2, what="5 hits and 5 refs seen fleet-wide")


def test_snapshot_through_a_fork_through_b_read_through_c(fleet: list[ServeProcess]) -> None:
    a, b, c = fleet
    block = os.urandom(80_000)
    with http(a) as ha, http(b) as hb, http(c) as hc:
        assert ha.put("snap-key", block)
        info = ha.snapshot(keys=["snap-key"])
        assert info is not None
        assert hb.put("snap-key", b"replaced")  # the live key moves on
        assert hc.snapshot_get(info.id, "snap-key") == block
        branch = hb.fork(info.id)
        assert branch is not None
        assert hc.branch_put(branch.id, "snap-key", b"branch bytes")
        assert ha.branch_get(branch.id, "snap-key") == b"branch bytes"
        assert hc.snapshot_get(info.id, "snap-key") == block
        assert [s.id for s in hb.list_snapshots()] == [info.id]
        assert hc.delete_snapshot(info.id)
        assert ha.branch_info(branch.id) is None
        assert hb.get("snap-key") == b"replaced"


def test_lmcache_stores_through_a_and_loads_through_b(fleet: list[ServeProcess]) -> None:
    pytest.importorskip("lmcache")
    from lmcache.lmcache_redis import LMCacheRedisClient

    from test_lmcache import native_call

    a, b, _ = fleet
    keys = [f"meta-llama/Llama-3-8B@00000000@0@cluster{i}" for i in range(4)]
    blocks = [os.urandom(512 * 1024) for _ in keys]
    ca = LMCacheRedisClient("127.0.0.1", a.ports["resp"], 2, "", TOKEN)
    cb = LMCacheRedisClient("127.0.0.1", b.ports["resp"], 2, "", TOKEN)
    try:
        ok, err, _ = native_call(ca, ca.submit_batch_set(keys, [memoryview(x) for x in blocks]))
        assert ok, err
        ok, err, found = native_call(cb, cb.submit_batch_exists([*keys, "absent"]))
        assert ok, err
        assert found == [True] * len(keys) + [False]
        bufs = [bytearray(len(x)) for x in blocks]
        ok, err, _ = native_call(cb, cb.submit_batch_get(keys, [memoryview(x) for x in bufs]))
        assert ok, err
        assert bufs == blocks
    finally:
        ca.close()
        cb.close()


def test_a_damaged_value_in_the_cluster_is_never_served(
    fleet: list[ServeProcess], cluster: LocalCluster
) -> None:
    _a, b, c = fleet
    block = os.urandom(100_000)
    with resp(b) as rb:
        rb.set("damaged", block)
    bkey = L.blob_key("kvc", digest_of(block), "default")
    damaged = bytearray(block)
    damaged[5000] ^= 0xFF
    with cluster.client(cluster.master_of_slot(_slot(cluster, bkey))) as r:
        assert r.hset(bkey, "d", bytes(damaged)) == 0  # an existing field overwritten
    with resp(c) as rc, http(c) as hc:
        before = hc.stats()
        assert rc.get("damaged") is None  # c never cached it: the damaged copy is refused
        assert rc.get("damaged") is None
        after = hc.stats()
    assert before is not None
    assert after is not None
    assert after.integrity_failures - before.integrity_failures >= 1
    with cluster.client(cluster.master_of_slot(_slot(cluster, bkey))) as r:
        assert not r.exists(bkey)  # the damaged block is deleted; its key with it
    with resp(b) as rb:
        assert rb.exists("damaged") == 0


def test_kill_a_front_end_the_others_serve_and_it_restarts_at_once(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    a = front_end(tmp_path / "a", cluster)
    b = front_end(tmp_path / "b", cluster)
    try:
        blocks = {f"fe-kill-{i}": os.urandom(64_000) for i in range(20)}
        with resp(a) as ra:
            for k, v in blocks.items():
                ra.set(k, v)
        a.kill()
        a.stop()  # reaps it and closes its pipe
        with resp(b) as rb:
            for k, v in blocks.items():
                assert rb.get(k) == v
            rb.set("fe-kill-after", b"z" * 100)
        t0 = time.monotonic()
        a = front_end(tmp_path / "a2", cluster)
        with resp(a) as ra:
            assert ra.get("fe-kill-after") == b"z" * 100
            assert ra.get("fe-kill-0") == blocks["fe-kill-0"]
        assert time.monotonic() - t0 < 30
    finally:
        a.stop()
        b.stop()


# -- the store API directly: write rules, leaks and the scrub ------------------------------
@pytest.fixture(scope="module")
def store(cluster: LocalCluster) -> Iterator[ClusterBackend]:
    s = ClusterBackend(
        cluster.url, StoreOptions(cluster_key_prefix="api", cluster_scrub_interval_s=0)
    )
    s.release_limit_ms, s.scrub_settle_ms = 300, 600  # no concurrent releases here
    yield s
    s.close()


def test_write_rules_match_the_single_node_store(
    store: ClusterBackend, rand: random.Random
) -> None:
    """Random PUT/DELETE/GET sequences (with nx/xx conditions) give the same outcomes and
    bytes as the memory backend."""
    ref = SharedKvIndex()
    values = [os.urandom(64) for _ in range(4)]
    ns = f"model-{rand.randrange(1 << 30)}"
    for _ in range(300):
        key = f"k{rand.randrange(5)}"
        op = rand.choice(["put", "put", "put", "delete", "get"])
        if op == "put":
            data = rand.choice(values)
            cond = rand.choice([None, None, "nx", "xx"])
            got = store.put(ns, key, data, cond=cond)  # type: ignore[arg-type]
            want = ref.put(ns, key, data, cond=cond)  # type: ignore[arg-type]
            assert (got.outcome, got.digest, got.size) == (want.outcome, want.digest, want.size)
        elif op == "delete":
            assert store.delete(ns, key) == ref.delete(ns, key)
        else:
            got_b = store.get(ns, key)
            want_b = ref.get(ns, key)
            assert (bytes(got_b) if got_b is not None else None) == (
                bytes(want_b) if want_b is not None else None
            )
    assert store.keys(ns) == ref.keys(ns)
    assert store.count(ns) == ref.count(ns)
    store.flush(ns)
    report = store.check()
    assert report.ok, report


def test_first_write_wins_tenants(cluster: LocalCluster) -> None:
    s = ClusterBackend(
        cluster.url,
        StoreOptions(
            cluster_key_prefix="fww",
            cluster_scrub_interval_s=0,
            first_write_wins=frozenset({"audit"}),
        ),
    )
    try:
        assert s.put("audit", "k", b"one").outcome is PutOutcome.NEW
        assert s.put("audit", "k", b"two").outcome is PutOutcome.CONFLICT
        assert s.put("audit", "k", b"one").outcome is PutOutcome.DUPLICATE
        assert s.put("other", "k", b"one").outcome is PutOutcome.NEW
        assert s.put("other", "k", b"two").outcome is PutOutcome.REPLACED
    finally:
        s.close()


def test_evicted_block_reads_as_a_miss_and_is_cleaned_up(
    store: ClusterBackend, cluster: LocalCluster
) -> None:
    other = ClusterBackend(
        cluster.url, StoreOptions(cluster_key_prefix="api", cluster_scrub_interval_s=0)
    )
    try:
        store.put("evict", "k1", b"e" * 5000)
        store.put("evict", "k2", b"e" * 5000)
        bkey = L.blob_key("api", digest_of(b"e" * 5000), "evict")
        with cluster.client(cluster.master_of_slot(_slot(cluster, bkey))) as r:
            assert r.delete(bkey) == 1  # what eviction under maxmemory does
        assert other.get("evict", "k1") is None  # not in its RAM: a miss
        assert other.keys("evict") == ["k2"]  # the dangling key was removed
        # the same bytes again make a new generation; the old dangling entry cannot
        # release the new block's reference
        assert other.put("evict", "k3", b"e" * 5000).outcome is PutOutcome.NEW
        report = store.scrub()
        assert report.orphan_index_entries == ["evict/k2"]
        assert store.keys("evict") == ["k3"]
        assert bytes(store.get("evict", "k3") or b"") == b"e" * 5000
        assert store.check().ok
    finally:
        other.close()


def test_scrub_takes_back_leaked_references(store: ClusterBackend, cluster: LocalCluster) -> None:
    data = os.urandom(4000)
    digest = digest_of(data)
    store.put("leak", "k", data)
    bkey = L.blob_key("api", digest, "leak")
    # a front-end that crashed between taking a reference and writing its entry
    store._conn.script(L.BLOB_REF, [bkey], [os.urandom(8), 0])
    orphan = os.urandom(3000)
    okey = L.blob_key("api", digest_of(orphan), "leak")
    store._blocks.store(okey, orphan, os.urandom(8))
    bare = os.urandom(2000)  # bytes whose writer died before the reference was taken
    zkey = L.blob_key("api", digest_of(bare), "leak")
    with cluster.client(cluster.master_of_slot(_slot(cluster, zkey))) as r:
        r.hset(zkey, "d", bare)
    report = store.check()
    assert report.refcount_mismatches
    assert report.orphan_blobs
    store.scrub()  # too recent: in flight as far as the scrub can tell
    assert not store.check().ok
    for k in (bkey, okey):  # ... an hour later
        with cluster.client(cluster.master_of_slot(_slot(cluster, k))) as r:
            r.hset(k, "t", int(time.time() * 1000) - 3_600_000)
    store.scrub()
    assert store.check().ok
    with cluster.client(cluster.master_of_slot(_slot(cluster, zkey))) as r:
        assert r.hget(zkey, "z") is not None  # marked by the first scrub
        r.hset(zkey, "z", int(time.time() * 1000) - 3_600_000)
    store.scrub()
    with cluster.client(cluster.master_of_slot(_slot(cluster, zkey))) as r:
        assert not r.exists(zkey)  # deleted by a later one
    with cluster.client(cluster.master_of_slot(_slot(cluster, bkey))) as r:
        assert int(r.hget(bkey, "r")) == 1
    with cluster.client(cluster.master_of_slot(_slot(cluster, okey))) as r:
        assert not r.exists(okey)
    assert bytes(store.get("leak", "k") or b"") == data


def test_a_late_release_is_refused_and_left_to_the_scrub(
    store: ClusterBackend, cluster: LocalCluster
) -> None:
    data = os.urandom(2000)
    store.put("late", "k1", data)
    store.put("late", "k2", data)
    bkey = L.blob_key("api", digest_of(data), "late")
    tk = store._entries.keys_of("late")
    raw, removed_ms = store._conn.script(
        L.ENTRY_DEL, [tk.entries, tk.order, tk.counters], [b"k1", b""]
    )
    e = L.parse_entry(raw)
    leaked = store._fe["leaked_refs"]
    # the release arrives long after the entry went (a front-end stalled in between)
    store._blocks.unref(
        "late", e.digest, e.gen, removed_ms=int(removed_ms) - 10 * store.release_limit_ms
    )
    assert store._fe["leaked_refs"] == leaked + 1
    with cluster.client(cluster.master_of_slot(_slot(cluster, bkey))) as r:
        assert int(r.hget(bkey, "r")) == 2  # refused: the count stays high, never low
        r.hset(bkey, "t", int(time.time() * 1000) - 3_600_000)
    store.scrub()
    with cluster.client(cluster.master_of_slot(_slot(cluster, bkey))) as r:
        assert int(r.hget(bkey, "r")) == 1
    assert bytes(store.get("late", "k2") or b"") == data


def test_pins_make_a_block_unevictable(store: ClusterBackend, cluster: LocalCluster) -> None:
    s = ClusterBackend(
        cluster.url,
        StoreOptions(
            cluster_key_prefix="ttl", cluster_block_ttl_s=3600, cluster_scrub_interval_s=0
        ),
    )
    try:
        s.put("p", "k", b"pinned bytes")
        bkey = L.blob_key("ttl", digest_of(b"pinned bytes"), "p")
        node = cluster.master_of_slot(_slot(cluster, bkey))
        with cluster.client(node) as r:
            assert r.pttl(bkey) > 0  # evictable under a volatile-* policy
            assert s.pin("p", "k")
            assert r.pttl(bkey) == -1  # pinned: no TTL, never evicted
            assert s.put("p", "k", b"replacement").outcome is PutOutcome.REPLACED
            assert r.pttl(bkey) > 0 or not r.exists(bkey)  # the pin moved with the key
            nkey = L.blob_key("ttl", digest_of(b"replacement"), "p")
        with cluster.client(cluster.master_of_slot(_slot(cluster, nkey))) as r:
            assert r.pttl(nkey) == -1
            assert s.unpin("p", "k")
            assert not s.unpin("p", "k")
            assert r.pttl(nkey) > 0
    finally:
        s.close()


def test_batches_mix_ram_cluster_and_misses(store: ClusterBackend, cluster: LocalCluster) -> None:
    other = ClusterBackend(
        cluster.url, StoreOptions(cluster_key_prefix="api", cluster_scrub_interval_s=0)
    )
    try:
        blocks = {f"m{i}": os.urandom(3000 + i) for i in range(6)}
        for k, v in blocks.items():
            store.put("many", k, v)
        other.get("many", "m0")  # in other's RAM; the rest come from the cluster
        keys = [*blocks, "absent"]
        got = other.get_many("many", keys)
        assert [bytes(g) if g is not None else None for g in got] == [*blocks.values(), None]
        assert other.exists_many("many", keys) == [True] * 6 + [False]
        store.delete("many", "m3")
        assert other.exists_many("many", ["m3", "m4"]) == [False, True]
    finally:
        other.close()


def test_retire_stale_reclaims_entries_and_blocks(store: ClusterBackend) -> None:
    for i in range(5):
        store.put("retire", f"s{i}", f"scoped-{i}".encode() * 100, epoch_scope="doc")
    store.put("retire", "plain", b"kept" * 100)
    assert store.epoch_bump("retire", "doc") == 1
    assert store.get("retire", "s0") is None  # stale at once
    assert store.count("retire") == 6  # ... and still there until retired
    assert store.retire_stale(max_items=100, budget_s=5.0) >= 5
    assert store.keys("retire") == ["plain"]
    assert store.check().ok


def test_pin_quota_is_atomic_per_tenant(store: ClusterBackend) -> None:
    saved = store.capacity_bytes
    store.capacity_bytes = 20_000  # as if the masters' maxmemory summed to this
    try:
        store.put("pins", "a", os.urandom(6000))
        store.put("pins", "b", os.urandom(6000))
        assert store.pin("pins", "a")
        assert store.pin("pins", "a")  # pinning a pinned key again costs nothing
        with pytest.raises(QuotaExceededError):
            store.pin("pins", "b")  # 12000 > 50% of 20000
        assert store.unpin("pins", "a")
        assert store.unpin("pins", "a")
        assert store.pin("pins", "b")
        assert store.stats("pins").pinned_blocks == 1
        assert store.delete("pins", "b")
        assert store.stats("pins").pinned_blocks == 0
    finally:
        store.capacity_bytes = saved


def test_cluster_check_command(cluster: LocalCluster) -> None:
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "epistemic_kvcache", "cluster", "check", "--cluster-url"]
    proc = subprocess.run(
        [*cmd, cluster.url, "--cluster-key-prefix", "cli"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["ok"] is True
    proc = subprocess.run(
        [sys.executable, "-m", "epistemic_kvcache", "cluster", "check"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "needs --cluster-url" in proc.stderr


@pytest.mark.parametrize("meanwhile", [False, True], ids=["reply-lost", "replaced-meanwhile"])
def test_a_write_whose_reply_is_lost_keeps_the_counts_right(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch, meanwhile: bool
) -> None:
    """The connection breaks after ENTRY_PUT ran (its reply lost); the retry must not
    reuse a reference that the entry consumed and a later writer may have released."""
    from epistemic_kvcache.store.cluster_conn import Unknown

    s = ClusterBackend(
        cluster.url, StoreOptions(cluster_key_prefix="lost", cluster_scrub_interval_s=0)
    )
    other = ClusterBackend(
        cluster.url, StoreOptions(cluster_key_prefix="lost", cluster_scrub_interval_s=0)
    )
    try:
        real = s._conn.exec
        fired = []

        def flaky(slot_key: bytes, cmds: Any, **kw: Any) -> list[Any]:
            out = real(slot_key, cmds, **kw)
            if cmds[0][0] == "EVALSHA" and cmds[0][1] == L.ENTRY_PUT.sha and not fired:
                fired.append(1)
                if meanwhile:  # another front-end replaces the key before the retry
                    other.put("t", "k", b"theirs" * 100)
                raise Unknown("connection reset after sending")
            return out

        monkeypatch.setattr(s._conn, "exec", flaky)
        r = s.put("t", "k", b"mine" * 100)
        assert fired
        # applied once (reply lost: "again"), or once more over theirs
        assert r.outcome is (PutOutcome.REPLACED if meanwhile else PutOutcome.NEW)
        assert bytes(other.get("t", "k") or b"") == b"mine" * 100
        monkeypatch.setattr(s._conn, "exec", real)
        report = s.check()
        # counts are never low; a reference may leak (reclaimed by the scrub)
        assert not report.orphan_index_entries
        for line in report.refcount_mismatches:
            have, want = (int(x) for x in line.rsplit(": ", 1)[1].split(" != "))
            assert have > want, line
        assert s.delete("t", "k")
        assert not s.exists("t", "k")
    finally:
        s.close()
        other.close()


# -- failures: failover, resharding, losing the cluster ------------------------------------
class Ledger:
    """Acknowledged writes and the errors seen, from several client threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acked: dict[str, bytes] = {}
        self.errors: list[tuple[float, str]] = []
        self.wrong: list[str] = []
        self.reads = 0

    def error(self, what: str) -> None:
        with self.lock:
            self.errors.append((time.monotonic(), what))

    def window_s(self) -> float:
        if not self.errors:
            return 0.0
        return self.errors[-1][0] - self.errors[0][0]


def writer(srv: ServeProcess, ledger: Ledger, stop: threading.Event, name: str, seed: int) -> None:
    rnd = random.Random(seed)
    with resp(srv) as r:
        i = 0
        while not stop.is_set():
            key = f"{name}-{i}"
            data = rnd.randbytes(rnd.randrange(1_000, 60_000))
            try:
                ok = r.set(key, data)
            except redis.RedisError as exc:
                ledger.error(f"SET {key}: {exc}")
                time.sleep(0.05)
            else:
                if ok:
                    with ledger.lock:
                        ledger.acked[key] = data
            i += 1


def reader(srv: ServeProcess, ledger: Ledger, stop: threading.Event, seed: int) -> None:
    rnd = random.Random(seed)
    with resp(srv) as r:
        while not stop.is_set():
            with ledger.lock:
                if not ledger.acked:
                    continue
                key = rnd.choice(list(ledger.acked))
                want = ledger.acked[key]
            try:
                got = r.get(key)
            except redis.RedisError as exc:
                ledger.error(f"GET {key}: {exc}")
                time.sleep(0.05)
                continue
            with ledger.lock:
                ledger.reads += 1
                if got != want:
                    ledger.wrong.append(f"{key}: {None if got is None else len(got)} bytes")


def acked_at_least(ledger: Ledger, n: int) -> None:
    """Until the writers have `n` acknowledged writes (instead of writing "for a while")."""
    eventually(lambda: len(ledger.acked) >= n, timeout=120, interval=0.05, what=f"{n} acks")


def verify_all(srv: ServeProcess, ledger: Ledger) -> None:
    with resp(srv) as r:
        keys = list(ledger.acked)
        for i in range(0, len(keys), 50):
            chunk = keys[i : i + 50]
            got = r.mget(chunk)
            for k, v in zip(chunk, got, strict=True):
                assert v == ledger.acked[k], f"acknowledged {k} lost or wrong after the change"


@pytest.mark.slow
def test_sigkill_a_master_during_writes(tmp_path: Path) -> None:
    with LocalCluster(tmp_path / "cluster", node_timeout_ms=1500) as cluster:
        a = front_end(tmp_path / "a", cluster, "--cluster-wait-replicas", "1")
        b = front_end(tmp_path / "b", cluster)
        try:
            ledger = Ledger()
            stop = threading.Event()
            threads = [
                threading.Thread(target=writer, args=(a, ledger, stop, f"w{i}", i))
                for i in range(3)
            ] + [threading.Thread(target=reader, args=(b, ledger, stop, 99))]
            for t in threads:
                t.start()
            acked_at_least(ledger, 20)
            victim = cluster.master_of_slot(random.randrange(16384))
            acked_before = len(ledger.acked)
            t_kill = time.monotonic()
            cluster.kill(victim)
            cluster.wait_failover(victim)
            failover_s = time.monotonic() - t_kill
            # the old master comes back as a replica (so WAIT 1 can succeed again there)
            cluster.restart(victim)
            cluster.wait_healthy()
            acked_at_least(ledger, len(ledger.acked) + 20)  # writes go on after it
            stop.set()
            for t in threads:
                t.join(60)
            print(
                f"failover {failover_s:.1f} s; acked {acked_before} before the kill, "
                f"{len(ledger.acked)} in all; {len(ledger.errors)} errors over "
                f"{ledger.window_s():.1f} s; {ledger.reads} reads; first errors: "
                f"{[e for _t, e in ledger.errors[:3]]}"
            )
            print("".join(ln for ln in a.output if "failed" in ln or "cluster" in ln)[:3000])
            assert len(ledger.acked) > acked_before, "no write succeeded after the failover"
            assert not ledger.wrong, ledger.wrong[:5]
            # bounded: the failover itself plus the time the old master took to come back
            assert ledger.window_s() < failover_s + 30, ledger.errors[:5]
            verify_all(b, ledger)
            fresh = front_end(tmp_path / "fresh", cluster)
            try:
                verify_all(fresh, ledger)
            finally:
                fresh.stop()
        finally:
            a.stop()
            b.stop()


@pytest.mark.slow
def test_add_a_master_and_rebalance_while_clients_write_and_read(tmp_path: Path) -> None:
    with LocalCluster(tmp_path / "cluster", masters=3, replicas=1) as cluster:
        a = front_end(tmp_path / "a", cluster)
        b = front_end(tmp_path / "b", cluster)
        try:
            ledger = Ledger()
            stop = threading.Event()
            threads = [
                threading.Thread(target=writer, args=(a, ledger, stop, f"r{i}", i))
                for i in range(2)
            ] + [threading.Thread(target=reader, args=(b, ledger, stop, i)) for i in (7, 8)]
            for t in threads:
                t.start()
            acked_at_least(ledger, 20)
            cluster.add_master()
            t0 = time.monotonic()
            out = cluster.rebalance()
            took = time.monotonic() - t0
            acked_at_least(ledger, len(ledger.acked) + 10)  # writes go on after it
            stop.set()
            for t in threads:
                t.join(60)
            print(
                f"rebalance {took:.1f} s ({out.count('Moving')} moves); "
                f"{len(ledger.acked)} acked, {ledger.reads} reads, {len(ledger.errors)} errors"
            )
            assert "Moving" in out
            assert not ledger.wrong, ledger.wrong[:5]
            assert not ledger.errors, ledger.errors[:5]  # redirections cost retries only
            verify_all(b, ledger)
            verify_all(a, ledger)
        finally:
            a.stop()
            b.stop()


@pytest.mark.slow
def test_a_front_end_that_loses_the_cluster_serves_ram_and_recovers(tmp_path: Path) -> None:
    with LocalCluster(tmp_path / "cluster", masters=3, replicas=0) as cluster:
        s = ClusterBackend(
            cluster.url, StoreOptions(cluster_retry_window_s=2.0, cluster_scrub_interval_s=0)
        )
        try:
            blocks = {f"k{i}": os.urandom(10_000) for i in range(10)}
            for k, v in blocks.items():
                s.put("t", k, v)
            assert s.health().ready
            for node in list(cluster.nodes):
                cluster.kill(node)
            deadline = time.monotonic() + 10
            while s.health().ready and time.monotonic() < deadline:
                time.sleep(0.2)
            h = s.health()
            assert not h.ready
            assert not h.writable
            assert "unreachable" in (h.reason or "")
            t0 = time.monotonic()
            for k, v in blocks.items():
                assert bytes(s.get("t", k) or b"") == v  # answered from RAM
            assert time.monotonic() - t0 < 5
            with pytest.raises(ClusterUnavailableError):
                s.put("t", "new", b"refused")
            with pytest.raises(ClusterUnavailableError):
                s.get("t", "never-seen")
            for node in cluster.nodes:
                cluster.restart(node)
            cluster.wait_healthy()
            deadline = time.monotonic() + 30
            while not s.health().ready and time.monotonic() < deadline:
                time.sleep(0.2)
            assert s.health().ready, s.health()
            assert s.put("t", "new", b"accepted").outcome is PutOutcome.NEW
            assert bytes(s.get("t", "k3") or b"") == blocks["k3"]
        finally:
            s.close()


def test_the_cluster_backend_owns_its_bytes(store: ClusterBackend) -> None:
    """Issue 22 item 3 on the cluster backend: a caller's buffer changed after a PUT (or
    a branch PUT) changes nothing stored, the original bytes deduplicate correctly
    under another key, and no read (RAM tier, cluster fetch, batch, snapshot, branch)
    hands out writable bytes."""
    from epistemic_kvcache.buffers import Handover

    ns = "owned"
    a, b = b"A" * 4096, b"B" * 4096
    mine = bytearray(a)
    assert store.put(ns, "k1", mine).created
    mine[:] = b
    assert store.get(ns, "k1") == a
    assert store.put(ns, "k2", a).created  # deduplicated onto k1's block
    assert store.get(ns, "k2") == a
    assert store.stats(ns).unique_blocks == 1
    handed = bytearray(b)
    store.put(ns, "h", Handover(handed))
    sid = store.snapshot_create(ns).id
    bid = store.branch_create(ns, sid).id
    theirs = bytearray(b"C" * 4096)
    store.branch_put(ns, bid, "br", theirs)
    theirs[:] = a
    assert store.branch_get(ns, bid, "br") == b"C" * 4096
    reads = [
        store.get(ns, "k1"),
        store.get(ns, "h"),
        *store.get_many(ns, ["k1", "k2", "h"]),
        store.snapshot_get(ns, sid, "k1"),
        store.branch_get(ns, bid, "br"),
    ]
    store._cache.flush(ns)  # the cluster's copies, fetched again
    reads += [store.get(ns, "k1"), *store.get_many(ns, ["k2", "h"])]
    for data in reads:
        assert data is not None
        with pytest.raises(TypeError):
            memoryview(data)[0] = 0
    assert [store.get(ns, k) for k in ("k1", "k2", "h")] == [a, a, b]
    store.snapshot_delete(ns, sid)
    store.flush(ns)
    assert store.check().ok
