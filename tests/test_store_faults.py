"""Fault injection: failing writes and syncs, flipped bytes on disk and in the warm tier.

Write and sync failures go through the durable backend's `DiskIO` seam (a subclass that
raises EIO or ENOSPC on the next N calls, or until cleared); a real ENOSPC comes from a
small tmpfs when the test runs as root. Corruption is made with plain file I/O on the
segment files, and by reaching into the engine's warm tier.
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest

from epistemic_kvcache.errors import DiskFullError, StorageIOError
from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.store import (
    DiskIO,
    PutOutcome,
    SharedKvBackend,
    SharedKvIndex,
    SharedKvStoreBackend,
)
from epistemic_kvcache.store.api import Buffer
from helpers import small_tmpfs

NS = "tenant"


class FaultyIO(DiskIO):
    """`DiskIO` whose `pwrite` / `fdatasync` fail on demand.

    `fail(call, err, times=N)` fails the next N calls, `times=None` until `clear()`. A
    failing `pwrite` first writes half of its buffer, like a write cut short by a full or
    failing disk, so garbage really lands past the committed length.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults: dict[str, tuple[int, int | None]] = {}
        self.calls: dict[str, int] = {"pwrite": 0, "fdatasync": 0}
        self.failed: dict[str, int] = {"pwrite": 0, "fdatasync": 0}

    def fail(self, call: str, err: int, times: int | None = None) -> None:
        assert call in self.calls
        with self._lock:
            self._faults[call] = (err, times)

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def _check(self, call: str) -> int | None:
        with self._lock:
            self.calls[call] += 1
            fault = self._faults.get(call)
            if fault is None:
                return None
            err, times = fault
            if times is not None:
                if times <= 1:
                    del self._faults[call]
                else:
                    self._faults[call] = (err, times - 1)
            self.failed[call] += 1
            return err

    def pwrite(self, fd: int, data: Buffer, offset: int) -> int:
        err = self._check("pwrite")
        if err is not None:
            half = memoryview(data)[: len(data) // 2]
            if len(half):
                os.pwrite(fd, half, offset)
            raise OSError(err, os.strerror(err))
        return super().pwrite(fd, data, offset)

    def pwritev(self, fd: int, bufs: list[Buffer], offset: int) -> int:
        err = self._check("pwrite")
        if err is not None:
            joined = b"".join(bytes(b) for b in bufs)
            half = joined[: len(joined) // 2]
            if half:
                os.pwrite(fd, half, offset)
            raise OSError(err, os.strerror(err))
        return super().pwritev(fd, bufs, offset)

    def fdatasync(self, fd: int) -> None:
        err = self._check("fdatasync")
        if err is not None:
            raise OSError(err, os.strerror(err))
        super().fdatasync(fd)


def block(tag: str, size: int = 64 << 10) -> bytes:
    """Deterministic incompressible bytes for `tag`."""
    return np.random.default_rng(int.from_bytes(blake3.blake3(tag.encode()).digest(8))).bytes(size)


def bf16_block(seed: int, size: int = 48 << 10) -> bytes:
    """bf16-shaped KV data: normal values truncated to bfloat16 (compresses ~0.75)."""
    vals = np.random.default_rng(seed).standard_normal(size // 2).astype(np.float32)
    return (vals.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def open_durable(path: Path, io: DiskIO | None = None, **kw: int) -> SharedKvStoreBackend:
    return SharedKvStoreBackend(path, StoreOptions(**{"map_size_bytes": 64 << 20, **kw}), io=io)


def assert_reads(store: SharedKvBackend, expected: dict[str, bytes]) -> None:
    for key, want in expected.items():
        got = store.get(NS, key)
        assert got is not None, key
        assert bytes(got) == want, key


ERRORS = {errno.EIO: StorageIOError, errno.ENOSPC: DiskFullError}


@pytest.mark.parametrize("call", ["pwrite", "fdatasync"])
@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC], ids=["EIO", "ENOSPC"])
@pytest.mark.parametrize("times", [2, None], ids=["transient", "persistent"])
def test_failed_write_or_sync_is_not_acked_and_never_served(
    tmp_path: Path, call: str, err: int, times: int | None
) -> None:
    io = FaultyIO()
    store = open_durable(tmp_path, io)
    good = {f"old-{i}": block(f"old-{i}") for i in range(4)}
    for key, data in good.items():
        assert store.put(NS, key, data).outcome is PutOutcome.NEW
    bad = {f"bad-{i}": block(f"bad-{i}") for i in range(3)}

    io.fail(call, err, times)
    with pytest.raises(ERRORS[err]):
        store.put(NS, "bad-0", bad["bad-0"])
    if times is None:
        with pytest.raises(ERRORS[err]):
            store.put_many(NS, [("bad-1", bad["bad-1"]), ("bad-2", bad["bad-2"])])
        with pytest.raises(ERRORS[err]):  # still failing until the fault clears
            store.put(NS, "bad-0", bad["bad-0"])
    else:
        with pytest.raises(ERRORS[err]):
            store.put(NS, "bad-1", bad["bad-1"])
        del bad["bad-2"]
        # the fault has passed: the very next PUT works without anything being reset
        assert store.put(NS, "transient-over", block("t")).outcome is PutOutcome.NEW
        good["transient-over"] = block("t")
    assert io.failed[call] == (times or io.failed[call]) >= 2
    # a PUT of bytes already stored writes no block, but its key record is in the log
    # too: while the fault lasts it fails like any write, and nothing is half done
    if times is None:
        with pytest.raises(ERRORS[err]):
            store.put(NS, "dup-of-old-0", good["old-0"])
        assert not store.exists(NS, "dup-of-old-0")
    else:
        assert store.put(NS, "dup-of-old-0", good["old-0"]).outcome is PutOutcome.NEW
        good["dup-of-old-0"] = good["old-0"]
    for key in bad:
        assert store.get(NS, key) is None
        assert not store.exists(NS, key)
    assert_reads(store, good)
    assert store.stats(None).extra["write_failures"] >= 2
    assert store.stats(NS).put_new == len(good)

    io.clear()
    assert store.put(NS, "after", block("after")).outcome is PutOutcome.NEW
    good["after"] = block("after")
    if times is None:
        assert store.put(NS, "dup-of-old-0", good["old-0"]).outcome is PutOutcome.NEW
        good["dup-of-old-0"] = good["old-0"]
    report = store.check(deep=True)
    assert report.ok, report
    assert report.keys == len(good)
    store.close()

    store = open_durable(tmp_path, io)
    try:
        for key in bad:
            assert store.get(NS, key) is None
        assert sorted(store.keys(NS)) == sorted(good)
        assert_reads(store, good)
        assert store.put(NS, "after-reopen", block("x")).outcome is PutOutcome.NEW
        assert_reads(store, {"after-reopen": block("x")})
        report = store.check(deep=True)
        assert report.ok, report
    finally:
        store.close()


def test_fault_during_reopened_store_then_recovery(tmp_path: Path) -> None:
    """A persistent fault right after reopening: nothing is lost, service resumes."""
    store = open_durable(tmp_path)
    store.put(NS, "a", block("a"))
    store.close()
    io = FaultyIO()
    io.fail("fdatasync", errno.EIO)
    store = open_durable(tmp_path, io)
    for i in range(3):
        with pytest.raises(StorageIOError):
            store.put(NS, f"b{i}", block(f"b{i}"))
    store.close()  # close while the disk is still failing
    store = open_durable(tmp_path, io)
    with pytest.raises(StorageIOError):
        store.put(NS, "b0", block("b0"))
    io.clear()
    store.put(NS, "c", block("c"))
    assert sorted(store.keys(NS)) == ["a", "c"]
    assert_reads(store, {"a": block("a"), "c": block("c")})
    assert store.check(deep=True).ok
    store.close()


def test_concurrent_writers_in_a_failing_batch_all_fail(tmp_path: Path) -> None:
    """Every PUT of a batch whose sync failed raises; none is visible, later ones work."""
    io = FaultyIO()
    store = open_durable(tmp_path, io)
    io.fail("fdatasync", errno.EIO)
    errors: list[BaseException] = []

    def put(i: int) -> None:
        try:
            store.put(NS, f"k{i}", block(f"k{i}"))
        except StorageIOError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=put, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 8
    assert store.keys(NS) == []
    assert store.stats(None).total_refs == 0
    io.clear()
    threads = [threading.Thread(target=put, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 8
    assert_reads(store, {f"k{i}": block(f"k{i}") for i in range(8)})
    assert store.check(deep=True).ok
    store.close()


def _flip_on_disk(store_dir: Path, data: bytes, at: int) -> None:
    """Flip one byte of the stored copy of `data` in its segment file (plain file I/O)."""
    for seg in sorted((store_dir / "segments").glob("*.seg")):
        raw = seg.read_bytes()
        off = raw.find(data)
        if off >= 0:
            with seg.open("r+b") as f:
                f.seek(off + at)
                f.write(bytes([raw[off + at] ^ 0x01]))
            return
    raise AssertionError("block not found in any segment")


def test_flipped_byte_on_disk_is_detected_and_quarantined(tmp_path: Path) -> None:
    store = open_durable(tmp_path)
    data = {k: block(k) for k in ("a", "b", "c")}
    for key, value in data.items():
        store.put(NS, key, value)
    store.put(NS, "b-twin", data["b"])  # same bytes: the same (soon corrupt) blob
    store.put("other", "b", data["b"])  # another tenant's copy is its own blob
    assert store.evict(NS, "b")  # out of RAM: the next GET reads the segment
    _flip_on_disk(tmp_path, data["b"], at=1000)

    assert store.get(NS, "b") is None
    stats = store.stats(NS)
    assert stats.integrity_failures == 1
    assert store.stats(None).integrity_failures == 1
    assert store.stats("other").integrity_failures == 0
    assert stats.get_misses == 1
    assert not store.exists(NS, "b")
    assert not store.exists(NS, "b-twin")  # its bytes were the corrupt ones
    assert store.get(NS, "b") is None
    assert store.stats(NS).integrity_failures == 1  # a quarantined key is a plain miss
    assert_reads(store, {"a": data["a"], "c": data["c"]})
    got = store.get("other", "b")
    assert got is not None
    assert bytes(got) == data["b"]
    report = store.check(deep=True)
    assert report.ok, report
    store.close()

    store = open_durable(tmp_path)  # the quarantine is durable
    try:
        assert store.get(NS, "b") is None
        assert sorted(store.keys(NS)) == ["a", "c"]
        assert_reads(store, {"a": data["a"], "c": data["c"]})
        assert store.check(deep=True).ok
        # the key can be written again, and then reads back
        assert store.put(NS, "b", data["b"]).outcome is PutOutcome.NEW
        assert_reads(store, {"b": data["b"]})
    finally:
        store.close()


def test_deep_check_reports_a_flipped_byte_on_disk(tmp_path: Path) -> None:
    store = open_durable(tmp_path)
    store.put(NS, "a", block("a"))
    store.put(NS, "b", block("b"))
    _flip_on_disk(tmp_path, block("a"), at=7)
    report = store.check(deep=True)
    assert not report.ok
    assert len(report.corrupt_blobs) == 1
    assert store.check(deep=False).ok  # a shallow check does not read blobs
    store.close()


# the durable backend does not keep incompressible blocks in warm (they are on disk)
@pytest.mark.parametrize(
    ("backend", "kind"), [("memory", "compressed"), ("memory", "raw"), ("durable", "compressed")]
)
def test_flipped_byte_in_warm_tier_is_detected(tmp_path: Path, backend: str, kind: str) -> None:
    caps = {"hot_capacity_bytes": 64 << 10, "warm_capacity_bytes": 1 << 20}
    store: SharedKvBackend = (
        SharedKvIndex(StoreOptions(**caps))
        if backend == "memory"
        else open_durable(tmp_path, **caps)
    )
    make = (
        (lambda i: bf16_block(i)) if kind == "compressed" else (lambda i: block(str(i), 48 << 10))
    )
    data = {f"k{i}": make(i) for i in range(3)}
    for key, value in data.items():
        store.put(NS, key, value)
    warm = store.ram.tiers.warm  # type: ignore[attr-defined]
    assert len(warm) == 2, "two of the three blocks should have been demoted to warm"
    victim = next(iter(warm.values()))
    (victim_ns, victim_key) = victim.key_refs()[0]
    copy = bytearray(victim.warm)
    if kind == "compressed":
        assert len(copy) < len(data[victim_key])
    copy[len(copy) // 2] ^= 0x10
    victim.warm = bytes(copy)

    if backend == "memory":
        # the warm copy was the only copy: quarantined, a miss
        assert store.get(victim_ns, victim_key) is None
        assert store.stats(NS).integrity_failures == 1
        assert not store.exists(NS, victim_key)
        del data[victim_key]
    else:
        # durable: the damaged RAM copy is dropped and the verified disk copy is served
        assert store.get(victim_ns, victim_key) == data[victim_key]
        assert store.stats(NS).integrity_failures == 1
        assert store.exists(NS, victim_key)
    assert_reads(store, data)
    report = store.check(deep=True)
    assert report.ok, report
    assert store.stats(NS).total_refs == len(data)
    store.close()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None, reason="needs root")
def test_real_disk_full_then_space_returns(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "mnt", "8m") as mnt:
        store = open_durable(mnt / "store", segment_bytes=1 << 20, map_size_bytes=1 << 20)
        stored: dict[str, bytes] = {}
        failed = ""
        for i in range(32):
            key = f"k{i}"
            try:
                store.put(NS, key, block(key, 1 << 20))
            except DiskFullError:
                failed = key
                break
            stored[key] = block(key, 1 << 20)
        assert failed, "8 MiB should not hold 32 MiB"
        assert 3 <= len(stored) < 8
        assert store.get(NS, failed) is None
        with pytest.raises(DiskFullError):  # still full
            store.put(NS, "again", block("again", 1 << 20))
        assert_reads(store, stored)
        # make room: delete two keys (their segments go), and PUTs work again
        for key in sorted(stored)[:2]:
            assert store.delete(NS, key)
            del stored[key]
        assert store.put(NS, "after", block("after", 1 << 20)).outcome is PutOutcome.NEW
        stored["after"] = block("after", 1 << 20)
        assert store.get(NS, failed) is None
        assert_reads(store, stored)
        assert store.check(deep=True).ok
        store.close()
        store = open_durable(mnt / "store", segment_bytes=1 << 20, map_size_bytes=1 << 20)
        try:
            assert sorted(store.keys(NS)) == sorted(stored)
            assert_reads(store, stored)
            assert store.check(deep=True).ok
        finally:
            store.close()


@pytest.mark.parametrize("call", ["pwrite", "fdatasync"])
def test_fault_in_a_batch_spanning_segments(tmp_path: Path, call: str) -> None:
    """Small segments: a failing batch that rolled over leaves no stray segment behind."""
    io = FaultyIO()
    opts = {"segment_bytes": 100 << 10}
    store = open_durable(tmp_path, io, **opts)
    good = {f"g{i}": block(f"g{i}") for i in range(3)}
    store.put_many(NS, list(good.items()))
    io.fail(call, errno.EIO)
    with pytest.raises(StorageIOError):
        store.put_many(NS, [(f"bad{i}", block(f"bad{i}")) for i in range(4)])
    io.clear()
    more = {f"m{i}": block(f"m{i}") for i in range(3)}
    store.put_many(NS, list(more.items()))
    good.update(more)
    assert sorted(store.keys(NS)) == sorted(good)
    assert store.check(deep=True).ok
    store.close()
    store = open_durable(tmp_path, **opts)
    try:
        assert sorted(store.keys(NS)) == sorted(good)
        for key in good:
            assert store.evict(NS, key)  # read from the segments, not from RAM
        assert_reads(store, good)
        assert store.check(deep=True).ok
        files = list((tmp_path / "segments").glob("*.seg"))
        assert len(files) == store.stats(None).extra["segments"]
    finally:
        store.close()


class GatedIO(DiskIO):
    """`DiskIO` whose next `fdatasync` waits for `release()`: the committer stalls, so
    the operations queued meanwhile are decided together in the next batch."""

    def __init__(self) -> None:
        self._gate = threading.Event()
        self._gate.set()
        self.waiting = threading.Event()

    def hold(self) -> None:
        self._gate.clear()
        self.waiting.clear()

    def release(self) -> None:
        self._gate.set()

    def fdatasync(self, fd: int) -> None:
        if not self._gate.is_set():
            self.waiting.set()
            assert self._gate.wait(timeout=30)
        super().fdatasync(fd)


def _queue_behind_a_stalled_commit(
    store: SharedKvStoreBackend, io: GatedIO, actions: list[Any]
) -> None:
    """Run `actions` in threads while the committer is stalled, each queued in order."""
    io.hold()
    threads = [threading.Thread(target=store.put, args=(NS, "stall", block("stall")))]
    threads[0].start()
    assert io.waiting.wait(timeout=30)
    for n, action in enumerate(actions, start=1):
        t = threading.Thread(target=action)
        t.start()
        threads.append(t)
        for _ in range(3000):  # wait until it is queued
            if store.log.committer.queued() >= n:
                break
            time.sleep(0.001)
        assert store.log.committer.queued() == n
    io.release()
    for t in threads:
        t.join(timeout=30)


def test_quarantine_batched_with_a_dedup_put_of_the_corrupt_blob(tmp_path: Path) -> None:
    """A key added to a blob in the same batch that quarantines it goes with the blob."""
    io = GatedIO()
    store = open_durable(tmp_path, io)
    x = block("x")
    store.put(NS, "x", x)
    store.put(NS, "y", block("y"))
    assert store.evict(NS, "x")
    _flip_on_disk(tmp_path, x, at=10)
    results: dict[str, Any] = {}
    _queue_behind_a_stalled_commit(
        store,
        io,
        [
            lambda: results.setdefault("put", store.put(NS, "x-twin", x)),
            lambda: results.setdefault("get", store.get(NS, "x")),
        ],
    )
    assert results["put"].outcome is PutOutcome.NEW  # deduplicated against corrupt bytes
    assert results["get"] is None
    assert store.stats(NS).integrity_failures == 1
    report = store.check(deep=True)
    assert report.ok, report
    assert sorted(store.keys(NS)) == ["stall", "y"]
    store.close()
    store = open_durable(tmp_path)
    try:
        report = store.check(deep=True)
        assert report.ok, report
        assert sorted(store.keys(NS)) == ["stall", "y"]
        store.put(NS, "x", x)  # fresh, good bytes
        assert store.evict(NS, "x")
        assert_reads(store, {"x": x, "y": block("y")})
    finally:
        store.close()


def test_a_late_quarantine_does_not_drop_a_rewritten_blob(tmp_path: Path) -> None:
    """Two readers hit the same corrupt blob; between their quarantines the bytes are
    written again (fresh copy, new location): the second quarantine must leave it."""
    io = GatedIO()
    store = open_durable(tmp_path, io)
    x = block("x")
    store.put(NS, "x", x)
    assert store.evict(NS, "x")
    _flip_on_disk(tmp_path, x, at=10)
    results: dict[str, Any] = {}
    _queue_behind_a_stalled_commit(
        store,
        io,
        [
            lambda: results.setdefault("get1", store.get(NS, "x")),
            lambda: results.setdefault("put", store.put(NS, "x-again", x)),
            lambda: results.setdefault("get2", store.get(NS, "x")),
        ],
    )
    assert results["get1"] is None
    assert results["get2"] is None
    assert results["put"].outcome is PutOutcome.NEW
    assert store.exists(NS, "x-again"), "an acknowledged PUT of good bytes was dropped"
    assert store.evict(NS, "x-again")
    assert_reads(store, {"x-again": x})
    report = store.check(deep=True)
    assert report.ok, report
    store.close()


def test_an_unexpected_error_in_the_committer_is_a_loud_read_only_fault(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Never a hang: every waiting and every later write fails at once, reads go on,
    readiness says why, the log says it once."""
    from epistemic_kvcache.errors import StoreFaultError
    from epistemic_kvcache.store import batches as durable_mod

    store = open_durable(tmp_path)
    store.put(NS, "before", block("before"))
    real = durable_mod.decide_batch

    def broken(reader: Any, ops: Any) -> Any:
        if any(op.key == "boom" for op in ops):
            raise RuntimeError("a bug in the committer")
        return real(reader, ops)

    monkeypatch.setattr(durable_mod, "decide_batch", broken)
    with pytest.raises(StoreFaultError, match="a bug in the committer"):
        store.put(NS, "boom", block("boom"))
    faulted = "read-only after a fault: RuntimeError: a bug in the committer"
    t0 = time.monotonic()
    for key in ("after", "other"):
        with pytest.raises(StoreFaultError, match=faulted):
            store.put(NS, key, block(key))
    with pytest.raises(StoreFaultError, match=faulted):
        store.delete(NS, "before")
    assert store.log.committer.queued() == 0  # refused, not queued for a committer that is gone
    # At once (milliseconds), not after a timeout: these calls have none of their own, so
    # a broken store hangs them (until pytest's timeout) or makes them wait for another
    # one, such as the 30 s shutdown timeout.
    assert time.monotonic() - t0 < 10
    assert bytes(store.get(NS, "before") or b"") == block("before")  # reads keep working
    health = store.health()
    assert not health.ready
    assert not health.writable
    assert not health.committer_alive
    assert health.reason is not None
    assert "a bug in the committer" in health.reason
    assert store.stats(None).extra["store_fault"] == 1
    faults = [r for r in caplog.records if "store fault" in r.getMessage()]
    assert len(faults) == 1
    store.close()
    with open_durable(tmp_path) as again:  # a restart clears it; nothing was lost
        assert bytes(again.get(NS, "before") or b"") == block("before")
        assert not again.exists(NS, "boom")
        assert again.health().ready


def test_cancelled_writes_are_dropped_from_their_batch(tmp_path: Path) -> None:
    """A future cancelled before its batch commits (its caller went away) writes nothing
    and never disturbs the committer."""
    io = GatedIO()
    store = open_durable(tmp_path, io)
    io.hold()
    stall = threading.Thread(target=store.put, args=(NS, "stall", block("stall")))
    stall.start()
    assert io.waiting.wait(timeout=30)
    queued = [store.put_nowait(NS, f"gone-{i}", block(f"gone-{i}")[:1000]) for i in range(50)]
    for fut in queued:
        assert isinstance(fut, concurrent.futures.Future)
        assert fut.cancel()
    io.release()
    stall.join(30)
    assert store.put(NS, "next", block("next")).outcome is PutOutcome.NEW
    for i in range(50):
        assert not store.exists(NS, f"gone-{i}")
    assert store.health().ready
    store.close()
