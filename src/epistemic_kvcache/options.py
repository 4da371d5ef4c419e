"""The store's options: one frozen `StoreOptions`, its fields and defaults written once.

How it works: the configuration builds one `StoreOptions` (`load_config` fills it from
the settings of the same names) and hands it whole to the backend it opens; every
backend (`SharedKvIndex`, `SharedKvStoreBackend`, `ClusterBackend`) takes it as its first
option argument and reads what applies to it. Validation runs once, in `__post_init__`,
so a bad value fails the same way whoever builds the object: a `ConfigurationError`
naming the field and the value. Things that are not options (the persist directory, the
cluster URL and its credentials, a test's clock, an I/O fault injector) stay arguments
of the backend that needs them.

Standard library only (like `shared`): `config` imports it without pulling in the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from epistemic_kvcache.errors import ConfigurationError
from epistemic_kvcache.shared import GiB, MiB, ServerLimits

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "DEFAULT_STORE_OPTIONS",
    "DedupScope",
    "StoreOptions",
    "first_write_wins_of",
]

DedupScope = Literal["namespace", "global"]
"""Identical bytes are shared within one namespace (the default) or across all."""

DEFAULT_SEGMENT_BYTES = 256 * MiB
"""Largest log segment of the durable store (smaller when the cold tier is small)."""

_LIMITS = ServerLimits()


@dataclass(frozen=True, slots=True)
class StoreOptions:
    """Tiers, quotas and durability of one store. Each backend reads the fields that
    apply to it (`cold_capacity_bytes` and the durability fields: the durable backend;
    `cluster_*`: the cluster backend) and ignores the rest."""

    # -- tiers ---------------------------------------------------------------------------
    hot_capacity_bytes: int = 1 * GiB
    """RAM for uncompressed blocks (0: no hot tier)."""
    warm_capacity_bytes: int = 1 * GiB
    """RAM for compressed blocks (0: no warm tier)."""
    cold_capacity_bytes: int = 100 * GiB
    """Disk for the durable store's log (durable backend only)."""
    max_block_bytes: int = _LIMITS.max_block_bytes
    """Largest block accepted: the server's `max_block_bytes` limit (`ServerLimits`)."""
    dedup_scope: DedupScope = "namespace"

    # -- quotas (per tenant) -------------------------------------------------------------
    max_pinned_fraction: float = 0.5
    """Share of the capacity one tenant may pin (pins and snapshots)."""
    max_snapshots_per_tenant: int = 256
    max_keys_per_tenant: int = 0
    """Keys one tenant may hold (0: no limit)."""
    max_epoch_scopes_per_tenant: int = 10_000
    """Epoch scopes one tenant may register; each is one small row of the registry."""
    first_write_wins: bool | frozenset[str] = False
    """Refuse a plain PUT of an existing key with other bytes (conflict) instead of
    replacing it: for every tenant (`True`) or for the tenants named."""

    # -- durability (durable backend) ----------------------------------------------------
    segment_bytes: int | None = None
    """Log segment size; `None`: `DEFAULT_SEGMENT_BYTES`, or a sixteenth of the cold tier
    (at least 1 MiB) when that is smaller."""
    map_size_bytes: int = 64 * GiB
    """The LMDB index's map (address space; the file grows with its rows)."""
    commit_batch_bytes: int = 512 * MiB
    """Most block bytes one group commit writes (one fsync)."""
    checkpoint_interval_s: float = 1.0
    max_checkpoint_lag_bytes: int = 512 * MiB
    """Log bytes the index may lag behind before a checkpoint is forced."""
    rebuild_index: bool = False
    """Rebuild the index from the log at open (else a missing or damaged index is an
    error)."""

    # -- cluster (cluster backend) -------------------------------------------------------
    cluster_wait_replicas: int = 0
    """Acknowledge a write once this many replicas have it (WAIT); 0: the master only."""
    cluster_wait_timeout_s: float = 2.0
    cluster_retry_window_s: float = 10.0
    """How long an operation retries through a failover or resharding."""
    cluster_key_prefix: str = "kvc"
    cluster_block_ttl_s: float = 0.0
    """Blocks expire this long after their last new reference unless pinned (0: never)."""
    cluster_scrub_interval_s: float = 3600.0
    cluster_socket_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        def fail(name: str, expected: str) -> None:
            raise ConfigurationError(
                f"invalid {name}: expected {expected} (got {getattr(self, name)!r})"
            )

        for name in ("hot_capacity_bytes", "warm_capacity_bytes"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
                fail(name, "a non-negative integer")
        for name in ("cold_capacity_bytes", "max_block_bytes", "map_size_bytes"):
            if not _is_int(getattr(self, name)) or getattr(self, name) <= 0:
                fail(name, "a positive integer")
        if self.segment_bytes is not None and (
            not _is_int(self.segment_bytes) or self.segment_bytes <= 0
        ):
            fail("segment_bytes", "a positive integer")
        if self.dedup_scope not in ("namespace", "global"):
            fail("dedup_scope", "namespace or global")
        if not 0.0 < self.max_pinned_fraction <= 1.0:
            fail("max_pinned_fraction", "(0, 1]")
        for name in ("max_snapshots_per_tenant", "max_epoch_scopes_per_tenant"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                fail(name, "a positive integer")
        if not _is_int(self.max_keys_per_tenant) or self.max_keys_per_tenant < 0:
            fail("max_keys_per_tenant", "0 (no limit) or a positive integer")
        if not isinstance(self.first_write_wins, bool | frozenset):
            fail("first_write_wins", "a bool or a frozenset of tenants")
        if not _is_int(self.cluster_wait_replicas) or self.cluster_wait_replicas < 0:
            fail("cluster_wait_replicas", "0 or more")
        if not self.cluster_retry_window_s > 0:
            fail("cluster_retry_window_s", "> 0")
        prefix = self.cluster_key_prefix
        if not prefix or any(c in prefix for c in "{}: \r\n"):
            fail("cluster_key_prefix", "a word without braces, colons or spaces")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def first_write_wins_of(tenants: tuple[str, ...]) -> bool | frozenset[str]:
    """The `first_write_wins_tenants` setting as a `StoreOptions.first_write_wins`
    value: `*` means every tenant, none means nobody."""
    if "*" in tenants:
        return True
    return frozenset(tenants) if tenants else False


DEFAULT_STORE_OPTIONS = StoreOptions()
"""Every option at its default (what a backend built without options gets)."""
