"""`RamTiers` (store/tiers.py) on its own: admission, victims, rebalance, leaving RAM,
over a real `Ledger` and codec, with nothing below RAM (`NoLowerTier`) or a lower tier
that keeps every block."""

from __future__ import annotations

import os
import threading

import pytest

from epistemic_kvcache.store.api import Buffer
from epistemic_kvcache.store.codec import WarmCodec
from epistemic_kvcache.store.model import INLINE_MAX_BYTES, Ledger, _Blob
from epistemic_kvcache.store.seams import LowerTier, NoLowerTier
from epistemic_kvcache.store.tiers import RamTiers


class KeepsAll(NoLowerTier):
    """A lower tier that holds every block (as the disk log does); counts `hot_full`."""

    keeps_blocks = True

    def __init__(self) -> None:
        self.hot_full_calls = 0

    def hot_full(self) -> None:
        self.hot_full_calls += 1


class Parts:
    def __init__(self, hot: int, warm: int, lower: LowerTier) -> None:
        self.lock = threading.Lock()
        self.ledger = Ledger()
        self.evicted: list[_Blob] = []
        self.tiers = RamTiers(
            lock=self.lock,
            ledger=self.ledger,
            codec=WarmCodec(),
            hot_capacity_bytes=hot,
            warm_capacity_bytes=warm,
            lower=lower,
            evict=self.evict,
        )

    def evict(self, b: _Blob) -> None:
        """What the engine does (lock held): the blob leaves RAM and the ledger."""
        if b.hot is not None:
            self.tiers.set_hot(b, None)
        if b.warm is not None:
            self.tiers.set_warm(b, None)
        self.evicted.append(b)

    def add_hot(self, name: str, data: Buffer) -> _Blob:
        b = _Blob(name.encode().rjust(32, b"-"), len(data))
        b.owner = "t"
        b.refs = 1  # referenced by a key (rebalance leaves unreferenced blobs alone)
        self.ledger.account(b, +1)  # a new blob enters the ledger with no tier
        with self.lock:
            assert self.tiers.hot_room(len(data))
            self.tiers.set_hot(b, data)
        return b


def compressible(n: int) -> bytes:
    return b"abcd" * (n // 4)


def test_hot_admission_never_exceeds_capacity_and_asks_the_lower_tier_for_room() -> None:
    lower = KeepsAll()
    p = Parts(hot=3000, warm=10_000, lower=lower)
    for i in range(3):
        p.add_hot(f"b{i}", compressible(1000))
    with p.lock:
        # the victim would need compressing (warm can take it): refused under the lock
        assert not p.tiers.hot_room(1000)
    assert lower.hot_full_calls == 1
    assert p.ledger.total.hot_bytes == 3000
    assert not p.tiers.hot_room(3001)  # larger than the tier: never admitted


@pytest.mark.parametrize("keeps", [False, True])
def test_without_warm_room_victims_leave_hot_under_the_lock(keeps: bool) -> None:
    p = Parts(hot=2000, warm=0, lower=KeepsAll() if keeps else NoLowerTier())
    first = p.add_hot("b0", compressible(1000))
    p.add_hot("b1", compressible(1000))
    p.add_hot("b2", compressible(1000))  # admitted: b0 left hot to make room
    assert first.hot is None
    assert first.sdig not in p.tiers.hot
    assert p.ledger.total.hot_bytes == 2000
    if keeps:  # dropped from RAM: the lower tier has it
        assert p.evicted == []
        assert p.ledger.total.demotions == 1
    else:  # nothing below: the block leaves the store
        assert p.evicted == [first]


def test_victims_skip_pinned_and_busy_blocks_and_prefer_cold_ones() -> None:
    p = Parts(hot=10_000, warm=10_000, lower=NoLowerTier())
    a, b, c = (p.add_hot(n, compressible(100)) for n in ("a", "b", "c"))
    a.pins = 1
    b.busy = True
    assert p.tiers.pick_victim(p.tiers.hot) is c
    b.busy = False
    b.hits = 16  # valuable: c, less recent but never read, goes first
    assert p.tiers.pick_victim(p.tiers.hot) is c
    c.pins = 1
    assert p.tiers.pick_victim(p.tiers.hot) is b


def test_rebalance_compresses_victims_into_warm() -> None:
    p = Parts(hot=4000, warm=4000, lower=NoLowerTier())
    blobs = [p.add_hot(f"b{i}", compressible(1000)) for i in range(4)]
    p.tiers.rebalance(hot_target=2000)
    assert p.ledger.total.hot_bytes == 2000
    moved = [b for b in blobs if b.warm is not None]
    assert len(moved) == 2
    assert all(b.hot is None for b in moved)
    assert p.ledger.total.warm_bytes == sum(len(b.warm or b"") for b in moved) < 2000
    assert p.ledger.total.demotions == 2
    assert p.tiers.leaving == 0


@pytest.mark.parametrize("keeps", [False, True])
def test_incompressible_victims_stay_raw_only_when_nothing_lies_below(keeps: bool) -> None:
    p = Parts(hot=2000, warm=4000, lower=KeepsAll() if keeps else NoLowerTier())
    b = p.add_hot("b0", os.urandom(1000))
    p.tiers.rebalance(hot_target=0)
    assert b.hot is None
    if keeps:
        assert b.warm is None  # the lower tier has it: not worth RAM uncompressed
    else:
        assert b.warm is not None
        assert len(b.warm) == 1000


@pytest.mark.parametrize("keeps", [False, True])
def test_warm_room_makes_its_victims_leave_ram(keeps: bool) -> None:
    p = Parts(hot=10_000, warm=1000, lower=KeepsAll() if keeps else NoLowerTier())
    b = p.add_hot("b0", os.urandom(800))
    with p.lock:
        p.tiers.set_warm(b, bytes(800))
        assert p.tiers.warm_room(500)
    assert b.warm is None
    assert p.ledger.total.warm_bytes == 0
    assert (p.evicted == []) is keeps


def test_cheap_room_depends_on_what_the_victims_cost() -> None:
    assert Parts(hot=100, warm=0, lower=KeepsAll()).tiers.cheap_room()
    assert not Parts(hot=100, warm=100, lower=KeepsAll()).tiers.cheap_room()
    small = Parts(hot=1 << 20, warm=1 << 20, lower=NoLowerTier())
    small.add_hot("s", compressible(1000))
    assert small.tiers.cheap_room()
    big = Parts(hot=1 << 20, warm=1 << 20, lower=NoLowerTier())
    big.add_hot("big", compressible(INLINE_MAX_BYTES + 4))
    assert not big.tiers.cheap_room()
