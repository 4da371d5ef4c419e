"""Receive buffers: large ones are mmap-backed and owned by the store without a copy."""

from __future__ import annotations

import gc
import mmap

import pytest

from epistemic_kvcache import buffers
from epistemic_kvcache.store import SharedKvIndex
from epistemic_kvcache.store.api import owned_buffer


def test_small_blocks_are_bytearrays_large_ones_mmap_views() -> None:
    small = buffers.alloc_block(buffers.MMAP_MIN_BYTES - 1)
    assert isinstance(small, bytearray)
    big = buffers.alloc_block(buffers.MMAP_MIN_BYTES)
    assert isinstance(big, memoryview)
    assert isinstance(big.obj, mmap.mmap)
    assert len(big) == buffers.MMAP_MIN_BYTES
    assert bytes(big[:16]) == bytes(16)  # zero-filled like a bytearray
    big[:5] = b"hello"
    assert bytes(big[:5]) == b"hello"


def test_mapping_count_is_bounded_and_released(monkeypatch: pytest.MonkeyPatch) -> None:
    gc.collect()
    start = buffers.live_mappings()
    monkeypatch.setattr(buffers, "MAX_MAPPINGS", start + 2)
    a = buffers.alloc_block(1 << 20)
    b = buffers.alloc_block(1 << 20)
    c = buffers.alloc_block(1 << 20)
    assert isinstance(a, memoryview)
    assert isinstance(b, memoryview)
    assert isinstance(c, bytearray)  # over the cap: a plain buffer, never a failure
    assert buffers.live_mappings() == start + 2
    del a, b
    gc.collect()
    assert buffers.live_mappings() == start


def test_the_store_keeps_mmap_views_and_copies_other_views() -> None:
    big = buffers.alloc_block(1 << 20)
    assert isinstance(big, memoryview)
    assert owned_buffer(big) is big
    borrowed = memoryview(bytearray(b"reused later"))
    kept = owned_buffer(borrowed)
    assert isinstance(kept, bytes)
    store = SharedKvIndex()
    big[:3] = b"abc"
    store.put("t", "k", big)
    assert store.get("t", "k") is big  # the hot tier holds the received buffer itself
    store.put("t", "v", borrowed)
    borrowed[:6] = b"CHANGE"
    assert store.get("t", "v") == b"reused later"
