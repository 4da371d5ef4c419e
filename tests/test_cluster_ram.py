"""store/cluster_ram.py on its own (no cluster): the block cache, the key memo and
reads while the cluster is down."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.store.cluster_ram import BlockCache, KeyMemo, RamTier
from epistemic_kvcache.store.engine import digest_of


@pytest.fixture
def cache() -> Iterator[BlockCache]:
    c = BlockCache(
        StoreOptions(hot_capacity_bytes=64 << 10, warm_capacity_bytes=0, max_block_bytes=64 << 10)
    )
    yield c
    c.close()


def test_admit_keys_blocks_by_tenant_and_digest(cache: BlockCache) -> None:
    data = b"x" * 1000
    d = digest_of(data)
    assert not cache.has("a", d)
    cache.admit("a", d, data)
    cache.admit("a", d, data)  # again: nothing changes
    assert cache.has("a", d)
    assert bytes(cache.block("a", d) or b"") == data
    assert not cache.has("b", d)  # namespace scope: another tenant's copy is not ours
    assert cache.block("b", d) is None
    assert cache.stats("a").tiers["hot"].bytes == 1000


def test_admit_stays_within_the_tiers(cache: BlockCache) -> None:
    blocks = [bytes([i]) * (20 << 10) for i in range(8)]  # 160 KiB through 64 KiB of hot
    for b in blocks:
        cache.admit("a", digest_of(b), b)
    assert cache.stats(None).tiers["hot"].bytes <= 64 << 10
    assert cache.has("a", digest_of(blocks[-1]))  # the newest is kept
    big = b"z" * (65 << 10)
    cache.admit("a", digest_of(big), big)  # larger than the tiers: simply not cached
    assert not cache.has("a", digest_of(big))


def test_the_memo_is_a_bounded_lru() -> None:
    memo = KeyMemo(limit=3)
    for i in range(3):
        memo.remember("t", f"k{i}", bytes([i]) * 32, 10)
    memo.remember("t", "k0", b"\x09" * 32, 10)  # refreshed: now the newest
    memo.remember("t", "k3", b"\x03" * 32, 10)  # evicts k1, the oldest
    assert memo.digest("t", "k1") is None
    assert memo.digest("t", "k0") == b"\x09" * 32
    memo.forget("t", "k0")
    assert memo.digest("t", "k0") is None
    memo.remember("u", "k0", b"\x01" * 32, 1)
    memo.forget_tenant("t")
    assert [memo.digest("t", k) for k in ("k2", "k3")] == [None, None]
    assert memo.digest("u", "k0") == b"\x01" * 32


def test_answers_while_down_need_the_digest_and_the_bytes(cache: BlockCache) -> None:
    ram = RamTier(cache)
    data = b"y" * 500
    d = digest_of(data)
    assert ram.answer_while_down("t", "k") is None  # never seen
    ram.memo.remember("t", "k", d, len(data))
    assert ram.answer_while_down("t", "k") is None  # seen, bytes not held
    cache.admit("t", d, data)
    assert bytes(ram.answer_while_down("t", "k") or b"") == data
    assert ram.counts["ram_answers_while_down"] == 1
