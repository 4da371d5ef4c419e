"""Receive buffers: handed over to the store (`Handover`), which keeps them without a copy."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from epistemic_kvcache import buffers
from epistemic_kvcache.store import SharedKvIndex
from epistemic_kvcache.store.api import owned_buffer

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _fresh_process_pool() -> Iterator[None]:
    """Each test starts with the process-wide prefault pool empty (it is shared)."""
    buffers.configure_prefault(0)
    buffers.configure_prefault(buffers.DEFAULT_PREFAULT_BYTES)
    yield
    buffers.configure_prefault(buffers.DEFAULT_PREFAULT_BYTES)


def test_receive_buffers_are_writable_heap_views_handed_to_the_store() -> None:
    for size in (1, 4096, 256 << 10, 3 * MiB + 1):
        buf = buffers.alloc_block(size)
        assert isinstance(buf, memoryview)
        assert (len(buf), buf.format, buf.itemsize, buf.readonly, buf.c_contiguous) == (
            size,
            "B",
            1,
            False,
            True,
        )
        assert buffers.handed_over(buf)
        # a smaller slice is not: the store would keep the whole buffer behind it
        assert not buffers.handed_over(buf[1:])
        assert not buffers.handed_over(buf[:-1])
        # a buffer with room for the wire's framing after the block: the block is, and
        # shifted views of it are not (their owner may still write where they start)
        roomy = buffers.alloc_block(size, slack=buffers.MAX_SLACK)
        assert len(roomy) == size + buffers.MAX_SLACK
        assert buffers.handed_over(roomy[:size])
        assert buffers.handed_over(roomy[: size + 1])
        assert not buffers.handed_over(roomy[1:])
        assert not buffers.handed_over(roomy[2:])
        assert not buffers.handed_over(roomy[1 : size + 1])
        assert not buffers.handed_over(roomy[:0])
        buf[-1:] = b"x"
        assert bytes(buf[-1:]) == b"x"
    with pytest.raises(ValueError, match="invalid slack"):
        buffers.alloc_block(8, slack=buffers.MAX_SLACK + 1)
    assert not buffers.handed_over(memoryview(bytearray(8)))
    assert not buffers.handed_over(memoryview(b"bytes"))


def test_numpy_does_not_ask_for_huge_pages_once_buffers_are_made() -> None:
    buffers.alloc_block(1)
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy < 2
        from numpy.core import multiarray  # type: ignore[no-redef]
    # the switch returns its previous state: off since the first receive buffer
    assert multiarray._set_madvise_hugepage(False) is False


def test_the_store_keeps_handed_over_receive_buffers_and_copies_other_views() -> None:
    import numpy as np

    big = buffers.alloc_block(1 << 20)
    assert isinstance(big, memoryview)
    assert owned_buffer(buffers.Handover(big)).obj is big.obj  # kept, read-only
    assert isinstance(owned_buffer(big), bytes)  # not handed over: copied
    mid = buffers.alloc_block(256 << 10)
    assert isinstance(buffers.received_block(mid), buffers.Handover)
    assert buffers.received_block(mid[:10]) is not None
    assert isinstance(owned_buffer(buffers.received_block(mid[:10])), bytes)  # a slice
    # a view of someone else's numpy array is not a receive buffer: copied
    theirs = memoryview(np.zeros(64, dtype=np.uint8))
    assert not buffers.handed_over(theirs)
    assert buffers.received_block(theirs) is theirs
    assert isinstance(owned_buffer(theirs), bytes)
    borrowed = memoryview(bytearray(b"reused later"))
    kept = owned_buffer(borrowed)
    assert isinstance(kept, bytes)
    store = SharedKvIndex()
    big[:3] = b"abc"
    store.put("t", "k", buffers.Handover(big))
    got = store.get("t", "k")
    assert isinstance(got, memoryview)
    assert got.obj is big.obj  # the hot tier holds the received buffer itself
    assert got.readonly
    store.put("t", "v", borrowed)
    borrowed[:6] = b"CHANGE"
    assert store.get("t", "v") == b"reused later"


def _wait_ready(pool: buffers.Prefaulter, n: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while pool.stats().ready_buffers < n:
        assert time.monotonic() < deadline, pool.stats()
        time.sleep(0.005)


def test_prefaulter_pools_a_size_asked_for_twice() -> None:
    pool = buffers.Prefaulter(8 * MiB)
    try:
        assert pool.take(2 * MiB) is None  # first sight of a size: not pooled
        assert pool.take(2 * MiB) is None  # second: pooled from now on (a miss)
        _wait_ready(pool, 4)  # 8 MiB budget / 2 MiB
        s = pool.stats()
        assert (s.ready_buffers, s.ready_bytes, s.hits, s.misses) == (4, 8 * MiB, 0, 1)
        arr = pool.take(2 * MiB)
        assert arr is not None
        assert arr.nbytes == 2 * MiB + buffers.MAX_SLACK  # the same buffer serves RESP and HTTP
        assert buffers.handed_over(memoryview(arr)[: 2 * MiB])
        assert pool.stats().hits == 1
        _wait_ready(pool, 4)  # refilled, never above the budget
        assert pool.stats().ready_bytes == 8 * MiB
        assert pool.take(3 * MiB) is None  # another size: its own first sight
    finally:
        pool.close()
    assert pool.stats().ready_buffers == 0
    assert pool.take(2 * MiB) is None  # closed: nothing more is pooled


def test_prefaulter_keeps_the_recent_sizes_within_budget_and_off_releases_all() -> None:
    pool = buffers.Prefaulter(12 * MiB)
    try:
        for size in (1 * MiB, 2 * MiB, 3 * MiB):
            pool.take(size)
            pool.take(size)
        # only the two most recent sizes stay pooled; each gets half the budget
        _wait_ready(pool, 2 + 3)  # 6 MiB / 3 MiB + 6 MiB / 2 MiB
        time.sleep(0.05)  # a delay on purpose: room for a wrong extra buffer to show up
        s = pool.stats()
        assert s.ready_bytes <= 12 * MiB
        assert pool.take(1 * MiB) is None  # dropped from the pool: its first sight again
        assert s.ready_buffers == 5
        pool.configure(0)
        s = pool.stats()
        assert (s.ready_buffers, s.ready_bytes, s.budget_bytes) == (0, 0, 0)
        assert pool.take(2 * MiB) is None
    finally:
        pool.close()


def test_prefaulter_larger_than_budget_is_never_pooled() -> None:
    pool = buffers.Prefaulter(1 * MiB)
    try:
        for _ in range(3):
            assert pool.take(2 * MiB) is None
        time.sleep(0.05)  # a delay on purpose: room for a wrong buffer to show up
        assert pool.stats().ready_buffers == 0
    finally:
        pool.close()


def test_alloc_block_uses_the_process_pool_and_the_store_keeps_its_buffer() -> None:
    size = 3 * MiB + 4096  # a size no other test asks for
    buffers.alloc_block(size)
    buffers.alloc_block(size)
    deadline = time.monotonic() + 10
    while buffers.prefault_stats().ready_bytes < 2 * size:  # two buffers ready
        assert time.monotonic() < deadline
        time.sleep(0.005)
    hits = buffers.prefault_stats().hits
    # RESP asks with room for the CRLF, HTTP without: one pooled size serves both
    roomy = buffers.alloc_block(size, slack=2)
    assert len(roomy) == size + 2
    assert buffers.handed_over(roomy[:size])
    block = buffers.alloc_block(size)
    assert buffers.prefault_stats().hits == hits + 2
    assert isinstance(block, memoryview)
    assert buffers.handed_over(block)
    assert len(block) == size
    block[-3:] = b"end"
    store = SharedKvIndex()
    store.put("t", "pooled", buffers.Handover(block))
    got = store.get("t", "pooled")
    assert isinstance(got, memoryview)
    assert got.obj is block.obj  # kept, not copied
    assert bytes(store.get("t", "pooled")[-3:]) == b"end"  # type: ignore[index]


def test_large_disk_reads_are_not_zero_filled(tmp_path: Path) -> None:
    """A cold read of a large block fills a buffer `bytearray(n)` would first zero-fill
    with the GIL held (128 MiB: ~150-200 ms here, every other client stalled, see
    bench/bench_stall.py): from 1 MiB it is uninitialized heap memory, faulted in by the
    `preadv` that fills it; smaller ones stay plain bytearrays."""
    import os

    from epistemic_kvcache.store.segments import Segment

    assert isinstance(buffers.read_buffer(buffers.READ_UNINIT_MIN_BYTES - 1), bytearray)
    big = buffers.read_buffer(3 * MiB + 1)
    assert isinstance(big, memoryview)
    assert (len(big), big.format, big.readonly, big.c_contiguous) == (3 * MiB + 1, "B", False, True)
    data = os.urandom(4 * MiB)
    seg = Segment(1, tmp_path / "seg", create=True)
    os.pwrite(seg.fd, data, 0)
    got = seg.read(1000, 2 * MiB)
    assert not isinstance(got, bytearray)
    assert bytes(got) == data[1000 : 1000 + 2 * MiB]
    small = seg.read(7, 4096)
    assert isinstance(small, bytearray)
    assert small == data[7 : 7 + 4096]
    with pytest.raises(OSError, match="short read"):
        seg.read(3 * MiB, 2 * MiB)
