"""Cluster mode's RAM tier: this front-end's copies of blocks, and what its keys named.

How it works
------------
`BlockCache` is the memory backend (hot and warm tiers) keyed (tenant, digest hex): a
digest's bytes never change, so nothing in it is ever invalidated; blocks enter already
verified (`admit`), so they are not hashed again. `KeyMemo` remembers, per (tenant, key),
the digest the cluster last said the key names (a bounded LRU): while the cluster is
unreachable, `RamTier.answer_while_down` serves a key from RAM when both are known.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict

from epistemic_kvcache.errors import CapacityError
from epistemic_kvcache.store.api import Buffer
from epistemic_kvcache.store.memory import SharedKvIndex

__all__ = ["BlockCache", "KeyMemo", "RamTier"]

MEMO_KEYS = 100_000
"""How many (tenant, key) -> digest answers a front-end remembers for reads while down."""


class BlockCache(SharedKvIndex):
    """This front-end's hot and warm tiers: the memory backend, keyed (tenant, digest hex).

    Blocks enter already verified (`admit`), so they are not hashed again; reads from
    warm are verified by the engine as usual."""

    def admit(self, ns: str, digest: bytes, data: Buffer) -> None:
        """Cache a verified block that the store owns already (`owned_buffer`'s answer, or
        bytes read from the cluster); a block the tiers cannot hold is simply not cached."""
        ram = self.ram
        sdig = ram.scoped(ns.encode(), digest)
        if not ram.has_blob(sdig):  # unlocked look: new bytes will need room in hot
            ram.tiers.make_hot_room((len(data),))  # codec work outside the lock
        with ram.lock:
            if ram.lookup_locked(ns, digest.hex()) is not None:
                return
            with contextlib.suppress(CapacityError):  # within the tiers' capacities, always
                self.put_locked(ns, digest.hex(), sdig, digest, data)

    def has(self, ns: str, digest: bytes) -> bool:
        with self.ram.lock:
            return self.ram.lookup_locked(ns, digest.hex()) is not None

    def block(self, ns: str, digest: bytes) -> Buffer | None:
        """The cached bytes of `digest`, or None."""
        return self.get(ns, digest.hex())


class KeyMemo:
    """(tenant, key) -> (digest, size) last seen, the `limit` most recent. Thread-safe."""

    def __init__(self, limit: int = MEMO_KEYS) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._seen: OrderedDict[tuple[str, str], tuple[bytes, int]] = OrderedDict()

    def remember(self, ns: str, key: str, digest: bytes, size: int) -> None:
        with self._lock:
            self._seen[(ns, key)] = (digest, size)
            self._seen.move_to_end((ns, key))
            while len(self._seen) > self.limit:
                self._seen.popitem(last=False)

    def forget(self, ns: str, key: str) -> None:
        with self._lock:
            self._seen.pop((ns, key), None)

    def forget_tenant(self, ns: str) -> None:
        with self._lock:
            for k in [k for k in self._seen if k[0] == ns]:
                del self._seen[k]

    def digest(self, ns: str, key: str) -> bytes | None:
        with self._lock:
            seen = self._seen.get((ns, key))
        return seen[0] if seen is not None else None


class RamTier:
    """The block cache and the key memo of one front-end."""

    def __init__(self, cache: BlockCache, memo: KeyMemo | None = None) -> None:
        self.cache = cache
        self.memo = memo if memo is not None else KeyMemo()
        self.counts = {"ram_answers_while_down": 0}

    def answer_while_down(self, ns: str, key: str) -> Buffer | None:
        """While the cluster is unreachable: the block last seen under `key`, if cached."""
        digest = self.memo.digest(ns, key)
        if digest is None:
            return None
        data = self.cache.block(ns, digest)
        if data is not None:
            self.counts["ram_answers_while_down"] += 1
        return data
