"""The store's non-blocking calls (`get_nowait`, `put_nowait`) and the durable
backend's pre-zeroed segment tail, on both real backends."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epistemic_kvcache.errors import InvalidKeyError
from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.shared import MAX_KEY_BYTES, validate_key
from epistemic_kvcache.store import PutResult, SharedKvIndex, SharedKvStoreBackend
from epistemic_kvcache.store.api import PutOutcome
from epistemic_kvcache.store.engine import INLINE_MAX_BYTES, WOULD_BLOCK
from epistemic_kvcache.store.segments import DELETE_RESERVE_BYTES

NS = "tenant"


def durable(path: Path, **kw: int) -> SharedKvStoreBackend:
    return SharedKvStoreBackend(
        path,
        StoreOptions(map_size_bytes=64 << 20, warm_capacity_bytes=0, **kw),  # type: ignore[arg-type]
    )


def test_memory_get_nowait_hit_and_miss_are_counted_once() -> None:
    store = SharedKvIndex(StoreOptions(warm_capacity_bytes=0))
    store.put(NS, "k", b"v" * 100)
    assert store.get_nowait(NS, "k") == b"v" * 100
    assert store.get_nowait(NS, "absent") is None
    st = store.stats(NS)
    assert (st.get_hits, st.get_misses) == (1, 1)
    with pytest.raises(InvalidKeyError):
        store.get_nowait(NS, "")


def test_exists_nowait_counts_each_mention_and_skips_stale_keys() -> None:
    """The engine's own `exists_nowait` (what every RESP EXISTS runs) answers as
    `exists_many` summed: one count per mention, absent keys and other namespaces 0,
    a key whose epoch scope went stale not counted."""
    store = SharedKvIndex(StoreOptions(warm_capacity_bytes=0))
    store.put(NS, "a", b"1")
    store.put(NS, "b", b"2")
    store.put("other", "c", b"3")
    for keys in (["a"], ["a", "a", "b"], ["a", "absent", "c"], []):
        assert store.exists_nowait(NS, keys) == sum(store.exists_many(NS, keys))
    assert store.exists_nowait("nobody", ["a"]) == 0
    store.put(NS, "scoped", b"4", epoch_scope="s")
    assert store.exists_nowait(NS, ["scoped"]) == 1
    store.epoch_bump(NS, "s")
    assert (
        store.exists_nowait(NS, ["scoped", "a"]) == 1 == sum(store.exists_many(NS, ["scoped", "a"]))
    )
    store.close()
    with pytest.raises(Exception, match="closed"):
        store.exists_nowait(NS, ["a"])


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.text(max_size=MAX_KEY_BYTES + 2),
        st.text(alphabet="a", min_size=MAX_KEY_BYTES - 1, max_size=MAX_KEY_BYTES + 1),
    )
)
def test_the_ascii_shortcut_accepts_exactly_what_validate_key_accepts(key: str) -> None:
    """The engine skips `validate_key` for short ASCII keys: every key it then takes or
    refuses is one `validate_key` takes or refuses."""
    try:
        validate_key(key)
        valid = True
    except InvalidKeyError:
        valid = False
    try:
        found = _SHORTCUT_STORE.exists_nowait(NS, [key])
    except InvalidKeyError:
        assert not valid
    else:
        assert valid
        assert found == 0


_SHORTCUT_STORE = SharedKvIndex(StoreOptions(warm_capacity_bytes=0))


def test_memory_put_nowait_small_is_done_large_or_full_would_block() -> None:
    store = SharedKvIndex(StoreOptions(hot_capacity_bytes=1 << 20, warm_capacity_bytes=1 << 20))
    r = store.put_nowait(NS, "small", b"x" * 1000)
    assert isinstance(r, PutResult)
    assert r.outcome is PutOutcome.NEW
    again = store.put_nowait(NS, "small", b"y" * 1000)
    assert isinstance(again, PutResult)
    assert again.outcome is PutOutcome.REPLACED
    assert bytes(store.get(NS, "small") or b"") == b"y" * 1000
    refused = store.put_nowait(NS, "small", b"z" * 1000, cond="nx")
    assert isinstance(refused, PutResult)
    assert refused.outcome is PutOutcome.CONFLICT
    assert store.put_nowait(NS, "big", os.urandom(INLINE_MAX_BYTES + 1)) is WOULD_BLOCK
    assert store.exists(NS, "big") is False
    store.put(NS, "fill", os.urandom((1 << 20) - 1000))  # hot tier now full
    assert store.put_nowait(NS, "more", b"z" * 1000) is WOULD_BLOCK
    assert store.stats(None).tiers["hot"].bytes <= 1 << 20


def test_memory_put_nowait_into_a_full_cache_evicts_inline_within_the_bound() -> None:
    # no warm tier: making room only drops blocks, so a full cache still answers inline
    cap = 64 * 4096
    store = SharedKvIndex(StoreOptions(hot_capacity_bytes=cap, warm_capacity_bytes=0))
    for i in range(200):
        r = store.put_nowait(NS, f"k{i}", os.urandom(4096))
        assert isinstance(r, PutResult), i
        assert store.stats(None).tiers["hot"].bytes <= cap
    st = store.stats(NS)
    assert st.evictions == 200 - 64
    assert store.count(NS) == 64
    assert store.exists(NS, "k199")
    assert not store.exists(NS, "k0")  # the least recent went
    assert store.check().ok


def test_memory_put_nowait_into_a_full_cache_compresses_only_small_victims_inline() -> None:
    cap = 1 << 20
    store = SharedKvIndex(StoreOptions(hot_capacity_bytes=cap, warm_capacity_bytes=cap))
    for i in range(300):  # small, compressible blocks: demoted to warm on the caller's thread
        block = i.to_bytes(4, "little") + bytes(4092)  # unique, compressible
        assert isinstance(store.put_nowait(NS, f"s{i}", block), PutResult)
    hot = store.stats(None).tiers["hot"]
    assert hot.bytes <= cap
    assert store.stats(None).tiers["warm"].blocks > 0
    # a large block among the next victims: compressing it is not for the caller's thread
    store.put(NS, "large", os.urandom(INLINE_MAX_BYTES + 1))
    store.flush(NS)
    store.put(NS, "large", os.urandom(INLINE_MAX_BYTES + 1))
    store.put(NS, "filler", os.urandom(cap - INLINE_MAX_BYTES - 1))
    assert store.put_nowait(NS, "one-more", b"z" * 4096) is WOULD_BLOCK
    assert store.check().ok


def test_durable_put_nowait_returns_a_future_resolved_once_on_disk(tmp_path: Path) -> None:
    store = durable(tmp_path)
    try:
        fut = store.put_nowait(NS, "k", b"d" * 4096)
        assert isinstance(fut, concurrent.futures.Future)
        assert fut.result(10).outcome is PutOutcome.NEW
        dup = store.put_nowait(NS, "k", b"d" * 4096)  # answered from RAM, no commit
        assert isinstance(dup, PutResult)
        assert dup.outcome is PutOutcome.DUPLICATE
        assert store.get_nowait(NS, "k") == b"d" * 4096
        assert store.evict(NS, "k")  # RAM copy dropped: reading needs the disk
        assert store.get_nowait(NS, "k") is WOULD_BLOCK
        assert store.stats(NS).get_hits == 1  # WOULD_BLOCK counted nothing
        assert store.get(NS, "k") == b"d" * 4096
    finally:
        store.close()
    store = durable(tmp_path)
    try:
        assert store.get(NS, "k") == b"d" * 4096
    finally:
        store.close()


def test_durable_futures_awaited_from_asyncio_share_group_commits(tmp_path: Path) -> None:
    store = durable(tmp_path)
    before = store.stats(None).extra["commit_batches"]

    async def main() -> list[PutResult]:
        started = [store.put_nowait(NS, f"k{i}", os.urandom(4096)) for i in range(32)]
        futs = [s for s in started if isinstance(s, concurrent.futures.Future)]
        assert len(futs) == 32
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futs)))

    try:
        results = asyncio.run(main())
        assert all(r.outcome is PutOutcome.NEW for r in results)
        assert store.stats(None).extra["commit_batches"] - before < 32
        assert store.check(deep=True).ok
    finally:
        store.close()


def test_prezeroed_segment_tail_is_dropped_on_reopen(tmp_path: Path) -> None:
    store = durable(tmp_path)
    blocks = {f"k{i}": os.urandom(4096) for i in range(20)}
    try:
        for key, data in blocks.items():
            store.put(NS, key, data)
        committed = store.stats(None).extra["segment_bytes"]
        assert 20 * 4096 < committed < 20 * (4096 + 400)  # blocks plus record headers
        (seg,) = (tmp_path / "segments").glob("*.seg")
        assert seg.stat().st_size > committed  # zeroed space kept past the end
        assert store.check(deep=True).ok
    finally:
        store.close()
    store = durable(tmp_path)
    try:
        assert seg.stat().st_size == committed
        for key, data in blocks.items():
            assert store.evict(NS, key)
            assert store.get(NS, key) == data
        more = os.urandom(4096)
        store.put(NS, "after", more)  # appended where the last batch ended
        assert store.get(NS, "after") == more
        assert store.check(deep=True).ok
    finally:
        store.close()


def test_large_batches_are_not_prezeroed(tmp_path: Path) -> None:
    store = durable(tmp_path)
    try:
        store.put(NS, "big", os.urandom(1 << 20))
        (seg,) = (tmp_path / "segments").glob("*.seg")
        written = store.stats(None).extra["segment_bytes"]
        assert (1 << 20) < written < (1 << 20) + 1024  # the block and its records
        # no pre-zeroing for speed after a large batch: only the delete reserve
        assert seg.stat().st_size == written + DELETE_RESERVE_BYTES
    finally:
        store.close()
