"""No write or read path takes a RAM tier past its capacity (issue 22, item 1).

A durable server with an 8 MiB hot tier and no warm tier, fed ten rounds of the client's
`put_many` (16 x 1 MiB) and `get_many`, held 160 MiB in hot: the durable batch PUT never
made room, and the tier thread was only woken by a single PUT that found none. Batch PUT
is LMCache's path, and RESP `MSET` takes it too. Every path is checked here, on both
backends and both wires, plus the cluster backend's RAM tiers and the reads that promote.

Each check reads the tiers' `peak_bytes` (the high-water mark the engine keeps), not only
their `bytes` after the fact, so a tier that is over capacity for a moment (a block added,
then room made) fails as surely as one that stays over, without sampling at the right
moment.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from epistemic_kvcache.client import EpistemicGraphKVBackend, KvCacheConfig
from epistemic_kvcache.errors import CapacityError
from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.server.app import ServerHandle, ServerThread
from epistemic_kvcache.store import SharedKvIndex, SharedKvStoreBackend
from epistemic_kvcache.store.engine import WOULD_BLOCK, TieredEngine
from servers import server_config

KiB, MiB = 1 << 10, 1 << 20
NS = "tenant"
TOKEN = "tier-bounds-token-0123456789"


def bf16(seed: int, size: int) -> bytes:
    """bf16-shaped bytes (they compress in warm, like real KV)."""
    vals = np.random.default_rng(seed).standard_normal(size // 2).astype(np.float32)
    return (vals.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def over_capacity(tiers: dict[str, dict[str, int]]) -> list[str]:
    """Tiers whose bytes, now or at their peak, passed their capacity."""
    return [
        f"{name}: bytes={t['bytes']} peak_bytes={t['peak_bytes']} capacity={t['capacity_bytes']}"
        for name, t in tiers.items()
        if max(t["bytes"], t["peak_bytes"]) > t["capacity_bytes"]
    ]


def store_tiers(store: TieredEngine) -> dict[str, dict[str, int]]:
    return {
        name: {"bytes": t.bytes, "peak_bytes": t.peak_bytes, "capacity_bytes": t.capacity_bytes}
        for name, t in store.stats(None).tiers.items()
    }


# -- the engine, one path at a time ----------------------------------------------------
def _memory(warm: int) -> TieredEngine:
    return SharedKvIndex(StoreOptions(hot_capacity_bytes=1 * MiB, warm_capacity_bytes=warm))


def _durable(tmp_path: Path, warm: int) -> TieredEngine:
    return SharedKvStoreBackend(
        tmp_path,
        StoreOptions(
            hot_capacity_bytes=1 * MiB,
            warm_capacity_bytes=warm,
            cold_capacity_bytes=64 * MiB,
            map_size_bytes=64 * MiB,
        ),
    )


def _single(store: TieredEngine, items: list[tuple[str, bytes]]) -> None:
    for key, value in items:
        store.put(NS, key, value)


def _batch(store: TieredEngine, items: list[tuple[str, bytes]]) -> None:
    store.put_many(NS, items)


def _nowait(store: TieredEngine, items: list[tuple[str, bytes]]) -> None:
    """The event loop's path (RESP SET, small HTTP PUTs): started inline when cheap."""
    for key, value in items:
        started = store.put_nowait(NS, key, value)
        if started is WOULD_BLOCK:
            store.put(NS, key, value)
        elif isinstance(started, concurrent.futures.Future):
            started.result(30)


WRITES: dict[str, Callable[[TieredEngine, list[tuple[str, bytes]]], None]] = {
    "put": _single,
    "put_many": _batch,
    "put_nowait": _nowait,
}


@pytest.mark.parametrize("warm", [0, 512 * KiB], ids=["no-warm", "warm"])
@pytest.mark.parametrize("write", sorted(WRITES))
@pytest.mark.parametrize("backend", ["memory", "durable"])
def test_writes_keep_every_tier_within_capacity(
    tmp_path: Path, backend: str, write: str, warm: int
) -> None:
    """16 rounds of 8 blocks of 256 KiB (32 MiB) through a 1 MiB hot tier."""
    store = _memory(warm) if backend == "memory" else _durable(tmp_path, warm)
    try:
        for r in range(16):
            items = [(f"r{r}-k{i}", bf16(r * 100 + i, 256 * KiB)) for i in range(8)]
            WRITES[write](store, items)
            assert over_capacity(store_tiers(store)) == [], f"round {r}"
            last = items
        kept = 0
        for key, value in last:  # what is kept reads back (the memory backend evicts)
            got = store.get(NS, key)
            if got is not None:
                assert bytes(got) == value
                kept += 1
        assert kept >= 4  # at least what hot holds
        assert store.check(deep=True).ok
    finally:
        store.close()


@pytest.mark.parametrize("warm", [0, 512 * KiB], ids=["no-warm", "warm"])
@pytest.mark.parametrize("read", ["get", "get_many"])
@pytest.mark.parametrize("backend", ["memory", "durable"])
def test_reads_that_promote_keep_every_tier_within_capacity(
    tmp_path: Path, backend: str, read: str, warm: int
) -> None:
    """Blocks promoted from warm (memory) or from disk (durable, reopened: all cold)."""
    n = 12 if backend == "memory" else 24
    data = {f"k{i}": bf16(i, 256 * KiB) for i in range(n)}
    if backend == "memory":  # 1 MiB hot + 2 MiB warm hold all 12 (compressed in warm)
        store: TieredEngine = SharedKvIndex(
            StoreOptions(hot_capacity_bytes=1 * MiB, warm_capacity_bytes=2 * MiB + warm)
        )
        store.put_many(NS, list(data.items()))
    else:
        first = _durable(tmp_path, warm)
        first.put_many(NS, list(data.items()))
        first.close()
        store = _durable(tmp_path, warm)
    try:
        keys = list(data)
        for _ in range(2):
            got = [store.get(NS, k) for k in keys] if read == "get" else store.get_many(NS, keys)
            assert [bytes(g) if g is not None else None for g in got] == list(data.values())
            assert over_capacity(store_tiers(store)) == []
        assert store.stats(None).promotions > 0
    finally:
        store.close()


def test_a_block_that_fits_no_tier_is_refused_and_nothing_is_lost() -> None:
    """Memory backend: hot holds 768 KiB of pinned blocks, warm is 256 KiB; a 512 KiB
    block fits neither. Before, it entered hot past its capacity and was evicted at once
    (the PUT said stored, the key was gone): now the PUT is refused with a precise error
    and the store is unchanged."""
    store = SharedKvIndex(
        StoreOptions(
            hot_capacity_bytes=1 * MiB, warm_capacity_bytes=256 * KiB, max_pinned_fraction=1.0
        )
    )
    for i in range(3):
        store.put(NS, f"pin{i}", bf16(i, 256 * KiB))
        assert store.pin(NS, f"pin{i}")
    with pytest.raises(CapacityError, match="no room for a 524288-byte block"):
        store.put(NS, "one-more", os.urandom(512 * KiB))
    assert not store.exists(NS, "one-more")
    assert store.count(NS) == 3
    assert store.stats(NS).evictions == 0
    assert over_capacity(store_tiers(store)) == []
    assert store.put(NS, "small", bf16(7, 128 * KiB)).applied  # what fits still goes in
    assert store.check(deep=True).ok
    store.close()


# -- the wires -------------------------------------------------------------------------
def _server(tmp_path: Path, backend: str, **extra: str) -> ServerThread:
    settings = {"hot_capacity_bytes": "2MiB", "warm_capacity_bytes": "0"}
    settings |= {"cold_capacity_bytes": "256MiB", **extra}
    config = server_config(tmp_path, backend=backend, tokens={TOKEN: "default"}, **settings)
    return ServerThread(config)


def http_tiers(handle: ServerHandle) -> dict[str, dict[str, int]]:
    req = urllib.request.Request(
        handle.http_url + "/kv/stats", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        tiers: dict[str, dict[str, int]] = json.load(resp)["tiers"]
    return tiers


@dataclass(frozen=True)
class Srv:
    handle: ServerHandle
    backend: str


@pytest.fixture(params=["durable", "memory"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Srv]:
    with _server(tmp_path, request.param) as handle:
        yield Srv(handle, request.param)


def check_reads(server: Srv, got: list[bytes | None], want: list[bytes]) -> None:
    """Every hit is exact; the durable backend misses nothing, the memory backend (2 MiB
    of hot, no warm) keeps at least the last block."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g is None or g == w
    if server.backend == "durable":
        assert None not in got
    assert got[-1] is not None


def _rounds(n: int, size: int) -> Iterator[list[tuple[str, bytes]]]:
    for r in range(n):
        yield [(f"r{r}-k{i}", os.urandom(size)) for i in range(16)]


def test_http_batch_put_and_get(server: Srv) -> None:
    """The reproduction: the client's put_many / get_many (LMCache's L2 path)."""
    client = EpistemicGraphKVBackend(KvCacheConfig(base_url=server.handle.http_url, token=TOKEN))
    try:
        for items in _rounds(6, 512 * KiB):  # 48 MiB through a 2 MiB hot tier
            client.put_many(items)
            got = client.get_many([k for k, _ in items])
            check_reads(server, got, [v for _, v in items])
            assert over_capacity(http_tiers(server.handle)) == []
    finally:
        client.close()


def test_http_single_put_and_get(server: Srv) -> None:
    client = EpistemicGraphKVBackend(KvCacheConfig(base_url=server.handle.http_url, token=TOKEN))
    try:
        for items in _rounds(3, 512 * KiB):
            for key, value in items:
                client.put(key, value)
            check_reads(server, [client.get(k) for k, _ in items], [v for _, v in items])
            assert over_capacity(http_tiers(server.handle)) == []
    finally:
        client.close()


@pytest.mark.parametrize("size", [64 * KiB, 512 * KiB], ids=["inline", "pooled"])
def test_resp_set_and_get(server: Srv, size: int) -> None:
    """Small SETs start on the event loop (`put_nowait`), large ones on the pool."""
    resp = server.handle.resp
    assert resp is not None
    r = redis.Redis(host="127.0.0.1", port=resp.port, password=TOKEN)
    try:
        for items in _rounds(64 * KiB * 48 // size if size < 512 * KiB else 3, size):
            with r.pipeline(transaction=False) as p:
                for key, value in items:
                    p.set(key, value)
                assert all(p.execute())
            check_reads(server, [r.get(k) for k, _ in items], [v for _, v in items])
            assert over_capacity(http_tiers(server.handle)) == []
    finally:
        r.close()


def test_resp_mset_and_mget(server: Srv) -> None:
    resp = server.handle.resp
    assert resp is not None
    r = redis.Redis(host="127.0.0.1", port=resp.port, password=TOKEN)
    try:
        for items in _rounds(6, 512 * KiB):
            assert r.mset(dict(items))
            check_reads(server, r.mget([k for k, _ in items]), [v for _, v in items])
            assert over_capacity(http_tiers(server.handle)) == []
    finally:
        r.close()


def test_durable_server_with_a_warm_tier(tmp_path: Path) -> None:
    """Batch PUTs through hot into a compressing warm tier: both stay bounded."""
    with _server(tmp_path, "durable", warm_capacity_bytes="2MiB") as handle:
        client = EpistemicGraphKVBackend(KvCacheConfig(base_url=handle.http_url, token=TOKEN))
        try:
            for r in range(6):
                items = [(f"r{r}-k{i}", bf16(r * 100 + i, 512 * KiB)) for i in range(16)]
                client.put_many(items)
                assert client.get_many([k for k, _ in items]) == [v for _, v in items]
                assert over_capacity(http_tiers(handle)) == []
            assert http_tiers(handle)["warm"]["peak_bytes"] > 0  # warm was used
        finally:
            client.close()


# -- the cluster backend's RAM tiers -----------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from redis_cluster import LocalCluster

    with LocalCluster(tmp_path_factory.mktemp("cluster"), masters=3, replicas=0) as c:
        yield c


@pytest.mark.redis
@pytest.mark.parametrize("warm", [0, 1 * MiB], ids=["no-warm", "warm"])
def test_cluster_ram_tiers_stay_within_capacity(cluster: Any, warm: int) -> None:
    """Writes admit their blocks into the front-end's RAM tiers, and reads from the
    cluster admit what they fetched: both through the same bounded admission."""
    from epistemic_kvcache.store.cluster import ClusterBackend

    writer = ClusterBackend(
        cluster.url,
        StoreOptions(
            cluster_key_prefix=f"bounds{warm}",
            cluster_scrub_interval_s=3600,
            hot_capacity_bytes=1 * MiB,
            warm_capacity_bytes=warm,
        ),
    )
    reader = ClusterBackend(
        cluster.url,
        StoreOptions(
            cluster_key_prefix=f"bounds{warm}",
            cluster_scrub_interval_s=3600,
            hot_capacity_bytes=1 * MiB,
            warm_capacity_bytes=warm,
        ),
    )
    try:
        data: dict[str, bytes] = {}
        for r in range(4):
            items = [(f"r{r}-k{i}", bf16(r * 100 + i, 256 * KiB)) for i in range(8)]
            writer.put_many(NS, items)
            data.update(items)
            assert over_capacity(_ram_tiers(writer)) == []
        got = reader.get_many(NS, list(data))
        assert [bytes(g) if g is not None else None for g in got] == list(data.values())
        for key, value in data.items():
            g = reader.get(NS, key)
            assert g is not None
            assert bytes(g) == value
        assert over_capacity(_ram_tiers(reader)) == []
    finally:
        writer.close()
        reader.close()


def _ram_tiers(store: Any) -> dict[str, dict[str, int]]:
    tiers = store.stats(None).tiers
    return {
        name: {"bytes": t.bytes, "peak_bytes": t.peak_bytes, "capacity_bytes": t.capacity_bytes}
        for name, t in tiers.items()
        if name in ("hot", "warm")
    }
