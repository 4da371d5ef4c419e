"""How effects change the store's RAM state: the only code that changes the index, the
blobs' refcounts and tiers' footprints, the pins, the tags and the records.

How it works
------------
`RamState` (ram.py) owns the containers and hands them, once, to an `EffectApplier`
(as it hands them to the hot core): `apply` takes a list of decided effects (`AddKey`,
`DelKey`, `PinDelta`, `MetaPut`, `MetaDel`, `Move`) and applies them in order, moving
every blob's footprint in the `Ledger` with it; `load` builds the same state in bulk
from the rows of an opened store. The caller holds the RAM lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sortedcontainers import SortedList

from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.store.api import read_only
from epistemic_kvcache.store.model import (
    AddKey,
    DelKey,
    Effect,
    Ledger,
    MetaPut,
    Move,
    PinDelta,
    _Blob,
    tenant_of,
)
from epistemic_kvcache.store.seams import LowerTier
from epistemic_kvcache.store.tiers import RamTiers

__all__ = ["EffectApplier", "Entry"]

Entry = tuple[str, str, bytes, int, int, int, tuple[str, int] | None, int]
"""A row loaded at open: (ns, key, scoped digest, size, segment, offset, tag, pins)."""


class EffectApplier:
    """Applies effects to the containers it was handed (see the module docstring)."""

    def __init__(
        self,
        *,
        options: StoreOptions,
        index: dict[str, dict[str, _Blob]],
        sorted_keys: dict[str, SortedList],
        blobs: dict[bytes, _Blob],
        pins: dict[tuple[str, str], int],
        tags: dict[tuple[str, str], tuple[str, int]],
        records: dict[str, dict[str, dict[str, dict[str, Any]]]],
        ledger: Ledger,
        tiers: RamTiers,
    ) -> None:
        self._options = options
        self._index = index
        self._sorted = sorted_keys
        self._blobs = blobs
        self._pins = pins
        self._tags = tags
        self._records = records
        self._ledger = ledger
        self._total = ledger.total
        self._tiers = tiers
        self.lower: LowerTier = tiers.lower
        """What lies below RAM (told when a blob is created, moved or destroyed)."""
        self.pinned_bytes = 0
        """Bytes of blobs with at least one pin."""

    def _lookup(self, ns: str, key: str) -> _Blob | None:
        idx = self._index.get(ns)
        return idx.get(key) if idx is not None else None

    def apply(self, effects: Sequence[Effect]) -> None:
        """Apply decided (and, for the durable backend, committed) effects (lock held)."""
        for e in effects:
            if isinstance(e, AddKey):
                self._apply_add(e)
            elif isinstance(e, DelKey):
                self._apply_del(e)
            elif isinstance(e, PinDelta):
                self._apply_pin(e)
            elif isinstance(e, MetaPut):
                self._records[e.kind].setdefault(e.tenant, {})[e.id] = e.record
            elif isinstance(e, Move):
                b = self._blobs.get(e.sdig)
                if b is not None:
                    self.lower.blob_destroyed(b)
                    b.seg, b.off = e.seg, e.off
                    self.lower.blob_created(b)
            else:
                recs = self._records[e.kind].get(e.tenant)
                if recs is not None:
                    recs.pop(e.id, None)

    def _apply_add(self, e: AddKey) -> None:
        b = self._blobs.get(e.sdig)
        c = self._ledger.counters(e.ns)
        tenant = tenant_of(e.ns)
        oc = c if tenant == e.ns else self._ledger.counters(tenant)
        if b is None:
            b = _Blob(e.sdig, e.size)
            b.seg, b.off = e.seg, e.off
            b.owner = {} if self._options.dedup_scope == "global" else tenant
            self._blobs[e.sdig] = b
            if e.data is not None and self._tiers.hot_room(e.size):
                b.hot = read_only(e.data)  # counted hot by the footprints below
                self._tiers.hot[e.sdig] = b
            Ledger.footprint(b, self._total, +1)
            if isinstance(b.owner, str):
                Ledger.footprint(b, oc, +1)
            self.lower.blob_created(b)
        b.refs += 1
        b.add_keyref((e.ns, e.key))
        if isinstance(b.owner, dict):
            n = b.owner.get(tenant, 0)
            b.owner[tenant] = n + 1
            if n == 0:
                Ledger.footprint(b, oc, +1)
        idx = self._index.get(e.ns)
        if idx is None:
            idx = self._index[e.ns] = {}
        if e.key not in idx:
            sl = self._sorted.get(e.ns)
            if sl is None:
                sl = self._sorted[e.ns] = SortedList()
            sl.add(e.key)
        idx[e.key] = b
        if e.tag is not None:
            self._tags[(e.ns, e.key)] = e.tag
        c.total_refs += 1
        c.logical_bytes += b.size
        self._total.total_refs += 1
        self._total.logical_bytes += b.size

    def _apply_del(self, e: DelKey) -> None:
        idx = self._index.get(e.ns)
        b = idx.pop(e.key, None) if idx is not None else None
        if b is None:
            return
        sl = self._sorted.get(e.ns)
        if sl is not None:
            sl.discard(e.key)
        c = self._ledger.counters(e.ns)
        tenant = tenant_of(e.ns)
        oc = c if tenant == e.ns else self._ledger.counters(tenant)
        self._tags.pop((e.ns, e.key), None)
        pins = self._pins.pop((e.ns, e.key), 0)
        if pins:
            self._change_pins(b, -pins)
        b.refs -= 1
        b.remove_keyref((e.ns, e.key))
        c.total_refs -= 1
        c.logical_bytes -= b.size
        self._total.total_refs -= 1
        self._total.logical_bytes -= b.size
        if e.evicted:
            c.evictions += 1
            self._total.evictions += 1
        if isinstance(b.owner, dict):
            n = b.owner[tenant] - 1
            if n == 0:
                Ledger.footprint(b, oc, -1)
                del b.owner[tenant]
            else:
                b.owner[tenant] = n
        if b.refs == 0:
            if isinstance(b.owner, str):
                Ledger.footprint(b, oc, -1)
            Ledger.footprint(b, self._total, -1)
            del self._blobs[b.sdig]
            if b.hot is not None:
                self._tiers.hot.pop(b.sdig, None)
            if b.warm is not None:
                self._tiers.warm.pop(b.sdig, None)
            b.hot = b.warm = None
            self.lower.blob_destroyed(b)

    def _apply_pin(self, e: PinDelta) -> None:
        b = self._lookup(e.ns, e.key)
        if b is None:
            return
        ref = (e.ns, e.key)
        n = self._pins.get(ref, 0) + e.delta
        if n > 0:
            self._pins[ref] = n
        else:
            self._pins.pop(ref, None)
        self._change_pins(b, e.delta)

    def _change_pins(self, b: _Blob, delta: int) -> None:
        was = b.pins > 0
        self._ledger.account(b, -1)
        b.pins += delta
        self._ledger.account(b, +1)
        if was != (b.pins > 0):
            self.pinned_bytes += b.size if b.pins > 0 else -b.size

    def load(self, entries: Iterable[Entry]) -> None:
        """Fill an empty store in bulk (opening a durable one): the same state as applying
        `AddKey` (+ `PinDelta`) per entry, built in a few passes (lock held)."""
        blobs = self._blobs
        glob = self._options.dedup_scope == "global"
        by_ns: dict[str, dict[str, _Blob]] = {}
        counters = self._ledger.counters
        for ns, key, sdig, size, seg, off, tag, pins in entries:
            b = blobs.get(sdig)
            if b is None:
                b = blobs[sdig] = _Blob(sdig, size)
                b.seg, b.off = seg, off
                b.owner = {} if glob else tenant_of(ns)
            b.refs += 1
            b.add_keyref((ns, key))
            if isinstance(b.owner, dict):
                t = tenant_of(ns)
                b.owner[t] = b.owner.get(t, 0) + 1
            idx = by_ns.get(ns)
            if idx is None:
                idx = by_ns[ns] = self._index.setdefault(ns, {})
            idx[key] = b
            if tag is not None:
                self._tags[(ns, key)] = tag
            if pins:
                self._pins[(ns, key)] = pins
                b.pins += pins
            c = counters(ns)
            c.total_refs += 1
            c.logical_bytes += b.size
        total = self._total
        for ns in by_ns:
            c = counters(ns)
            total.total_refs += c.total_refs
            total.logical_bytes += c.logical_bytes
            self._sorted[ns] = SortedList(self._index[ns])
        for b in blobs.values():
            Ledger.footprint(b, total, +1)
            for o in b.owners():
                Ledger.footprint(b, counters(o), +1)
            if b.pins:
                self.pinned_bytes += b.size
            self.lower.blob_created(b)
