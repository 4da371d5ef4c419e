"""Cluster mode's blocks: bytes by digest in the cluster, with their reference counts.

How it works
------------
A block is one hash in the slot of its digest (`cluster_lua.blob_key`): bytes `d`,
references `r`, pinned references `p`, generation `g`, last change `t`. `ref` takes a
reference before an entry names the block: when the RAM tier holds the digest (the
block was probably stored already) it asks without the bytes (`BLOB_REF`); otherwise,
or when the block turns out to be absent, the bytes go as a plain argument of an HSETNX
in one MULTI with the reference (`store`), never through Lua. `unref` drops references
once, after no entry names them; a failure there leaks a reference (counted, logged)
and the scrub takes it back, so counts are never low. Reads (`fetch`) are verified
against the digest before they are served or cached: a block of another generation, an
absent one (evicted) or a damaged one (deleted at once) is None, counted.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import redis

from epistemic_kvcache.errors import StoreError
from epistemic_kvcache.options import DedupScope
from epistemic_kvcache.store import cluster_lua as L
from epistemic_kvcache.store.api import Buffer
from epistemic_kvcache.store.cluster_conn import ClusterConnection
from epistemic_kvcache.store.cluster_counters import SharedCounters
from epistemic_kvcache.store.cluster_ram import BlockCache
from epistemic_kvcache.store.engine import digest_of

log = logging.getLogger(__name__)

__all__ = ["RELEASE_LIMIT_MS", "ClusterBlocks"]

RELEASE_LIMIT_MS = 60_000
"""A reference release arriving this long after its entry was removed is refused (the
reference leaks instead): the scrub relies on it to tell a leak from a release in flight."""


@dataclass(eq=False)
class ClusterBlocks:
    """A front-end's view of the blocks in the cluster. Thread-safe.

    `cache`: RAM copies (a hint that a block is stored, and where verified reads go);
    `block_ttl_ms`: a TTL on unpinned blocks (0: none)."""

    conn: ClusterConnection
    cache: BlockCache
    counters: SharedCounters
    _: KW_ONLY
    prefix: str
    dedup_scope: DedupScope
    block_ttl_ms: int
    release_limit_ms: int = RELEASE_LIMIT_MS
    counts: dict[str, int] = field(default_factory=lambda: {"leaked_refs": 0})

    def key(self, ns: str, digest: bytes) -> bytes:
        """The Redis key of `ns`'s block `digest` (shared by every tenant in global scope)."""
        return L.blob_key(self.prefix, digest, None if self.dedup_scope == "global" else ns)

    def _freed(self, ns: str, nbytes: int) -> None:
        self.counters.count(ns, "unique_blocks", -1)
        self.counters.count(ns, "resident_bytes", -nbytes)

    # -- references ------------------------------------------------------------------------
    def ref(self, ns: str, digest: bytes, data: Buffer) -> tuple[bytes, int, bool]:
        """Take a reference on the block, storing it if absent: (generation, the cluster's
        ms when taken, created)."""
        bkey = self.key(ns, digest)
        gen = secrets.token_bytes(L.GEN_LEN)
        if self.cache.has(ns, digest):  # probably stored already: no bytes on the wire
            r = self.conn.script(L.BLOB_REF, [bkey], [gen, self.block_ttl_ms], durable=True)
            if r:
                return bytes(r[0]), int(r[1]), False
        r = self.store(bkey, data, gen)
        created = bool(int(r[2]))
        if created:
            self.counters.count(ns, "unique_blocks")
            self.counters.count(ns, "resident_bytes", len(data))
        return bytes(r[0]), int(r[1]), created

    def store(self, bkey: bytes, data: Buffer, gen: bytes) -> Any:
        """HSETNX the bytes and take the reference in one MULTI (the bytes go to Redis as
        a plain argument, never through Lua) -> `BLOB_REF`'s answer."""
        payload = data if isinstance(data, bytes | memoryview) else memoryview(data)
        out = self.conn.exec(
            bkey,
            [
                ("MULTI",),
                ("HSETNX", bkey, "d", payload),
                ("EVALSHA", L.BLOB_REF.sha, 1, bkey, gen, self.block_ttl_ms),
                ("EXEC",),
            ],
            durable=True,
        )
        return out[3][1]

    def unref(
        self,
        ns: str,
        digest: bytes,
        gen: bytes,
        *,
        refs: int = -1,
        pins: int = 0,
        removed_ms: int = 0,
    ) -> None:
        """Drop references (and pins) on a block, once; a failure leaks (the scrub takes
        it back). `removed_ms`: when the entry naming them was removed (tenant master's
        clock); the release is refused past `release_limit_ms` (see the scrub)."""
        bkey = self.key(ns, digest)
        try:
            left, freed = self.conn.script(
                L.BLOB_ADJ,
                [bkey],
                [gen, refs, pins, self.block_ttl_ms, int(removed_ms), self.release_limit_ms],
                safe=False,
            )
        except (StoreError, redis.RedisError) as exc:
            self.counts["leaked_refs"] += 1
            log.warning("block reference not released (the scrub will): %s", exc)
            return
        if int(left) == -2:
            self.counts["leaked_refs"] += 1
            log.warning("block reference released too late; left for the scrub")
        elif int(left) == 0 and int(freed) >= 0 and refs < 0:
            self._freed(ns, int(freed))

    def release(self, ns: str, e: L.Entry, removed_ms: int) -> None:
        """The references (and pins) of an entry removed at `removed_ms`."""
        self.unref(ns, e.digest, e.gen, pins=-e.pins, removed_ms=removed_ms)

    # -- reads -----------------------------------------------------------------------------
    def fetch(self, ns: str, e: L.Entry) -> Buffer | None:
        """The entry's block from the cluster, verified (None: gone or damaged)."""
        bkey = self.key(ns, e.digest)
        gen, data = self.conn.exec(bkey, [("HMGET", bkey, "g", "d")])[0]
        return self.verified(ns, e, gen, data)

    def fetch_many(self, ns: str, entries: Sequence[L.Entry]) -> list[Buffer | None]:
        """`fetch` of many blocks, one round trip per node."""
        got = self.conn.reads([("HMGET", self.key(ns, e.digest), "g", "d") for e in entries])
        return [self.verified(ns, e, g, d) for e, (g, d) in zip(entries, got, strict=True)]

    def read(self, ns: str, e: L.Entry) -> Buffer | None:
        """The entry's block: from RAM, else the cluster (verified)."""
        data = self.cache.block(ns, e.digest)
        return data if data is not None else self.fetch(ns, e)

    def verified(self, ns: str, e: L.Entry, gen: bytes | None, data: bytes | None) -> Buffer | None:
        """`data` if it is the entry's block and matches its digest (then also cached);
        else None, counted, and a damaged block deleted."""
        if gen is None or gen != e.gen or data is None:
            self.counters.count(ns, "evictions")
            return None
        if len(data) != e.size or digest_of(data) != e.digest:
            log.error(
                "integrity failure: block %s of tenant %r in the cluster does not match its "
                "digest; deleted, never served",
                e.digest.hex(),
                ns,
            )
            self.counters.count(ns, "integrity_failures")
            try:
                freed = int(
                    self.conn.script(L.BLOB_DROP, [self.key(ns, e.digest)], [e.gen], safe=False)
                )
            except StoreError:
                return None
            if freed:
                self._freed(ns, freed)
            return None
        self.cache.admit(ns, e.digest, data)
        return data

    def live(self, ns: str, e: L.Entry) -> bool:
        """Whether the entry's block is still in the cluster (or in this front-end's RAM)."""
        if self.cache.has(ns, e.digest):
            return True
        bkey = self.key(ns, e.digest)
        return bool(self.conn.exec(bkey, [("HGET", bkey, "g")])[0] == e.gen)

    def live_many(self, ns: str, entries: Sequence[L.Entry]) -> list[bool]:
        """`live` of many blocks, one round trip per node for those not in RAM."""
        out = [self.cache.has(ns, e.digest) for e in entries]
        ask = [(i, e) for i, e in enumerate(entries) if not out[i]]
        if ask:
            gens = self.conn.reads([("HGET", self.key(ns, e.digest), "g") for _i, e in ask])
            for (i, e), g in zip(ask, gens, strict=True):
                out[i] = g == e.gen
        return out
