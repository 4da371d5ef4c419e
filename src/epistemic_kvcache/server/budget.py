"""Shares of what every connection competes for: buffered bytes and connection slots.

How it works
------------
`MemoryBudget` counts every byte the server buffers on behalf of a client — request
bodies and large RESP bulks being received, small RESP arguments of commands not yet
run, response and reply buffers (cold reads, batch answers) until the transport has
sent them — server-wide and per tenant. Each connection holds one `Account` and moves
its own total up and down; taking more either succeeds or is refused with the limit
that refused it (`"server"`: the server-wide `max_inflight_bytes`; `"tenant"`: the
tenant's share `max_tenant_inflight_bytes`), so a tenant at its share gets its own
error while other tenants are unaffected. Bytes that already exist (a reply produced,
a command already framed) are `force`d: counted, never refused, and bounded elsewhere
(read-ahead pauses, one reply per command). Unauthenticated connections are accounted
under the pseudo-tenant `None`, whose bytes are bounded by the pre-AUTH parser limits.
Thread-safe: the store pool reserves read buffers from its threads.

`ConnectionSlots` hands out one listener's connection slots: a total cap, a small
separate pool for connections that have not authenticated yet (full pool: the oldest
unauthenticated connection is closed to admit the new one, so a peer cannot lock
others out by holding slots open), a per-peer cap on unauthenticated connections
(the same peer's oldest is closed first), a per-peer cap on all connections, and a
per-tenant cap checked when a connection authenticates.

Across event loops (`--event-loops N`): one `MemoryBudget` and one `ConnectionSlots` per
listener serve every loop, so each limit is exact server-wide. Every compound
check-and-update runs under the object's `threading.Lock` (uncontended on one loop:
well under a microsecond). A slot records the loop its connection runs on; when an
admission on one loop reclaims a slot of a connection on another, the slot is released
under the lock at once (the count is exact immediately) and the connection's `evict`
is scheduled on its own loop with `call_soon_threadsafe` after the lock is let go, so
no thread touches another loop's transport. A connection that authenticates after
its slot was reclaimed is refused (`RELEASED`); its `evict` closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal

Limit = Literal["server", "tenant"]

UNAUTHENTICATED: Final = None
"""The pseudo-tenant of connections that have not authenticated yet."""


class Busy(Exception):
    """Buffering `nbytes` more was refused by `limit` (the server's or the tenant's)."""

    def __init__(self, limit: Limit, nbytes: int) -> None:
        super().__init__(f"{nbytes} bytes refused by the {limit} limit")
        self.limit: Limit = limit
        self.nbytes = nbytes


class BatchTooLarge(Exception):
    """A batch answer (MGET, batch GET) would exceed `max_batch_bytes`."""

    def __init__(self, total: int, limit: int) -> None:
        super().__init__(f"batch answer of {total} bytes exceeds max_batch_bytes={limit}; split it")
        self.total = total
        self.limit = limit


class MemoryBudget:
    """Bytes buffered for clients: a server-wide cap and a cap per tenant. Thread-safe."""

    def __init__(self, total: int, per_tenant: int) -> None:
        self.total = total
        self.per_tenant = per_tenant
        self.used = 0
        self.peak = 0
        self._by_tenant: dict[str | None, int] = {}
        self._lock = threading.Lock()
        self.refusals: dict[Limit, int] = {"server": 0, "tenant": 0}

    def used_by(self, tenant: str | None) -> int:
        """Bytes currently counted for `tenant`."""
        return self._by_tenant.get(tenant, 0)

    def headroom(self, tenant: str | None) -> int:
        """Bytes `tenant` could still take now (0 when at either limit)."""
        cap = self.per_tenant if tenant is not None else self.total
        with self._lock:  # both counts from one moment
            return max(0, min(self.total - self.used, cap - self.used_by(tenant)))

    def check(self) -> None:
        """Raise `AssertionError` unless the per-tenant counts add up to `used` and no
        taken byte is over a limit (tests call it, concurrently with the takers)."""
        with self._lock:
            by_tenant = sum(self._by_tenant.values())
            if by_tenant != self.used or self.used < 0:
                raise AssertionError(f"used={self.used} but the tenants hold {by_tenant}")

    def try_take(self, tenant: str | None, nbytes: int) -> Limit | None:
        """Take `nbytes` for `tenant`; None on success, else the limit that refused."""
        if nbytes <= 0:
            return None
        with self._lock:
            if self.used + nbytes > self.total:
                self.refusals["server"] += 1
                return "server"
            held = self._by_tenant.get(tenant, 0)
            if tenant is not None and held + nbytes > self.per_tenant:
                self.refusals["tenant"] += 1
                return "tenant"
            self._add(tenant, held, nbytes)
        return None

    def force(self, tenant: str | None, nbytes: int) -> None:
        """Count `nbytes` that already exist (never refused)."""
        if nbytes <= 0:
            return
        with self._lock:
            self._add(tenant, self._by_tenant.get(tenant, 0), nbytes)

    def give_back(self, tenant: str | None, nbytes: int) -> None:
        """Return `nbytes` taken or forced for `tenant`."""
        if nbytes <= 0:
            return
        with self._lock:
            self.used -= nbytes
            left = self._by_tenant.get(tenant, 0) - nbytes
            if left > 0:
                self._by_tenant[tenant] = left
            else:
                self._by_tenant.pop(tenant, None)

    def _add(self, tenant: str | None, held: int, nbytes: int) -> None:
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        self._by_tenant[tenant] = held + nbytes


class Account:
    """What one connection (or one request) holds of a `MemoryBudget`, by purpose.

    Each purpose (`"input"`, `"output"`, `"body"`, ...) is a running total the owner sets;
    the account takes or gives back the difference. Thread-safe for distinct purposes
    only: a purpose is moved by one thread at a time.
    """

    __slots__ = ("_budget", "_held", "_lock", "closed", "tenant")

    def __init__(self, budget: MemoryBudget, tenant: str | None = UNAUTHENTICATED) -> None:
        self._budget = budget
        self.tenant = tenant
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()
        self.closed = False
        """After `close`, nothing more is taken (a pool job finishing late is refused)."""

    @property
    def held(self) -> int:
        """Bytes this account holds, every purpose together."""
        return sum(list(self._held.values()))

    def holding(self, purpose: str) -> int:
        return self._held.get(purpose, 0)

    def headroom(self) -> int:
        """Bytes this account's tenant could still take now (`MemoryBudget.headroom`)."""
        return self._budget.headroom(self.tenant)

    def take(self, purpose: str, nbytes: int) -> Limit | None:
        """Hold `nbytes` more for `purpose`; None on success, else the refusing limit."""
        with self._lock:
            if self.closed:
                return "server"
            refused = self._budget.try_take(self.tenant, nbytes)
            if refused is None and nbytes > 0:
                self._held[purpose] = self._held.get(purpose, 0) + nbytes
            return refused

    def set(self, purpose: str, nbytes: int, *, force: bool = False) -> Limit | None:
        """Make `purpose` hold exactly `nbytes` (growing may be refused unless `force`)."""
        if self._held.get(purpose, 0) == nbytes:  # the common case: nothing changes
            return None
        with self._lock:
            if self.closed:
                return None
            delta = nbytes - self._held.get(purpose, 0)
            if delta > 0:
                if force:
                    self._budget.force(self.tenant, delta)
                else:
                    refused = self._budget.try_take(self.tenant, delta)
                    if refused is not None:
                        return refused
            elif delta < 0:
                self._budget.give_back(self.tenant, -delta)
            if nbytes:
                self._held[purpose] = nbytes
            else:
                self._held.pop(purpose, None)
            return None

    def give_back(self, purpose: str, nbytes: int | None = None) -> None:
        """Return `nbytes` of `purpose` (all of it by default)."""
        held = self._held.get(purpose, 0)
        n = held if nbytes is None else min(nbytes, held)
        if n:
            self.set(purpose, held - n)

    def track_output(self, transport: object, limit: int) -> int | None:
        """Count a transport's unsent bytes under "output"; returns that count when it
        is over `limit` (the caller disconnects the client), else None."""
        size = getattr(transport, "get_write_buffer_size", None)
        queued = int(size()) if size is not None else 0
        self.set("output", queued, force=True)
        return queued if queued > limit else None

    def move_to(self, tenant: str | None) -> None:
        """Count everything held under `tenant` from now on (after authentication)."""
        with self._lock:
            if tenant == self.tenant:
                return
            total = sum(self._held.values())
            self._budget.give_back(self.tenant, total)
            self.tenant = tenant
            self._budget.force(tenant, total)

    def close(self) -> None:
        """Return everything (the connection is gone)."""
        with self._lock:
            self.closed = True
            self._budget.give_back(self.tenant, sum(self._held.values()))
            self._held.clear()


# -- connection slots ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SlotLimits:
    max_connections: int
    max_unauthenticated: int
    max_unauthenticated_per_peer: int
    max_per_peer: int
    max_per_tenant: int


class Slot:
    """One connection's slot; `evict` closes the connection when its slot is reclaimed.

    `loop` is the event loop the connection runs on (the running loop at `admit`; None
    outside one): an admission on another loop that reclaims this slot schedules
    `evict` there instead of calling it."""

    __slots__ = ("evict", "loop", "opened", "peer", "tenant")

    def __init__(
        self,
        peer: str,
        evict: Callable[[], None],
        opened: float,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.peer = peer
        self.tenant: str | None = None
        self.evict = evict
        self.opened = opened
        self.loop = loop

    @property
    def released(self) -> bool:
        """Whether the slot was given back (its connection closed, or it was reclaimed)."""
        return self.peer == ""


UNAUTHENTICATED_GRACE_S: Final = 1.0
"""An unauthenticated connection younger than this is never closed to make room (a
client authenticates within milliseconds of connecting): a burst of new connections
from a pool is refused at worst, never cut off mid-handshake."""

RELEASED: Final = "connection closed: its slot was reclaimed"
"""`authenticate`'s refusal for a slot reclaimed meanwhile (by an admission on another
loop); the connection's `evict` is on its way."""


class ConnectionSlots:
    """Connection slots of one listener (see the module docstring). Thread-safe: the
    listeners of every event loop share one instance."""

    def __init__(self, limits: SlotLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self.open = 0
        self._lock = threading.Lock()
        self._unauthenticated: OrderedDict[Slot, None] = OrderedDict()
        self._unauth_by_peer: dict[str, OrderedDict[Slot, None]] = {}
        self._by_peer: dict[str, int] = {}
        self._by_tenant: dict[str, int] = {}
        self.evicted = 0
        self.refused = 0

    def connections_of(self, tenant: str) -> int:
        return self._by_tenant.get(tenant, 0)

    @property
    def unauthenticated(self) -> int:
        return len(self._unauthenticated)

    def admit(self, peer: str, evict: Callable[[], None]) -> Slot | str:
        """A slot for a new (unauthenticated) connection, or why it is refused.

        Where a limit is reached, the oldest unauthenticated connection concerned is
        closed to make room if it is older than `UNAUTHENTICATED_GRACE_S`: its slot is
        released here, its `evict` runs after the lock is let go (on its own loop)."""
        reclaimed: list[Slot] = []
        loop = asyncio._get_running_loop()  # None outside a loop (no exception raised)
        with self._lock:
            admitted = self._admit_locked(peer, evict, loop, reclaimed)
        for old in reclaimed:
            _evict(old, loop)
        return admitted

    def _admit_locked(
        self,
        peer: str,
        evict: Callable[[], None],
        loop: asyncio.AbstractEventLoop | None,
        reclaimed: list[Slot],
    ) -> Slot | str:
        lim = self.limits
        now = self.clock()
        if self.open >= lim.max_connections and not self._reclaim(
            self._unauthenticated, now, reclaimed
        ):
            self.refused += 1
            return "max number of clients reached"
        pending = self._unauth_by_peer.get(peer)
        if self._by_peer.get(peer, 0) >= lim.max_per_peer and not self._reclaim(
            pending, now, reclaimed
        ):
            self.refused += 1
            return "max number of clients reached for this address"
        pending = self._unauth_by_peer.get(peer)
        if (
            pending is not None
            and len(pending) >= lim.max_unauthenticated_per_peer
            and not self._reclaim(pending, now, reclaimed)
        ):
            self.refused += 1
            return "too many unauthenticated connections from this address"
        if len(self._unauthenticated) >= lim.max_unauthenticated and not self._reclaim(
            self._unauthenticated, now, reclaimed
        ):
            self.refused += 1
            return "too many unauthenticated connections"
        slot = Slot(peer, evict, now, loop)
        self.open += 1
        self._by_peer[peer] = self._by_peer.get(peer, 0) + 1
        self._unauthenticated[slot] = None
        self._unauth_by_peer.setdefault(peer, OrderedDict())[slot] = None
        return slot

    def authenticate(self, slot: Slot, tenant: str) -> str | None:
        """Move `slot` to `tenant`'s share; a refusal reason when the tenant is at its cap
        (or `RELEASED` when the slot was reclaimed meanwhile)."""
        with self._lock:
            if slot.tenant == tenant and not slot.released:
                return None
            if slot.released:
                return RELEASED
            if self._by_tenant.get(tenant, 0) >= self.limits.max_per_tenant:
                self.refused += 1
                return "max number of clients reached for this tenant"
            self._leave(slot)
            slot.tenant = tenant
            self._by_tenant[tenant] = self._by_tenant.get(tenant, 0) + 1
            return None

    def deauthenticate(self, slot: Slot) -> None:
        """The connection is unauthenticated again (RESP `RESET`): back to the small pool."""
        with self._lock:
            if slot.tenant is None or slot.released:
                return
            self._leave(slot)
            slot.tenant = None
            slot.opened = self.clock()
            self._unauthenticated[slot] = None
            self._unauth_by_peer.setdefault(slot.peer, OrderedDict())[slot] = None

    def release(self, slot: Slot) -> bool:
        """The connection closed (idempotent); False if the slot was released already
        (by an earlier call, or reclaimed for a newer connection)."""
        with self._lock:
            return self._release_locked(slot)

    def _release_locked(self, slot: Slot) -> bool:
        if slot.released:
            return False
        self._leave(slot)
        self.open -= 1
        left = self._by_peer.get(slot.peer, 0) - 1
        if left > 0:
            self._by_peer[slot.peer] = left
        else:
            self._by_peer.pop(slot.peer, None)
        slot.peer = ""
        return True

    def _leave(self, slot: Slot) -> None:
        """Take `slot` out of whichever share it is counted in (not the totals)."""
        if slot.tenant is None:
            self._unauthenticated.pop(slot, None)
            pending = self._unauth_by_peer.get(slot.peer)
            if pending is not None:
                pending.pop(slot, None)
                if not pending:
                    del self._unauth_by_peer[slot.peer]
        else:
            left = self._by_tenant.get(slot.tenant, 0) - 1
            if left > 0:
                self._by_tenant[slot.tenant] = left
            else:
                self._by_tenant.pop(slot.tenant, None)

    def _reclaim(
        self, pool: OrderedDict[Slot, None] | None, now: float, reclaimed: list[Slot]
    ) -> bool:
        """Release the oldest slot of `pool` if it is past the grace period (lock held);
        its connection is closed by the caller, once the lock is let go."""
        if not pool:
            return False
        oldest = next(iter(pool))
        if now - oldest.opened < UNAUTHENTICATED_GRACE_S:
            return False
        self.evicted += 1
        self._release_locked(oldest)
        reclaimed.append(oldest)
        return True

    def check(self, *, pools: bool = True) -> None:
        """Raise `AssertionError` unless the counts agree with each other and every cap
        holds (tests call it, concurrently with the connections). `pools=False` skips
        the unauthenticated pools' caps, which a RESP `RESET` (`deauthenticate`) may
        overrun: a connection that was admitted keeps its slot."""
        with self._lock:
            lim = self.limits
            problems = []
            if not 0 <= self.open <= lim.max_connections:
                problems.append(f"open={self.open} (max {lim.max_connections})")
            if sum(self._by_peer.values()) != self.open:
                problems.append(f"per-peer counts {sum(self._by_peer.values())} != {self.open}")
            if pools and len(self._unauthenticated) > lim.max_unauthenticated:
                problems.append(f"unauthenticated={len(self._unauthenticated)}")
            if len(self._unauthenticated) + sum(self._by_tenant.values()) != self.open:
                problems.append("unauthenticated + per-tenant counts != open")
            if sum(len(p) for p in self._unauth_by_peer.values()) != len(self._unauthenticated):
                problems.append("per-peer unauthenticated pools disagree with the pool")
            if any(n > lim.max_per_peer for n in self._by_peer.values()):
                problems.append(f"a peer over max_per_peer: {self._by_peer}")
            if pools and any(
                len(p) > lim.max_unauthenticated_per_peer for p in self._unauth_by_peer.values()
            ):
                problems.append("a peer over max_unauthenticated_per_peer")
            if any(n > lim.max_per_tenant for n in self._by_tenant.values()):
                problems.append(f"a tenant over max_per_tenant: {self._by_tenant}")
            if problems:
                raise AssertionError("; ".join(problems))


def _evict(slot: Slot, here: asyncio.AbstractEventLoop | None) -> None:
    """Close the connection of a reclaimed slot: at once on its own loop (or outside
    any), else scheduled on its loop, whose thread alone may touch its transport."""
    owner = slot.loop
    if owner is None or owner is here:
        slot.evict()
        return
    with contextlib.suppress(RuntimeError):  # its loop is closed: the connection is gone
        owner.call_soon_threadsafe(slot.evict)


def peer_of(transport: object) -> str:
    """The peer's address (host only) of a transport, `"?"` when unknown (unix sockets)."""
    get = getattr(transport, "get_extra_info", None)
    peer = get("peername") if get is not None else None
    if isinstance(peer, tuple) and peer:
        return str(peer[0])
    return "?"


__all__ = [
    "RELEASED",
    "UNAUTHENTICATED",
    "Account",
    "BatchTooLarge",
    "Busy",
    "ConnectionSlots",
    "Limit",
    "MemoryBudget",
    "Slot",
    "SlotLimits",
    "peer_of",
]
