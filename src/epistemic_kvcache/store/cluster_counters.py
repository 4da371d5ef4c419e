"""Cluster mode's shared counters: tenants' stats, fleet-wide, at most a second behind.

How it works
------------
Each tenant has one counters hash in its slot (`{P:t:T}:c`). The scripts keep `keys`,
`logical_bytes` and the pin counts there exactly; every other counter (hits, misses,
dedup hits, unique blocks, ...) a front-end adds up in RAM (`count`) and the maintenance
thread adds to the hash once a second (`flush`: one pipeline of HINCRBY per tenant). A
flush whose outcome is unknown is dropped rather than risk adding twice; one that
surely failed is kept for the next. Reading a tenant's stats adds this front-end's
pending deltas to the hash, so a front-end always sees its own work. The set of tenants
(`{P}:tenants`, hex names) lets stats and the scrub walk every tenant.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from epistemic_kvcache.errors import StoreError
from epistemic_kvcache.store import cluster_lua as L
from epistemic_kvcache.store.api import StoreStats, TierStats
from epistemic_kvcache.store.cluster_conn import ClusterConnection, Unknown

__all__ = ["SharedCounters", "stats_of"]


class SharedCounters:
    """Per-tenant counters of a front-end, flushed into the cluster. Thread-safe."""

    def __init__(self, conn: ClusterConnection, prefix: str) -> None:
        self.conn = conn
        self.prefix = prefix
        self._lock = threading.Lock()
        self._deltas: dict[str, dict[str, int]] = {}
        self._tenants_seen: set[str] = set()

    def count(self, ns: str, name: str, n: int = 1) -> None:
        with self._lock:
            d = self._deltas.setdefault(ns, {})
            d[name] = d.get(name, 0) + n

    def _add_back(self, ns: str, items: list[tuple[str, int]]) -> None:
        with self._lock:
            d = self._deltas.setdefault(ns, {})
            for name, n in items:
                d[name] = d.get(name, 0) + n

    def flush(self) -> None:
        """Add the pending deltas to the tenants' shared counters."""
        with self._lock:
            pending, self._deltas = self._deltas, {}
        for ns, d in pending.items():
            items = [(k, v) for k, v in d.items() if v]
            if not items:
                continue
            tk = L.TenantKeys.of(self.prefix, ns)
            try:
                self.conn.exec(
                    tk.counters,
                    [("HINCRBY", tk.counters, k, v) for k, v in items],
                    safe=False,
                    window_s=1.0,
                )
            except Unknown:
                pass  # may have been added: never add twice
            except StoreError:
                self._add_back(ns, items)  # not added: keep them for the next flush

    def shared(self, ns: str) -> dict[str, int]:
        """The tenant's counters in the cluster plus this front-end's pending deltas."""
        tk = L.TenantKeys.of(self.prefix, ns)
        raw = self.conn.exec(tk.counters, [("HGETALL", tk.counters)])[0]
        out = {bytes(k).decode(): int(v) for k, v in dict(raw).items()}
        with self._lock:
            for name, n in self._deltas.get(ns, {}).items():
                out[name] = out.get(name, 0) + n
        return out

    def fleet(self) -> dict[str, int]:
        """Every tenant's counters summed."""
        c: dict[str, int] = {}
        for tenant in self.tenants():
            for name, n in self.shared(tenant).items():
                c[name] = c.get(name, 0) + n
        return c

    # -- the tenants -----------------------------------------------------------------------
    def register(self, ns: str) -> None:
        """Add `ns` to the cluster's set of tenants (once per front-end)."""
        if ns in self._tenants_seen:
            return
        k = L.tenants_key(self.prefix)
        self.conn.exec(k, [("SADD", k, ns.encode().hex())])
        with self._lock:
            self._tenants_seen.add(ns)

    def tenants(self) -> list[str]:
        """Every tenant that ever wrote through any front-end, sorted."""
        k = L.tenants_key(self.prefix)
        raw = self.conn.exec(k, [("SMEMBERS", k)])[0]
        return sorted(bytes.fromhex(bytes(t).decode()).decode() for t in raw)


_COUNTER_OF = {"total_refs": "keys", "pinned_blocks": "pinned_keys"}
"""Stats fields whose shared counter has another name (the rest share theirs)."""


def stats_of(c: Mapping[str, int], local: StoreStats, capacity_bytes: int) -> StoreStats:
    """`StoreStats` from shared counters `c` and the front-end's RAM tiers' stats `local`
    (hot and warm occupancy, promotions and demotions are this front-end's own)."""
    logical = c.get("logical_bytes", 0)
    resident = c.get("resident_bytes", 0)
    s = StoreStats.of(
        lambda name: c.get(_COUNTER_OF.get(name, name), 0),
        dedup_savings_bytes=max(0, logical - resident),
        promotions=local.promotions,
        demotions=local.demotions,
    )
    s.tiers["hot"] = local.tiers["hot"]
    s.tiers["warm"] = local.tiers["warm"]
    s.tiers["cluster"] = TierStats(  # no high-water mark kept: the peak reads as now
        c.get("unique_blocks", 0), resident, capacity_bytes, resident, resident
    )
    return s
