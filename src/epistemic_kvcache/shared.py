"""Facts the client and the server must agree on, defined once.

Key and namespace limits, size units, the server's request limits (`ServerLimits`, whose
defaults the client uses to split batches), the `/kv/stats` fields, and the snapshot and
branch records. Standard library only: the client, `config` and the wire code import it
without pulling in the store (lmdb, blosc2, numpy) or the server (uvloop, prometheus).
"""

from __future__ import annotations

import ipaddress
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from epistemic_kvcache.errors import InvalidKeyError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB

DEFAULT_HTTP_PORT = 9130
DEFAULT_RESP_PORT = 6379
DEFAULT_HOST = "127.0.0.1"

MAX_KEY_BYTES = 1024
"""A key is 1..1024 bytes of UTF-8 (LMCache keys are ~100-300 bytes)."""
MAX_NAMESPACE_BYTES = 256
MAX_SCOPE_BYTES = 200
"""Epoch scopes are short names; with a 256-byte tenant they fit one LMDB key (511)."""

RESERVED_SEGMENTS = frozenset({"stats", "batch", "snapshot", "branch", "epoch", "page-in", "keys"})
"""`/kv/<segment>` route names: a key spelled like one is reachable through the batch
routes only."""


def is_loopback_host(host: str) -> bool:
    """True for exactly `localhost` and loopback IP literals (IPv4 127/8, IPv6 ::1).

    Not `*.localhost`: glibc resolves such names through DNS like any other, so a plain
    http:// request (and its bearer token) could leave the machine.
    """
    h = host.strip("[]").lower()
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def _utf8(text: str, what: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidKeyError(f"invalid {what}: not valid UTF-8 ({exc.reason})") from exc


def validate_key(key: str) -> bytes:
    """Return the key's UTF-8 bytes, or raise `InvalidKeyError`."""
    raw = _utf8(key, "key")
    if not raw:
        raise InvalidKeyError("invalid key: empty")
    if len(raw) > MAX_KEY_BYTES:
        raise InvalidKeyError(f"invalid key: {len(raw)} bytes, limit is {MAX_KEY_BYTES}")
    return raw


def validate_namespace(ns: str) -> bytes:
    """Return the namespace's UTF-8 bytes, or raise `InvalidKeyError`."""
    raw = _utf8(ns, "namespace")
    if not raw or len(raw) > MAX_NAMESPACE_BYTES or b"\x00" in raw:
        raise InvalidKeyError(
            f"invalid namespace {ns!r}: expected 1..{MAX_NAMESPACE_BYTES} bytes without NUL"
        )
    return raw


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Bounds on everything a client can make the server hold. Defaults say why."""

    max_block_bytes: int = 128 * MiB
    """Llama-3-70B 256-token chunks are ~80 MiB; leave headroom, refuse the absurd."""
    receive_prefault_bytes: int = 256 * MiB
    """Receive memory for large blocks faulted in ahead of need on a helper thread, so
    the event loop does not take the page faults (0: off). Counts toward the process's
    RSS while unused; see `buffers.Prefaulter`."""
    max_header_bytes: int = 16 * KiB
    """Total request head size (nginx default large_client_header_buffers is 4x8 KiB)."""
    max_headers: int = 100
    """Header count (node.js maxHeadersCount defaults to 2000; we need a handful)."""
    request_timeout_s: float = 60.0
    """Deadline to receive one whole request once its first byte arrived (slowloris)."""
    idle_timeout_s: float = 300.0
    """Keep-alive connections idle this long are closed."""
    auth_timeout_s: float = 10.0
    """A connection not authenticated this long after it opened is closed, so that
    anonymous peers cannot hold every connection slot (HTTP: no request with valid
    credentials yet; RESP: no successful AUTH/HELLO)."""
    max_connections: int = 1024
    """Open connections per listener. When full, the oldest connection that has not
    authenticated yet is closed to make room; with none, the new one is refused."""
    max_unauthenticated_connections: int = 256
    """Connections per listener that have not authenticated yet (a small pool of its
    own: when full, its oldest connection is closed to admit the new one, if that one
    has had a second to authenticate; else the new one is refused)."""
    max_unauthenticated_connections_per_peer: int = 64
    """Unauthenticated connections one client address may hold (its oldest is closed,
    the same way), so one host cannot fill the pool."""
    max_connections_per_peer: int = 512
    """Connections one client address may hold on one listener."""
    max_connections_per_tenant: int = 512
    """Authenticated connections one tenant may hold on one listener; at most half of
    `max_connections` is used (`tenant_connection_cap`), so one tenant never holds
    every slot of a listener."""
    subscriber_idle_timeout_s: float = 1800.0
    """A RESP connection in subscribed mode that sends nothing this long is closed (a
    subscriber is otherwise never idle); redis-py's `health_check_interval` keeps it."""
    max_batch_keys: int = 1024
    max_batch_bytes: int = 256 * MiB
    """A batch is one request body (or answer, or MGET reply) held whole in RAM: 256 MiB
    is 1024 keys of 256 KiB."""
    max_inflight_body_bytes: int = 2048 * MiB
    """Every byte buffered for clients, server-wide: request bodies and RESP bulks being
    received, RESP commands not yet run, cold-read and batch answers until sent. A body
    is allocated whole once its head is accepted, so without this a few header-only
    requests could make the server allocate gigabytes."""
    max_tenant_inflight_bytes: int = 512 * MiB
    """One tenant's share of `max_inflight_body_bytes` (over it: HTTP 429, RESP -ERR),
    so one tenant cannot make the server busy for the others."""
    client_output_buffer_limit_bytes: int = 512 * MiB
    """Replies queued for one connection that does not read them; over it the client is
    disconnected (Redis' client-output-buffer-limit). A connection's next command waits
    until its replies are sent, so only a slow reader of one huge answer reaches it."""
    resp_max_query_buffer_bytes: int = 32 * MiB
    """Bytes one RESP connection may buffer of commands not yet run (small arguments
    with their overhead; bulks of 32 KiB and more are counted in the in-flight budget
    only). A client over it is disconnected (Redis' client-query-buffer-limit)."""
    resp_unauthenticated_max_args: int = 10
    """Before AUTH: at most this many arguments, command name included (Redis'
    CVE-2021-32675 limit; `HELLO 3 AUTH <user> <pass> SETNAME <name>` needs 7)."""
    resp_unauthenticated_max_bulk_bytes: int = 4 * KiB
    resp_unauthenticated_max_buffer_bytes: int = 64 * KiB
    """Before AUTH: bytes read ahead of the command being run; reading pauses above it,
    so an unauthenticated peer cannot queue a pipeline (one command at a time)."""
    resp_max_args: int = 1024 * 1024
    """Redis' own multibulk limit is 1024*1024 arguments."""

    @property
    def tenant_connection_cap(self) -> int:
        """The per-tenant connection cap in force: `max_connections_per_tenant`, clamped
        to half of `max_connections` (at least 1) so that the other tenants always have
        half of a listener's slots (the defaults, 512 of 1024, are exactly that)."""
        return min(self.max_connections_per_tenant, max(1, self.max_connections // 2))


DEFAULT_LIMITS = ServerLimits()
"""The server's defaults; a client splits its batches at these."""


# -- /kv/stats ------------------------------------------------------------------------

StatKind = Literal["counter", "gauge"]


@dataclass(frozen=True, slots=True)
class StatField:
    """One integer field of `/kv/stats` (and of the store's `StoreStats`)."""

    name: str
    kind: StatKind
    """`counter`: only grows while the server runs; `gauge`: goes up and down."""
    help: str
    unit: str = ""
    """`bytes` for sizes, empty for counts."""


def _stat(kind: StatKind, help: str, unit: str = "") -> Any:
    """A stats field: 0 by default; its kind, help and unit ride in the metadata."""
    return field(default=0, metadata={"kind": kind, "help": help, "unit": unit})


@dataclass(frozen=True, slots=True)
class StatCounts:
    """The integer fields of `/kv/stats`, in the order the server writes them: THE one
    definition. The store's `StoreStats`, the client's `KvCacheStats` and the metrics
    (`STATS_FIELDS`, `kvcache_<name>`) all derive from it."""

    unique_blocks: int = _stat("gauge", "Distinct blobs stored.")
    total_refs: int = _stat("gauge", "Keys referencing blobs.")
    logical_bytes: int = _stat("gauge", "Bytes as seen by clients (sum over keys).", "bytes")
    resident_bytes: int = _stat("gauge", "Bytes physically held.", "bytes")
    dedup_savings_bytes: int = _stat("gauge", "Bytes not stored thanks to dedup.", "bytes")
    dedup_hits: int = _stat("counter", "PUTs whose bytes were already stored.")
    put_new: int = _stat("counter", "PUTs that created a key.")
    put_conflicts: int = _stat("counter", "PUTs refused because the key already existed.")
    put_replaced: int = _stat("counter", "PUTs that replaced a key's bytes with other bytes.")
    get_hits: int = _stat("counter", "GETs that found their block.")
    get_misses: int = _stat("counter", "GETs that found nothing.")
    stale_missed: int = _stat("counter", "GETs that found only a stale-epoch entry.")
    integrity_failures: int = _stat("counter", "Blocks failing their digest (never served).")
    evictions: int = _stat("counter", "Blocks evicted.")
    promotions: int = _stat("counter", "Blocks promoted to a faster tier.")
    demotions: int = _stat("counter", "Blocks demoted to a slower tier.")
    pinned_blocks: int = _stat("gauge", "Blocks protected from eviction.")


@dataclass(frozen=True, slots=True)
class TierCounts:
    """The integer fields of one tier (`tiers.<name>.<field>`): the one definition of
    the store's `TierStats` and the client's `TierOccupancy` (each tier also has a
    `compression_ratio`)."""

    blocks: int = _stat("gauge", "Blocks in the tier.")
    bytes: int = _stat("gauge", "Physical bytes in the tier (compressed in warm).", "bytes")
    capacity_bytes: int = _stat("gauge", "Configured capacity of the tier.", "bytes")
    logical_bytes: int = _stat("gauge", "Uncompressed bytes in the tier.", "bytes")
    peak_bytes: int = _stat("gauge", "Most physical bytes the tier held since start.", "bytes")


def _stat_fields(cls: type[Any]) -> tuple[StatField, ...]:
    return tuple(
        StatField(f.name, f.metadata["kind"], f.metadata["help"], f.metadata["unit"])
        for f in fields(cls)
    )


STATS_FIELDS: tuple[StatField, ...] = _stat_fields(StatCounts)
"""Every integer field of `/kv/stats`, in the order the server writes them."""

TIER_FIELDS: tuple[StatField, ...] = _stat_fields(TierCounts)
"""Per-tier integer fields (`tiers.<name>.<field>`); each tier also has `compression_ratio`."""

TIERS = ("hot", "warm", "cold")


# -- snapshot and branch records ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    """An immutable set of `key -> digest` references of one namespace.

    It holds a reference (and a pin) on every block it names, so they stay while it lives.
    """

    id: str
    ns: str
    keys: int
    logical_bytes: int
    created_at: float
    expires_at: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class BranchInfo:
    """A copy-on-write overlay over a snapshot: reads fall through, writes stay here."""

    id: str
    ns: str
    snapshot_id: str
    created_at: float
    private_keys: int
    """Keys written in the branch overlay."""
    private_bytes: int
    """Bytes of overlay blocks the snapshot does not also reference."""
    shared_bytes: int
    """Bytes of the snapshot's blocks, shared with it (never copied)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
