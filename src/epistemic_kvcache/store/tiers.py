"""The RAM tiers: hot (uncompressed) and warm (compressed), byte-bounded.

How it works
------------
`hot` and `warm` are LRU `OrderedDict`s of blobs (least recently used first). A block
enters hot only through `hot_room` and warm only through `warm_room` (RAM lock
held), so neither ever holds more than its capacity, whatever the path (single or batch
PUT, a read that promotes).

To make room, a victim is picked among the least recently used few (`pick_victim`),
blending recency with value (hits, external importance); pinned blocks and blocks being
moved are never chosen. `rebalance` compresses its victims *outside* the lock (the
victim is marked `busy` meanwhile) and moves them to warm; a block that does not
compress below the codec's ratio is kept raw in warm when nothing lies below RAM, or
just dropped from RAM when the lower tier keeps every block. When warm has no room for
a copy, its victims leave RAM: dropped (a lower tier keeps them) or evicted with all
their keys (`evict`, given by the engine).

Every change of a blob's tier moves its footprint in the `Ledger` (model.py), so the
per-namespace and store-wide occupancy stay exact.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable

from epistemic_kvcache.store.api import Buffer, read_only
from epistemic_kvcache.store.codec import WarmCodec
from epistemic_kvcache.store.model import _VICTIM_WINDOW, INLINE_MAX_BYTES, Ledger, _Blob
from epistemic_kvcache.store.seams import LowerTier


class RamTiers:
    """Admission, victims and movement of the hot and warm tiers."""

    def __init__(
        self,
        *,
        lock: threading.Lock,
        ledger: Ledger,
        codec: WarmCodec,
        hot_capacity_bytes: int,
        warm_capacity_bytes: int,
        lower: LowerTier,
        evict: Callable[[_Blob], None],
    ) -> None:
        """`lock`: the engine's; `evict(b)`: drop a block and every key of it (lock held)."""
        self._lock = lock
        self._ledger = ledger
        self._total = ledger.total
        self.codec = codec
        self.hot_capacity_bytes = hot_capacity_bytes
        self.warm_capacity_bytes = warm_capacity_bytes
        self.lower = lower
        self._evict = evict
        self.hot: OrderedDict[bytes, _Blob] = OrderedDict()
        self.warm: OrderedDict[bytes, _Blob] = OrderedDict()
        self.leaving = 0  # bytes of hot blobs being demoted right now

    def set_hot(self, b: _Blob, data: Buffer | None) -> None:
        """Put `data` (owned by the store: nobody else writes it) in hot, or take `b` out
        (lock held). The hot copy is what a GET hands out, so it is kept read-only."""
        if data is not None:
            data = read_only(data)
        self._ledger.account(b, -1)
        if b.hot is not None:
            self.hot.pop(b.sdig, None)
        b.hot = data
        if data is not None:
            self.hot[b.sdig] = b
        self._ledger.account(b, +1)

    def set_warm(self, b: _Blob, data: bytes | None) -> None:
        """Put a warm copy of `b` in warm, or take it out (lock held)."""
        self._ledger.account(b, -1)
        if b.warm is not None:
            self.warm.pop(b.sdig, None)
        b.warm = data
        if data is not None:
            self.warm[b.sdig] = b
        self._ledger.account(b, +1)

    def hot_room(self, size: int) -> bool:
        """Whether `size` more bytes fit in the hot tier now (lock held): the one
        admission test of the tier, so it never holds more than its capacity.

        Victims that leave hot without codec work (no warm copy to make: the warm tier is
        off or too small for them) are demoted here, under the lock. A victim that needs
        compressing is not: the block is refused (the lower tier is told: `hot_full`),
        and the caller keeps it where it is (on disk) or places it itself; blocking
        callers make room beforehand with `make_hot_room`, the codec work outside the
        lock."""
        cap = self.hot_capacity_bytes
        if size > cap:
            return False
        while self._total.hot_bytes + size > cap:
            victim = self.pick_victim(self.hot)
            if victim is None or 0 < victim.size <= self.warm_capacity_bytes:
                self.lower.hot_full()
                return False
            self.demote(victim, None)
        return True

    def warm_room(self, nbytes: int) -> bool:
        """Whether a warm copy of `nbytes` fits, after the least valuable warm blocks
        left RAM for it (lock held): every block enters warm through it."""
        cap = self.warm_capacity_bytes
        if nbytes > cap:
            return False
        while self._total.warm_bytes + nbytes > cap:
            victim = self.pick_victim(self.warm)
            if victim is None:
                return False
            self.leave_ram(victim)
        return True

    def make_hot_room(self, sizes: Iterable[int]) -> None:
        """Before blocks of `sizes` enter hot (a blocking caller, off the event loop):
        demote until they fit, compressing the victims outside the lock. Their admission
        (`hot_room`) stays the bound; this only keeps new blocks from being refused."""
        cap = self.hot_capacity_bytes
        need = min(sum(n for n in sizes if n <= cap), cap)
        if need and self._total.hot_bytes + need > cap:  # unlocked look: a hint
            self.rebalance(cap - need)

    def cheap_room(self) -> bool:
        """Whether a PUT into a full hot tier may still run on the caller's thread: the
        blocks hot would demote next leave it without codec work (no warm tier), or with
        little (nothing below RAM, and each is at most `INLINE_MAX_BYTES`: a few tens of
        microseconds, like the hash). A full cache, the normal state of one, must not send
        every PUT to the thread pool."""
        if self.warm_capacity_bytes == 0:
            return True
        if self.lower.keeps_blocks:
            return False  # the committer's thread applies: leave the codec work to it
        with self._lock:
            for n, b in enumerate(self.hot.values()):
                if n >= _VICTIM_WINDOW:
                    return True
                if b.size > INLINE_MAX_BYTES:
                    return False
        return True

    @staticmethod
    def score(b: _Blob, rank: int) -> float:
        """Lower is evicted first: recency rank blended with hits and importance."""
        recency = rank / _VICTIM_WINDOW
        value = min(b.hits, 16) / 16
        return 0.5 * recency + 0.2 * value + 0.3 * b.importance

    def pick_victim(self, tier: OrderedDict[bytes, _Blob]) -> _Blob | None:
        best: _Blob | None = None
        best_score = 0.0
        rank = 0
        for b in tier.values():
            if b.pins or b.busy:
                continue
            if rank == 0 and not b.hits and not b.importance:
                return b  # score 0: nothing can score lower (the common case)
            s = self.score(b, rank)
            if best is None or s < best_score:
                best, best_score = b, s
            rank += 1
            if rank >= _VICTIM_WINDOW:
                break
        return best

    def rebalance(self, hot_target: int | None = None) -> None:
        """Demote hot -> warm (-> out of RAM) until hot holds at most `hot_target` bytes
        (default: its capacity) and warm fits its capacity (lock NOT held)."""
        target = self.hot_capacity_bytes if hot_target is None else hot_target
        total = self._total
        if (
            total.hot_bytes - self.leaving <= target
            and total.warm_bytes <= self.warm_capacity_bytes
        ):
            return  # nothing to do (unlocked look: whoever adds bytes calls this after)
        while True:
            with self._lock:
                victim = None
                while total.hot_bytes - self.leaving > target:
                    victim = self.pick_victim(self.hot)
                    if victim is None:
                        break
                    data = victim.hot
                    if data is not None and 0 < victim.size <= self.warm_capacity_bytes:
                        victim.busy = True  # compressed outside the lock, below
                        self.leaving += victim.size
                        break
                    self.demote(victim, None)  # nothing to compress: it leaves hot now
                    victim = None
                if victim is None:
                    break
            comp: bytes | None = None
            try:
                if data is not None and 0 < victim.size <= self.warm_capacity_bytes:
                    comp = self.codec.compress(data)
                    if comp is None and not self.lower.keeps_blocks:
                        comp = bytes(data)  # the only copy: kept raw
            finally:
                with self._lock:
                    victim.busy = False
                    self.leaving -= victim.size
                    if victim.hot is data and data is not None and victim.refs > 0:
                        self.demote(victim, comp)
        with self._lock:
            while total.warm_bytes > self.warm_capacity_bytes:
                victim = self.pick_victim(self.warm)
                if victim is None:
                    break
                self.leave_ram(victim)

    def demote(self, b: _Blob, warm_copy: bytes | None) -> None:
        """Move `b` out of hot, into warm when `warm_copy` is given and warm has room
        for it (lock held)."""
        if warm_copy is not None and self.warm_room(len(warm_copy)):
            self.set_warm(b, warm_copy)
        elif not self.lower.keeps_blocks:
            self._evict(b)  # no warm copy and nothing below: the block leaves the store
            return
        self.set_hot(b, None)
        self._ledger.bump(b, "demotions")

    def leave_ram(self, b: _Blob) -> None:
        """Warm victim: drop the RAM copy (a lower tier keeps the block) or evict the
        block (lock held)."""
        if self.lower.keeps_blocks:
            self.set_warm(b, None)
            self._ledger.bump(b, "demotions")
        else:
            self._evict(b)
