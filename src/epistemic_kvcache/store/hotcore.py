"""The engine's records and its hit paths: `_Blob`, `_Counters` and `HotCore`.

How it works
------------
- One source, two twins, like proto/resp_parser.py. This file is the pure-Python
  reference; store/_hotcore_c is the same file compiled by Cython (setup.py) with the C
  types of store/_hotcore_c.pxd: a blob's and a counter set's numbers become C fields,
  and `HotCore`'s paths run as C over them. store/core.py picks the twin at import.
- `HotCore` answers the requests that RAM alone answers, the most frequent ones, in one
  call under the RAM lock: a GET of a hot block or of an absent key, EXISTS, and a PUT
  of the bytes a key already holds (a duplicate: found equal to the hot copy byte for
  byte, or by its digest). For anything else it declines with `WOULD_BLOCK` (`DECLINED`
  for EXISTS) before it has counted or changed anything, and the engine's general path
  (engine.py) does the request: a store with epoch-tagged entries, a block that is not
  hot, an internal namespace, a namespace or key not yet validated, counters not yet
  made, a key with a write in flight (durable backend).
- It works on the engine's own containers, handed over once and never replaced, so
  both paths see one state and keep one set of books: the LRU orders, the hit counts and
  the counters move exactly as the general path would move them.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Final

from blake3 import blake3

from epistemic_kvcache.shared import MAX_KEY_BYTES
from epistemic_kvcache.store.api import (
    PUT_DUPLICATE,
    WOULD_BLOCK,
    BlockData,
    Buffer,
    PutResult,
    StoreStats,
    TierStats,
    WouldBlock,
)

DIGEST_BYTES: Final = 32
DECLINED: Final = -1
"""What `HotCore.exists` answers when the engine's general path must count."""


class _Blob:
    """One stored block. `seg >= 0` means it is on disk (durable backend)."""

    __slots__ = (
        "busy",
        "hits",
        "hot",
        "importance",
        "keys",
        "off",
        "owner",
        "pins",
        "refs",
        "sdig",
        "seg",
        "size",
        "warm",
    )

    def __init__(self, sdig: bytes, size: int) -> None:
        self.sdig = sdig
        self.size = size
        self.refs = 0
        self.pins = 0
        self.hits = 0
        self.importance = 0.0
        self.hot: Buffer | None = None
        self.warm: bytes | None = None
        self.seg = -1
        self.off = 0
        # namespace scope: the one owning namespace; global scope: {ns: refs}
        self.owner: str | dict[str, int] = ""
        # The keys referencing the blob: None; one key of the owning namespace as its bare
        # name (the common case: no tuple per block); one (ns, key); or a list of them.
        self.keys: str | tuple[str, str] | list[tuple[str, str]] | None = None
        self.busy = False

    @property
    def digest(self) -> bytes:
        return self.sdig[-DIGEST_BYTES:]

    def key_refs(self) -> list[tuple[str, str]]:
        k = self.keys
        if k is None:
            return []
        if isinstance(k, str):
            return [(self.owner, k)]  # type: ignore[list-item]  # owner is a str then
        return [k] if isinstance(k, tuple) else list(k)

    def add_keyref(self, ref: tuple[str, str]) -> None:
        k = self.keys
        if k is None:
            self.keys = ref[1] if ref[0] == self.owner else ref
        elif isinstance(k, list):
            k.append(ref)
        else:
            self.keys = [*self.key_refs(), ref]

    def remove_keyref(self, ref: tuple[str, str]) -> None:
        k = self.keys
        if isinstance(k, list):
            k.remove(ref)
            if len(k) == 1:
                self.keys = None
                self.add_keyref(k[0])
        elif k is not None and self.key_refs()[0] == ref:
            self.keys = None

    def owners(self) -> Iterable[str]:
        o = self.owner
        return (o,) if isinstance(o, str) else tuple(o)


class _Counters:  # noqa: PLW1641  # compared by value, so unhashable (as a dataclass is)
    """Per-namespace counters and gauges (gauges are kept exact under the lock)."""

    __slots__ = (
        "cold_blocks",
        "cold_bytes",
        "cold_peak",
        "dedup_hits",
        "demotions",
        "evictions",
        "get_hits",
        "get_misses",
        "hot_blocks",
        "hot_bytes",
        "hot_peak",
        "integrity_failures",
        "logical_bytes",
        "pinned_blocks",
        "pinned_bytes",
        "promotions",
        "put_conflicts",
        "put_new",
        "put_replaced",
        "resident_bytes",
        "stale_missed",
        "total_refs",
        "unique_blocks",
        "warm_blocks",
        "warm_bytes",
        "warm_logical",
        "warm_peak",
    )

    def __init__(self) -> None:
        self.cold_blocks = 0
        self.cold_bytes = 0
        self.cold_peak = 0
        self.dedup_hits = 0
        self.demotions = 0
        self.evictions = 0
        self.get_hits = 0
        self.get_misses = 0
        self.hot_blocks = 0
        self.hot_bytes = 0
        self.hot_peak = 0
        self.integrity_failures = 0
        self.logical_bytes = 0
        self.pinned_blocks = 0
        self.pinned_bytes = 0
        self.promotions = 0
        self.put_conflicts = 0
        self.put_new = 0
        self.put_replaced = 0
        self.resident_bytes = 0
        self.stale_missed = 0
        self.total_refs = 0
        self.unique_blocks = 0
        self.warm_blocks = 0
        self.warm_bytes = 0
        self.warm_logical = 0
        self.warm_peak = 0

    def values(self) -> tuple[int, ...]:
        """Every counter, in `__slots__` order."""
        return tuple([getattr(self, name) for name in _Counters.__slots__])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Counters):
            return NotImplemented
        return self.values() == other.values()

    def __repr__(self) -> str:
        nonzero = ", ".join(
            f"{name}={getattr(self, name)}" for name in _Counters.__slots__ if getattr(self, name)
        )
        return f"_Counters({nonzero})"

    def stats(self, caps: dict[str, int]) -> StoreStats:
        """These counters as `StoreStats`; `caps`: tier capacities by name."""
        s = StoreStats.of(
            functools.partial(getattr, self),
            dedup_savings_bytes=self.logical_bytes - self.resident_bytes,
        )
        s.tiers["hot"] = TierStats(
            self.hot_blocks, self.hot_bytes, caps["hot"], self.hot_bytes, self.hot_peak
        )
        s.tiers["warm"] = TierStats(
            self.warm_blocks, self.warm_bytes, caps["warm"], self.warm_logical, self.warm_peak
        )
        if "cold" in caps:
            s.tiers["cold"] = TierStats(
                self.cold_blocks, self.cold_bytes, caps["cold"], self.cold_bytes, self.cold_peak
            )
        return s


class HotCore:
    """The engine's hit paths: GET of a hot block, EXISTS, a duplicate PUT (module doc)."""

    def __init__(
        self,
        *,
        index: dict[str, dict[str, _Blob]],
        blobs: dict[bytes, _Blob],
        hot: OrderedDict[bytes, _Blob],
        by_ns: dict[str, _Counters],
        total: _Counters,
        lock: threading.Lock,
        tags: dict[tuple[str, str], tuple[str, int]],
        valid_ns: dict[str, bytes],
        global_dedup: bool,
        max_block_bytes: int,
    ) -> None:
        """The engine's containers (`engine.py`: `_index`, `_blobs`, the hot tier's LRU,
        the ledger's counters, its lock, epoch tags, validated namespaces)."""
        self.index = index
        self.blobs = blobs
        self.move_hot = hot.move_to_end
        self.by_ns = by_ns
        self.total = total
        self.lock = lock
        self.tags = tags
        self.valid_ns = valid_ns
        self.global_dedup = global_dedup
        self.max_block_bytes = max_block_bytes
        # (ns, key) -> writes queued for the committer (durable backend: it decides those)
        self.inflight: dict[tuple[str, str], int] = {}

    def get(self, ns: str, key: str) -> Buffer | WouldBlock | None:
        """A hot block's bytes, or None for an absent key (a counted miss); else
        `WOULD_BLOCK`, with nothing counted or changed."""
        if (
            type(ns) is not str
            or type(key) is not str
            or ns not in self.valid_ns
            or not (key.isascii() and 0 < len(key) <= MAX_KEY_BYTES)
        ):
            return WOULD_BLOCK
        lock = self.lock
        lock.acquire()
        try:
            if self.tags:
                return WOULD_BLOCK
            c = self.by_ns.get(ns)
            idx = self.index.get(ns)
            if c is None or idx is None:
                return WOULD_BLOCK
            b = idx.get(key)
            if b is None:
                c.get_misses += 1
                self.total.get_misses += 1
                return None
            data = b.hot
            if data is None:
                return WOULD_BLOCK
            b.hits += 1
            # least recently used first: _blobs (the cold tier's order) and the hot tier
            sdig = b.sdig
            blobs = self.blobs
            del blobs[sdig]
            blobs[sdig] = b
            self.move_hot(sdig)
            c.get_hits += 1
            self.total.get_hits += 1
            return data
        finally:
            lock.release()

    def exists(self, ns: str, keys: Sequence[str]) -> int:
        """How many of `keys` exist (one count per mention); `DECLINED` when the general
        path must answer."""
        if type(ns) is not str or ns not in self.valid_ns:
            return DECLINED
        for key in keys:
            if type(key) is not str or not (key.isascii() and 0 < len(key) <= MAX_KEY_BYTES):
                return DECLINED
        lock = self.lock
        lock.acquire()
        try:
            if self.tags:
                return DECLINED
            idx = self.index.get(ns)
            found = 0
            if idx:
                for key in keys:
                    if key in idx:
                        found += 1
            return found
        finally:
            lock.release()

    def put(self, ns: str, key: str, data: BlockData) -> PutResult | WouldBlock:
        """The answer to a PUT (no condition) of the bytes `key` already holds: a
        duplicate, counted; else `WOULD_BLOCK`, with nothing counted or changed.

        A key whose block is hot is compared with it byte for byte (equal bytes have
        equal digests: no hash needed, and other bytes are declined unhashed); otherwise
        the bytes are hashed when the key holds a block of their size."""
        if type(ns) is not str or type(key) is not str:
            return WOULD_BLOCK
        raw = self.valid_ns.get(ns)
        if raw is None or "\x00" in ns or not (key.isascii() and 0 < len(key) <= MAX_KEY_BYTES):
            return WOULD_BLOCK
        if type(data) is bytes or type(data) is bytearray:
            size = len(data)
        else:  # a view, a `Handover`: the general path
            return WOULD_BLOCK
        idx = self.index.get(ns)
        if idx is None or size > self.max_block_bytes:
            return WOULD_BLOCK
        b = idx.get(key)  # unlocked look: is this likely the same block again?
        if b is None or b.size != size:
            return WOULD_BLOCK
        hot = b.hot  # (a blob's hot copy, while it has one, is its bytes: immutable)
        if hot is not None:
            if hot != data:
                return WOULD_BLOCK  # other bytes: a replacement, for the general path
            digest = b.sdig[-DIGEST_BYTES:]
        else:
            digest = blake3(data).digest()  # (small: the engine sends larger blocks elsewhere)
        # what the general path compares the key's blob with: these bytes, scoped
        sdig = digest if self.global_dedup else raw + b"\x00" + digest
        lock = self.lock
        lock.acquire()
        try:
            if self.tags or (self.inflight and self.inflight.get((ns, key))):
                return WOULD_BLOCK
            c = self.by_ns.get(ns)
            idx = self.index.get(ns)
            b = idx.get(key) if idx is not None else None
            if c is None or b is None or b.sdig != sdig:
                return WOULD_BLOCK
            c.dedup_hits += 1
            self.total.dedup_hits += 1
        finally:
            lock.release()
        return PutResult(PUT_DUPLICATE, digest, size)
