"""Epochs: fleet-wide invalidation of epoch-tagged entries, on both backends.

An entry written with `epoch_scope=` carries the scope's epoch at write time; once
`epoch_bump` moves the scope on, the entry is stale: every read path misses at once
(`stale_missed` counts GETs), a PUT replaces it, and `retire_stale` reclaims its space
in bounded steps. The durable backend keeps epochs in a registry (`epoch_dir`) that
survives restarts and that several processes may share: a bump in one is seen by the
others at once (tested with a real second process, `epoch_bumper.py`). Each process
needs its own persist dir: a persist dir is locked by the one process that opens it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import blake3
import pytest

from epistemic_kvcache.errors import ConfigurationError, InvalidKeyError
from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.store import PutOutcome, SharedKvBackend, SharedKvIndex, SharedKvStoreBackend

NS = "tenant-a"
OTHER = "tenant-b"
SCOPE = "ctxbundle:docs"
BUMPER = Path(__file__).with_name("epoch_bumper.py")
SRC = str(Path(__file__).resolve().parent.parent / "src")


def blob(label: str, size: int = 2048) -> bytes:
    return blake3.blake3(label.encode()).digest(length=size)


@pytest.fixture(params=["memory", "durable"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SharedKvBackend]:
    s: SharedKvBackend
    if request.param == "memory":
        s = SharedKvIndex()
    else:
        s = SharedKvStoreBackend(tmp_path / "store", StoreOptions(map_size_bytes=64 << 20))
    yield s
    s.close()


def read(store: SharedKvBackend, key: str, ns: str = NS) -> bytes | None:
    got = store.get(ns, key)
    return bytes(got) if got is not None else None


def test_a_bump_makes_tagged_entries_stale_at_once(store: SharedKvBackend) -> None:
    store.put(NS, "tagged", blob("t"), epoch_scope=SCOPE)
    store.put(NS, "tagged2", blob("t2"), epoch_scope=SCOPE)
    store.put(NS, "plain", blob("p"))
    store.put(NS, "elsewhere", blob("e"), epoch_scope="other-scope")
    store.put(OTHER, "tagged", blob("o"), epoch_scope=SCOPE)  # same scope name, other tenant
    assert store.epoch_get(NS, SCOPE) == 0
    assert read(store, "tagged") == blob("t")

    assert store.epoch_bump(NS, SCOPE) == 1
    assert store.epoch_get(NS, SCOPE) == 1
    assert store.epoch_get(OTHER, SCOPE) == 0
    assert read(store, "tagged") is None
    assert read(store, "tagged2") is None
    assert not store.exists(NS, "tagged")
    assert store.size(NS, "tagged") is None
    assert store.exists_many(NS, ["tagged", "plain", "elsewhere", "tagged2"]) == [
        False,
        True,
        True,
        False,
    ]
    assert store.get_many(NS, ["tagged", "plain"]) == [None, blob("p")]
    stats = store.stats(NS)
    assert stats.stale_missed == 3  # two GETs and the get_many miss
    assert stats.get_misses >= 3
    assert store.stats(None).stale_missed == 3
    assert store.stats(OTHER).stale_missed == 0
    # untagged entries, other scopes and other tenants are untouched
    assert read(store, "plain") == blob("p")
    assert read(store, "elsewhere") == blob("e")
    assert read(store, "tagged", OTHER) == blob("o")
    # bumping again keeps counting up
    assert store.epoch_bump(NS, SCOPE) == 2
    assert store.stats(NS).stale_missed == 3


def test_a_put_over_a_stale_entry_replaces_it(store: SharedKvBackend) -> None:
    assert store.put(NS, "k", blob("v1"), epoch_scope=SCOPE).created
    # within one epoch, a PUT of other bytes replaces the entry as for any key
    assert store.put(NS, "k", blob("v1b"), epoch_scope=SCOPE).outcome is PutOutcome.REPLACED
    assert read(store, "k") == blob("v1b")
    # create-only refuses over a live entry, but a stale entry counts as absent
    assert store.put(NS, "k", blob("v1c"), epoch_scope=SCOPE, cond="nx").outcome is (
        PutOutcome.CONFLICT
    )
    store.epoch_bump(NS, SCOPE)
    assert store.put(NS, "k", blob("v1c"), cond="xx").outcome is PutOutcome.MISSING
    blocks = store.stats(NS).unique_blocks
    assert store.put(NS, "k", blob("v2"), epoch_scope=SCOPE).outcome is PutOutcome.NEW
    assert read(store, "k") == blob("v2")
    assert store.stats(NS).unique_blocks == blocks  # v1's block went with its entry
    # the same bytes again after a bump: a new entry of the new epoch
    store.epoch_bump(NS, SCOPE)
    assert store.put(NS, "k", blob("v2"), epoch_scope=SCOPE).outcome is PutOutcome.NEW
    assert read(store, "k") == blob("v2")
    # an untagged PUT over a stale entry replaces it with an entry that never goes stale
    store.epoch_bump(NS, SCOPE)
    assert store.put(NS, "k", blob("v3")).created
    store.epoch_bump(NS, SCOPE)
    assert read(store, "k") == blob("v3")
    assert store.check(deep=True).ok


def test_snapshots_capture_only_fresh_entries_and_stay_immutable(store: SharedKvBackend) -> None:
    store.put(NS, "old", blob("old"), epoch_scope=SCOPE)
    store.epoch_bump(NS, SCOPE)
    store.put(NS, "new", blob("new"), epoch_scope=SCOPE)
    snap = store.snapshot_create(NS)
    assert snap.keys == 1
    assert store.snapshot_get(NS, snap.id, "old") is None
    store.epoch_bump(NS, SCOPE)
    assert read(store, "new") is None
    got = store.snapshot_get(NS, snap.id, "new")  # a snapshot is what it captured
    assert got is not None
    assert bytes(got) == blob("new")


def test_retire_stale_reclaims_space_in_bounded_steps(store: SharedKvBackend) -> None:
    for i in range(30):
        store.put(NS, f"t{i}", blob(f"t{i}"), epoch_scope=SCOPE)
    for i in range(5):
        store.put(NS, f"p{i}", blob(f"p{i}"))
        store.put(NS, f"f{i}", blob(f"f{i}"), epoch_scope="fresh")
    assert store.retire_stale() == 0  # nothing is stale yet
    store.epoch_bump(NS, SCOPE)
    before = store.stats(NS)
    assert before.unique_blocks == 40
    assert store.retire_stale(max_items=10) == 10
    after = store.stats(NS)
    assert after.unique_blocks == 30
    assert after.resident_bytes == before.resident_bytes - 10 * 2048
    assert store.retire_stale(max_items=15) == 15
    assert store.retire_stale(max_items=15) == 5
    assert store.retire_stale() == 0
    final = store.stats(NS)
    assert (final.unique_blocks, final.total_refs) == (10, 10)
    assert store.count(NS) == 10
    for i in range(5):
        assert read(store, f"p{i}") == blob(f"p{i}")
        assert read(store, f"f{i}") == blob(f"f{i}")
    assert store.check(deep=True).ok


def test_retire_stale_stops_at_its_time_budget(store: SharedKvBackend) -> None:
    n = 1200
    store.put_many(NS, [(f"plain{i}", blob(f"plain{i}", 16)) for i in range(10)])
    for i in range(n):
        store.put(NS, f"t{i}", blob(f"t{i}", 16), epoch_scope=SCOPE)
    store.epoch_bump(NS, SCOPE)
    # a zero budget still makes progress (one chunk of the scan), but not all of it
    first = store.retire_stale(max_items=n, budget_s=0.0)
    assert 0 < first < n
    total = first
    for _ in range(n):
        if total == n:
            break
        total += store.retire_stale(max_items=n, budget_s=0.0)
    assert total == n
    assert store.count(NS) == 10
    assert store.check().ok


def test_retire_stale_gets_past_a_long_run_of_fresh_entries(store: SharedKvBackend) -> None:
    """Each bounded call resumes where the last one stopped, so stale entries behind many
    fresh ones are reached too (a scan that restarts from the top would never get there)."""
    for i in range(1000):
        store.put(NS, f"fresh{i}", blob(f"fresh{i}", 16), epoch_scope="fresh")
    for i in range(10):
        store.put(NS, f"old{i}", blob(f"old{i}", 16), epoch_scope=SCOPE)
    store.epoch_bump(NS, SCOPE)
    removed = sum(store.retire_stale(budget_s=0.0) for _ in range(10))
    assert removed == 10
    assert store.count(NS) == 1000


def test_reads_are_correct_while_retire_lags(store: SharedKvBackend) -> None:
    for i in range(20):
        store.put(NS, f"t{i}", blob(f"t{i}"), epoch_scope=SCOPE)
    store.epoch_bump(NS, SCOPE)
    store.retire_stale(max_items=7)
    for i in range(20):
        assert read(store, f"t{i}") is None
        assert not store.exists(NS, f"t{i}")
    assert store.stats(NS).stale_missed == 20 - 7  # retired entries are plain misses


def test_invalid_scopes_are_refused(store: SharedKvBackend) -> None:
    for bad in ("", "a\x00b", "x" * 257):
        with pytest.raises(InvalidKeyError):
            store.epoch_bump(NS, bad)
        with pytest.raises(InvalidKeyError):
            store.put(NS, "k", b"v", epoch_scope=bad)
    assert not store.exists(NS, "k")


# -- durable: persistence and a shared registry ------------------------------------------


def test_epochs_and_tags_persist_across_reopen(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with SharedKvStoreBackend(path, StoreOptions(map_size_bytes=64 << 20)) as s:
        s.put(NS, "old", blob("old"), epoch_scope=SCOPE)
        assert s.epoch_bump(NS, SCOPE) == 1
        s.put(NS, "new", blob("new"), epoch_scope=SCOPE)
    with SharedKvStoreBackend(path, StoreOptions(map_size_bytes=64 << 20)) as s:
        assert s.epoch_get(NS, SCOPE) == 1
        assert read(s, "old") is None
        assert read(s, "new") == blob("new")
        assert s.epoch_bump(NS, SCOPE) == 2
        assert read(s, "new") is None
    with SharedKvStoreBackend(path, StoreOptions(map_size_bytes=64 << 20)) as s:
        assert s.retire_stale() == 2
        assert s.count(NS) == 0
        assert s.stats(None).unique_blocks == 0
        assert s.check(deep=True).ok


def test_a_custom_epoch_dir_is_used(tmp_path: Path) -> None:
    epochs = tmp_path / "registry"
    with SharedKvStoreBackend(
        tmp_path / "a", StoreOptions(map_size_bytes=64 << 20), epoch_dir=epochs
    ) as s:
        assert s.epoch_dir == epochs
        s.epoch_bump(NS, SCOPE)
    assert (epochs / "data.mdb").exists()
    assert not (tmp_path / "a" / "epochs").exists()
    with SharedKvStoreBackend(
        tmp_path / "b", StoreOptions(map_size_bytes=64 << 20), epoch_dir=epochs
    ) as s:
        assert s.epoch_get(NS, SCOPE) == 1  # another store, same registry


def test_one_persist_dir_is_one_process(tmp_path: Path) -> None:
    """Sharing means sharing the epoch registry: a persist dir itself is locked."""
    with (
        SharedKvStoreBackend(tmp_path / "store", StoreOptions(map_size_bytes=64 << 20)),
        pytest.raises(ConfigurationError, match="in use"),
    ):
        SharedKvStoreBackend(tmp_path / "store", StoreOptions(map_size_bytes=64 << 20))


class _Peer:
    """`epoch_bumper.py` in its own process: one command line in, one answer line out."""

    def __init__(self, persist_dir: Path, epoch_dir: Path) -> None:
        env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, str(BUMPER), str(persist_dir), str(epoch_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        assert self._line() == "READY"

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "the peer process died"
        return line.rstrip("\n")

    def ask(self, *words: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(" ".join(words) + "\n")
        self.proc.stdin.flush()
        return self._line()

    def close(self) -> None:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.close()
        assert self.proc.wait(30) == 0
        self.proc.stdout.close()


def test_a_bump_in_another_process_is_seen_at_once(tmp_path: Path) -> None:
    epochs = tmp_path / "epochs"
    peer = _Peer(tmp_path / "peer", epochs)
    try:
        with SharedKvStoreBackend(
            tmp_path / "here", StoreOptions(map_size_bytes=64 << 20), epoch_dir=epochs
        ) as here:
            here.put(NS, "k", blob("here"), epoch_scope=SCOPE)
            here.put(NS, "plain", blob("plain"))
            assert peer.ask("put", NS, "k", SCOPE, blob("peer").hex()) == "new"
            assert peer.ask("get", NS, "k") == blob("peer").hex()

            # the peer bumps: our tagged entry is stale with no delay, no polling
            assert peer.ask("bump", NS, SCOPE) == "1"
            assert here.epoch_get(NS, SCOPE) == 1
            assert read(here, "k") is None
            assert read(here, "plain") == blob("plain")
            assert peer.ask("get", NS, "k") == "-"

            # and the other way round
            assert here.put(NS, "k", blob("here2"), epoch_scope=SCOPE).created
            assert peer.ask("put", NS, "k", SCOPE, blob("peer2").hex()) == "new"
            t0 = time.monotonic()
            assert here.epoch_bump(NS, SCOPE) == 2
            assert peer.ask("get", NS, "k") == "-"
            assert time.monotonic() - t0 < 5
            assert peer.ask("stale_missed", NS) == "2"
            assert peer.ask("epoch", NS, SCOPE) == "2"
            assert read(here, "k") is None

            # epochs are per tenant in the shared registry too
            assert peer.ask("bump", OTHER, SCOPE) == "1"
            assert here.put(NS, "k3", blob("k3"), epoch_scope=SCOPE).created
            assert read(here, "k3") == blob("k3")

            # a bump made while this store is closed is seen when it reopens
        assert peer.ask("bump", NS, SCOPE) == "3"
        with SharedKvStoreBackend(
            tmp_path / "here", StoreOptions(map_size_bytes=64 << 20), epoch_dir=epochs
        ) as here:
            assert here.epoch_get(NS, SCOPE) == 3
            assert read(here, "k3") is None
    finally:
        peer.close()


def test_one_tenant_cannot_fill_the_epoch_registry_for_the_others(tmp_path: Path) -> None:
    """The registry's map is shared: before, a tenant within its scope count (or ~14 of
    them at 10,000 long scopes, on the 64 MiB map) filled it, and every tenant's next new
    scope failed with a storage error (MDB_MAP_FULL). Now a tenant holds a bounded share:
    it is refused (QuotaExceededError, naming its share) while the others still register,
    and the map never fills. A 1 MiB map and 200-byte names make it small enough to fill."""
    from epistemic_kvcache.errors import QuotaExceededError, StorageIOError
    from epistemic_kvcache.store.epochs import EpochRegistry

    def never_live(_tenant: str, _scope: str) -> int:
        raise AssertionError("a shared registry never prunes")

    reg = EpochRegistry(tmp_path / "epochs", shared=True, map_size_bytes=1 << 20)

    def fill(tenant: str) -> tuple[int, str]:
        """Register new scopes for `tenant` until refused: (how many, why)."""
        for i in range(10_000):
            scope = blake3.blake3(f"{tenant}/{i}".encode()).hexdigest(
                100
            )  # 200 bytes, random order
            try:
                reg.advance(tenant, scope, never_live)
            except QuotaExceededError as exc:
                return i, str(exc)
        raise AssertionError(f"{tenant} was never refused")

    try:
        hog = "h" * 200
        n_hog, why = fill(hog)
        assert n_hog > 100
        assert "holds its share" in why
        got = {}
        for t in range(20):
            tenant = f"{t:03d}" + "t" * 197
            n, why = fill(tenant)
            assert n >= 1, f"tenant {t} got no scope at all: {why}"
            got[t] = n
        # everyone refused so far was refused by its share, none by a full map
        more = 0
        while True:  # newcomers until the registry is full: a quota error, never a map error
            n, why = fill(f"{more:03d}" + "n" * 197)
            more += 1
            if n == 0:
                break
        assert "quota exceeded" in why
        # the existing scopes still bump (a row rewritten, nothing added)
        first = blake3.blake3(f"{hog}/0".encode()).hexdigest(100)
        before = reg.current(hog, first)
        assert reg.advance(hog, first, never_live) == before + 1
        assert len(reg.scopes(hog)) == n_hog
    except StorageIOError as exc:  # the map filled up: the failure this test is about
        raise AssertionError(f"the registry's map filled: {exc}") from exc
    finally:
        reg.close()
    assert min(got.values()) >= 1
    assert n_hog > max(got.values())  # the first tenant took more, before the pressure point
