"""Disk space: a full disk comes back without a restart, deletes always work, and the log
stays within its bounds across churn and restarts.

The full-disk tests use a real, small tmpfs (so ENOSPC comes from the kernel); they need
root to mount it, as CI has.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

import pytest

from epistemic_kvcache.errors import DiskFullError
from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.store import PutOutcome, SharedKvStoreBackend
from test_store_faults import block, small_tmpfs

NS = "tenant"
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("mount") is None, reason="needs root to mount a tmpfs"
)


def seg_bytes(path: Path) -> int:
    total = 0
    for p in (path / "segments").iterdir():
        with contextlib.suppress(FileNotFoundError):  # compaction deleted it meanwhile
            total += p.stat().st_size
    return total


def disk_use(path: Path) -> int:
    """Bytes the segment files occupy on disk (dead payloads are punched out of them)."""
    total = 0
    for p in (path / "segments").iterdir():
        with contextlib.suppress(FileNotFoundError):  # compaction deleted it meanwhile
            st = p.stat()
            total += min(st.st_size, st.st_blocks * 512)
    return total


def wait_for_compaction(store: SharedKvStoreBackend, path: Path, bound: int) -> int:
    deadline = time.monotonic() + 20
    while seg_bytes(path) > bound and time.monotonic() < deadline:
        time.sleep(0.1)  # the committer compacts while idle
    return seg_bytes(path)


@needs_root
def test_full_disk_deletes_work_and_space_comes_back_without_restart(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "mnt", "8m") as mnt:
        path = mnt / "store"
        store = SharedKvStoreBackend(
            path, StoreOptions(segment_bytes=512 << 10, map_size_bytes=1 << 20)
        )
        stored: dict[str, bytes] = {}
        for i in range(400):  # 64 KiB blocks until the file system is full
            key = f"k{i}"
            try:
                store.put(NS, key, block(key))
            except DiskFullError:
                break
            stored[key] = block(key)
        else:
            raise AssertionError("8 MiB should not hold 25 MiB")
        assert len(stored) >= 40
        assert not store.health().ready
        assert store.health().disk_full
        with pytest.raises(DiskFullError):
            store.put(NS, "still-full", block("x"))
        # every DELETE works on the full disk (tombstones use the space kept for them)
        doomed = sorted(stored)[: len(stored) * 3 // 4]
        for key in doomed:
            assert store.delete(NS, key), key
            del stored[key]
        # the space comes back without a restart: PUTs work again
        for i in range(10):
            assert store.put(NS, f"after{i}", block(f"after{i}")).outcome is PutOutcome.NEW
            stored[f"after{i}"] = block(f"after{i}")
        deadline = time.monotonic() + 20  # idle compaction gives back the rest
        while not store.health().ready and time.monotonic() < deadline:
            time.sleep(0.1)
        assert store.health().ready, store.stats(None).extra
        for key, value in stored.items():
            assert bytes(store.get(NS, key) or b"") == value
        assert store.check(deep=True).ok
        store.close()
        with SharedKvStoreBackend(
            path, StoreOptions(segment_bytes=512 << 10, map_size_bytes=1 << 20)
        ) as again:
            assert sorted(again.keys(NS, limit=1000)) == sorted(stored)
            assert again.check(deep=True).ok


def test_churn_with_restarts_stays_within_the_disk_bound(tmp_path: Path) -> None:
    """Rounds of write, delete, restart (each restart used to leave a sealed segment that
    was never compacted): the log stays within ~1.5x the live bytes plus a segment."""
    seg = 1 << 20
    opts = StoreOptions(segment_bytes=seg, map_size_bytes=64 << 20, hot_capacity_bytes=1 << 20)
    live: dict[str, bytes] = {}
    for r in range(10):
        with SharedKvStoreBackend(tmp_path, opts) as store:
            for i in range(40):
                key = f"r{r}-{i}"
                live[key] = os.urandom(64 << 10)
                store.put(NS, key, live[key])
            for key in sorted(live)[: len(live) - 40]:  # keep the newest 40 (2.5 MiB)
                assert store.delete(NS, key)
                del live[key]
            live_bytes = sum(len(v) for v in live.values())
            bound = int(1.5 * live_bytes) + 2 * seg + (256 << 10)
            got = wait_for_compaction(store, tmp_path, bound)
            assert got <= bound, (r, got, bound, store.stats(None).extra)
    with SharedKvStoreBackend(tmp_path, opts) as store:
        assert sorted(store.keys(NS)) == sorted(live)
        for key, value in live.items():
            assert bytes(store.get(NS, key) or b"") == value
        assert store.check(deep=True).ok


def test_the_cold_capacity_bounds_the_files_on_disk(tmp_path: Path) -> None:
    """With --cold-capacity-bytes the segment files never occupy more of the disk: old
    blocks are evicted (their payloads punched out) or their space compacted before new
    ones are written."""
    cap = 8 << 20
    opts = StoreOptions(cold_capacity_bytes=cap, map_size_bytes=64 << 20, hot_capacity_bytes=0)
    peak = 0
    for r in range(4):
        with SharedKvStoreBackend(tmp_path, opts) as store:
            for i in range(100):
                store.put(NS, f"r{r}-{i}", os.urandom(100 << 10))
                peak = max(peak, disk_use(tmp_path))
            stats = store.stats(None)
            assert stats.evictions > 0 or r == 0
            assert stats.tiers["cold"].bytes <= store.live_capacity_bytes
    assert peak <= cap, peak
    with SharedKvStoreBackend(tmp_path, opts) as store:
        assert store.check(deep=True).ok
        n = store.count(NS)
        assert 40 <= n <= 80
        for key in store.keys(NS, limit=1000):
            assert store.get(NS, key) is not None
