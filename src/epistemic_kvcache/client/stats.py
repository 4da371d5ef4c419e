"""Typed views of `/kv/stats` and of the client's own counters.

The integer fields are inherited from `shared.StatCounts` / `shared.TierCounts`, the
classes the server's `StoreStats` / `TierStats` derive from too: one definition.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from epistemic_kvcache.shared import STATS_FIELDS, TIER_FIELDS, StatCounts, TierCounts


def _int(d: Mapping[str, Any], name: str) -> int:
    value = d.get(name, 0)
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    return 0


@dataclass(frozen=True, slots=True)
class TierOccupancy(TierCounts):
    """One tier as `/kv/stats` reports it (fields: `shared.TierCounts`). `bytes` are
    physical (compressed in warm)."""

    compression_ratio: float = 1.0

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TierOccupancy:
        """Parse one entry of the `tiers` object (missing fields read as 0)."""
        ratio = d.get("compression_ratio", 1.0)
        return cls(
            **{f.name: _int(d, f.name) for f in TIER_FIELDS},
            compression_ratio=float(ratio) if isinstance(ratio, int | float) else 1.0,
        )


@dataclass(frozen=True, slots=True)
class KvCacheStats(StatCounts):
    """The caller's namespace stats from `GET /kv/stats` (docs/http-api.md); the integer
    fields are `shared.StatCounts`, the server's own definition."""

    namespace: str = ""
    tiers: dict[str, TierOccupancy] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """The whole JSON document, including fields this client version does not know."""

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> KvCacheStats:
        """Parse the `/kv/stats` JSON object."""
        tiers_raw = d.get("tiers") or {}
        tiers = {
            str(name): TierOccupancy.from_json(t)
            for name, t in (tiers_raw.items() if isinstance(tiers_raw, Mapping) else ())
            if isinstance(t, Mapping)
        }
        ns = d.get("namespace", "")
        counts = {f.name: _int(d, f.name) for f in STATS_FIELDS}
        return cls(
            namespace=ns if isinstance(ns, str) else str(ns),
            **counts,
            tiers=tiers,
            raw=dict(d),
        )


@dataclass(frozen=True, slots=True)
class ClientCounters:
    """What one client instance saw since it was created (a snapshot)."""

    requests: int = 0
    """HTTP requests sent (a batch is one)."""
    hits: int = 0
    """Blocks read (GET and batch GET hits)."""
    misses: int = 0
    """Blocks asked for and not found (404 / batch miss)."""
    puts_ok: int = 0
    puts_failed: int = 0
    """Blocks the server did not store (transport error, 413, 507, 5xx, per-key error)."""
    transport_errors: int = 0
    """Refused, reset, timed out, TLS failures after the handshake: degraded to a miss."""
    server_errors: int = 0
    """5xx / 429 / 408 answers: degraded to a miss."""
    size_mismatches: int = 0
    """`get_into` blocks whose size did not match the caller's buffer (read as a miss)."""
    bytes_sent: int = 0
    bytes_received: int = 0
    fast_failures: int = 0
    """Requests answered without the network while the circuit breaker was open."""
    breaker_trips: int = 0
    """Times the circuit breaker opened (a timeout, a refused or cut connection)."""
