"""`Ledger` (store/model.py): a blob's footprint moves with it and counts per namespace."""

from __future__ import annotations

from epistemic_kvcache.store.api import PutOutcome
from epistemic_kvcache.store.model import Ledger, _Blob


def blob(size: int, owner: str | dict[str, int]) -> _Blob:
    b = _Blob(b"x" * 32, size)
    b.owner = owner
    return b


def test_footprint_goes_to_every_owner_and_the_total() -> None:
    led = Ledger()
    b = blob(100, {"t": 1, "u": 2})
    b.hot = b"h" * 100
    b.warm = b"w" * 40
    b.seg, b.pins = 3, 1
    led.account(b, +1)
    for c in (led.total, led.counters("t"), led.counters("u")):
        assert (c.unique_blocks, c.hot_bytes, c.warm_bytes, c.warm_logical) == (1, 100, 40, 100)
        assert (c.cold_bytes, c.pinned_bytes, c.resident_bytes) == (100, 100, 100)
    led.account(b, -1)
    assert led.total.unique_blocks == 0
    assert led.total.hot_peak == 100


def test_put_outcomes_and_events_are_counted_once_per_place() -> None:
    led = Ledger()
    led.count_put("t", PutOutcome.NEW, True)
    led.count_put("t", PutOutcome.REPLACED, False)
    led.count_put("t", PutOutcome.DUPLICATE, False)
    led.count_put("t", PutOutcome.CONFLICT, False)
    c = led.counters("t")
    assert (c.put_new, c.put_replaced, c.dedup_hits, c.put_conflicts) == (1, 1, 2, 1)
    assert led.total == c
    led.bump(blob(1, "t"), "promotions")
    assert led.total.promotions == led.counters("t").promotions == 1


def test_stats_show_cold_only_where_there_is_a_cold_tier() -> None:
    led = Ledger()
    assert "cold" not in led.total.stats({"hot": 1, "warm": 2}).tiers
    s = led.total.stats({"hot": 1, "warm": 2, "cold": 3})
    assert s.tiers["cold"].capacity_bytes == 3
    assert s.tiers["hot"].capacity_bytes == 1
