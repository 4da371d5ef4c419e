"""The seams the tier engine is composed along: a lower tier, a sequencer, an epoch source.

How it works
------------
`RamState` (ram.py) owns the index, the blobs, their refcounts and the RAM tiers
(tiers.py); `TieredEngine` (engine.py) is the facade over it. What differs between
backends is behind three small protocols, each one object the engine calls (no subclass
overrides an engine hook):

- `LowerTier`: where a block lives below RAM. `NoLowerTier` (memory backend: a block
  that leaves RAM leaves the store) or the durable backend's disk log
  (`disklog.DiskLogTier`: a RAM copy may be dropped, reads fall through to the log).
- `Sequencer`: how a decided change reaches RAM. Apply-now (memory backend,
  `memory.ApplyNow`: decide and apply under the RAM lock, in the caller's thread)
  or group commit (`disklog.GroupCommit`: queue for the committer, which decides,
  writes and syncs a batch, then applies it).
- `EpochSource`: the current epoch of a (tenant, scope): a dict in RAM (`RamEpochs`,
  here) or the shared on-disk registry (`epochs.EpochRegistry`).

This module imports only `api` and `model`, so every store module may import it.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Protocol

from epistemic_kvcache.errors import QuotaExceededError
from epistemic_kvcache.store.api import BlockData, Buffer, PutCond, PutResult
from epistemic_kvcache.store.model import MetaPut, _Blob, tenant_of

Loc = tuple[int, int]
"""(segment, payload offset) of a block on disk; (-1, 0) when it has none."""
Tag = tuple[str, int] | None
"""(epoch scope, epoch) an entry is written in, or None."""
Started = PutResult | concurrent.futures.Future[PutResult]
"""A PUT's result, or a future of it (resolved once the PUT is durable)."""


class LowerTier(Protocol):
    """Where blocks live below the RAM tiers. Called with the RAM lock NOT held,
    except `hot_full`, `blob_created` and `blob_destroyed` (lock held)."""

    keeps_blocks: bool
    """Every block is also stored below RAM: a RAM copy may simply be dropped."""

    def caps(self) -> dict[str, int]:
        """Capacities of the tiers below RAM, by name (e.g. {"cold": n})."""
        ...

    def pin_capacity(self) -> int | None:
        """The bytes pins compete for, or None: the RAM tiers'."""
        ...

    def extra_stats(self) -> dict[str, int | float]:
        """Store-wide statistics of this tier."""
        ...

    def hot_full(self) -> None:
        """The hot tier refused a block (lock held): make room for the next ones."""
        ...

    def blob_created(self, b: _Blob) -> None:
        """A blob entered the index (lock held)."""
        ...

    def blob_destroyed(self, b: _Blob) -> None:
        """A blob left the index (lock held)."""
        ...

    def read(self, b: _Blob, loc: Loc) -> Buffer | None:
        """The bytes at `loc`, unverified; None: unreadable now (a miss)."""
        ...

    def recover(self, b: _Blob, loc: Loc) -> Buffer | None:
        """The read at `loc` failed or did not verify: the verified bytes from elsewhere,
        or None."""
        ...

    def quarantine(self, b: _Blob, reason: str, loc: Loc) -> bool:
        """The block's bytes failed verification. False: this tier holds nothing for
        it, the engine drops the blob itself."""
        ...


class NoLowerTier:
    """No tier below RAM (memory backend): a block that leaves RAM leaves the store."""

    keeps_blocks = False

    def caps(self) -> dict[str, int]:
        return {}

    def pin_capacity(self) -> int | None:
        return None

    def extra_stats(self) -> dict[str, int | float]:
        return {}

    def hot_full(self) -> None:
        pass

    def blob_created(self, b: _Blob) -> None:
        pass

    def blob_destroyed(self, b: _Blob) -> None:
        pass

    def read(self, b: _Blob, loc: Loc) -> Buffer | None:
        return None

    def recover(self, b: _Blob, loc: Loc) -> Buffer | None:
        return None

    def quarantine(self, b: _Blob, reason: str, loc: Loc) -> bool:
        return False


class Sequencer(Protocol):
    """How writes reach RAM: decided and applied now, or through a group commit."""

    queues: bool
    """Writes wait for a commit (a PUT can be started, and awaited as a future)."""

    def put(
        self, ns: str, raw: bytes, key: str, data: BlockData, tag: Tag, cond: PutCond, wait: bool
    ) -> Started:
        """PUT into a (possibly internal) namespace, validated; blobs are scoped by `raw`
        (the namespace's UTF-8). `wait`: a blocking caller (it may make room in hot
        first, and gets the result once the write is visible and durable); else a caller
        on an event loop, which may get a future, resolved once the write is durable."""
        ...

    def snapshot(
        self, tenant: str, sid: str, keys: list[str] | None, prefix: str | None, rec: dict[str, Any]
    ) -> None:
        """Reference (and pin) the live entries named, under snapshot_ns(tenant, sid)."""
        ...

    def drop(self, tenant: str, items: list[tuple[str, str]]) -> None:
        """Delete the records and every entry of the named snapshots / branches."""
        ...

    def commit_meta(self, effect: MetaPut) -> None:
        """Make a snapshot/branch record durable (where there is a disk) and apply it."""
        ...

    def retire(self, pairs: list[tuple[str, str]]) -> int:
        """Delete the given entries if they are still stale; returns how many went."""
        ...


class EpochSource(Protocol):
    """Epochs of (tenant, scope)."""

    def current(self, tenant: str, scope: str) -> int: ...

    def bump(self, tenant: str, scope: str) -> int:
        """Advance the scope's epoch; raises `QuotaExceededError` past the tenant's
        share of scopes."""
        ...


class RamEpochs:
    """`EpochSource` in RAM (memory backend): (tenant, scope) -> epoch."""

    def __init__(
        self,
        lock: threading.Lock,
        tags: dict[tuple[str, str], tuple[str, int]],
        max_scopes_per_tenant: int,
    ) -> None:
        """`tags`: the engine's (ns, key) -> (scope, epoch) of tagged entries (read under
        `lock`, to prune scopes nothing is tagged with)."""
        self._lock = lock
        self._tags = tags
        self.max_scopes_per_tenant = max_scopes_per_tenant
        self.epochs: dict[tuple[str, str], int] = {}

    def current(self, tenant: str, scope: str) -> int:
        return self.epochs.get((tenant, scope), 0)

    def bump(self, tenant: str, scope: str) -> int:
        with self._lock:
            if (tenant, scope) not in self.epochs:
                self._room(tenant)
            n = self.epochs.get((tenant, scope), 0) + 1
            self.epochs[(tenant, scope)] = n
            return n

    def _room(self, tenant: str) -> None:
        """A tenant at its scope limit first loses the scopes no live entry is tagged
        with (forgetting their epoch cannot make anything fresh). Lock held."""
        mine = [s for (t, s) in self.epochs if t == tenant]
        limit = self.max_scopes_per_tenant
        if len(mine) < limit:
            return
        used = {tag[0] for (ns, _k), tag in self._tags.items() if tenant_of(ns) == tenant}
        for scope in mine:
            if scope not in used:
                del self.epochs[(tenant, scope)]
        if len(mine) - sum(1 for sc in mine if sc not in used) >= limit:
            raise QuotaExceededError(
                f"epoch scope quota exceeded: this tenant has {limit} scopes with live "
                "entries (its limit)",
                resource="epoch_scopes",
            )
