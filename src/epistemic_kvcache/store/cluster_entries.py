"""Cluster mode's key entries: the write protocol of a PUT, and removing entries.

How it works
------------
A tenant's entries, key order, epochs and counters share one hash slot, so a PUT's
decision (`decide_put`'s rule, conditions, first-write-wins, epoch staleness, key quota)
is one atomic script there (`ENTRY_PUT`). A PUT (`put_to`): hash (BLAKE3) -> take a
reference on the block (`ClusterBlocks.ref`) -> write the entry (`ENTRY_PUT`, carrying a
random op id so a retried call is recognised: outcome `again`) -> drop the reference it
no longer needs (refused, duplicate) or the one the replaced entry held. A reference is
always taken before an entry names it and dropped only after no entry does, once; an
outcome the front-end cannot know (`Unknown`: a connection lost after sending) is never
assumed undone, so every attempt holds a reference of its own and the worst a crash
does is leak one, which the scrub takes back. Every removal (`remove`, `pop`) hands the
removed entries' references back with the time of removal (see `ClusterBlocks.unref`).
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass

from epistemic_kvcache.errors import (
    ClusterUnavailableError,
    QuotaExceededError,
    StoreError,
)
from epistemic_kvcache.store import cluster_lua as L
from epistemic_kvcache.store.api import Buffer, PutCond, PutOutcome, PutResult
from epistemic_kvcache.store.cluster_blocks import ClusterBlocks
from epistemic_kvcache.store.cluster_conn import ClusterConnection, Unknown
from epistemic_kvcache.store.cluster_counters import SharedCounters
from epistemic_kvcache.store.cluster_ram import RamTier
from epistemic_kvcache.store.engine import digest_of

__all__ = ["MAX_INFLIGHT_MS", "ClusterEntries", "Found"]

MAX_INFLIGHT_MS = 60_000
"""A block reference older than this may not be used by an entry write (the PUT fails,
retryably): the scrub relies on it to tell a leaked reference from one in flight."""
POP_CHUNK = 500
"""How many entries one `ENTRY_POP` removes."""
_TRIES = 4

Found = tuple[bool, L.Entry] | None
"""A key's entry as read: None (absent) or (stale, entry)."""


@dataclass(eq=False)
class ClusterEntries:
    """Key entries of every tenant (and of branch overlays). Thread-safe.

    `first_write_wins`: for every tenant, or for the tenants named."""

    conn: ClusterConnection
    blocks: ClusterBlocks
    ram: RamTier
    counters: SharedCounters
    _: KW_ONLY
    prefix: str
    first_write_wins: bool | frozenset[str]

    def keys_of(self, ns: str) -> L.TenantKeys:
        return L.TenantKeys.of(self.prefix, ns)

    def _fww(self, ns: str) -> bool:
        f = self.first_write_wins
        return f if isinstance(f, bool) else ns in f

    def read(self, ns: str, keys: Sequence[str]) -> list[Found]:
        """Per key: None (absent) or (stale, entry), in one script (epochs checked)."""
        tk = self.keys_of(ns)
        raw = self.conn.script(L.ENTRY_GET, [tk.entries, tk.epochs], [k.encode() for k in keys])
        return [(r[0] == b"stale", L.parse_entry(r[1])) if r else None for r in raw]

    # -- writing ---------------------------------------------------------------------------
    def put_to(
        self,
        ns: str,
        tk: L.TenantKeys,
        key: str,
        data: Buffer,
        epoch_scope: str | None,
        cond: PutCond,
        quota: int,
        *,
        memo: bool,
    ) -> PutResult:
        """PUT owned, size-checked `data` into the entries `tk` names (the tenant's, or a
        branch overlay's); `memo`: remember the key's digest for reads while down."""
        digest = digest_of(data)
        op = secrets.token_bytes(L.OP_LEN)
        size = len(data)
        created = False
        for attempt in range(_TRIES):
            # every attempt holds a reference of its own: after an unknown outcome the
            # earlier attempt's reference may already have been consumed by its entry and
            # released by whoever replaced that entry since
            gen, t_ref, new_block = self.blocks.ref(ns, digest, data)
            created = created or new_block
            try:
                outcome_raw, cur_raw, removed_ms = self.conn.script(
                    L.ENTRY_PUT,
                    [tk.entries, tk.order, tk.epochs, tk.counters],
                    [
                        key.encode(),
                        digest + gen,
                        op,
                        size,
                        (epoch_scope or "").encode(),
                        cond or "",
                        "1" if self._fww(ns) else "0",
                        t_ref,
                        MAX_INFLIGHT_MS,
                        quota,
                    ],
                    safe=False,
                    durable=True,
                )
                break
            except Unknown as exc:
                self.blocks.counts["leaked_refs"] += 1  # this attempt's: consumed or leaked
                if attempt == _TRIES - 1:
                    raise ClusterUnavailableError(
                        f"the write's outcome is unknown after {attempt + 1} tries: {exc}"
                    ) from exc
        outcome = outcome_raw.decode()
        cur = L.parse_entry(cur_raw) if cur_raw else None
        count = self.counters.count
        if outcome == "again":
            # an earlier attempt of this very call is in place and holds its own reference
            self.blocks.unref(ns, digest, gen)
            self._written(ns, key, digest, data, memo=memo)
            count(ns, "put_new")
            return PutResult(PutOutcome.NEW, digest, size)
        if outcome in ("missing", "conflict", "expired", "quota") or (
            outcome == "duplicate" and cur is not None and cur.ref == digest + gen
        ):
            self.blocks.unref(ns, digest, gen)  # the entry does not name our reference
        if outcome == "expired":
            raise ClusterUnavailableError("the write took too long to complete; retry")
        if outcome == "quota":
            raise QuotaExceededError(
                f"key quota exceeded: this tenant holds {quota} keys "
                "(its limit); delete some first",
                resource="keys",
            )
        if outcome == "missing":
            return PutResult(PutOutcome.MISSING, digest, size)
        if outcome == "conflict":
            count(ns, "put_conflicts")
            assert cur is not None
            return PutResult(PutOutcome.CONFLICT, cur.digest, cur.size)
        self._written(ns, key, digest, data, memo=memo)
        if cur is not None and cur.ref != digest + gen:
            # the entry no longer names cur's reference; its pins move to the new block
            self.blocks.unref(ns, cur.digest, cur.gen, pins=-cur.pins, removed_ms=removed_ms)
            if cur.pins:
                self.blocks.unref(ns, digest, gen, refs=0, pins=cur.pins)
        if outcome == "duplicate":
            count(ns, "dedup_hits")
            return PutResult(PutOutcome.DUPLICATE, digest, size)
        result = PutOutcome.NEW if outcome == "new" else PutOutcome.REPLACED
        count(ns, "put_new" if result is PutOutcome.NEW else "put_replaced")
        if not created:
            count(ns, "dedup_hits")
        return PutResult(result, digest, size)

    def _written(self, ns: str, key: str, digest: bytes, data: Buffer, *, memo: bool) -> None:
        self.ram.cache.admit(ns, digest, data)
        if memo:
            self.ram.memo.remember(ns, key, digest, len(data))

    def pin(self, ns: str, key: str, delta: int, limit: int) -> bool | None:
        """Pin (+1) or unpin (-1) a live key; None: over the pinned-bytes `limit`."""
        tk = self.keys_of(ns)
        raw = self.conn.script(
            L.ENTRY_PIN, [tk.entries, tk.epochs, tk.counters], [key.encode(), delta, limit]
        )
        if not raw or raw == b"nopin":
            return False
        if raw == b"quota":
            return None
        e = L.parse_entry(raw)
        self.blocks.unref(ns, e.digest, e.gen, refs=0, pins=delta)
        return True

    # -- removing --------------------------------------------------------------------------
    def remove(
        self,
        ns: str,
        key: bytes,
        expected: bytes = b"",
        *,
        release: bool = True,
        durable: bool = False,
    ) -> L.Entry | None:
        """Remove the key's entry (only if it is `expected`, when given) and, with
        `release`, its references -> the entry removed, or None."""
        tk = self.keys_of(ns)
        raw = self.conn.script(
            L.ENTRY_DEL, [tk.entries, tk.order, tk.counters], [key, expected], durable=durable
        )
        if not raw:
            return None
        e = L.parse_entry(raw[0])
        if release:
            self.blocks.release(ns, e, raw[1])
        return e

    def drop(self, ns: str, key: str, e: L.Entry) -> None:
        """Remove an entry whose block is gone (nothing to release), if it is still that
        entry."""
        self.ram.memo.forget(ns, key)
        with contextlib.suppress(StoreError):  # another reader (or the scrub) will
            self.remove(ns, key.encode(), e.raw, release=False)

    def pop(self, ns: str) -> int:
        """Remove every entry of `ns` (in chunks) -> how many."""
        tk = self.keys_of(ns)
        n = 0
        while True:
            removed_ms, popped = self.conn.script(
                L.ENTRY_POP, [tk.entries, tk.order, tk.counters], [POP_CHUNK], durable=True
            )
            for raw in popped:
                self.blocks.release(ns, L.parse_entry(raw), removed_ms)
            n += len(popped)
            if len(popped) < POP_CHUNK:
                return n
