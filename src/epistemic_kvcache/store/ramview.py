"""The durable layer's one view of the engine's RAM (keys, blobs, pins, tags, records).

How it works
------------
The batch decision (`store/plan.py`, its `Reader`), the compactor (`store/compaction.py`,
its `LiveRam`) and the checkpointer (`store/checkpointer.py`, its `RowSource`) each
read RAM through a small protocol of their own; `RamView` answers all three from a
`TieredEngine`. Each call takes the engine's lock, except those named `*_locked`, made
by a caller that holds it already. The few things only the durable store can do (point
RAM at a verified copy, queue a quarantine, evict a segment's blocks, note log bytes
for the checkpointer) are handed in as callables, so this module imports no store.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any

from epistemic_kvcache.store.engine import Move, TieredEngine, _Blob
from epistemic_kvcache.store.plan import KeyView

__all__ = ["RamView"]


@dataclass(eq=False)
class RamView:
    """RAM as the batch decision (`store/plan.py`, its `Reader`) and the compactor
    (`store/compaction.py`, its `LiveRam`) read it: each call takes the lock, but those
    named `*_locked`, made with it held."""

    s: TieredEngine
    _: KW_ONLY
    live_capacity_bytes: int
    relocate_blob: Callable[[_Blob, tuple[int, int], tuple[int, int]], None]
    quarantine_async: Callable[[bytes, tuple[int, int]], None]
    evict_segment: Callable[[int], bool]
    checkpoint_due: Callable[[int], None]

    def __post_init__(self) -> None:
        self.max_keys_per_tenant = self.s.options.max_keys_per_tenant
        self.cold_capacity_bytes = self.s.options.cold_capacity_bytes

    def key(self, ns: str, key: str) -> KeyView | None:
        with self.s._lock:
            return self.key_locked(ns, key)

    def blob(self, sdig: bytes) -> _Blob | None:
        return self.s._blobs.get(sdig)

    def key_refs(self, sdig: bytes) -> list[tuple[str, str]]:
        with self.s._lock:
            b = self.s._blobs.get(sdig)
            return b.key_refs() if b is not None else []

    def meta(self, kind: str, tenant: str, rid: str) -> dict[str, Any] | None:
        return self.s._meta(kind).get(tenant, {}).get(rid)

    def ns_keys(self, ns: str) -> list[str]:
        with self.s._lock:
            return list(self.s._index.get(ns) or ())

    def cold_bytes(self) -> int:
        with self.s._lock:
            return self.s._total.cold_bytes

    def lru_victims(self, need: int, skip: set[bytes]) -> list[tuple[bytes, int]] | None:
        victims: list[tuple[bytes, int]] = []
        with self.s._lock:
            for b in self.s._blobs.values():  # least recently used first
                if need <= 0:
                    break
                if b.pins or b.sdig in skip:
                    continue
                victims.append((b.sdig, b.size))
                need -= b.size
        return victims if need <= 0 else None

    def epoch(self, tenant: str, scope: str) -> int:
        return self.s._epoch_current(tenant, scope)

    def first_write_wins(self, ns: str) -> bool:
        return self.s._fww(ns)

    def check_key_quota(self, ns: str, pending: int) -> None:
        with self.s._lock:
            self.s._check_key_quota(ns, pending)

    def check_pin_quota(self, tenant: str, extra: int) -> None:
        with self.s._lock:
            self.s._check_pin_quota(tenant, extra)

    def check_snapshot_quota(self, tenant: str, pending: int) -> None:
        with self.s._lock:
            self.s._check_snapshot_quota(tenant, pending)

    def now(self) -> float:
        return time.time()

    # -- what the compactor asks ---------------------------------------------------------
    def key_locked(self, ns: str, key: str) -> KeyView | None:
        s = self.s
        b = s._lookup(ns, key)
        if b is None:
            return None
        ref = (ns, key)
        return KeyView(b.sdig, b.size, s._pins.get(ref, 0), s._tags.get(ref))

    def use_order(self) -> list[tuple[int, int, int]]:
        with self.s._lock:
            return [(b.seg, b.size, b.pins) for b in self.s._blobs.values()]

    def relocate(self, sdig: bytes, wrong: tuple[int, int], right: tuple[int, int]) -> None:
        b = self.s._blobs.get(sdig)
        if b is not None:
            self.relocate_blob(b, wrong, right)

    def move_locked(self, sdig: bytes, old: tuple[int, int], new: tuple[int, int]) -> int:
        b = self.s._blobs.get(sdig)
        if b is None or (b.seg, b.off) != old:
            return 0
        self.s._apply([Move(sdig, new[0], new[1])])
        return b.size
