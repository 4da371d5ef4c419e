"""Long keys, compaction, and races found in review: each test failed before its fix."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
from pathlib import Path

import pytest

from epistemic_kvcache.errors import CapacityError, InvalidKeyError, NotFoundError
from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.store import SharedKvIndex, SharedKvStoreBackend
from epistemic_kvcache.store.engine import WOULD_BLOCK, branch_ns

LONG = "p/" + "k" * 1022  # 1024 bytes: the documented maximum


def _durable(path: Path, **kw: int) -> SharedKvStoreBackend:
    return SharedKvStoreBackend(path, StoreOptions(**kw))  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["memory", "durable"])
def test_keys_of_1024_bytes_work_everywhere(tmp_path: Path, backend: str) -> None:
    store = SharedKvIndex() if backend == "memory" else _durable(tmp_path / "s")
    long2 = "p/" + "j" * 1000
    assert store.put("t", LONG, b"a" * 10).created
    assert store.put("t", long2, b"b" * 10).created
    assert store.put("t", "p/short", b"c").created
    assert store.put("t", LONG, b"a" * 10).outcome.value == "duplicate"
    assert store.get("t", LONG) == b"a" * 10
    assert store.pin("t", LONG)
    assert store.unpin("t", LONG)
    assert LONG in store.keys("t")
    by_prefix = store.snapshot_create("t", prefix="p/")
    assert by_prefix.keys == 3
    by_name = store.snapshot_create("t", keys=[LONG])
    assert by_name.keys == 1
    branch = store.branch_create("t", by_prefix.id)
    assert store.branch_put("t", branch.id, LONG, b"zz").created
    if isinstance(store, SharedKvStoreBackend):
        store.close()
        store = _durable(tmp_path / "s")
    assert bytes(store.get("t", LONG) or b"") == b"a" * 10
    assert bytes(store.snapshot_get("t", by_prefix.id, long2) or b"") == b"b" * 10
    assert bytes(store.branch_get("t", branch.id, LONG) or b"") == b"zz"
    assert store.count("t") == 3
    assert store.check(deep=True).ok
    assert store.snapshot_delete("t", by_prefix.id)
    assert store.snapshot_delete("t", by_name.id)
    assert store.delete("t", LONG)
    assert store.check(deep=True).ok
    store.close()


def test_long_key_puts_do_not_fail_other_writers(tmp_path: Path) -> None:
    """A key row longer than LMDB's 511-byte limit once failed whole group commits."""
    store = _durable(tmp_path, hot_capacity_bytes=1 << 20, warm_capacity_bytes=0)
    errors: list[str] = []

    def victim(i: int) -> None:
        try:
            store.put("victim", f"v{i}", os.urandom(2000))
        except Exception as exc:
            errors.append(repr(exc))

    def long_writer(i: int) -> None:
        store.put("attacker", "k" * 1000 + str(i), b"y")

    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        futures = [ex.submit(f, i) for i in range(100) for f in (victim, long_writer)]
    for f in futures:
        f.result()
    assert errors == []
    assert store.count("victim") == 100
    assert store.count("attacker") == 100
    assert store.stats().extra["write_failures"] == 0
    store.close()


def test_too_long_keys_and_scopes_are_refused_clearly(tmp_path: Path) -> None:
    store = _durable(tmp_path)
    with pytest.raises(InvalidKeyError):
        store.put("t", "k" * 1025, b"x")
    with pytest.raises(InvalidKeyError):
        store.put("t", "k", b"x", epoch_scope="s" * 201)
    store.put("t", "k", b"x", epoch_scope="s" * 200)
    assert store.epoch_bump("t" * 256, "s" * 200) == 1  # the longest registry key fits
    store.close()


@pytest.mark.parametrize("backend", ["memory", "durable"])
def test_branch_put_racing_branch_delete_leaves_no_orphan(tmp_path: Path, backend: str) -> None:
    store = (
        SharedKvIndex(StoreOptions(hot_capacity_bytes=256 << 20))
        if backend == "memory"
        else _durable(tmp_path, hot_capacity_bytes=256 << 20, warm_capacity_bytes=0)
    )
    store.put("t", "base", b"x")
    sid = store.snapshot_create("t").id
    bid = store.branch_create("t", sid).id
    big = os.urandom(64 << 20)  # hashing it holds the window open
    outcome: list[object] = []

    def write() -> None:
        try:
            outcome.append(store.branch_put("t", bid, "k", big))
        except NotFoundError as exc:
            outcome.append(exc)

    th = threading.Thread(target=write)
    th.start()
    time.sleep(0.005)  # a delay on purpose: a race, either order must end consistent
    store.branch_delete("t", bid)
    th.join()
    assert store.branch_info("t", bid) is None
    assert not store.ram.ns_len_locked(branch_ns("t", bid)), "the overlay outlived its branch"
    assert store.stats("t").unique_blocks == 1
    assert store.check(deep=True).ok
    with pytest.raises(NotFoundError):
        store.branch_put("t", bid, "k2", b"late")
    store.close()


def _segment_bytes_on_disk(path: Path) -> int:
    total = 0
    for p in (path / "segments").iterdir():
        with contextlib.suppress(FileNotFoundError):  # compaction deleted it meanwhile
            total += p.stat().st_size
    return total


def test_compaction_bounds_disk_use_and_keeps_every_block(tmp_path: Path) -> None:
    store = _durable(
        tmp_path,
        hot_capacity_bytes=0,
        warm_capacity_bytes=0,
        cold_capacity_bytes=4 << 20,
        segment_bytes=1 << 20,
    )
    keep: dict[str, bytes] = {}
    for r in range(30):
        keep[f"keep{r}"] = os.urandom(100)
        store.put("t", f"keep{r}", keep[f"keep{r}"])
        for i in range(15):
            store.put("t", f"tmp{r}-{i}", os.urandom(64 << 10))
        for i in range(15):
            store.delete("t", f"tmp{r}-{i}")
    deadline = time.monotonic() + 10
    while _segment_bytes_on_disk(tmp_path) > 2 << 20 and time.monotonic() < deadline:
        time.sleep(0.1)  # the committer compacts while idle
    assert _segment_bytes_on_disk(tmp_path) <= 2 << 20
    assert store.stats().extra["compactions"] > 0
    assert all(bytes(store.get("t", k) or b"") == v for k, v in keep.items())
    assert store.check(deep=True).ok
    store.close()
    store = _durable(tmp_path, segment_bytes=1 << 20)
    assert all(bytes(store.get("t", k) or b"") == v for k, v in keep.items())
    assert store.check(deep=True).ok
    store.close()


def test_reads_stay_correct_while_compaction_moves_blocks(tmp_path: Path) -> None:
    store = _durable(tmp_path, hot_capacity_bytes=0, warm_capacity_bytes=0, segment_bytes=1 << 20)
    live = {f"live{i}": os.urandom(3000 + i) for i in range(60)}
    for i, (k, v) in enumerate(live.items()):
        store.put("t", k, v)
        for j in range(4):
            store.put("t", f"dead{i}-{j}", os.urandom(60_000))
    stop = threading.Event()
    bad: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            for k, v in live.items():
                got = store.get("t", k)
                if got is None or bytes(got) != v:
                    bad.append(k)

    readers = [threading.Thread(target=reader) for _ in range(3)]
    for th in readers:
        th.start()
    for i in range(60):
        for j in range(4):
            store.delete("t", f"dead{i}-{j}")
    deadline = time.monotonic() + 10
    while store.stats().extra["compactions"] < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    for th in readers:
        th.join()
    assert store.stats().extra["compactions"] >= 3
    assert bad == []
    assert store.stats().integrity_failures == 0
    assert store.check(deep=True).ok
    store.close()


def test_get_nowait_never_reads_below_ram(tmp_path: Path) -> None:
    store = _durable(tmp_path, hot_capacity_bytes=1 << 20, warm_capacity_bytes=0)
    store.put("t", "k", b"v" * 100)
    assert store.get_nowait("t", "k") == b"v" * 100
    assert store.evict("t", "k")
    assert store.get_nowait("t", "k") is WOULD_BLOCK
    assert store.get("t", "k") == b"v" * 100  # the worker-thread path reads the disk
    store.close()


@pytest.mark.parametrize("backend", ["memory", "durable"])
def test_one_tenant_cannot_pin_the_store_full(tmp_path: Path, backend: str) -> None:
    """Pins and snapshots count against a per-tenant quota (half the capacity by default),
    so another tenant's PUTs still find room."""
    caps = {"hot_capacity_bytes": 1 << 20, "warm_capacity_bytes": 0}
    store = (
        SharedKvIndex(StoreOptions(**caps, max_snapshots_per_tenant=3))
        if backend == "memory"
        else _durable(
            tmp_path,
            **caps,
            cold_capacity_bytes=(1 << 20) + (288 << 10),  # ~1 MiB live + the log's reserve
            segment_bytes=64 << 10,
            max_snapshots_per_tenant=3,
        )
    )
    block = 100 << 10
    for i in range(8):
        store.put("greedy", f"k{i}", os.urandom(block))
    for i in range(5):  # 500 KiB of 1 MiB: within the 50% share
        assert store.pin("greedy", f"k{i}")
    with pytest.raises(CapacityError, match="pin quota"):
        store.pin("greedy", "k5")
    assert store.pin("greedy", "k0")  # pinning an already-pinned block costs nothing
    with pytest.raises(CapacityError, match="pin quota"):
        store.snapshot_create("greedy")  # k5..k7 would add 300 KiB
    store.snapshot_create("greedy", keys=["k0", "k1"])  # already pinned: no new bytes
    store.snapshot_create("greedy", keys=["nothing"])
    store.snapshot_create("greedy", keys=["nothing"])
    with pytest.raises(CapacityError, match="snapshot quota"):
        store.snapshot_create("greedy", keys=["nothing"])
    # another tenant still has room to write (the greedy tenant's unpinned blocks go)
    # (three blocks: the live capacity is 1 MiB less the log's compaction reserve)
    for i in range(3):
        store.put("other", f"o{i}", os.urandom(block))
    assert all(store.exists("other", f"o{i}") for i in range(3))
    assert store.stats("greedy").pinned_blocks == 5
    assert store.check(deep=True).ok
    store.close()


@pytest.mark.parametrize("backend", ["memory", "durable"])
def test_per_tenant_key_and_epoch_scope_quotas(tmp_path: Path, backend: str) -> None:
    """A tenant at its own limit gets its own error; other tenants do not notice."""
    from epistemic_kvcache.errors import QuotaExceededError

    opts = {"max_keys_per_tenant": 5, "max_epoch_scopes_per_tenant": 3}
    store = (
        SharedKvIndex(StoreOptions(**opts))
        if backend == "memory"
        else _durable(tmp_path, map_size_bytes=64 << 20, **opts)
    )
    for i in range(5):
        store.put("greedy", f"k{i}", b"x%d" % i)
    with pytest.raises(QuotaExceededError, match="key quota") as exc:
        store.put("greedy", "k5", b"y")
    assert exc.value.resource == "keys"
    assert store.put("greedy", "k0", b"replaced").outcome.value == "replaced"  # no new key
    store.put("other", "k0", b"fine")  # another tenant is not affected
    assert store.delete("greedy", "k1")
    store.put("greedy", "k5", b"now it fits")
    # epoch scopes: three per tenant; at the limit, scopes no live entry uses are pruned
    assert store.delete("greedy", "k4")
    store.put("greedy", "tagged", b"t", epoch_scope="s0")
    for scope in ("s0", "s1", "s2"):
        store.epoch_bump("greedy", scope)
    store.epoch_bump("greedy", "s3")  # s1 and s2 tag nothing: pruned to make room
    assert store.epoch_get("greedy", "s3") == 1
    store.put("greedy", "k2", b"in s3", epoch_scope="s3")
    store.put("greedy", "k3", b"in s4", epoch_scope="s4")
    store.epoch_bump("greedy", "s4")  # s0, s3, s4: each tags a live entry
    with pytest.raises(QuotaExceededError, match="epoch scope") as exc:
        store.epoch_bump("greedy", "s5")
    assert exc.value.resource == "epoch_scopes"
    assert store.epoch_bump("other", "s5") == 1  # the other tenant's own share
    store.close()


@pytest.mark.parametrize("backend", ["memory", "durable"])
def test_quotas_hold_under_concurrent_requests(tmp_path: Path, backend: str) -> None:
    """Snapshot and pin quotas are checked atomically with the commit: concurrent
    requests cannot all pass a check made before any of them is committed."""
    from epistemic_kvcache.errors import CapacityError

    store = (
        SharedKvIndex(
            StoreOptions(
                hot_capacity_bytes=64 << 20, warm_capacity_bytes=0, max_snapshots_per_tenant=5
            )
        )
        if backend == "memory"
        else _durable(
            tmp_path,
            hot_capacity_bytes=64 << 20,
            cold_capacity_bytes=(64 << 20) + (16 << 20),
            segment_bytes=4 << 20,
            max_snapshots_per_tenant=5,
            map_size_bytes=64 << 20,
        )
    )
    block = 1 << 20
    for i in range(48):
        store.put("t", f"k{i}", os.urandom(block))
    barrier = threading.Barrier(20)

    def snap(i: int) -> bool:
        barrier.wait()
        try:
            store.snapshot_create("t", keys=[f"k{i}"])
            return True
        except CapacityError:
            return False

    with concurrent.futures.ThreadPoolExecutor(20) as ex:
        made = sum(ex.map(snap, range(20)))
    assert made == 5
    assert len(store.snapshot_list("t")) == 5
    for s in store.snapshot_list("t"):
        store.snapshot_delete("t", s.id)
    limit = int(store.ram.pin_capacity() * store.options.max_pinned_fraction)  # type: ignore[attr-defined]
    barrier = threading.Barrier(40)

    def pin(i: int) -> bool:
        barrier.wait()
        try:
            return store.pin("t", f"k{i}")
        except CapacityError:
            return False

    with concurrent.futures.ThreadPoolExecutor(40) as ex:
        pinned = sum(ex.map(pin, range(40)))
    assert pinned == limit // block
    assert store.stats("t").pinned_blocks * block <= limit
    store.close()
