"""Snapshots and branches on both store backends, in both dedup scopes.

A snapshot is a set of `key -> digest` references in an internal namespace; a branch is
an overlay namespace over it. These tests check what that must mean for a user: reads as
of the snapshot survive anything done to the live keys, branch writes are invisible
everywhere but in their own branch, deleting frees exactly the blocks nobody else
references, snapshot blocks are pinned, TTLs expire, tenants are isolated, durable
snapshots survive reopen and SIGKILL, and a fork copies zero bytes. A Hypothesis state
machine checks the isolation properties against a dict model.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import blake3
import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from epistemic_kvcache.errors import CapacityError, NotFoundError
from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.store import PutOutcome, SharedKvBackend, SharedKvIndex, SharedKvStoreBackend
from helpers import FakeClock

SRC = str(Path(__file__).resolve().parent.parent / "src")
NS = "tenant-a"
OTHER = "tenant-b"


def blob(label: str, size: int = 4096) -> bytes:
    """Deterministic incompressible bytes (so the warm tier cannot shrink them)."""
    return blake3.blake3(label.encode()).digest(length=size)


Opener = Callable[..., SharedKvBackend]


@pytest.fixture(params=["memory", "durable"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=["namespace", "global"])
def scope(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def opener(backend: str, scope: str, tmp_path: Path) -> Iterator[Opener]:
    """Opens a store of the parametrized kind; the durable one always in the same dir."""
    opened: list[SharedKvBackend] = []

    def open_store(*, clock: Callable[[], float] = time.time, **options: Any) -> SharedKvBackend:
        store: SharedKvBackend
        if backend == "memory":
            store = SharedKvIndex(StoreOptions(dedup_scope=scope, **options), clock=clock)  # type: ignore[arg-type]
        else:
            options.setdefault("map_size_bytes", 256 << 20)
            options.setdefault("segment_bytes", 16 << 20)
            opts = StoreOptions(dedup_scope=scope, **options)  # type: ignore[arg-type]
            store = SharedKvStoreBackend(tmp_path / "store", opts, clock=clock)
        opened.append(store)
        return store

    yield open_store
    for store in opened:
        store.close()


@pytest.fixture
def store(opener: Opener) -> SharedKvBackend:
    return opener()


def fill(store: SharedKvBackend, ns: str, items: dict[str, bytes]) -> None:
    for key, data in items.items():
        assert store.put(ns, key, data).created


# -- capture -------------------------------------------------------------------------------


def test_snapshot_of_explicit_keys_skips_absent_ones(store: SharedKvBackend) -> None:
    fill(store, NS, {"a": blob("a"), "b": blob("b"), "c": blob("c")})
    info = store.snapshot_create(NS, keys=["a", "c", "missing", "a"])
    assert (info.ns, info.keys, info.logical_bytes) == (NS, 2, 2 * 4096)
    assert info.expires_at is None
    assert bytes(store.snapshot_get(NS, info.id, "a") or b"") == blob("a")
    assert bytes(store.snapshot_get(NS, info.id, "c") or b"") == blob("c")
    assert store.snapshot_get(NS, info.id, "b") is None
    assert store.snapshot_get(NS, info.id, "missing") is None
    assert store.snapshot_info(NS, info.id) == info
    assert [s.id for s in store.snapshot_list(NS)] == [info.id]


def test_snapshot_of_a_prefix(store: SharedKvBackend) -> None:
    fill(store, NS, {"model@1": blob("1"), "model@2": blob("2"), "other": blob("o")})
    fill(store, OTHER, {"model@9": blob("9")})
    info = store.snapshot_create(NS, prefix="model@")
    assert info.keys == 2
    assert store.snapshot_get(NS, info.id, "model@2") is not None
    assert store.snapshot_get(NS, info.id, "other") is None
    assert store.snapshot_get(NS, info.id, "model@9") is None
    # keys and prefix together: only the listed keys with the prefix
    both = store.snapshot_create(NS, keys=["model@1", "other"], prefix="model@")
    assert both.keys == 1


def test_snapshot_of_the_whole_namespace(store: SharedKvBackend) -> None:
    items = {f"k{i}": blob(f"k{i}", 100 + i) for i in range(20)}
    fill(store, NS, items)
    fill(store, OTHER, {"k0": blob("elsewhere")})
    info = store.snapshot_create(NS)
    assert info.keys == 20
    assert info.logical_bytes == sum(len(v) for v in items.values())
    for key, data in items.items():
        assert bytes(store.snapshot_get(NS, info.id, key) or b"") == data
    empty = store.snapshot_create("nobody-home")
    assert empty.keys == 0


def test_snapshot_reads_survive_delete_and_overwrite(store: SharedKvBackend) -> None:
    fill(store, NS, {"a": blob("a"), "b": blob("b")})
    sid = store.snapshot_create(NS).id
    assert store.delete(NS, "a")
    assert store.delete(NS, "b")
    assert store.put(NS, "b", blob("b2")).created
    assert store.get(NS, "a") is None
    assert bytes(store.get(NS, "b") or b"") == blob("b2")
    assert bytes(store.snapshot_get(NS, sid, "a") or b"") == blob("a")
    assert bytes(store.snapshot_get(NS, sid, "b") or b"") == blob("b")
    assert store.check(deep=True).ok


# -- branches ------------------------------------------------------------------------------


def test_branch_reads_fall_through_and_writes_stay_in_the_overlay(store: SharedKvBackend) -> None:
    fill(store, NS, {"a": blob("a"), "b": blob("b")})
    sid = store.snapshot_create(NS).id
    b1 = store.branch_create(NS, sid)
    b2 = store.branch_create(NS, sid)
    assert (b1.snapshot_id, b1.private_keys, b1.private_bytes, b1.shared_bytes) == (
        sid,
        0,
        0,
        2 * 4096,
    )
    assert bytes(store.branch_get(NS, b1.id, "a") or b"") == blob("a")
    assert store.branch_size(NS, b1.id, "a") == 4096

    assert store.branch_put(NS, b1.id, "a", blob("a-b1")).created  # shadows the snapshot
    assert store.branch_put(NS, b1.id, "new", blob("new-b1", 100)).created
    assert store.branch_put(NS, b2.id, "new", blob("new-b2", 200)).created

    assert bytes(store.branch_get(NS, b1.id, "a") or b"") == blob("a-b1")
    assert bytes(store.branch_get(NS, b1.id, "new") or b"") == blob("new-b1", 100)
    assert store.branch_size(NS, b1.id, "new") == 100
    assert bytes(store.branch_get(NS, b2.id, "a") or b"") == blob("a")  # sibling unaffected
    assert bytes(store.branch_get(NS, b2.id, "new") or b"") == blob("new-b2", 200)
    assert bytes(store.snapshot_get(NS, sid, "a") or b"") == blob("a")  # snapshot unaffected
    assert store.snapshot_get(NS, sid, "new") is None
    assert bytes(store.get(NS, "a") or b"") == blob("a")  # live namespace unaffected
    assert store.get(NS, "new") is None
    assert not store.exists(NS, "new")
    assert store.count(NS) == 2
    assert store.keys(NS) == ["a", "b"]

    info = store.branch_info(NS, b1.id)
    assert info is not None
    assert (info.private_keys, info.private_bytes) == (2, 4096 + 100)
    assert [b.id for b in store.branch_list(NS)] == [b1.id, b2.id]
    assert store.branch_get(NS, b1.id, "never") is None
    assert store.branch_get(NS, "no-such-branch", "a") is None
    with pytest.raises(NotFoundError):
        store.branch_put(NS, "no-such-branch", "a", b"x")
    with pytest.raises(NotFoundError):
        store.branch_create(NS, "no-such-snapshot")


def test_overwrites_inside_an_overlay_leave_the_snapshot_alone(store: SharedKvBackend) -> None:
    fill(store, NS, {"a": blob("a")})
    sid = store.snapshot_create(NS).id
    bid = store.branch_create(NS, sid).id
    # writing the snapshot's own bytes into the overlay is a new overlay key (deduped)
    assert store.branch_put(NS, bid, "a", blob("a")).outcome is PutOutcome.NEW
    assert store.branch_put(NS, bid, "a", blob("a")).outcome is PutOutcome.DUPLICATE
    assert store.branch_put(NS, bid, "a", blob("other")).outcome is PutOutcome.REPLACED
    assert bytes(store.branch_get(NS, bid, "a") or b"") == blob("other")
    assert bytes(store.snapshot_get(NS, sid, "a") or b"") == blob("a")
    assert store.branch_put(NS, bid, "x", blob("x1")).outcome is PutOutcome.NEW
    assert store.branch_put(NS, bid, "x", blob("x2")).outcome is PutOutcome.REPLACED
    assert bytes(store.branch_get(NS, bid, "x") or b"") == blob("x2")


def test_overwrite_and_flush_keep_the_snapshots_bytes(store: SharedKvBackend) -> None:
    fill(store, NS, {"a": blob("a"), "b": blob("b")})
    sid = store.snapshot_create(NS).id
    assert store.put(NS, "a", blob("a2")).outcome is PutOutcome.REPLACED
    assert bytes(store.get(NS, "a") or b"") == blob("a2")
    assert bytes(store.snapshot_get(NS, sid, "a") or b"") == blob("a")
    assert store.flush(NS) == 2
    assert store.count(NS) == 0
    assert bytes(store.snapshot_get(NS, sid, "b") or b"") == blob("b")
    assert store.check(deep=True).ok


def test_branch_delete_releases_only_its_overlay(store: SharedKvBackend) -> None:
    fill(store, NS, {"a": blob("a")})
    sid = store.snapshot_create(NS).id
    bid = store.branch_create(NS, sid).id
    before = store.stats(NS)
    store.branch_put(NS, bid, "p", blob("private"))
    assert store.stats(NS).unique_blocks == before.unique_blocks + 1
    assert store.branch_delete(NS, bid)
    assert not store.branch_delete(NS, bid)
    assert store.branch_info(NS, bid) is None
    assert store.branch_get(NS, bid, "a") is None
    after = store.stats(NS)
    assert (after.unique_blocks, after.resident_bytes) == (
        before.unique_blocks,
        before.resident_bytes,
    )
    assert bytes(store.snapshot_get(NS, sid, "a") or b"") == blob("a")
    assert store.check(deep=True).ok


# -- reclaiming ----------------------------------------------------------------------------


def test_deleting_a_snapshot_frees_exactly_the_unreferenced_blocks(
    store: SharedKvBackend, scope: str
) -> None:
    fill(store, NS, {"a": blob("a"), "b": blob("b"), "c": blob("c"), "keep": blob("keep")})
    fill(store, OTHER, {"same-as-a": blob("a")})  # shares a's block only in global scope
    sid = store.snapshot_create(NS, keys=["a", "b", "c"]).id
    bid = store.branch_create(NS, sid).id
    store.branch_put(NS, bid, "d", blob("d"))  # branch-private block
    store.branch_put(NS, bid, "e", blob("c"))  # same bytes as c: deduplicated
    store.delete(NS, "a")
    store.delete(NS, "b")
    store.put(NS, "b", blob("b-new"))
    store.delete(NS, "c")
    # live: keep, b-new; snapshot: a, b, c; branch: d (+ c again)
    held = store.stats(NS)
    assert held.unique_blocks == 6
    assert held.resident_bytes == 6 * 4096
    whole = store.stats(None)
    assert store.snapshot_delete(NS, sid)
    assert not store.snapshot_delete(NS, sid)
    assert store.snapshot_info(NS, sid) is None
    assert store.branch_info(NS, bid) is None  # branches go with their snapshot
    assert store.branch_list(NS) == []
    assert store.snapshot_get(NS, sid, "a") is None
    after = store.stats(NS)
    assert after.unique_blocks == 2  # keep, b-new
    assert after.resident_bytes == 2 * 4096
    assert after.pinned_blocks == 0
    freed_globally = 4 if scope == "namespace" else 3  # a's block is still OTHER's
    assert store.stats(None).unique_blocks == whole.unique_blocks - freed_globally
    assert store.stats(None).resident_bytes == whole.resident_bytes - freed_globally * 4096
    assert bytes(store.get(OTHER, "same-as-a") or b"") == blob("a")
    assert bytes(store.get(NS, "b") or b"") == blob("b-new")
    assert store.check(deep=True).ok


def test_snapshot_blocks_are_pinned_until_the_snapshot_goes(opener: Opener, backend: str) -> None:
    size = 4096
    # RAM for 12 blocks; the durable cold tier for 12 more
    store = opener(
        hot_capacity_bytes=4 * size,
        warm_capacity_bytes=8 * size,
        cold_capacity_bytes=12 * size,
    )
    held = {f"h{i}": blob(f"h{i}") for i in range(4)}
    fill(store, NS, held)
    sid = store.snapshot_create(NS).id
    for key in held:
        store.delete(NS, key)  # only the snapshot references these blocks now
    assert store.stats(NS).pinned_blocks == 4
    for i in range(40):  # pressure: far more than every tier holds
        try:
            store.put(NS, f"p{i}", blob(f"p{i}"))
        except CapacityError:
            pytest.fail("a store full of unpinned blocks must make room")
    for key, data in held.items():
        assert bytes(store.snapshot_get(NS, sid, key) or b"") == data
    assert store.stats(None).evictions > 0
    # the snapshot's blocks are referenced again by live keys, then the snapshot goes
    fill(store, NS, {f"again{i}": blob(f"h{i}") for i in range(4)})
    store.snapshot_delete(NS, sid)
    assert store.stats(NS).pinned_blocks == 0
    for i in range(40, 80):
        store.put(NS, f"p{i}", blob(f"p{i}"))
    survivors = sum(store.exists(NS, f"again{i}") for i in range(4))
    assert survivors < 4  # unpinned now: pressure evicts them like any other block
    assert store.check(deep=True).ok


@pytest.mark.parametrize("scope", ["namespace", "global"])
def test_a_memory_store_full_of_snapshot_blocks_refuses_new_ones(scope: str) -> None:
    store = SharedKvIndex(
        StoreOptions(
            hot_capacity_bytes=2 * 4096,
            warm_capacity_bytes=2 * 4096,
            dedup_scope=scope,  # type: ignore[arg-type]
            max_pinned_fraction=1.0,
        ),  # a single-tenant deployment may pin everything
    )
    fill(store, NS, {f"h{i}": blob(f"h{i}") for i in range(4)})
    store.snapshot_create(NS)
    with pytest.raises(CapacityError):
        store.put(NS, "one-more", blob("one-more"))


def test_snapshot_ttl_expires_and_retire_stale_reclaims(opener: Opener) -> None:
    clock = FakeClock()
    store = opener(clock=clock)
    fill(store, NS, {"a": blob("a")})
    sid = store.snapshot_create(NS, ttl_s=0.3).id
    bid = store.branch_create(NS, sid).id
    store.branch_put(NS, bid, "p", blob("p"))
    store.delete(NS, "a")
    forever = store.snapshot_create(NS, keys=["nothing"]).id
    info = store.snapshot_info(NS, sid)
    assert info is not None
    assert info.expires_at is not None
    assert info.expires_at == pytest.approx(info.created_at + 0.3)
    assert store.retire_stale() == 0
    held = store.stats(NS)
    assert held.unique_blocks == 2
    clock.advance(0.29)
    assert store.snapshot_info(NS, sid) is not None  # not yet
    clock.advance(0.02)
    # expired: every read misses at once, before any sweep
    assert store.snapshot_get(NS, sid, "a") is None
    assert store.snapshot_info(NS, sid) is None
    assert [s.id for s in store.snapshot_list(NS)] == [forever]
    assert store.branch_get(NS, bid, "a") is None
    assert store.branch_get(NS, bid, "p") is None
    assert store.branch_info(NS, bid) is None
    with pytest.raises(NotFoundError):
        store.branch_create(NS, sid)
    with pytest.raises(NotFoundError):
        store.branch_put(NS, bid, "q", b"q")
    assert store.stats(NS).unique_blocks == 2  # space not reclaimed yet
    assert store.retire_stale() >= 1
    assert store.stats(NS).unique_blocks == 0
    assert store.stats(NS).resident_bytes == 0
    assert store.snapshot_info(NS, forever) is not None
    assert store.check(deep=True).ok
    with pytest.raises(ValueError, match="ttl_s"):
        store.snapshot_create(NS, ttl_s=0)


def test_retire_stale_drops_expired_snapshots_in_bounded_steps(opener: Opener) -> None:
    clock = FakeClock()
    store = opener(clock=clock)
    fill(store, NS, {"a": blob("a")})
    for _ in range(5):
        store.snapshot_create(NS, ttl_s=0.05)
    assert store.retire_stale() == 0
    clock.advance(0.05)
    assert store.retire_stale(max_items=2) == 2
    assert store.retire_stale(max_items=2) == 2
    assert store.retire_stale(max_items=2) == 1
    assert store.retire_stale() == 0
    assert store.stats(NS).total_refs == 1
    assert store.check().ok


def test_tenants_cannot_see_fork_or_delete_each_others_snapshots(store: SharedKvBackend) -> None:
    fill(store, NS, {"a": blob("a")})
    fill(store, OTHER, {"a": blob("b's a")})
    sid = store.snapshot_create(NS).id
    bid = store.branch_create(NS, sid).id
    store.branch_put(NS, bid, "x", blob("x"))
    assert store.snapshot_info(OTHER, sid) is None
    assert store.snapshot_list(OTHER) == []
    assert store.snapshot_get(OTHER, sid, "a") is None
    with pytest.raises(NotFoundError):
        store.branch_create(OTHER, sid)
    assert store.branch_info(OTHER, bid) is None
    assert store.branch_list(OTHER) == []
    assert store.branch_get(OTHER, bid, "a") is None
    assert store.branch_get(OTHER, bid, "x") is None
    assert store.branch_size(OTHER, bid, "x") is None
    with pytest.raises(NotFoundError):
        store.branch_put(OTHER, bid, "y", b"y")
    assert not store.branch_delete(OTHER, bid)
    assert not store.snapshot_delete(OTHER, sid)
    # still intact for the owner
    assert bytes(store.branch_get(NS, bid, "x") or b"") == blob("x")
    assert bytes(store.snapshot_get(NS, sid, "a") or b"") == blob("a")
    # the other tenant's stats never count the snapshot
    other = store.stats(OTHER)
    assert (other.unique_blocks, other.pinned_blocks) == (1, 0)
    # internal namespaces are not nameable: they contain NUL
    with pytest.raises(ValueError):
        store.get(f"{NS}\x00s\x00{sid}", "a")


# -- durability ----------------------------------------------------------------------------


def test_durable_snapshots_and_branches_survive_reopen(tmp_path: Path, scope: str) -> None:
    path = tmp_path / "store"
    with SharedKvStoreBackend(path, StoreOptions(dedup_scope=scope, map_size_bytes=64 << 20)) as s:  # type: ignore[arg-type]
        fill(s, NS, {"a": blob("a"), "b": blob("b")})
        snap = s.snapshot_create(NS, ttl_s=3600)
        br = s.branch_create(NS, snap.id)
        s.branch_put(NS, br.id, "a", blob("a-branch"))
        s.delete(NS, "a")
        stats = s.stats(None)
    with SharedKvStoreBackend(path, StoreOptions(dedup_scope=scope, map_size_bytes=64 << 20)) as s:  # type: ignore[arg-type]
        assert s.snapshot_info(NS, snap.id) == snap
        assert s.branch_info(NS, br.id) is not None
        assert bytes(s.snapshot_get(NS, snap.id, "a") or b"") == blob("a")
        assert bytes(s.branch_get(NS, br.id, "a") or b"") == blob("a-branch")
        assert bytes(s.branch_get(NS, br.id, "b") or b"") == blob("b")
        assert s.get(NS, "a") is None
        again = s.stats(None)
        assert (again.unique_blocks, again.total_refs, again.pinned_blocks) == (
            stats.unique_blocks,
            stats.total_refs,
            stats.pinned_blocks,
        )
        assert s.check(deep=True).ok
        assert s.snapshot_delete(NS, snap.id)
    with SharedKvStoreBackend(path, StoreOptions(dedup_scope=scope, map_size_bytes=64 << 20)) as s:  # type: ignore[arg-type]
        assert s.snapshot_info(NS, snap.id) is None
        assert s.branch_info(NS, br.id) is None
        assert s.stats(NS).unique_blocks == 1  # b
        assert s.check(deep=True).ok


_HOLDER = textwrap.dedent(
    """
    import sys, time
    import blake3
    from epistemic_kvcache.options import StoreOptions
    from epistemic_kvcache.store import SharedKvStoreBackend

    def blob(label, size=4096):
        return blake3.blake3(label.encode()).digest(length=size)

    s = SharedKvStoreBackend(sys.argv[1], StoreOptions(map_size_bytes=64 << 20))
    for i in range(8):
        s.put("tenant-a", f"k{i}", blob(f"k{i}"))
    snap = s.snapshot_create("tenant-a")
    br = s.branch_create("tenant-a", snap.id)
    s.branch_put("tenant-a", br.id, "k0", blob("k0-branch"))
    for i in range(8):
        s.delete("tenant-a", f"k{i}")
    print(snap.id, br.id, flush=True)
    time.sleep(120)  # killed here, the store never closed
    """
)


def test_durable_snapshot_survives_sigkill_of_its_process(tmp_path: Path) -> None:
    path = tmp_path / "store"
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(path)], stdout=subprocess.PIPE, env=env
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode().split()
        assert len(line) == 2, "holder process died before it answered"
        sid, bid = line
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
    with SharedKvStoreBackend(path, StoreOptions(map_size_bytes=64 << 20)) as s:
        assert s.count(NS) == 0
        for i in range(8):
            assert bytes(s.snapshot_get(NS, sid, f"k{i}") or b"") == blob(f"k{i}")
        assert bytes(s.branch_get(NS, bid, "k0") or b"") == blob("k0-branch")
        assert bytes(s.branch_get(NS, bid, "k1") or b"") == blob("k1")
        assert s.stats(NS).pinned_blocks == 8
        assert s.check(deep=True).ok


def test_fork_of_a_10000_block_snapshot_copies_zero_bytes(opener: Opener, backend: str) -> None:
    store = opener()
    n = 10_000
    items = [(f"blk{i:05d}", blob(f"blk{i}", 64)) for i in range(n)]
    for start in range(0, n, 1000):
        store.put_many(NS, items[start : start + 1000])
    before = store.stats(None)
    snap = store.snapshot_create(NS)
    assert snap.keys == n
    forked = store.stats(None)
    br = store.branch_create(NS, snap.id)
    after = store.stats(None)
    assert br.shared_bytes == 64 * n
    assert br.private_bytes == 0
    for s in (forked, after):
        assert s.unique_blocks == before.unique_blocks == n
        assert s.resident_bytes == before.resident_bytes
        assert s.total_refs == before.total_refs + n  # references, not copies
        if backend == "durable":
            # the log gains one small key record per entry, never a block's bytes
            assert s.extra["segment_bytes"] - before.extra["segment_bytes"] < n * 200
    assert bytes(store.branch_get(NS, br.id, "blk09999") or b"") == items[-1][1]


# -- isolation properties (Hypothesis) ---------------------------------------------------

KEYS = ["a", "b", "c"]
CONTENTS = [blob("x", 300), blob("y", 300), blob("z", 700), b"", b"short"]


class SnapshotModel(RuleBasedStateMachine):
    """live dict + snapshots (frozen dicts) + branches (overlay dicts) against the store."""

    durable: ClassVar[bool] = False
    snapshots = Bundle("snapshots")
    branches = Bundle("branches")

    def __init__(self) -> None:
        super().__init__()
        self.store: SharedKvBackend | None = None
        self.tmpdir: str | None = None
        self.scope = "namespace"
        self.live: dict[str, bytes] = {}
        self.snaps: dict[str, dict[str, bytes]] = {}
        self.overlays: dict[str, tuple[str, dict[str, bytes]]] = {}  # bid -> (sid, overlay)

    def open_store(self, *, rebuild: bool = False) -> SharedKvBackend:
        if not self.durable:
            return SharedKvIndex(StoreOptions(dedup_scope=self.scope))  # type: ignore[arg-type]
        assert self.tmpdir is not None
        return SharedKvStoreBackend(
            self.tmpdir,
            StoreOptions(
                dedup_scope=self.scope,  # type: ignore[arg-type]
                map_size_bytes=64 << 20,
                segment_bytes=1 << 20,
                checkpoint_interval_s=0.05,
                rebuild_index=rebuild,
            ),
        )

    @property
    def s(self) -> SharedKvBackend:
        assert self.store is not None
        return self.store

    @initialize(scope=st.sampled_from(["namespace", "global"]))
    def start(self, scope: str) -> None:
        self.scope = scope
        if self.durable:
            self.tmpdir = tempfile.mkdtemp(prefix="kv-snap-model-")
        self.store = self.open_store()

    def teardown(self) -> None:
        if self.store is not None:
            self.store.close()
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)

    @rule(key=st.sampled_from(KEYS), data=st.sampled_from(CONTENTS))
    def put(self, key: str, data: bytes) -> None:
        result = self.s.put(NS, key, data)
        if key in self.live:
            assert result.outcome is (
                PutOutcome.DUPLICATE if self.live[key] == data else PutOutcome.REPLACED
            )
        else:
            assert result.created
        self.live[key] = data  # snapshots taken before keep the old bytes

    @rule(key=st.sampled_from(KEYS))
    def delete(self, key: str) -> None:
        assert self.s.delete(NS, key) == (key in self.live)
        self.live.pop(key, None)

    @rule(target=snapshots, keys=st.none() | st.lists(st.sampled_from([*KEYS, "zz"]), max_size=3))
    def snapshot(self, keys: list[str] | None) -> str:
        info = self.s.snapshot_create(NS, keys=keys)
        names = self.live if keys is None else [k for k in keys if k in self.live]
        self.snaps[info.id] = {k: self.live[k] for k in names}
        assert info.keys == len(self.snaps[info.id])
        return info.id

    @rule(target=branches, sid=snapshots)
    def fork(self, sid: str) -> str:
        if sid not in self.snaps:
            with pytest.raises(NotFoundError):
                self.s.branch_create(NS, sid)
            return "gone"
        bid = self.s.branch_create(NS, sid).id
        self.overlays[bid] = (sid, {})
        return bid

    @rule(bid=branches, key=st.sampled_from(KEYS), data=st.sampled_from(CONTENTS))
    def branch_put(self, bid: str, key: str, data: bytes) -> None:
        if bid not in self.overlays:
            with pytest.raises(NotFoundError):
                self.s.branch_put(NS, bid, key, data)
            return
        overlay = self.overlays[bid][1]
        result = self.s.branch_put(NS, bid, key, data)
        if key in overlay:
            assert result.outcome is (
                PutOutcome.DUPLICATE if overlay[key] == data else PutOutcome.REPLACED
            )
        else:
            assert result.created
        overlay[key] = data

    @rule(bid=branches, key=st.sampled_from(KEYS))
    def branch_get(self, bid: str, key: str) -> None:
        got = self.s.branch_get(NS, bid, key)
        if bid not in self.overlays:
            assert got is None
            return
        sid, overlay = self.overlays[bid]
        want = overlay.get(key, self.snaps[sid].get(key))
        assert (bytes(got) if got is not None else None) == want
        assert self.s.branch_size(NS, bid, key) == (len(want) if want is not None else None)

    @rule(sid=snapshots, key=st.sampled_from(KEYS))
    def snapshot_get(self, sid: str, key: str) -> None:
        got = self.s.snapshot_get(NS, sid, key)
        want = self.snaps.get(sid, {}).get(key)
        assert (bytes(got) if got is not None else None) == want

    @rule(sid=consumes(snapshots))
    def delete_snapshot(self, sid: str) -> None:
        assert self.s.snapshot_delete(NS, sid) == (sid in self.snaps)
        self.snaps.pop(sid, None)
        for bid in [b for b, (s, _) in self.overlays.items() if s == sid]:
            del self.overlays[bid]

    @rule(bid=consumes(branches))
    def delete_branch(self, bid: str) -> None:
        assert self.s.branch_delete(NS, bid) == (bid in self.overlays)
        self.overlays.pop(bid, None)

    @precondition(lambda self: self.durable)
    @rule(how=st.sampled_from(["close", "crash", "rebuild"]))
    def reopen(self, how: str) -> None:
        """Reopen cleanly, after a crash with the index behind the log, or rebuilt."""
        assert isinstance(self.store, SharedKvStoreBackend)
        if how == "crash":
            self.store._close_without_checkpoint()
        else:
            self.s.close()
        if how == "rebuild":
            shutil.rmtree(f"{self.tmpdir}/index")
        self.store = self.open_store(rebuild=how == "rebuild")

    @invariant()
    def live_namespace_matches(self) -> None:
        if self.store is None:
            return
        assert self.s.keys(NS) == sorted(self.live)
        for key in KEYS:
            got = self.s.get(NS, key)
            assert (bytes(got) if got is not None else None) == self.live.get(key)

    @invariant()
    def blocks_are_exactly_the_referenced_ones(self) -> None:
        if self.store is None:
            return
        contents = set(self.live.values())
        for snap in self.snaps.values():
            contents.update(snap.values())
        for _, overlay in self.overlays.values():
            contents.update(overlay.values())
        st_ = self.s.stats(NS)
        assert st_.unique_blocks == len(contents)
        assert st_.resident_bytes == sum(len(c) for c in contents)
        assert st_.pinned_blocks == len({c for snap in self.snaps.values() for c in snap.values()})
        assert [i.id for i in self.s.snapshot_list(NS)] == list(self.snaps)
        assert sorted(i.id for i in self.s.branch_list(NS)) == sorted(self.overlays)
        assert self.s.check().ok


class DurableSnapshotModel(SnapshotModel):
    durable = True


_SETTINGS = settings(
    max_examples=50,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestMemorySnapshotModel = SnapshotModel.TestCase
TestMemorySnapshotModel.settings = _SETTINGS
TestDurableSnapshotModel = DurableSnapshotModel.TestCase
TestDurableSnapshotModel.settings = settings(_SETTINGS, max_examples=20)
