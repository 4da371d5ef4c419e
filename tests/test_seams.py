"""The engine's seams (store/seams.py): the tier engine composed with another lower tier
and the apply-now sequencer, without subclassing anything of the engine."""

from __future__ import annotations

import concurrent.futures
import os

from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.store.api import Buffer, PutOutcome, PutResult
from epistemic_kvcache.store.codec import WarmCodec
from epistemic_kvcache.store.memory import ApplyNow, SharedKvIndex
from epistemic_kvcache.store.model import _Blob, digest_of
from epistemic_kvcache.store.seams import EpochSource, LowerTier, NoLowerTier, Sequencer


class DictLower(NoLowerTier):
    """A lower tier keeping every block's bytes in a dict (by scoped digest)."""

    keeps_blocks = True

    def __init__(self) -> None:
        self.blocks: dict[bytes, bytes] = {}
        self.quarantined: list[bytes] = []

    def blob_created(self, b: _Blob) -> None:
        assert b.hot is not None  # new bytes always enter hot in these tests
        self.blocks[b.sdig] = bytes(b.hot)

    def blob_destroyed(self, b: _Blob) -> None:
        self.blocks.pop(b.sdig, None)

    def caps(self) -> dict[str, int]:
        return {"cold": 1 << 20}

    def read(self, b: _Blob, loc: tuple[int, int]) -> Buffer | None:
        return self.blocks.get(b.sdig)

    def quarantine(self, b: _Blob, reason: str, loc: tuple[int, int]) -> bool:
        self.quarantined.append(b.sdig)
        return False  # the engine drops the blob


def composed(lower: LowerTier) -> SharedKvIndex:
    store = SharedKvIndex(
        StoreOptions(hot_capacity_bytes=4096, warm_capacity_bytes=0), codec=WarmCodec()
    )
    store._compose(sequencer=ApplyNow(store.ram, store.catalog), lower=lower)
    return store


def test_the_parts_satisfy_their_protocols() -> None:
    store = SharedKvIndex()
    parts: tuple[LowerTier, Sequencer, EpochSource] = (
        NoLowerTier(),
        ApplyNow(store.ram, store.catalog),
        store.ram.epochs,
    )
    assert all(p is not None for p in parts)


def test_blocks_leaving_ram_are_read_back_from_the_lower_tier() -> None:
    lower = DictLower()
    store = composed(lower)
    data = {f"k{i}": os.urandom(2048) for i in range(4)}
    for key, value in data.items():
        assert store.put("t", key, value).outcome is PutOutcome.NEW
    assert store.stats().tiers["hot"].bytes <= 4096  # two left RAM, kept below
    assert store.stats().tiers["cold"].capacity_bytes == 1 << 20
    for key, value in data.items():
        assert store.get("t", key) == value
    assert store.stats().promotions >= 2


def test_a_bad_lower_copy_is_a_miss_and_the_blob_is_dropped() -> None:
    lower = DictLower()
    store = composed(lower)
    store.put("t", "a", os.urandom(3000))
    store.put("t", "b", os.urandom(3000))  # "a" left hot: only the lower tier has it
    sdig = next(s for s in lower.blocks if store.ram.blob(s).hot is None)
    lower.blocks[sdig] = bytes(3000)  # damaged below
    assert store.get("t", "a") is None
    assert lower.quarantined == [sdig]
    assert store.stats().integrity_failures == 1
    assert store.exists("t", "a") is False
    assert store.check().ok


def test_apply_now_answers_at_once_whether_or_not_the_caller_waits() -> None:
    store = SharedKvIndex()
    seq = ApplyNow(store.ram, store.catalog)
    data = b"x" * 100
    raw = store.ram.validate("t", "k")
    first = seq.put("t", raw, "k", data, None, None, False)
    assert isinstance(first, PutResult)
    assert first.outcome is PutOutcome.NEW
    again = seq.put("t", raw, "k", data, None, None, True)
    assert not isinstance(again, concurrent.futures.Future)
    assert again.outcome is PutOutcome.DUPLICATE
    assert again.digest == digest_of(data)
    refused = seq.put("t", raw, "k", b"y" * 100, None, "nx", True)
    assert refused.outcome is PutOutcome.CONFLICT
    assert store.get("t", "k") == data
