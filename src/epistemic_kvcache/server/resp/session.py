"""What a RESP command handler sees: the client's session and the listener's shared state.

Handlers never touch the connection (transport, parser, timers). They get a `Session`:
the client's protocol version, name, identity, subscriptions and memory account, the
store calls (errors mapped to RESP replies), and a few requests to the connection
(authenticate, reset, quit, subscriptions changed) through `SessionHooks`.
`Shared` holds what all connections of one listener share: the server context, the
per-tenant SCAN cursor tables, the start time and version.
"""

from __future__ import annotations

import secrets
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Final, Protocol, TypeVar

from epistemic_kvcache.errors import AuthError, StoreError
from epistemic_kvcache.proto.resp import Buffer, Command, ErrorReply
from epistemic_kvcache.server.budget import Account
from epistemic_kvcache.server.context import Identity, ServerContext
from epistemic_kvcache.server.resp.common import (
    BUSY,
    NOAUTH,
    TENANT_BUSY,
    WIRE,
    WRONGPASS,
    Reply,
    store_error_reply,
)
from epistemic_kvcache.server.writes import TenantGates, Watcher
from epistemic_kvcache.shared import ServerLimits
from epistemic_kvcache.store.api import SharedKvBackend

T = TypeVar("T")

READ_BUFFER_BYTES: Final = 64 * 1024
"""One read's worth: what a connection parses per read callback is bounded by it."""
SCAN_CURSORS_PER_TENANT: Final = 1024
"""SCAN cursors remembered per tenant (its oldest forgotten first)."""
SCAN_CURSORS: Final = 16384
"""SCAN cursors remembered in all; past it the tenant holding the most loses its oldest."""


class CursorTable:
    """SCAN cursors -> positions, per tenant, with fair eviction. Thread-safe."""

    def __init__(
        self, per_tenant: int = SCAN_CURSORS_PER_TENANT, total: int = SCAN_CURSORS
    ) -> None:
        self.per_tenant = per_tenant
        self.total = total
        self._tables: dict[str, OrderedDict[int, str]] = {}
        self._count = 0
        self._lock = threading.Lock()

    def new(self, tenant: str, after: str) -> int:
        """A fresh random cursor resuming after `after`."""
        with self._lock:
            table = self._tables.setdefault(tenant, OrderedDict())
            cursor = 0
            while cursor == 0 or cursor in table:
                cursor = secrets.randbits(63)
            table[cursor] = after
            self._count += 1
            if len(table) > self.per_tenant:
                table.popitem(last=False)
                self._count -= 1
            while self._count > self.total:
                largest = max(self._tables.values(), key=len)
                largest.popitem(last=False)
                self._count -= 1
            return cursor

    def position(self, tenant: str, cursor: int) -> str | None:
        """Where `cursor` of `tenant` resumes, or None (unknown, forgotten, another's)."""
        with self._lock:
            table = self._tables.get(tenant)
            if table is None:
                return None
            after = table.get(cursor)
            if after is not None:
                table.move_to_end(cursor)
            return after

    def held_by(self, tenant: str) -> int:
        return len(self._tables.get(tenant, ()))


@dataclass(slots=True)
class CommandStat:
    """One command's calls for INFO commandstats (a tenant's own)."""

    calls: int = 0
    usec: float = 0.0
    failed: int = 0


@dataclass(slots=True)
class Activity:
    """A tenant's RESP activity on this listener (INFO `total_*`; its own only)."""

    connections: int = 0
    commands: int = 0
    per_command: dict[str, CommandStat] = field(default_factory=dict)
    """INFO commandstats: calls per command route (bounded by the command table)."""

    def count(self, route: str, seconds: float, failed: int = 0, calls: int = 1) -> None:
        stat = self.per_command.get(route)
        if stat is None:
            stat = self.per_command[route] = CommandStat()
        stat.calls += calls
        stat.usec += seconds * 1e6
        stat.failed += failed


MAX_MULTI_COMMANDS: Final = 10_000
"""Commands one connection may queue after MULTI (more: the transaction is aborted).
Redis has no such cap; its queue is bounded only by `client-query-buffer-limit`-like
output limits. Ours also counts the queued arguments against the in-flight budget."""
MULTI_COMMAND_OVERHEAD: Final = 64
"""Bytes a queued command is counted for beyond its arguments (the list and its items)."""


MAX_ACTIVITY_TENANTS: Final = 10_000
"""Tenants whose activity counters are kept (the least recently active dropped first)."""


class Shared:
    """What all connections of one RESP listener share, on one event loop.

    With several event loops (`event_loops`) each loop has its own `Shared` (its read
    scratch, its live connections, its activity counters), made with `first`: the SCAN
    cursors and the MULTI/EXEC gates are then the first loop's (one table for all), and
    `peers` lists every loop's `Shared` for what a tenant sees server-wide (CLIENT LIST,
    INFO's counters)."""

    def __init__(self, ctx: ServerContext, first: Shared | None = None) -> None:
        self.ctx = ctx
        self.started: float = time.monotonic() if first is None else first.started
        self.cursors: CursorTable = CursorTable() if first is None else first.cursors
        self.scratch = bytearray(READ_BUFFER_BYTES)
        """The read buffer every connection's parser borrows between `get_buffer` and
        `buffer_updated` (the parser copies out what it keeps before returning)."""
        try:
            self.version = metadata.version("epistemic-kvcache")
        except metadata.PackageNotFoundError:
            self.version = "0"
        self.durable = ctx.store.durable
        """Whether acknowledged writes are on disk (drives CONFIG GET appendonly/INFO)."""
        self._activity: OrderedDict[str, Activity] = OrderedDict()
        self.live: weakref.WeakSet[LiveConnection] = weakref.WeakSet()
        self.gates: TenantGates = ctx.writes.gates
        """MULTI/EXEC isolation per tenant (server/writes.py), across loops and wires."""
        self.peers: list[Shared] = [self] if first is None else first.peers
        """Every event loop's `Shared`, this one included."""
        if first is not None:
            self.peers.append(self)
        ctx.reload_hooks.append(self.revalidate)

    def all_live(self) -> list[LiveConnection]:
        """The open connections of every event loop (a copy)."""
        out: list[LiveConnection] = []
        for peer in list(self.peers):
            for _ in range(100):  # another loop may add or drop one while it is copied
                try:
                    out.extend(list(peer.live))
                    break
                except RuntimeError:
                    continue
        return out

    def activity_total(self, tenant: str) -> Activity:
        """`tenant`'s activity summed over every event loop (a copy, for INFO)."""
        total = Activity()
        for peer in list(self.peers):
            found = peer._activity.get(tenant)
            if found is None:
                continue
            total.connections += found.connections
            total.commands += found.commands
            for route, stat in list(found.per_command.items()):
                have = total.per_command.setdefault(route, CommandStat())
                have.calls += stat.calls
                have.usec += stat.usec
                have.failed += stat.failed
        return total

    def revalidate(self) -> None:
        """After a credentials reload: close the connections whose credential no longer
        verifies (a revoked token or key ends its sessions, not only new logins)."""
        for conn in list(self.live):
            if not conn.session.still_valid():
                conn.revoke()

    def activity(self, tenant: str) -> Activity:
        """The activity counters of `tenant` (created on first use; past
        `MAX_ACTIVITY_TENANTS` the least recently active tenant's are dropped)."""
        found = self._activity.get(tenant)
        if found is not None:
            self._activity.move_to_end(tenant)
        else:
            found = self._activity[tenant] = Activity()
            while len(self._activity) > MAX_ACTIVITY_TENANTS:
                self._activity.popitem(last=False)
        return found


class LiveConnection(Protocol):
    """What `Shared.revalidate` needs of a connection."""

    session: Session

    def kill(self) -> None:
        """CLIENT KILL: close the connection now."""

    def revoke(self) -> None:
        """Close the connection: its credential was revoked."""


class SessionHooks(Protocol):
    """What a session asks of its connection."""

    def on_login(self, identity: Identity) -> ErrorReply | None:
        """Take a connection slot for `identity`'s tenant; an error reply if refused."""

    def on_reset(self) -> None:
        """The session is unauthenticated again (parser limits, auth deadline, slot)."""

    def on_subscriptions(self) -> None:
        """The set of subscribed channels changed."""


class Session:
    """One client's session: the narrow context every command handler receives."""

    def __init__(self, shared: Shared, account: Account, hooks: SessionHooks) -> None:
        self.shared = shared
        self.ctx = shared.ctx
        self.account = account
        # a proxy: the connection owns its session, so the session must not hold the
        # connection (that cycle kept every closed connection for the garbage collector)
        self.hooks: SessionHooks = weakref.proxy(hooks)
        self.client_id = secrets.randbits(62) + 1
        """Random per connection: a counter would tell one tenant the others' rate."""
        self.identity: Identity | None = None
        self.credential: str | None = None
        """Kept to re-check the session when the credentials are reloaded (SIGHUP)."""
        self.protocol_version = 2
        self.name: str | None = None
        self.lib_name: str | None = None
        self.lib_version: str | None = None
        self.channels: dict[bytes, None] = {}
        """Subscribed pub/sub channels, in subscription order."""
        self.quit_requested = False
        self.multi: list[Command] | None = None
        """Commands queued since MULTI (None: no transaction open)."""
        self.multi_aborted = False
        """A command was refused while queuing: EXEC answers EXECABORT."""
        self.watcher: Watcher | None = None
        """The keys WATCHed (server/writes.py), made at the first WATCH."""
        self.peer = "?"
        """The client's address (for the log)."""
        self.addr = "?:0"
        self.laddr = "?:0"
        """The client's and the listener's `host:port` (CLIENT LIST, CLIENT KILL)."""
        self.created = time.monotonic()
        self.last_command = self.created
        """When the dispatcher last ran a command of this client (CLIENT LIST idle)."""
        self.last_route = "NULL"

    @property
    def store(self) -> SharedKvBackend:
        return self.ctx.store

    @property
    def limits(self) -> ServerLimits:
        return self.ctx.limits

    @property
    def namespace(self) -> str:
        identity = self.identity
        if identity is None:  # handlers run only once authenticated
            raise Reply(NOAUTH)
        return identity.tenant

    @staticmethod
    def call(fn: Callable[..., T], *args: object) -> T:
        """Call the store (on the thread pool), mapping its errors to RESP errors."""
        try:
            return fn(*args)
        except StoreError as exc:
            raise Reply(store_error_reply(exc, getattr(fn, "__name__", repr(fn)))) from None

    def authenticate(self, password: Buffer) -> ErrorReply | None:
        """Verify a credential and switch identity; an error reply on failure (the reason
        goes to the log, the client gets Redis' generic WRONGPASS)."""
        try:
            credential = bytes(password).decode("utf-8")
            identity = self.ctx.auth.authenticate(credential)
        except UnicodeDecodeError:
            self.ctx.auth_failures.failed(WIRE, self.addr, "credential is not UTF-8")
            return WRONGPASS
        except AuthError as exc:
            self.ctx.auth_failures.failed(WIRE, self.addr, str(exc) or "invalid credentials")
            return WRONGPASS
        refused = self.hooks.on_login(identity)
        if refused is not None:
            return refused
        self.identity = identity
        self.credential = credential
        self.hooks.on_subscriptions()
        return None

    def still_valid(self) -> bool:
        """Whether the session's credential still verifies to the same tenant (after
        the credentials were reloaded); True for an unauthenticated session."""
        if self.identity is None or self.credential is None:
            return True
        try:
            identity = self.ctx.auth.authenticate(self.credential)
        except AuthError:
            return False
        return identity.tenant == self.identity.tenant

    # -- MULTI / EXEC -----------------------------------------------------------------------
    def begin_multi(self) -> None:
        self.multi = []
        self.multi_aborted = False

    def queue_command(self, cmd: Command, nbytes: int) -> ErrorReply | None:
        """Queue `cmd` (counting `nbytes` under the "multi" purpose of the account); an
        error reply (and the transaction marked aborted) when a limit refuses it."""
        queued = self.multi
        if queued is None:  # the dispatcher queues only inside MULTI
            raise RuntimeError("queue_command outside MULTI")
        if len(queued) >= MAX_MULTI_COMMANDS:
            self.multi_aborted = True
            return ErrorReply(
                f"ERR too many commands queued in this transaction (at most {MAX_MULTI_COMMANDS})"
            )
        refused = self.account.take("multi", nbytes + MULTI_COMMAND_OVERHEAD)
        if refused is not None:
            self.multi_aborted = True
            return TENANT_BUSY if refused == "tenant" else BUSY
        queued.append(cmd)
        return None

    def end_multi(self) -> tuple[list[Command], bool]:
        """Close the transaction: its queued commands and whether it was aborted; the
        bytes counted for them go back to the budget."""
        queued, aborted = self.multi or [], self.multi_aborted
        self.multi = None
        self.multi_aborted = False
        self.account.give_back("multi")
        return queued, aborted

    # -- WATCH ------------------------------------------------------------------------------
    def watch(self, keys: list[str]) -> ErrorReply | None:
        """WATCH `keys` of the session's tenant; an error when over the connection's share."""
        ns = self.namespace
        if self.watcher is None:
            self.watcher = Watcher()
        refused = self.ctx.writes.watches.watch(self.watcher, [(ns, k) for k in keys])
        return None if refused is None else ErrorReply(f"ERR WATCH refused: {refused}")

    def unwatch(self) -> None:
        """UNWATCH (and EXEC, DISCARD, RESET, close): forget every watched key."""
        if self.watcher is not None:
            self.ctx.writes.watches.forget(self.watcher)

    def watch_changed(self) -> bool:
        """Whether a watched key was written since WATCH (EXEC then answers nil)."""
        return self.watcher is not None and self.watcher.changed

    def reset(self) -> None:
        """RESET: RESP2, no name, unauthenticated, no subscriptions, no transaction, no
        watched keys."""
        self.end_multi()
        self.unwatch()
        self.channels.clear()
        self.hooks.on_subscriptions()
        self.protocol_version = 2
        self.name = None
        self.identity = None
        self.credential = None
        self.hooks.on_reset()

    def subscriptions_changed(self) -> None:
        self.hooks.on_subscriptions()
