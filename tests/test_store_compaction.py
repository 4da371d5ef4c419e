"""The compactor (`store/compaction.py`) driven directly on a real store's segment space.

The store's own compaction is switched off (`_compact = None`), so each test
decides when a step runs; the compactor gets the store's `SegmentSpace` and its RAM view
(`LiveRam`), real segment files on tmp_path, and the results are checked on disk, in the
space's accounting, by reading every key back, and after a reopen (also one that
rebuilds the index from the log alone).
"""

from __future__ import annotations

from pathlib import Path

import blake3

from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.store import SharedKvStoreBackend
from epistemic_kvcache.store.compaction import Compactor

NS = "tenant"
BLOCK = 64 << 10


def block(key: str) -> bytes:
    return blake3.blake3(key.encode()).digest(length=BLOCK)


def open_store(path: Path, **kw: object) -> SharedKvStoreBackend:
    options = StoreOptions(
        segment_bytes=1 << 20,
        map_size_bytes=1 << 26,
        checkpoint_interval_s=0.05,
        **kw,  # type: ignore[arg-type]
    )
    return SharedKvStoreBackend(path, options)


def driven(store: SharedKvStoreBackend) -> Compactor:
    """A compactor of the store's space that only the test runs."""
    store._compact = store._batches.compactor = None
    return Compactor(store.space, store.ram, store._batches)


def seg_files(path: Path) -> set[str]:
    return {p.name for p in (path / "segments").iterdir()}


def fill(store: SharedKvStoreBackend, n: int) -> dict[str, bytes]:
    data = {f"k{i}": block(f"k{i}") for i in range(n)}
    for key, value in data.items():
        store.put(NS, key, value)
    return data


def assert_reads(store: SharedKvStoreBackend, data: dict[str, bytes]) -> None:
    for key, value in data.items():
        got = store.get(NS, key)
        assert got is not None, key
        assert bytes(got) == value, key
    assert store.check(deep=True).ok


def test_nothing_dead_means_nothing_to_do(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        c = driven(store)
        fill(store, 40)
        before = seg_files(tmp_path)
        assert c.candidate() is None
        assert not c.step()
        assert seg_files(tmp_path) == before


def test_a_segment_with_nothing_live_is_deleted_without_a_copy(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        c = driven(store)
        data = fill(store, 40)  # ~2.5 MiB: three segments
        sp = store.space
        first = min(sp.segs)
        doomed = [k for k in data if store.ram.lookup_locked(NS, k).seg == first]  # type: ignore[union-attr]
        assert doomed
        for key in doomed:
            store.delete(NS, key)
            del data[key]
        assert sp.seg_live.get(first, 0) == 0
        written_before = store.stats(None).extra["compacted_bytes"]
        assert c.candidate() == first
        assert c.step()
        assert first not in sp.segs
        assert f"{first:08d}.seg" not in seg_files(tmp_path)
        assert sp.segments_deleted == 1
        assert store.stats(None).extra["compacted_bytes"] == written_before  # nothing copied
        assert_reads(store, data)
    with open_store(tmp_path) as store:  # the SEGDEL record: a deleted file, not a lost one
        assert store.stats(None).extra["missing_segments"] == 0
        assert_reads(store, data)
        assert not any(store.exists(NS, k) for k in doomed)


def test_live_records_are_copied_forward_and_the_segment_goes(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        c = driven(store)
        data = fill(store, 40)
        sp = store.space
        first = min(sp.segs)
        mine = [k for k in data if store.ram.lookup_locked(NS, k).seg == first]  # type: ignore[union-attr]
        gone, kept = mine[: len(mine) * 2 // 3], mine[len(mine) * 2 // 3 :]
        assert kept
        store.pin(NS, kept[0])  # pins travel with the key record
        for key in gone:
            store.delete(NS, key)
            del data[key]
        live_before = sum(sp.seg_live.values())
        assert c.candidate() == first
        for _ in range(20):
            if not c.step():
                break
        assert first not in sp.segs
        assert sum(sp.seg_live.values()) == live_before  # moved, not lost or doubled
        assert all(store.ram.lookup_locked(NS, k).seg != first for k in kept)  # type: ignore[union-attr]
        assert sp.compactions == 1
        assert store.stats(None).extra["compacted_bytes"] >= len(kept) * BLOCK
        assert_reads(store, data)
    with open_store(tmp_path) as store:  # the index rows follow the copies
        assert_reads(store, data)
    with open_store(tmp_path, rebuild_index=True) as store:  # so does the log alone
        assert_reads(store, data)
        assert not any(store.exists(NS, k) for k in gone)
        assert store.unpin(NS, kept[0])  # the pin was copied with its key record
