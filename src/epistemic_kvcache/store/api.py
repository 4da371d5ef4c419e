"""The store seam: `SharedKvBackend`, its result and stats types.

Everything above the store (HTTP, RESP, tests) talks to this interface only. Its
implementations (`SharedKvIndex`, RAM only; `SharedKvStoreBackend`, durable;
`ClusterBackend`) are synchronous and thread-safe: the asyncio server calls them from a
thread pool. What every backend does alike is written here once: `put` (its keywords,
waiting for a started PUT: the backend's `_start_put`), the argument checks of
`snapshot_create` and `branch_put` (then `_snapshot_create`, `_branch_put`), and
`StoreStats.of`, stats built from the one list of fields (`shared.STATS_FIELDS`).

Conventions:
- `ns` is the namespace (the tenant taken from a verified identity), `key` the client's
  key; both are `str`. Keys are 1..`MAX_KEY_BYTES` bytes of UTF-8; namespaces
  1..`MAX_NAMESPACE_BYTES` and may not contain NUL.
- A miss is `None` / `False`; a failure is a `StoreError` subclass.
- The store owns its bytes. A PUT's `data` may be anything bytes-like: `bytes` are kept
  as they are, any mutable buffer (`bytearray`, `memoryview`, an array) is copied before
  the PUT returns, so the caller may reuse it at once. A caller that gives its buffer
  away wraps it in a `Handover` (the wires do, for their receive buffers): kept without
  a copy, and never touched by the caller again.
- Blocks come back read-only: `bytes` or a read-only `memoryview` (writing into one
  raises TypeError); copy one (`bytearray(block)`) to change it.
"""

from __future__ import annotations

import abc
import concurrent.futures
import enum
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Literal, NamedTuple

# A PUT's explicit transfer of a buffer (re-exported: part of the store's interface).
from epistemic_kvcache.buffers import Handover as Handover  # noqa: PLC0414
from epistemic_kvcache.errors import BlockTooLargeError

# Re-exported for the store's modules; shared.py defines them once (the client uses them).
from epistemic_kvcache.shared import MAX_KEY_BYTES as MAX_KEY_BYTES  # noqa: PLC0414
from epistemic_kvcache.shared import MAX_NAMESPACE_BYTES as MAX_NAMESPACE_BYTES  # noqa: PLC0414
from epistemic_kvcache.shared import STATS_FIELDS, TIER_FIELDS, StatCounts, TierCounts
from epistemic_kvcache.shared import BranchInfo as BranchInfo  # noqa: PLC0414
from epistemic_kvcache.shared import SnapshotInfo as SnapshotInfo  # noqa: PLC0414
from epistemic_kvcache.shared import validate_key as validate_key  # noqa: PLC0414
from epistemic_kvcache.shared import validate_namespace as validate_namespace  # noqa: PLC0414

Buffer = bytes | bytearray | memoryview
"""A block's bytes. What the store returns is always read-only (see the module doc)."""
BlockData = Buffer | Handover
"""What a PUT takes: bytes-like (copied when mutable), or a `Handover` (kept as it is)."""


def owned_buffer(data: BlockData) -> Buffer:
    """What the store keeps of a PUT's `data`: something nobody can change afterwards.

    `bytes` (and a read-only view of all of a `bytes`) as they are; a `Handover`'s
    buffer as it is, read-only (its owner gave it away); any other buffer is copied
    (its owner may write into it later: a `bytearray`, a writable or read-only view of
    one, an array, a receive buffer passed without a `Handover`).
    """
    if type(data) is bytes:
        return data
    if isinstance(data, Handover):
        return data.view
    if (
        isinstance(data, memoryview)
        and type(data.obj) is bytes
        and data.format == "B"
        and data.c_contiguous
        and data.nbytes == len(data.obj)
    ):
        return data  # the whole of an immutable object (a part would keep all of it)
    return bytes(data)


def read_only(data: Buffer) -> Buffer:
    """`data` as the store hands it out: `bytes` or a read-only memoryview of the same
    memory (no copy)."""
    if type(data) is bytes or (isinstance(data, memoryview) and data.readonly):
        return data
    return memoryview(data).toreadonly()


PutCond = Literal["nx", "xx"] | None
"""A PUT's condition: `"nx"` create only (Redis `SET NX`, HTTP `If-None-Match: *`),
`"xx"` replace only (Redis `SET XX`), None: create or replace."""


class PutOutcome(enum.Enum):
    """What a PUT did. A plain PUT of an existing key replaces it (Redis semantics)."""

    NEW = "new"
    """The key was created (its bytes may still have been deduplicated against another key)."""
    DUPLICATE = "duplicate"
    """The key already held these exact bytes; nothing was written."""
    REPLACED = "replaced"
    """The key held other bytes and now holds these (the old block's reference dropped;
    snapshots keep the old bytes)."""
    CONFLICT = "conflict"
    """Refused: the key exists and the PUT was create-only (`nx`), or the tenant is
    configured first-write-wins and the bytes differ. Nothing was written."""
    MISSING = "missing"
    """Refused: the PUT was replace-only (`xx`) and the key does not exist."""


# The members as module constants: on Python 3.11 reading `PutOutcome.NEW` goes through
# the enum's class descriptor (~70 ns), and every PUT compares its outcome a few times.
PUT_NEW: Final = PutOutcome.NEW
PUT_DUPLICATE: Final = PutOutcome.DUPLICATE
PUT_REPLACED: Final = PutOutcome.REPLACED
PUT_CONFLICT: Final = PutOutcome.CONFLICT
PUT_MISSING: Final = PutOutcome.MISSING


class PutResult(NamedTuple):
    """Outcome of one PUT. `digest` is the BLAKE3 digest of the bytes the key now holds
    (the existing bytes when refused with CONFLICT; the offered bytes for MISSING).

    Immutable. (A named tuple, not a frozen dataclass: one is made per PUT, and a
    frozen dataclass's `__init__` costs twice as much.)"""

    outcome: PutOutcome
    digest: bytes
    size: int

    @property
    def created(self) -> bool:
        """True when the key did not exist before (HTTP 201)."""
        return self.outcome is PUT_NEW

    @property
    def applied(self) -> bool:
        """True unless the PUT was refused (CONFLICT, MISSING): the key holds these bytes."""
        outcome = self.outcome
        return outcome is not PUT_CONFLICT and outcome is not PUT_MISSING


def decide_put(
    existing: bytes | None, sdig: bytes, cond: PutCond, first_write_wins: bool
) -> PutOutcome:
    """The write rule, in one place: what a PUT of `sdig` does to a key holding
    `existing` (None: absent, or stale under its epoch)."""
    if existing is None:
        return PUT_MISSING if cond == "xx" else PUT_NEW
    if cond == "nx":
        return PUT_CONFLICT
    if existing == sdig:
        return PUT_DUPLICATE
    if first_write_wins and cond is None:
        return PUT_CONFLICT
    return PUT_REPLACED


def check_block_size(data: BlockData, max_block_bytes: int) -> None:
    """BlockTooLargeError unless `data` fits in `max_block_bytes`."""
    if len(data) > max_block_bytes:
        raise BlockTooLargeError(
            f"block of {len(data)} bytes exceeds max_block_bytes={max_block_bytes}"
        )


def validate_cond(cond: object) -> PutCond:
    """`cond` if it is a valid `PutCond`, else ValueError."""
    if cond not in (None, "nx", "xx"):
        raise ValueError(f"invalid put condition: expected 'nx', 'xx' or None (got {cond!r})")
    return cond


@dataclass(frozen=True, slots=True)
class StoreHealth:
    """What a readiness probe needs to know (HTTP `/readyz`, RESP `INFO`)."""

    ready: bool = True
    """Serving reads and writes: recovery finished, writable."""
    writable: bool = True
    """Writes are accepted (false after a store fault, or while the disk is full)."""
    committer_alive: bool = True
    disk_full: bool = False
    recovering: bool = False
    reason: str | None = None
    """Why not ready, in one line (None when ready)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class TierStats(TierCounts):
    """Occupancy of one tier (fields: `shared.TierCounts`). `bytes` are physical
    (compressed in warm); `logical_bytes` uncompressed; `peak_bytes` the most `bytes` the
    tier has held since the store was opened (a high-water mark that no sampling can miss:
    the RAM tiers keep it under their capacities)."""

    @property
    def compression_ratio(self) -> float:
        """Physical / logical bytes (1.0 when empty or uncompressed)."""
        return self.bytes / self.logical_bytes if self.logical_bytes else 1.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: the `TIER_FIELDS` and the ratio."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in TIER_FIELDS}
        out["compression_ratio"] = round(self.compression_ratio, 4)
        return out


@dataclass(frozen=True, slots=True)
class StoreStats(StatCounts):
    """Stats for one namespace (or the whole store when asked with `ns=None`). The integer
    fields are `shared.StatCounts` (defined once, for the client and metrics too); the
    `tiers` and `extra` dicts are filled in after construction."""

    tiers: dict[str, TierStats] = field(default_factory=dict)
    extra: dict[str, int | float] = field(default_factory=dict)
    """Store-wide counters (e.g. fsyncs, group-commit batches); empty in tenant stats."""

    @classmethod
    def of(cls, count: Callable[[str], int], **given: int) -> StoreStats:
        """Stats whose `STATS_FIELDS` are `count(name)`, but for the ones `given`."""
        ints: dict[str, Any] = {
            f.name: given[f.name] if f.name in given else count(f.name) for f in STATS_FIELDS
        }
        return cls(**ints)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: the DESIGN.md §5 field names, tiers nested, warm with a ratio."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in STATS_FIELDS}
        out["tiers"] = {name: t.to_dict() for name, t in self.tiers.items()}
        out["extra"] = dict(self.extra)
        return out


@dataclass(slots=True)
class ConsistencyReport:
    """Result of `SharedKvBackend.check()`. `ok` when every list is empty."""

    blocks: int = 0
    keys: int = 0
    orphan_index_entries: list[str] = field(default_factory=list)
    """Index entries whose digest has no blob (or a blob outside committed bytes)."""
    orphan_blobs: list[str] = field(default_factory=list)
    """Blobs no index entry references."""
    refcount_mismatches: list[str] = field(default_factory=list)
    corrupt_blobs: list[str] = field(default_factory=list)
    """Blobs whose bytes no longer match their digest (only with `deep=True`)."""
    lost_keys: list[str] = field(default_factory=list)
    """Keys (`ns/key`) whose bytes were gone when the store opened (served as misses)."""

    @property
    def ok(self) -> bool:
        return not (
            self.orphan_index_entries
            or self.orphan_blobs
            or self.refcount_mismatches
            or self.corrupt_blobs
            or self.lost_keys
        )


class SharedKvBackend(abc.ABC):
    """The block store interface. Thread-safe; every method may block on I/O."""

    max_block_bytes: int

    # -- single-key operations ---------------------------------------------------------
    def put(
        self,
        ns: str,
        key: str,
        data: BlockData,
        *,
        epoch_scope: str | None = None,
        cond: PutCond = None,
    ) -> PutResult:
        """Store `data` under `key`, replacing what the key held (see `decide_put` and
        `PutOutcome`; `cond` makes it create-only or replace-only). Durable before it
        returns (durable backend). A mutable `data` is copied (`owned_buffer`): the
        caller may reuse it at once; a `Handover` is kept as it is.

        With `epoch_scope`, the entry is tagged with the scope's current epoch and goes
        stale (reads miss, `stale_missed` counts) once `epoch_bump(ns, scope)` runs; a
        PUT over a stale entry replaces it. Untagged entries never go stale.

        Raises `InvalidKeyError`, `BlockTooLargeError`, `CapacityError`, `DiskFullError`,
        `StorageIOError`, `StoreClosedError`.
        """
        r = self._start_put(ns, key, data, epoch_scope, cond, True)
        return r if isinstance(r, PutResult) else r.result()

    @abc.abstractmethod
    def _start_put(
        self, ns: str, key: str, data: BlockData, scope: str | None, cond: PutCond, wait: bool
    ) -> PutResult | concurrent.futures.Future[PutResult]:
        """`put`'s work, for every backend: validate, then store or start storing.
        `wait`: a blocking caller (`put`), answered once the PUT is done; else an event
        loop's `put_nowait`, which may get a future resolved once the PUT is durable."""

    @abc.abstractmethod
    def get(self, ns: str, key: str) -> Buffer | None:
        """The block's bytes, read-only (verified against its digest when read from disk
        or warm)."""

    @abc.abstractmethod
    def size(self, ns: str, key: str) -> int | None:
        """The block's length without reading it (HTTP HEAD, RESP STRLEN)."""

    @abc.abstractmethod
    def exists(self, ns: str, key: str) -> bool:
        """Whether `key` is present (no tier movement, no hit counted)."""

    @abc.abstractmethod
    def delete(self, ns: str, key: str) -> bool:
        """Remove `key`; the blob goes when its last reference does. False if absent."""

    def key_hits(self, ns: str, key: str) -> int | None:
        """Reads counted for the key's block (RESP OBJECT FREQ), None if absent. A
        backend that does not count reads answers 0 for a present key."""
        return 0 if self.exists(ns, key) else None

    @abc.abstractmethod
    def pin(self, ns: str, key: str) -> bool:
        """Protect the key's block from eviction (counted; unpin once per pin)."""

    @abc.abstractmethod
    def unpin(self, ns: str, key: str) -> bool:
        """Undo one `pin`. False if absent or not pinned."""

    @abc.abstractmethod
    def evict(self, ns: str, key: str) -> bool:
        """Push the key's block out of RAM (hot and warm tiers).

        Durable backend: the block stays on disk and reads back. Memory backend: there is
        no lower tier, so the key is gone. False if absent or pinned.
        """

    @abc.abstractmethod
    def promote(self, ns: str, key: str) -> bool:
        """Bring the key's block into the hot tier (graph-aware paging). False if absent."""

    @abc.abstractmethod
    def set_importance(self, ns: str, key: str, score: float) -> bool:
        """Set an external importance in [0, 1] that the hot tier blends into eviction."""

    @abc.abstractmethod
    def keys(self, ns: str, *, after: str | None = None, limit: int = 1000) -> list[str]:
        """Keys of `ns` in sorted order, strictly after `after` (RESP SCAN, DBSIZE)."""

    @abc.abstractmethod
    def count(self, ns: str) -> int:
        """Number of keys in `ns`."""

    @abc.abstractmethod
    def stats(self, ns: str | None = None) -> StoreStats:
        """Stats of one namespace (never revealing others), or the whole store."""

    @abc.abstractmethod
    def check(self, *, deep: bool = False) -> ConsistencyReport:
        """Verify index <-> blobs <-> refcounts; `deep` also re-hashes every blob."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush and release everything. Idempotent."""

    @abc.abstractmethod
    def flush(self, ns: str) -> int:
        """Delete every key of the tenant namespace `ns` (per-tenant FLUSHDB); returns how
        many went. Snapshots and branches keep their references (and so their bytes)."""

    def health(self) -> StoreHealth:
        """Readiness: recovered, writable, committer alive, disk not full."""
        return StoreHealth()

    # -- snapshots and branches (DESIGN.md §2) --------------------------------------------
    def snapshot_create(
        self,
        ns: str,
        *,
        keys: Sequence[str] | None = None,
        prefix: str | None = None,
        ttl_s: float | None = None,
    ) -> SnapshotInfo:
        """Snapshot the given keys (absent ones are skipped) or every key with `prefix`
        (both None: the whole namespace). No block bytes are copied."""
        validate_namespace(ns)
        for key in keys or ():
            validate_key(key)
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"invalid ttl_s: expected a positive number (got {ttl_s!r})")
        return self._snapshot_create(ns, keys, prefix, ttl_s)

    @abc.abstractmethod
    def _snapshot_create(
        self, ns: str, keys: Sequence[str] | None, prefix: str | None, ttl_s: float | None
    ) -> SnapshotInfo:
        """`snapshot_create` of checked arguments, before anything is read or held."""

    @abc.abstractmethod
    def snapshot_info(self, ns: str, snapshot_id: str) -> SnapshotInfo | None:
        """The snapshot, or None if absent or expired."""

    @abc.abstractmethod
    def snapshot_list(self, ns: str) -> list[SnapshotInfo]:
        """Live snapshots of `ns`, oldest first."""

    @abc.abstractmethod
    def snapshot_delete(self, ns: str, snapshot_id: str) -> bool:
        """Release the snapshot's references (and delete its branches)."""

    @abc.abstractmethod
    def snapshot_get(self, ns: str, snapshot_id: str, key: str) -> Buffer | None:
        """Read `key` as of the snapshot."""

    @abc.abstractmethod
    def branch_create(self, ns: str, snapshot_id: str) -> BranchInfo:
        """Fork a snapshot (O(1), zero bytes copied). Raises `NotFoundError` if absent."""

    @abc.abstractmethod
    def branch_info(self, ns: str, branch_id: str) -> BranchInfo | None:
        """The branch, or None."""

    @abc.abstractmethod
    def branch_list(self, ns: str) -> list[BranchInfo]:
        """Branches of `ns`, oldest first."""

    @abc.abstractmethod
    def branch_delete(self, ns: str, branch_id: str) -> bool:
        """Release the branch overlay's references."""

    @abc.abstractmethod
    def branch_get(self, ns: str, branch_id: str, key: str) -> Buffer | None:
        """The overlay's block, else the snapshot's. None if neither has it (or no branch)."""

    @abc.abstractmethod
    def branch_size(self, ns: str, branch_id: str, key: str) -> int | None:
        """Like `branch_get` without reading the block."""

    def branch_put(self, ns: str, branch_id: str, key: str, data: BlockData) -> PutResult:
        """Write into the overlay only (a key written twice in the overlay is replaced).

        Raises `NotFoundError` when the branch does not exist."""
        validate_namespace(ns)
        validate_key(key)
        check_block_size(data, self.max_block_bytes)
        return self._branch_put(ns, branch_id, key, data)

    @abc.abstractmethod
    def _branch_put(self, ns: str, branch_id: str, key: str, data: BlockData) -> PutResult:
        """`branch_put` of checked arguments."""

    # -- epochs (derived-context invalidation) -----------------------------------------
    @abc.abstractmethod
    def epoch_get(self, ns: str, scope: str) -> int:
        """Current epoch of `scope` in `ns` (0 if never bumped)."""

    @abc.abstractmethod
    def epoch_bump(self, ns: str, scope: str) -> int:
        """Make every entry tagged with `scope` stale at once; returns the new epoch.

        Persisted (durable backend), and visible to every server sharing the epoch
        registry."""

    def set_epoch_listener(self, listener: Callable[[str, str, int], None] | None) -> bool:
        """Be told of every epoch bump, wherever it was made: `listener(tenant, scope,
        epoch)`, called on a store thread. False when this backend has no such feed (the
        server then polls `epoch_get`); the cluster backend has one (pub/sub)."""
        return False

    @abc.abstractmethod
    def retire_stale(self, *, max_items: int = 1000, budget_s: float = 0.05) -> int:
        """Reclaim up to `max_items` stale entries (and expired snapshots) within
        `budget_s`; returns how many were removed. Reads are correct whether or not it
        has run."""

    # -- batch forms (one lock acquisition / one group commit where it matters) ---------
    def put_many(
        self, ns: str, items: Sequence[tuple[str, BlockData]], *, cond: PutCond = None
    ) -> list[PutResult]:
        """PUT each item; raises on the first failure (earlier items stay stored)."""
        return [self.put(ns, key, data, cond=cond) for key, data in items]

    def get_many(self, ns: str, keys: Sequence[str]) -> list[Buffer | None]:
        """GET each key."""
        return [self.get(ns, key) for key in keys]

    def exists_many(self, ns: str, keys: Sequence[str]) -> list[bool]:
        """EXISTS for each key."""
        return [self.exists(ns, key) for key in keys]

    def delete_many(self, ns: str, keys: Sequence[str]) -> list[bool]:
        """DELETE each key."""
        return [self.delete(ns, key) for key in keys]

    def __enter__(self) -> SharedKvBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- answers an event loop may ask for inline ------------------------------------
    # The capability seam of the server's fast path: a backend answers what it can from
    # RAM at once and says `WOULD_BLOCK` for the rest (the caller then makes the
    # blocking call on a worker thread). These defaults answer nothing inline.
    durable: bool = True
    """Acknowledged writes are on stable storage (False: RAM only)."""
    index_in_ram: bool = False
    """`exists_many` and `size` answer from RAM (no I/O), so an event loop may call them."""

    def get_nowait(self, ns: str, key: str) -> Buffer | WouldBlock | None:
        """`get` when RAM alone answers it (a hit or a miss); else `WOULD_BLOCK`."""
        return WOULD_BLOCK

    def put_nowait(
        self, ns: str, key: str, data: BlockData, *, cond: PutCond = None
    ) -> PutResult | concurrent.futures.Future[PutResult] | WouldBlock:
        """`put` (without an epoch scope) when it is cheap to start inline: its result,
        or a future resolved once the PUT is durable; else `WOULD_BLOCK`. Errors are
        raised as by `put`."""
        return WOULD_BLOCK

    def exists_nowait(self, ns: str, keys: Sequence[str]) -> int | WouldBlock:
        """How many of `keys` exist (one count per mention) if RAM answers, else
        `WOULD_BLOCK`."""
        return sum(self.exists_many(ns, keys)) if self.index_in_ram else WOULD_BLOCK

    def size_nowait(self, ns: str, key: str) -> int | WouldBlock | None:
        """`size` if RAM answers it, else `WOULD_BLOCK`."""
        return self.size(ns, key) if self.index_in_ram else WOULD_BLOCK


class WouldBlock(enum.Enum):
    """Answer of the `*_nowait` calls when answering needs I/O, codec work or a lot of
    hashing: make the blocking call instead (off the event loop)."""

    WOULD_BLOCK = "WOULD_BLOCK"


WOULD_BLOCK: Final = WouldBlock.WOULD_BLOCK
