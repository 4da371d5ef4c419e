"""Cluster mode: a stateless front-end over one Redis/Valkey Cluster (`--cluster-url`).

How it works
------------
`ClusterBackend` is the store API over collaborators that each own one concern, built
once in `__init__` and handed to each other explicitly:

| module | owns |
|---|---|
| `cluster_lua` | key layout, the entry format, the Lua scripts |
| `cluster_conn` | the URL, redis-py's cluster client, routing, retries, up/down |
| `cluster_ram` | this front-end's RAM tiers (blocks by digest) and key -> digest memo |
| `cluster_counters` | per-tenant counters (flushed fleet-wide every second), tenants |
| `cluster_blocks` | blocks and their reference counts in the cluster, verified reads |
| `cluster_entries` | key entries: the PUT protocol, removals |
| `cluster_epochs` | epoch bumps and the notice subscriber thread |
| `cluster_snapshots` | snapshots and branches |
| `cluster_scrub` | the scrub (reference recount and repair) and the check |
| `cluster_maint` | the maintenance thread, stale-entry retirement |

- A PUT: validate -> own the bytes -> register the tenant -> `ClusterEntries.put_to`
  (take a block reference, write the entry in the tenant's slot with one script, drop
  the reference no entry names) -> admit the bytes into RAM. With `wait_replicas`, each
  write is followed on the same connection by `WAIT`, so a block is on N replicas before
  an entry names it and an acknowledged PUT is on N replicas.
- A GET: the entry from the tenant's slot (one script: also the epoch check), then the
  bytes from this front-end's RAM tier or from the cluster, verified against the digest
  before they are served or cached. An absent or damaged block is a miss, counted; the
  entry is removed (only if it is unchanged).
- Losing the cluster: after the retry window the front-end is "down": `health()` is not
  ready, writes fail at once with `ClusterUnavailableError` (retryable), reads are
  answered from RAM when this front-end knows the key's digest and holds the bytes; the
  maintenance thread's probe clears the state by itself.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from epistemic_kvcache.errors import (
    ClusterUnavailableError,
    ConfigurationError,
    QuotaExceededError,
    StoreClosedError,
)
from epistemic_kvcache.options import DEFAULT_STORE_OPTIONS, DedupScope, StoreOptions
from epistemic_kvcache.store import cluster_epochs
from epistemic_kvcache.store import cluster_lua as L
from epistemic_kvcache.store.api import (
    BlockData,
    BranchInfo,
    Buffer,
    ConsistencyReport,
    PutCond,
    PutResult,
    SharedKvBackend,
    SnapshotInfo,
    StoreHealth,
    StoreStats,
    check_block_size,
    owned_buffer,
    validate_cond,
    validate_key,
    validate_namespace,
)
from epistemic_kvcache.store.cluster_blocks import ClusterBlocks
from epistemic_kvcache.store.cluster_conn import (
    ClusterConnection,
    ClusterTarget,
    parse_cluster_url,
)
from epistemic_kvcache.store.cluster_counters import SharedCounters, stats_of
from epistemic_kvcache.store.cluster_entries import ClusterEntries, Found
from epistemic_kvcache.store.cluster_epochs import EpochListener, EpochNotices
from epistemic_kvcache.store.cluster_maint import Maintenance, StaleRetirer
from epistemic_kvcache.store.cluster_ram import BlockCache, RamTier
from epistemic_kvcache.store.cluster_scrub import ClusterScrub
from epistemic_kvcache.store.cluster_snapshots import SCRIPTS as SNAPSHOT_SCRIPTS
from epistemic_kvcache.store.cluster_snapshots import ClusterSnapshots
from epistemic_kvcache.store.codec import WarmCodec
from epistemic_kvcache.store.engine import validate_scope

__all__ = ["ClusterBackend", "ClusterTarget", "EpochListener", "parse_cluster_url", "run_check"]


class ClusterBackend(SharedKvBackend):
    """The store over a Redis/Valkey Cluster. Thread-safe; every call may block on I/O."""

    def __init__(
        self,
        url: str,
        options: StoreOptions = DEFAULT_STORE_OPTIONS,
        *,
        tls_ca: Path | None = None,
        password_file: Path | None = None,
        codec: WarmCodec | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`url`, `tls_ca`, `password_file`: the cluster and how to reach it; `options`:
        the tiers of this front-end's RAM cache, the quotas and the `cluster_*` tuning;
        `clock`: wall-clock seconds for snapshot TTLs and creation times (tests pass a
        fake clock they advance)."""
        self._clock = clock
        self.options = options
        """The tiers of the RAM cache, the quotas and the `cluster_*` tuning, read where
        they apply."""
        self.max_block_bytes = options.max_block_bytes  # the store seam's attribute
        key_prefix = self.prefix = options.cluster_key_prefix
        dedup_scope: DedupScope = options.dedup_scope
        # the RAM cache holds blocks only: its tiers, none of the quotas (the cluster's)
        cache_options = StoreOptions(
            hot_capacity_bytes=options.hot_capacity_bytes,
            warm_capacity_bytes=options.warm_capacity_bytes,
            max_block_bytes=options.max_block_bytes,
            dedup_scope=dedup_scope,
        )
        self._cache = BlockCache(cache_options, codec=codec)
        self.target = parse_cluster_url(url, password_file=password_file)
        conn = self._conn = ClusterConnection(
            self.target,
            tls_ca=tls_ca,
            socket_timeout_s=options.cluster_socket_timeout_s,
            retry_window_s=options.cluster_retry_window_s,
            wait_replicas=options.cluster_wait_replicas,
            wait_timeout_s=options.cluster_wait_timeout_s,
            scripts=(*L.SCRIPTS, *SNAPSHOT_SCRIPTS),
        )
        try:
            self.capacity_bytes = conn.check(key_prefix, dedup_scope)
        except BaseException:
            conn.close()
            raise
        self._ram = RamTier(self._cache)
        self._counters = SharedCounters(conn, key_prefix)
        self._blocks = ClusterBlocks(
            conn,
            self._cache,
            self._counters,
            prefix=key_prefix,
            dedup_scope=dedup_scope,
            block_ttl_ms=int(options.cluster_block_ttl_s * 1000),
        )
        self._entries = ClusterEntries(
            conn,
            self._blocks,
            self._ram,
            self._counters,
            prefix=key_prefix,
            first_write_wins=options.first_write_wins,
        )
        self._snaps = ClusterSnapshots(
            conn,
            self._blocks,
            self._entries,
            self._counters,
            prefix=key_prefix,
            clock=clock,
            max_snapshots_per_tenant=options.max_snapshots_per_tenant,
        )
        self._stop = threading.Event()
        self._scrubber = ClusterScrub(
            conn,
            self._counters,
            self._snaps.entry_hashes,
            self._blocks,
            self._entries,
            self._stop,
            prefix=key_prefix,
        )
        self._retirer = StaleRetirer(conn, self._entries, self._counters, self._snaps.retire)
        self._notices = EpochNotices(conn, key_prefix, self._stop)
        self._maint = Maintenance(
            conn,
            self._counters,
            self.scrub,
            self._stop,
            scrub_interval_s=options.cluster_scrub_interval_s,
        )
        self._maint.start()
        self._notices.start()

    # -- tuning (tests shorten the scrub's waits) ----------------------------------------
    @property
    def release_limit_ms(self) -> int:
        """A release this long after its entry was removed is refused (see the scrub)."""
        return self._blocks.release_limit_ms

    @release_limit_ms.setter
    def release_limit_ms(self, ms: int) -> None:
        self._blocks.release_limit_ms = ms

    @property
    def scrub_settle_ms(self) -> int:
        """How long after it started counting the scrub may correct counts."""
        return self._scrubber.settle_ms

    @scrub_settle_ms.setter
    def scrub_settle_ms(self, ms: int) -> None:
        self._scrubber.settle_ms = ms

    @property
    def _fe(self) -> dict[str, int]:
        """This front-end's own counters (stats' `extra`)."""
        parts = (self._conn, self._blocks, self._ram, self._scrubber)
        return {name: n for part in parts for name, n in part.counts.items()}

    def _validate(self, ns: str, key: str) -> None:
        validate_namespace(ns)
        validate_key(key)
        if self._conn.closed:
            raise StoreClosedError("the store is closed")

    def _found(self, ns: str, key: str) -> Found:
        return self._entries.read(ns, [key])[0]

    # -- single-key operations ---------------------------------------------------------
    def _start_put(
        self, ns: str, key: str, data: BlockData, scope: str | None, cond: PutCond, wait: bool
    ) -> PutResult:
        """The whole PUT, whoever waits (nothing is answered inline: `put_nowait` says
        `WOULD_BLOCK`)."""
        self._validate(ns, key)
        check_block_size(data, self.max_block_bytes)
        validate_cond(cond)
        if scope is not None:
            validate_scope(scope)
        data = owned_buffer(data)
        self._counters.register(ns)
        tk = self._entries.keys_of(ns)
        quota = self.options.max_keys_per_tenant
        return self._entries.put_to(ns, tk, key, data, scope, cond, quota, memo=True)

    def get(self, ns: str, key: str) -> Buffer | None:
        self._validate(ns, key)
        try:
            found = self._found(ns, key)
        except ClusterUnavailableError:
            data = self._ram.answer_while_down(ns, key)
            if data is None:
                raise
            return data
        return self._read(ns, key, found)

    def _read(self, ns: str, key: str, found: Found) -> Buffer | None:
        if found is None or found[0]:
            self._counters.count(ns, "get_misses")
            if found is not None:
                self._counters.count(ns, "stale_missed")
            self._ram.memo.forget(ns, key)
            return None
        e = found[1]
        self._ram.memo.remember(ns, key, e.digest, e.size)
        data = self._cache.block(ns, e.digest)
        if data is None:
            data = self._blocks.fetch(ns, e)
            if data is None:
                self._entries.drop(ns, key, e)
        self._counters.count(ns, "get_hits" if data is not None else "get_misses")
        return data

    def size(self, ns: str, key: str) -> int | None:
        self._validate(ns, key)
        found = self._found(ns, key)
        if found is None or found[0] or not self._blocks.live(ns, found[1]):
            return None
        return found[1].size

    def exists(self, ns: str, key: str) -> bool:
        return self.size(ns, key) is not None

    def exists_many(self, ns: str, keys: Sequence[str]) -> list[bool]:
        for key in keys:
            self._validate(ns, key)
        if not keys:
            return []
        live = [(i, f[1]) for i, f in enumerate(self._entries.read(ns, keys)) if f and not f[0]]
        out = [False] * len(keys)
        for (i, _e), ok in zip(
            live, self._blocks.live_many(ns, [e for _i, e in live]), strict=True
        ):
            out[i] = ok
        return out

    def get_many(self, ns: str, keys: Sequence[str]) -> list[Buffer | None]:
        for key in keys:
            self._validate(ns, key)
        if not keys:
            return []
        try:
            found = self._entries.read(ns, keys)
        except ClusterUnavailableError:
            ram = [self._ram.answer_while_down(ns, k) for k in keys]
            if any(d is None for d in ram):
                raise
            return ram
        out: list[Buffer | None] = [None] * len(keys)
        fetch: list[tuple[int, L.Entry]] = []
        for i, (key, f) in enumerate(zip(keys, found, strict=True)):
            if f is None or f[0]:
                out[i] = self._read(ns, key, f)  # a miss, counted
                continue
            cached = self._cache.block(ns, f[1].digest)
            self._ram.memo.remember(ns, key, f[1].digest, f[1].size)
            if cached is not None:
                self._counters.count(ns, "get_hits")
                out[i] = cached
            else:
                fetch.append((i, f[1]))
        if fetch:
            got = self._blocks.fetch_many(ns, [e for _i, e in fetch])
            for (i, e), data in zip(fetch, got, strict=True):
                if data is None:
                    self._entries.drop(ns, keys[i], e)
                out[i] = data
                self._counters.count(ns, "get_hits" if data is not None else "get_misses")
        return out

    def delete(self, ns: str, key: str) -> bool:
        self._validate(ns, key)
        removed = self._entries.remove(ns, key.encode(), durable=True)
        self._ram.memo.forget(ns, key)
        return removed is not None

    def flush(self, ns: str) -> int:
        validate_namespace(ns)
        n = self._entries.pop(ns)
        self._ram.memo.forget_tenant(ns)
        return n

    def _pin(self, ns: str, key: str, delta: int) -> bool:
        self._validate(ns, key)
        fraction = self.options.max_pinned_fraction
        limit = int(self.capacity_bytes * fraction)
        done = self._entries.pin(ns, key, delta, limit)
        if done is None:
            raise QuotaExceededError(
                f"pin quota exceeded: this tenant's pinned keys would pass {limit} bytes "
                f"({fraction:.0%} of the cluster's {self.capacity_bytes} bytes "
                "of maxmemory)",
                resource="pins",
            )
        return done

    def pin(self, ns: str, key: str) -> bool:
        return self._pin(ns, key, +1)

    def unpin(self, ns: str, key: str) -> bool:
        return self._pin(ns, key, -1)

    def evict(self, ns: str, key: str) -> bool:
        self._validate(ns, key)
        found = self._found(ns, key)
        if found is None or found[0] or found[1].pins:
            return False
        self._cache.delete(ns, found[1].digest.hex())
        return True

    def promote(self, ns: str, key: str) -> bool:
        return self.get(ns, key) is not None

    def set_importance(self, ns: str, key: str, score: float) -> bool:
        self._validate(ns, key)
        if not 0.0 <= score <= 1.0:
            raise ValueError(f"importance must be in [0, 1] (got {score!r})")
        found = self._found(ns, key)
        if found is None or found[0]:
            return False
        self._cache.set_importance(ns, found[1].digest.hex(), score)
        return True

    def keys(self, ns: str, *, after: str | None = None, limit: int = 1000) -> list[str]:
        validate_namespace(ns)
        if limit <= 0:
            return []
        z = self._entries.keys_of(ns).order
        lo = b"(" + after.encode() if after is not None else b"-"
        raw = self._conn.exec(z, [("ZRANGEBYLEX", z, lo, b"+", "LIMIT", 0, limit)])[0]
        return [bytes(k).decode() for k in raw]

    def count(self, ns: str) -> int:
        validate_namespace(ns)
        z = self._entries.keys_of(ns).order
        return int(self._conn.exec(z, [("ZCARD", z)])[0])

    # -- stats -----------------------------------------------------------------------------
    def stats(self, ns: str | None = None) -> StoreStats:
        c = self._counters.fleet() if ns is None else self._counters.shared(ns)
        s = stats_of(c, self._cache.stats(ns), self.capacity_bytes)
        if ns is None:
            s.extra.update(self._fe)
            s.extra["namespaces"] = len(self._counters.tenants())
            s.extra["cluster_masters"] = len(self._conn.primaries())
            s.extra["cluster_down"] = int(self._conn.down_since is not None)
        return s

    # -- epochs ----------------------------------------------------------------------------
    def epoch_get(self, ns: str, scope: str) -> int:
        validate_namespace(ns)
        validate_scope(scope)
        return cluster_epochs.current(self._conn, self.prefix, ns, scope)

    def epoch_bump(self, ns: str, scope: str) -> int:
        validate_namespace(ns)
        validate_scope(scope)
        limit = self.options.max_epoch_scopes_per_tenant
        return cluster_epochs.bump(self._conn, self.prefix, ns, scope, limit)

    def set_epoch_listener(self, listener: EpochListener | None) -> bool:
        self._notices.listener = listener
        return True

    def retire_stale(self, *, max_items: int = 1000, budget_s: float = 0.05) -> int:
        """Remove stale entries (entries whose epoch scope moved on) and expired snapshots,
        bounded per call; every front-end may run it (removals are compare-and-delete)."""
        return self._retirer.retire(max_items=max_items, budget_s=budget_s)

    # -- health, the scrub, closing ---------------------------------------------------------
    def health(self) -> StoreHealth:
        if self._conn.closed:
            return StoreHealth(ready=False, writable=False, reason="the store is closed")
        if self._conn.down_since is not None:
            return StoreHealth(
                ready=False,
                writable=False,
                reason=f"the cluster is unreachable: {self._conn.down_reason}",
            )
        return StoreHealth()

    def scrub(self, *, fix: bool = True, deep: bool = False) -> ConsistencyReport:
        """Recount every block's references from the entries and, with `fix`, repair
        (see `store/cluster_scrub.py`). One front-end at a time. `deep` re-hashes blocks."""
        return self._scrubber.scrub(fix=fix, deep=deep)

    def check(self, *, deep: bool = False) -> ConsistencyReport:
        return self.scrub(fix=False, deep=deep)

    def close(self) -> None:
        if self._conn.closed:
            return
        self._stop.set()
        with contextlib.suppress(Exception):  # closing: at worst the counters are lost
            self._counters.flush()
        self._conn.closed = True
        self._maint.join(5.0)
        self._notices.join(5.0)
        self._cache.close()
        self._conn.close()

    # -- snapshots and branches (store/cluster_snapshots.py) ---------------------------
    def _snapshot_create(
        self, ns: str, keys: Sequence[str] | None, prefix: str | None, ttl_s: float | None
    ) -> SnapshotInfo:
        return self._snaps.create(ns, keys, prefix, ttl_s)

    def snapshot_info(self, ns: str, snapshot_id: str) -> SnapshotInfo | None:
        return self._snaps.info(ns, snapshot_id)

    def snapshot_list(self, ns: str) -> list[SnapshotInfo]:
        return self._snaps.listing(ns)

    def snapshot_delete(self, ns: str, snapshot_id: str) -> bool:
        return self._snaps.delete(ns, "snap", snapshot_id)

    def snapshot_get(self, ns: str, snapshot_id: str, key: str) -> Buffer | None:
        return self._snaps.get(ns, snapshot_id, key)

    def branch_create(self, ns: str, snapshot_id: str) -> BranchInfo:
        return self._snaps.branch_create(ns, snapshot_id)

    def branch_info(self, ns: str, branch_id: str) -> BranchInfo | None:
        return self._snaps.branch_info(ns, branch_id)

    def branch_list(self, ns: str) -> list[BranchInfo]:
        return self._snaps.branch_list(ns)

    def branch_delete(self, ns: str, branch_id: str) -> bool:
        return self._snaps.delete(ns, "branch", branch_id)

    def branch_get(self, ns: str, branch_id: str, key: str) -> Buffer | None:
        return self._snaps.branch_get(ns, branch_id, key)

    def branch_size(self, ns: str, branch_id: str, key: str) -> int | None:
        return self._snaps.branch_size(ns, branch_id, key)

    def _branch_put(self, ns: str, branch_id: str, key: str, data: BlockData) -> PutResult:
        return self._snaps.branch_put(ns, branch_id, key, data)


def run_check(config: Any, *, fix: bool, deep: bool) -> int:
    """`epistemic-kvcache cluster check|scrub`: print the report as JSON; exit 0 when the
    cluster is consistent (after repairs, with `fix`), 1 otherwise."""
    import dataclasses
    import json

    if config.cluster_url is None:
        raise ConfigurationError("invalid cluster_url: cluster check needs --cluster-url")
    options = dataclasses.replace(
        config.store, hot_capacity_bytes=0, warm_capacity_bytes=0, cluster_scrub_interval_s=0.0
    )
    store = ClusterBackend(
        config.cluster_url,
        options,
        tls_ca=config.cluster_tls_ca,
        password_file=config.cluster_password_file,
    )
    try:
        report = store.scrub(fix=fix, deep=deep)
        if fix:
            report = store.scrub(fix=False, deep=False)
        print(json.dumps({"ok": report.ok, **dataclasses.asdict(report)}, indent=2))
        return 0 if report.ok else 1
    finally:
        store.close()
