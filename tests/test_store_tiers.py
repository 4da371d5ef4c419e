"""Tier movement and accounting: hot -> warm -> cold, pins, cold eviction, exact stats.

Capacities are a few hundred KiB to a few MiB so that every movement happens with a
handful of blocks. bf16-shaped data (normal values truncated to bfloat16) compresses in
warm; random bytes do not. Stats are compared with a recount made from `iter_refs()`,
`size()` and the engine's own tier dictionaries, also after 16 threads of mixed traffic.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from epistemic_kvcache.errors import CapacityError
from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.store import (
    PutOutcome,
    SharedKvIndex,
    SharedKvStoreBackend,
)
from epistemic_kvcache.store.engine import TieredEngine

KiB, MiB = 1 << 10, 1 << 20
NS = "tenant"


def bf16(seed: int, size: int = 256 * KiB) -> bytes:
    vals = np.random.default_rng(seed).standard_normal(size // 2).astype(np.float32)
    return (vals.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def rnd(seed: int, size: int = 256 * KiB) -> bytes:
    return np.random.default_rng(seed + 1_000_000).bytes(size)


def durable(path: Path, **kw: Any) -> SharedKvStoreBackend:
    return SharedKvStoreBackend(path, StoreOptions(map_size_bytes=64 * MiB, **kw))


def recount(store: TieredEngine, ns: str | None) -> dict[str, int]:
    """Stats of `ns` (or of the store) recomputed from the index and the tier contents."""
    sizes: dict[bytes, int] = {}
    refs = logical = 0
    for rns, key, digest in store.iter_refs():
        if ns is not None and rns != ns:
            continue
        size = store.size(rns, key)
        assert size is not None
        refs += 1
        logical += size
        # a blob is per namespace unless dedup is global
        ident = digest if store.options.dedup_scope == "global" else rns.encode() + b"\0" + digest
        sizes[ident] = size
    with store.ram.lock:
        blobs = [
            b
            for b in store.ram.blob_list_locked()
            if ns is None or ns in {r[0] for r in b.key_refs()}
        ]
        hot = [b for b in store.ram.tiers.hot.values() if b in blobs]
        warm = [b for b in store.ram.tiers.warm.values() if b in blobs]
        out = {
            "total_refs": refs,
            "logical_bytes": logical,
            "unique_blocks": len(sizes),
            "resident_bytes": sum(sizes.values()),
            "pinned_blocks": sum(1 for b in blobs if b.pins),
            "hot_blocks": len(hot),
            "hot_bytes": sum(len(b.hot) for b in hot),
            "warm_blocks": len(warm),
            "warm_bytes": sum(len(b.warm) for b in warm),
            "warm_logical": sum(b.size for b in warm),
            "cold_blocks": sum(1 for b in blobs if b.seg >= 0),
            "cold_bytes": sum(b.size for b in blobs if b.seg >= 0),
        }
    assert out["unique_blocks"] == len(blobs)
    return out


def reported(store: TieredEngine, ns: str | None) -> dict[str, int]:
    s = store.stats(ns)
    out = {
        "total_refs": s.total_refs,
        "logical_bytes": s.logical_bytes,
        "unique_blocks": s.unique_blocks,
        "resident_bytes": s.resident_bytes,
        "pinned_blocks": s.pinned_blocks,
        "hot_blocks": s.tiers["hot"].blocks,
        "hot_bytes": s.tiers["hot"].bytes,
        "warm_blocks": s.tiers["warm"].blocks,
        "warm_bytes": s.tiers["warm"].bytes,
        "warm_logical": s.tiers["warm"].logical_bytes,
        "cold_blocks": s.tiers["cold"].blocks if "cold" in s.tiers else 0,
        "cold_bytes": s.tiers["cold"].bytes if "cold" in s.tiers else 0,
    }
    assert s.dedup_savings_bytes == s.logical_bytes - s.resident_bytes
    return out


def assert_exact(store: TieredEngine, namespaces: list[str]) -> None:
    for ns in [*namespaces, None]:
        assert reported(store, ns) == recount(store, ns), ns
    report = store.check(deep=True)
    assert report.ok, report


def assert_within_capacity(store: TieredEngine) -> None:
    s = store.stats(None)
    for name, tier in s.tiers.items():
        assert tier.bytes <= tier.capacity_bytes, (name, tier)


# -- memory backend ----------------------------------------------------------------------
def test_memory_demotes_to_compressed_warm_and_promotes_on_get() -> None:
    store = SharedKvIndex(StoreOptions(hot_capacity_bytes=1 * MiB, warm_capacity_bytes=2 * MiB))
    data = {f"k{i}": bf16(i) for i in range(8)}  # 2 MiB logical
    for key, value in data.items():
        assert store.put(NS, key, value).outcome is PutOutcome.NEW
    s = store.stats(NS)
    assert s.tiers["hot"].blocks == 4
    assert s.tiers["warm"].blocks == 4
    assert s.demotions == 4
    assert s.evictions == 0
    assert s.unique_blocks == 8
    assert s.resident_bytes == 2 * MiB
    ratio = s.tiers["warm"].compression_ratio
    assert 0.5 < ratio < 0.9, ratio  # bf16: the exponent byte compresses, the mantissa not
    assert_within_capacity(store)
    assert_exact(store, [NS])

    cold_key = next(k for k in data if _in(store.ram.tiers.warm, store, k))
    got = store.get(NS, cold_key)
    assert got is not None
    assert bytes(got) == data[cold_key]
    s2 = store.stats(NS)
    assert s2.promotions == 1
    assert s2.demotions == 5  # promoting one pushed another hot block down
    assert _in(store.ram.tiers.hot, store, cold_key)
    assert (s2.tiers["hot"].blocks, s2.tiers["warm"].blocks) == (4, 4)
    for key, value in data.items():  # everything still reads back bit-exact
        got = store.get(NS, key)
        assert got is not None
        assert bytes(got) == value
    assert_within_capacity(store)
    assert_exact(store, [NS])


def _in(tier: Any, store: TieredEngine, key: str) -> bool:
    b = store.ram.lookup_locked(NS, key)
    return b is not None and b.sdig in tier


def test_memory_incompressible_blocks_stay_raw_and_overflow_evicts() -> None:
    store = SharedKvIndex(StoreOptions(hot_capacity_bytes=1 * MiB, warm_capacity_bytes=1 * MiB))
    for i in range(16):  # 4 MiB of random bytes through 2 MiB of RAM
        store.put(NS, f"k{i}", rnd(i))
    s = store.stats(NS)
    assert s.tiers["warm"].compression_ratio == 1.0  # kept raw: compression not worth it
    assert s.evictions == 8
    assert s.total_refs == 8
    assert store.count(NS) == 8
    gone = [i for i in range(16) if not store.exists(NS, f"k{i}")]
    assert len(gone) == 8
    assert store.get(NS, f"k{gone[0]}") is None
    for i in set(range(16)) - set(gone):
        got = store.get(NS, f"k{i}")
        assert got is not None
        assert bytes(got) == rnd(i)
    assert_within_capacity(store)
    assert_exact(store, [NS])


def test_memory_pinned_blocks_are_never_evicted_and_full_pins_refuse_puts() -> None:
    store = SharedKvIndex(
        StoreOptions(
            hot_capacity_bytes=1 * MiB, warm_capacity_bytes=1 * MiB, max_pinned_fraction=1.0
        )
    )
    for i in range(2):
        store.put(NS, f"pin{i}", rnd(100 + i))
        assert store.pin(NS, f"pin{i}")
    for i in range(24):  # heavy churn around the pinned blocks
        store.put(NS, f"k{i}", rnd(i))
    for i in range(2):
        got = store.get(NS, f"pin{i}")
        assert got is not None
        assert bytes(got) == rnd(100 + i)
        assert _in(store.ram.tiers.hot, store, f"pin{i}")  # pinned blocks are not even demoted
    assert not store.evict(NS, "pin0")
    assert store.stats(NS).pinned_blocks == 2
    assert_exact(store, [NS])

    for i in range(6):  # pin 2 MiB in all: the whole RAM budget
        store.put(NS, f"pin{2 + i}", rnd(102 + i))
        assert store.pin(NS, f"pin{2 + i}")
    with pytest.raises(CapacityError):
        store.put(NS, "one-more", rnd(999))
    assert not store.exists(NS, "one-more")
    assert store.count(NS) == 8
    assert store.unpin(NS, "pin7")
    assert store.put(NS, "one-more", rnd(999)).outcome is PutOutcome.NEW
    assert store.exists(NS, "one-more")
    for i in range(7):
        assert store.exists(NS, f"pin{i}")
    assert_exact(store, [NS])


# -- durable backend ---------------------------------------------------------------------
def test_durable_tiers_hot_warm_cold_and_promotion(tmp_path: Path) -> None:
    store = durable(
        tmp_path,
        hot_capacity_bytes=512 * KiB,
        warm_capacity_bytes=512 * KiB,
        cold_capacity_bytes=8 * MiB,
    )
    data = {f"k{i}": bf16(i) for i in range(8)}
    for key, value in data.items():
        store.put(NS, key, value)
    s = store.stats(NS)
    assert s.tiers["cold"].blocks == 8  # every block is on disk
    assert s.tiers["cold"].bytes == 2 * MiB
    assert s.tiers["hot"].blocks == 2
    assert 1 <= s.tiers["warm"].blocks <= 2  # compressed ~0.76: two fit in 512 KiB
    assert s.tiers["warm"].compression_ratio < 0.9
    assert s.demotions >= 6  # hot -> warm, and warm -> out of RAM
    assert s.evictions == 0
    assert_within_capacity(store)
    assert_exact(store, [NS])
    # a block that is only on disk comes back through the read path, verified
    disk_only = [
        k
        for k in data
        if not _in(store.ram.tiers.hot, store, k) and not _in(store.ram.tiers.warm, store, k)
    ]
    assert disk_only
    before = store.stats(NS).promotions
    got = store.get(NS, disk_only[0])
    assert got is not None
    assert bytes(got) == data[disk_only[0]]
    assert store.stats(NS).promotions == before + 1
    assert _in(store.ram.tiers.hot, store, disk_only[0])
    assert_within_capacity(store)
    assert_exact(store, [NS])
    store.close()
    store = durable(tmp_path, hot_capacity_bytes=512 * KiB, warm_capacity_bytes=512 * KiB)
    try:
        s = store.stats(NS)
        assert (s.tiers["hot"].blocks, s.tiers["warm"].blocks, s.tiers["cold"].blocks) == (0, 0, 8)
        for key, value in data.items():
            got = store.get(NS, key)
            assert got is not None
            assert bytes(got) == value
        assert_within_capacity(store)
        assert_exact(store, [NS])
    finally:
        store.close()


def test_durable_cold_full_deletes_least_valuable_unpinned(tmp_path: Path) -> None:
    # 4 MiB of live blocks, plus the reserve the log keeps for compaction (two segments)
    opts = {"cold_capacity_bytes": 4 * MiB + 768 * KiB, "segment_bytes": 256 * KiB}
    store = durable(tmp_path, hot_capacity_bytes=256 * KiB, warm_capacity_bytes=256 * KiB, **opts)
    assert store.live_capacity_bytes == 4 * MiB
    for i in range(16):  # exactly fills cold
        store.put(NS, f"k{i}", rnd(i))
    assert store.stats(NS).evictions == 0
    assert store.pin(NS, "k0")  # oldest, but pinned
    got = store.get(NS, "k1")  # oldest unpinned, but just used
    assert got is not None
    store.put(NS, "k16", rnd(16))  # needs one block of room: k2 is the least valuable
    assert not store.exists(NS, "k2")
    assert store.exists(NS, "k0")
    assert store.exists(NS, "k1")
    assert store.stats(NS).evictions == 1
    assert store.stats(NS).tiers["cold"].bytes == 4 * MiB
    store.put(NS, "big", rnd(77, 1 * MiB))  # four more blocks go: k3..k6
    assert [i for i in range(17) if not store.exists(NS, f"k{i}")] == [2, 3, 4, 5, 6]
    assert store.stats(NS).evictions == 5
    assert_within_capacity(store)
    assert_exact(store, [NS])
    store.close()
    store = durable(tmp_path, **opts)
    try:
        assert store.count(NS) == 13
        assert_exact(store, [NS])
    finally:
        store.close()


def test_durable_cold_full_of_pinned_blocks_refuses_puts(tmp_path: Path) -> None:
    store = durable(
        tmp_path,
        hot_capacity_bytes=256 * KiB,
        warm_capacity_bytes=0,
        cold_capacity_bytes=2 * MiB + 512 * KiB,  # 2 MiB live + the log's reserve
        segment_bytes=128 * KiB,
        max_pinned_fraction=1.0,  # one tenant may pin it all: the store must still refuse
    )
    assert store.live_capacity_bytes == 2 * MiB
    for i in range(8):
        store.put(NS, f"p{i}", rnd(i))
        assert store.pin(NS, f"p{i}")
    with pytest.raises(CapacityError):
        store.put(NS, "x", rnd(100))
    assert not store.exists(NS, "x")
    assert store.get(NS, "x") is None
    # a PUT of bytes already stored needs no room
    assert store.put(NS, "twin", rnd(3)).outcome is PutOutcome.NEW
    for i in range(8):
        got = store.get(NS, f"p{i}")
        assert got is not None
        assert bytes(got) == rnd(i)
    assert store.unpin(NS, "p5")
    assert store.put(NS, "x", rnd(100)).outcome is PutOutcome.NEW
    assert not store.exists(NS, "p5")  # the only unpinned block made room
    assert store.stats(NS).evictions == 1
    assert_exact(store, [NS])
    store.close()


# -- stats under concurrency, tenant isolation, group commit ----------------------------
@pytest.mark.parametrize("backend", ["memory", "durable"])
@pytest.mark.parametrize("scope", ["namespace", "global"])
def test_stats_exact_under_concurrency(tmp_path: Path, backend: str, scope: str) -> None:
    caps = {"hot_capacity_bytes": 1 * MiB, "warm_capacity_bytes": 1 * MiB}
    store: TieredEngine
    if backend == "memory":
        store = SharedKvIndex(StoreOptions(dedup_scope=scope, **caps))  # type: ignore[arg-type]
    else:
        store = durable(tmp_path, dedup_scope=scope, cold_capacity_bytes=3 * MiB, **caps)
    namespaces = ["a", "b", "c"]
    contents = [bf16(i, 64 * KiB) for i in range(12)] + [rnd(i, 96 * KiB) for i in range(12)]
    keys = [f"key{i}" for i in range(40)]
    counts: list[Counter[str]] = [Counter() for _ in range(16)]
    errors: list[BaseException] = []

    def worker(tid: int) -> None:
        rng = random.Random(tid)
        c = counts[tid]
        try:
            for _ in range(120):
                ns, key = rng.choice(namespaces), rng.choice(keys)
                r = rng.random()
                if r < 0.5:
                    res = store.put(ns, key, rng.choice(contents))
                    c[f"{ns}:{res.outcome.value}"] += 1
                elif r < 0.85:
                    got = store.get(ns, key)
                    c[f"{ns}:get"] += 1
                    if got is not None:
                        assert bytes(got) in contents
                elif r < 0.95:
                    store.delete(ns, key)
                elif r < 0.98:
                    if store.pin(ns, key):
                        store.unpin(ns, key)
                else:
                    store.evict(ns, key)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    total: Counter[str] = sum(counts, Counter())
    for ns in namespaces:
        s = store.stats(ns)
        assert s.put_new == total[f"{ns}:new"]
        assert s.put_replaced == total[f"{ns}:replaced"]
        assert s.put_conflicts == total[f"{ns}:conflict"] == 0
        assert total[f"{ns}:duplicate"] <= s.dedup_hits
        assert s.dedup_hits <= (
            total[f"{ns}:duplicate"] + total[f"{ns}:new"] + total[f"{ns}:replaced"]
        )
        assert s.get_hits + s.get_misses == total[f"{ns}:get"]
    s = store.stats(None)
    assert s.put_new == sum(v for k, v in total.items() if k.endswith(":new"))
    assert s.get_hits + s.get_misses == sum(v for k, v in total.items() if k.endswith(":get"))
    assert s.integrity_failures == 0
    assert_within_capacity(store)
    assert_exact(store, namespaces)
    if backend == "durable":
        assert s.demotions > 0
        print(f"{scope}: {s.evictions} cold evictions, {s.demotions} demotions")
        store.close()
        store = durable(tmp_path, dedup_scope=scope, cold_capacity_bytes=3 * MiB, **caps)
        assert_exact(store, namespaces)
    store.close()


@pytest.mark.parametrize("backend", ["memory", "durable"])
def test_tenant_stats_are_isolated_in_namespace_scope(tmp_path: Path, backend: str) -> None:
    store: TieredEngine = SharedKvIndex() if backend == "memory" else durable(tmp_path)
    block = bf16(1, 64 * KiB)
    store.put("alice", "k1", block)
    store.put("alice", "k2", block)  # dedup inside alice's namespace
    before = store.stats("alice")
    r = store.put("bob", "k1", block)  # same bytes, other tenant: stored again
    assert r.outcome is PutOutcome.NEW
    store.get("bob", "k1")
    store.get("bob", "nope")
    store.delete("bob", "k1")
    after = store.stats("alice")
    assert after == before, "another tenant's traffic changed alice's stats"
    assert (after.unique_blocks, after.total_refs, after.dedup_hits) == (1, 2, 1)
    assert after.dedup_savings_bytes == 64 * KiB
    bob = store.stats("bob")
    assert (bob.put_new, bob.dedup_hits, bob.dedup_savings_bytes) == (1, 0, 0)
    assert (bob.get_hits, bob.get_misses, bob.unique_blocks) == (1, 1, 0)
    assert store.stats("nobody").to_dict() == store.stats("never-seen").to_dict()
    assert store.stats("nobody").unique_blocks == 0
    assert store.stats(None).put_new == 3
    assert_exact(store, ["alice", "bob"])
    store.close()


def test_global_scope_shares_blocks_across_namespaces(tmp_path: Path) -> None:
    store = durable(tmp_path, dedup_scope="global")
    block = rnd(5, 64 * KiB)
    store.put("alice", "k", block)
    assert store.put("bob", "k", block).outcome is PutOutcome.NEW
    assert store.stats(None).unique_blocks == 1
    assert store.stats(None).resident_bytes == 64 * KiB
    for ns in ("alice", "bob"):
        s = store.stats(ns)
        assert (s.unique_blocks, s.resident_bytes) == (1, 64 * KiB)
    assert store.stats("bob").dedup_hits == 1
    assert store.delete("alice", "k")
    got = store.get("bob", "k")
    assert got is not None
    assert bytes(got) == block
    assert store.stats("alice").unique_blocks == 0
    assert_exact(store, ["alice", "bob"])
    store.close()


def test_group_commit_batches_concurrent_writers(tmp_path: Path) -> None:
    store = durable(tmp_path)
    base = store.stats(None).extra
    n_threads, per_thread = 16, 8
    barrier = threading.Barrier(n_threads)
    errors: list[BaseException] = []

    def writer(tid: int) -> None:
        try:
            barrier.wait()
            for i in range(per_thread):
                store.put(NS, f"t{tid}-{i}", rnd(tid * 100 + i, 64 * KiB))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    extra = store.stats(None).extra
    puts = n_threads * per_thread
    fsyncs = extra["fsyncs"] - base["fsyncs"]
    batches = extra["commit_batches"] - base["commit_batches"]
    print(f"{puts} PUTs: {batches} group commits, {fsyncs / puts:.2f} fsyncs per PUT")
    assert fsyncs / puts < 1.0, "concurrent PUTs did not share their syncs"
    assert batches < puts / 2
    # put_many queues everything before waiting: one or two commits for 32 blocks
    before = store.stats(None).extra["commit_batches"]
    store.put_many(NS, [(f"m{i}", rnd(5000 + i, 16 * KiB)) for i in range(32)])
    assert store.stats(None).extra["commit_batches"] - before <= 2
    assert store.count(NS) == puts + 32
    assert store.check(deep=True).ok
    store.close()


# -- the warm codec: large blocks in bounded slices ---------------------------------------


@pytest.mark.parametrize(
    "size", [4096, 4 * MiB - 2, 4 * MiB, 4 * MiB + 2, 3 * 4 * MiB + 6 * KiB, 9 * MiB + 2]
)
def test_warm_codec_round_trips_in_slices(size: int) -> None:
    """blosc2 holds the GIL for a whole call (a 128 MiB block: 0.3-1.3 s to compress,
    0.25-0.45 s to decompress here, every other client stalled); a block is compressed
    and decompressed in independent chunks of at most SLICE_BYTES, one call each."""
    from epistemic_kvcache.store.codec import SLICE_BYTES, WarmCodec, _chunks

    codec = WarmCodec(max_ratio=1.0)
    data = bf16(size, size + size % 2)[:size]
    comp = codec.compress(data)
    assert comp is not None
    chunks = _chunks(comp)
    assert len(chunks) == -(-size // SLICE_BYTES)
    assert all(nbytes <= SLICE_BYTES for _off, _cbytes, nbytes in chunks)
    assert sum(nbytes for _off, _cbytes, nbytes in chunks) == size
    assert bytes(codec.decompress(comp)) == data


def test_warm_codec_refuses_damaged_and_not_worth_it_frames() -> None:
    from epistemic_kvcache.store.codec import WarmCodec

    codec = WarmCodec()
    assert codec.compress(rnd(1, 9 * MiB)) is None  # random bytes: not worth it
    comp = codec.compress(bf16(2, 9 * MiB))
    assert comp is not None
    for bad in (
        comp[:-1],  # the last chunk cut short
        comp[:10],  # a header cut short
        comp[:12] + (10**9).to_bytes(4, "little") + comp[16:],  # a chunk size past the end
        b"",
    ):
        with pytest.raises(ValueError, match="damaged warm-tier frame"):
            codec.decompress(bad)


def test_large_blocks_demote_to_warm_and_come_back(tmp_path: Path) -> None:
    """A 9 MiB block (three slices) through warm in both backends, bytes exact."""
    block = bf16(7, 9 * MiB)
    for store in (
        SharedKvIndex(StoreOptions(hot_capacity_bytes=10 * MiB, warm_capacity_bytes=64 * MiB)),
        durable(tmp_path / "d", hot_capacity_bytes=10 * MiB, warm_capacity_bytes=64 * MiB),
    ):
        try:
            store.put("t", "big", block)
            store.put("t", "push", bf16(8, 9 * MiB))  # hot holds one: "big" goes to warm
            deadline = time.monotonic() + 10
            while store.stats("t").tiers["warm"].blocks == 0:
                assert time.monotonic() < deadline, "nothing was demoted to warm"
                time.sleep(0.01)
            assert bytes(store.get("t", "big")) == block
            assert store.stats("t").integrity_failures == 0
        finally:
            store.close()
