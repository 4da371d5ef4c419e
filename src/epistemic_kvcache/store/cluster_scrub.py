"""Cluster mode's scrub: recount every block's references from the entries, and repair.

How it works
------------
The scrub runs on one front-end at a time (a lease key, `SET NX PX`). It notes the
cluster's time `t0`, counts per block (key, generation) the entries that name it (every
tenant's live entries, snapshots and branch overlays), then SCANs every master's blocks
and compares. Repairs never race a writer:
- counts are corrected only on blocks untouched for `SCRUB_GRACE_MS` (nothing in flight:
  an entry write refuses references older than `MAX_INFLIGHT_MS`), after waiting until
  `t0 + scrub_settle_ms` (every release of an entry that was gone when counting began
  has landed, or been refused, by then: `RELEASE_LIMIT_MS`), and by compare-and-set
  (`SCRUB_FIX`: same generation, count and time as read);
- bytes without a generation (a writer died inside its MULTI) are marked the first time
  and deleted by a later scrub (`SCRUB_BARE`);
- entries whose block the cluster lost are removed only if unchanged.
`check` is the same walk without the lease and without repairs; `deep` re-hashes bytes.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections.abc import Callable, Iterator
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from epistemic_kvcache.errors import StoreError
from epistemic_kvcache.store import cluster_lua as L
from epistemic_kvcache.store.api import ConsistencyReport
from epistemic_kvcache.store.cluster_blocks import RELEASE_LIMIT_MS, ClusterBlocks
from epistemic_kvcache.store.cluster_conn import SCAN_COUNT, ClusterConnection
from epistemic_kvcache.store.cluster_counters import SharedCounters
from epistemic_kvcache.store.cluster_entries import MAX_INFLIGHT_MS, ClusterEntries
from epistemic_kvcache.store.engine import digest_of

__all__ = ["SCRUB_GRACE_MS", "SCRUB_SETTLE_MS", "ClusterScrub", "hash_entries"]

SCRUB_SETTLE_MS = RELEASE_LIMIT_MS + 60_000
"""The scrub corrects counts only this long after it started counting: every release of
an entry it did not count has landed (or been refused) by then, with a minute of margin
for clocks."""
SCRUB_GRACE_MS = 2 * MAX_INFLIGHT_MS
"""The scrub leaves alone blocks whose references changed this recently (covers
`MAX_INFLIGHT_MS` plus clock differences between masters of up to a minute)."""
_LEASE_MS = 600_000


def hash_entries(conn: ClusterConnection, key: bytes) -> Iterator[tuple[bytes, bytes]]:
    """Every (field, value) of a hash of entries, page by page (HSCAN)."""
    cursor = 0
    while True:
        cursor, page = conn.hscan(key, cursor)
        yield from page.items()
        if cursor == 0:
            return


@dataclass(eq=False)
class ClusterScrub:
    """The scrub and the consistency check of one front-end.

    `counters`: the tenants to walk. `snapshot_hashes(ns)`: the hashes of entries of
    `ns`'s snapshots and branch overlays (they hold references too). `stop`: set when
    closing (a scrub waiting to repair then repairs nothing)."""

    conn: ClusterConnection
    counters: SharedCounters
    snapshot_hashes: Callable[[str], list[bytes]]
    blocks: ClusterBlocks
    entries: ClusterEntries
    stop: threading.Event
    _: KW_ONLY
    prefix: str
    settle_ms: int = SCRUB_SETTLE_MS
    counts: dict[str, int] = field(
        default_factory=lambda: {"scrubs": 0, "scrub_fixed_blocks": 0, "scrub_removed_entries": 0}
    )

    def scrub(self, *, fix: bool = True, deep: bool = False) -> ConsistencyReport:
        """Recount every block's references from the entries; with `fix`, give back
        leaked references (blocks untouched for `SCRUB_GRACE_MS`: nothing in flight),
        delete blocks nothing names, and remove entries whose block the cluster lost.
        One front-end at a time (a lease in the cluster). `deep` re-hashes every block."""
        report = ConsistencyReport()
        lock = L.lock_key(self.prefix)
        token = secrets.token_hex(8)
        exec_ = self.conn.exec
        if fix and not exec_(lock, [("SET", lock, token, "NX", "PX", _LEASE_MS)])[0]:
            return report  # another front-end is scrubbing
        try:
            self._scrub(report, fix=fix, deep=deep)
            self.counts["scrubs"] += 1
        finally:
            if fix:
                with contextlib.suppress(StoreError):
                    if exec_(lock, [("GET", lock)])[0] == token.encode():
                        exec_(lock, [("DEL", lock)])
        return report

    def _count_refs(
        self, report: ConsistencyReport
    ) -> tuple[dict[tuple[bytes, bytes], list[int]], list[tuple[str, bytes, L.Entry]]]:
        """(block key, gen) -> [references, pinned references] the entries hold, and the
        tenants' live entries (tenant, key, entry)."""
        refs: dict[tuple[bytes, bytes], list[int]] = {}
        named: list[tuple[str, bytes, L.Entry]] = []

        def counted(ns: str, e: L.Entry) -> None:
            slot = refs.setdefault((self.blocks.key(ns, e.digest), e.gen), [0, 0])
            slot[0] += 1
            slot[1] += 1 if e.pins else 0

        for ns in self.counters.tenants():
            for k, v in hash_entries(self.conn, self.entries.keys_of(ns).entries):
                try:
                    e = L.parse_entry(v)
                except ValueError:
                    report.orphan_index_entries.append(f"{ns}/{k!r}: not an entry")
                    continue
                report.keys += 1
                counted(ns, e)
                named.append((ns, k, e))
            for h in self.snapshot_hashes(ns):  # snapshots and branch overlays
                for _k, v in hash_entries(self.conn, h):
                    counted(ns, L.parse_entry(v))
        return refs, named

    def _scrub(self, report: ConsistencyReport, *, fix: bool, deep: bool) -> None:
        t0 = self.conn.server_ms(self.prefix)
        refs, named = self._count_refs(report)
        seen: set[tuple[bytes, bytes]] = set()
        fixes: list[tuple[bytes, Any, Any, Any, int, int]] = []
        pattern = f"{self.prefix}:b:*".encode()
        for node in self.conn.primaries():
            client = self.conn.client(node)
            for found in client.scan_iter(match=pattern, count=SCAN_COUNT):
                bkey = bytes(found)
                try:
                    g, r, p, t = self.conn.exec(bkey, [("HMGET", bkey, "g", "r", "p", "t")])[0]
                except StoreError:
                    continue
                if g is None:
                    if fix:  # bytes nobody initialised: marked now, deleted next time
                        self.conn.script(L.SCRUB_BARE, [bkey], [t0, SCRUB_GRACE_MS], safe=False)
                    continue
                report.blocks += 1
                seen.add((bkey, bytes(g)))
                counted = refs.get((bkey, bytes(g)), [0, 0])
                if deep:
                    self._scrub_deep(report, bkey)
                if int(r) == counted[0] and int(p or 0) == counted[1]:
                    continue
                name = bkey.decode(errors="replace")
                if counted[0] == 0:
                    report.orphan_blobs.append(name)
                else:
                    report.refcount_mismatches.append(f"{name}: {int(r)} != {counted[0]}")
                if fix and int(t) < t0 - SCRUB_GRACE_MS:
                    fixes.append((bkey, g, r, t, counted[0], counted[1]))
        if fixes and not self._fix_counts(t0, fixes):
            return  # closing: fix nothing early
        self._lost_blocks(report, named, seen, fix=fix)

    def _fix_counts(self, t0: int, fixes: list[tuple[bytes, Any, Any, Any, int, int]]) -> bool:
        """Every release of an entry that was gone when counting began lands (or is
        refused) within release_limit_ms: wait that long, then correct only the blocks
        nobody touched since they were read (compare-and-set). False: closing meanwhile."""
        wait_ms = t0 + self.settle_ms - self.conn.server_ms(self.prefix)
        if wait_ms > 0 and self.stop.wait(wait_ms / 1000):
            return False
        for bkey, g, r, t, n_refs, n_pins in fixes:
            res = int(
                self.conn.script(
                    L.SCRUB_FIX,
                    [bkey],
                    [g, r, t, n_refs, n_pins, self.blocks.block_ttl_ms],
                    safe=False,
                )
            )
            if res >= 0:
                self.counts["scrub_fixed_blocks"] += 1
        return True

    def _lost_blocks(
        self,
        report: ConsistencyReport,
        named: list[tuple[str, bytes, L.Entry]],
        seen: set[tuple[bytes, bytes]],
        *,
        fix: bool,
    ) -> None:
        """Report (and with `fix` remove, if unchanged) entries whose block is gone."""
        for ns, key, e in named:
            bkey = self.blocks.key(ns, e.digest)
            if (bkey, e.gen) in seen:
                continue
            if self.conn.exec(bkey, [("HGET", bkey, "g")])[0] == e.gen:
                continue  # created after the scan passed its slot
            report.orphan_index_entries.append(f"{ns}/{key.decode(errors='replace')}")
            if fix and self.entries.remove(ns, key, e.raw, release=False) is not None:
                self.counts["scrub_removed_entries"] += 1
                self.counters.count(ns, "evictions")

    def _scrub_deep(self, report: ConsistencyReport, bkey: bytes) -> None:
        data = self.conn.exec(bkey, [("HGET", bkey, "d")])[0]
        hexd = bkey.split(b"{", 1)[1].split(b"}", 1)[0]
        if data is None or digest_of(data) != bytes.fromhex(hexd.decode()):
            report.corrupt_blobs.append(bkey.decode(errors="replace"))
