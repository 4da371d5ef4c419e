"""What every listener shares: the store, the authenticator, limits, metrics, a thread pool.

The listeners (`server/http.py`, `server/resp.py`) are thin asyncio protocols. A store
call that may block (disk reads, fsync waits, hashing or compressing a large block) goes
through `ServerContext.run`, which runs it on the thread pool so it never blocks the
event loop. The hot path does not pay that hop: `get` and `put` first ask the store's
non-blocking variants (`get_nowait` / `put_nowait`: RAM hits, misses, small PUTs that
fit the hot tier), which answer inline in a few microseconds; a durable PUT is then
awaited as an asyncio future that the store's group committer resolves, so no pool
thread waits on an fsync and every PUT in flight can join the same group commit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar

from epistemic_kvcache.server.budget import (
    Account,
    BatchTooLarge,
    Busy,
    ConnectionSlots,
    MemoryBudget,
    SlotLimits,
)
from epistemic_kvcache.server.oplog import AccessLog, AuthFailureLog, RefusalLog
from epistemic_kvcache.server.writes import Writes, start_put
from epistemic_kvcache.shared import ServerLimits
from epistemic_kvcache.store.api import (
    WOULD_BLOCK,
    BlockData,
    Buffer,
    PutCond,
    PutResult,
    SharedKvBackend,
    WouldBlock,
)

if TYPE_CHECKING:
    from epistemic_kvcache.server.metrics import Metrics

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Identity:
    """A verified caller. `tenant` is the namespace every key of the caller lives in."""

    tenant: str
    subject: str
    method: Literal["token", "jwt", "mtls"]


class Authenticator(Protocol):
    """Turns a credential into an `Identity` or raises `AuthError`.

    HTTP passes the `Authorization: Bearer <credential>` value; RESP passes the AUTH
    password (the username is informational).
    """

    def authenticate(self, credential: str) -> Identity: ...


EpochCallback = Callable[[str, int], None]
"""A subscriber's delivery function: (scope, epoch)."""


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> Callable[[], None]:
    """`fn`, made callable from any thread: it runs on `loop` (at once when called there,
    else through `call_soon_threadsafe`; nothing when `loop` has stopped). For calls
    another event loop may make: CLIENT KILL of a connection served by another loop, a
    reload's re-check of each loop's sessions. (An evicted connection slot's callback is
    already run on its own loop by `ConnectionSlots`.)"""

    def call() -> None:
        if _running_loop() is loop:
            fn()
        else:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(fn)

    return call


class EpochNotifier:
    """Fan-out of epoch bumps to one server's RESP subscribers, per tenant (thread-safe).

    Also remembers the `(tenant, scope)` pairs this server has seen (bumped or watched) and
    their last known epoch, so a watcher can poll the shared registry for bumps made by
    other processes; each epoch is published at most once per server. The table is
    shared fairly: a tenant watching more than `max_watched_per_tenant` scopes forgets
    its own oldest, and past `max_watched` in all the tenant watching the most loses
    its oldest, so one tenant cannot push another's watches out.

    One notifier serves every event loop of the server (`event_loops`): a subscriber is
    remembered with the loop it subscribed on, and a bump published on another loop (or
    thread) reaches it through that loop's `call_soon_threadsafe`; on its own loop it is
    called at once. A lock guards the tables.
    """

    def __init__(self, max_watched: int = 10_000, max_watched_per_tenant: int = 1_000) -> None:
        self.max_watched = max_watched
        self.max_watched_per_tenant = max_watched_per_tenant
        self.subscribers: dict[str, dict[EpochCallback, asyncio.AbstractEventLoop | None]] = {}
        """tenant -> {delivery function: the loop it runs on (None: any thread)}."""
        self.known: dict[tuple[str, str], int | None] = {}
        """(tenant, scope) -> last epoch published or seen; None: not read yet."""
        self._by_tenant: dict[str, dict[str, None]] = {}
        """tenant -> its watched scopes, oldest first."""
        self._lock = threading.RLock()

    def subscribe(self, tenant: str, deliver: EpochCallback) -> None:
        """Deliver `tenant`'s bumps to `deliver`, on the loop running now (if any)."""
        with self._lock:
            self.subscribers.setdefault(tenant, {})[deliver] = _running_loop()

    def unsubscribe(self, tenant: str, deliver: EpochCallback) -> None:
        with self._lock:
            subs = self.subscribers.get(tenant)
            if subs is not None:
                subs.pop(deliver, None)
                if not subs:
                    del self.subscribers[tenant]

    def watched_by(self, tenant: str) -> int:
        """How many scopes of `tenant` are watched."""
        return len(self._by_tenant.get(tenant, ()))

    def watched(self) -> list[tuple[str, str]]:
        """A copy of the watched `(tenant, scope)` pairs."""
        with self._lock:
            return list(self.known)

    def baseline(self, tenant: str, scope: str) -> bool:
        """Whether `scope` is watched and its epoch not read yet."""
        with self._lock:
            return (tenant, scope) in self.known and self.known[(tenant, scope)] is None

    def watch(self, tenant: str, scope: str, epoch: int | None = None) -> None:
        """Poll `scope` from now on (its current epoch, if known, is not published)."""
        with self._lock:
            key = (tenant, scope)
            if key not in self.known:
                scopes = self._by_tenant.setdefault(tenant, {})
                if len(scopes) >= self.max_watched_per_tenant:
                    self._forget(tenant, next(iter(scopes)))
                self.known[key] = epoch
                self._by_tenant.setdefault(tenant, {})[scope] = None
                while len(self.known) > self.max_watched:
                    largest = max(self._by_tenant, key=lambda t: len(self._by_tenant[t]))
                    self._forget(largest, next(iter(self._by_tenant[largest])))
            elif epoch is not None:
                last = self.known[key]
                self.known[key] = epoch if last is None else max(last, epoch)

    def _forget(self, tenant: str, scope: str) -> None:
        self.known.pop((tenant, scope), None)
        scopes = self._by_tenant.get(tenant)
        if scopes is not None:
            scopes.pop(scope, None)
            if not scopes:
                del self._by_tenant[tenant]

    def publish(self, tenant: str, scope: str, epoch: int) -> bool:
        """Deliver `<scope> <epoch>` to the tenant's subscribers unless already known."""
        key = (tenant, scope)
        with self._lock:
            last = self.known.get(key)
            if last is not None and last >= epoch:
                return False
            self.watch(tenant, scope)
            if key in self.known:
                self.known[key] = epoch
            targets = list(self.subscribers.get(tenant, {}).items())
        here = _running_loop()
        for deliver, loop in targets:
            if loop is None or loop is here:
                deliver(scope, epoch)
            else:
                with contextlib.suppress(RuntimeError):  # that loop has stopped
                    loop.call_soon_threadsafe(deliver, scope, epoch)
        return True


@dataclass(slots=True)
class LoopStats:
    """One event loop's share of the server (`event_loops`): its index, its thread and
    how busy that thread is (`busy`: its CPU time over the last sampling interval, set by
    background.py `sample_loop_forever`)."""

    index: int
    thread_id: int = 0
    busy: float = 0.0
    cpu_s: float = 0.0
    event_loop: asyncio.AbstractEventLoop | None = None
    """The loop itself, once it serves (reload hooks are run on it)."""

    def cpu_seconds(self) -> float:
        """CPU time of the loop's thread so far (readable from any thread on Linux)."""
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self.thread_id))
        except (AttributeError, OSError, OverflowError):
            return self.cpu_s


@dataclass(frozen=True, slots=True)
class Readiness:
    """Whether the server should get traffic (`/readyz`, RESP `INFO`), and why not."""

    ready: bool
    reason: str | None = None
    detail: dict[str, bool] = field(default_factory=dict)


class LiveConnection(Protocol):
    """What the graceful stop needs of a connection (server/loops.py `drain`)."""

    @property
    def transport(self) -> asyncio.Transport | None: ...

    def begin_drain(self) -> None:
        """The server is stopping: finish the request in progress (and what the peer
        pipelined with it), then close at the next boundary between requests: HTTP with
        `Connection: close` on the last answer, RESP after a reply and outside MULTI."""

    @property
    def drained(self) -> bool:
        """Nothing of this connection is in flight any more: closed, or its write side
        shut after its last answer (the peer is reading it)."""


class Lifecycle:
    """What every event loop's context shares about the server's own state: draining
    (a stop began: not ready), and listeners that failed while serving (not ready)."""

    __slots__ = ("draining", "listener_faults")

    def __init__(self) -> None:
        self.draining = False
        self.listener_faults: dict[str, str] = {}
        """Listener name ("http", "resp") -> what broke it (readiness fails while any)."""


@dataclass(slots=True)
class ServerContext:
    """Shared state of one server instance (both listeners)."""

    store: SharedKvBackend
    auth: Authenticator
    limits: ServerLimits
    metrics: Metrics
    executor: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(
            max_workers=32, thread_name_prefix="kvcache-store"
        )
    )
    open_connections: dict[str, int] = field(default_factory=dict)
    """Live connections per listener name ("http", "resp"), exported as a metric."""
    live: set[LiveConnection] = field(default_factory=set)
    """Every open connection of both listeners (each adds itself when made and leaves
    when lost): the graceful stop waits for them and closes them."""
    metrics_tenants: frozenset[str] = frozenset({"default"})
    """Tenants that may read `/metrics` (store-wide totals: operators only)."""
    settings: tuple[tuple[str, str, str], ...] = ()
    """(name, value, source) of every setting, as `config.effective_settings` gives them:
    RESP `CONFIG GET` shows them to the operators (`metrics_tenants`)."""
    epochs: EpochNotifier = field(default_factory=EpochNotifier)
    """Epoch bump notifications (RESP pub/sub channel `kvcache:epochs`)."""
    auth_failures: AuthFailureLog = field(default_factory=AuthFailureLog)
    refusals: RefusalLog = field(default_factory=RefusalLog)
    """Connections refused or closed at a limit (rate-limited WARNING lines)."""
    writes: Writes = field(default_factory=Writes)
    """The tenant gates every write enters and the WATCHed keys it marks changed
    (server/writes.py; one object shared by every event loop's context)."""
    access_log: AccessLog = field(default_factory=AccessLog)
    reload_hooks: list[Callable[[], None]] = field(default_factory=list)
    """Called after the credentials were reloaded (SIGHUP): RESP re-checks its sessions."""
    budget: MemoryBudget = field(init=False)
    """Every byte buffered for clients, server-wide and per tenant (see server/budget.py)."""
    slots: dict[str, ConnectionSlots] = field(init=False, default_factory=dict)
    """Connection slots per listener name."""
    loop: LoopStats = field(default_factory=lambda: LoopStats(0))
    """This event loop's index and busy fraction (one context per loop: `sibling`)."""
    peers: list[ServerContext] = field(default_factory=list)
    """Every event loop's context, this one included (one list shared by all)."""
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    """Draining and listener faults (one object shared by every loop's context)."""

    def __post_init__(self) -> None:
        lim = self.limits
        self.budget = MemoryBudget(
            lim.max_inflight_body_bytes,
            min(lim.max_tenant_inflight_bytes, lim.max_inflight_body_bytes),
        )
        if not self.peers:
            self.peers.append(self)
        self.metrics.watch_auth_failures(self.auth_failures.by_wire)

    def sibling(self, index: int) -> ServerContext:
        """The context of another event loop of this server (`event_loops`).

        Global: the store, the authenticator, limits, the memory budget and connection
        slots (limits hold across loops), metrics' registry, the thread pool, epoch
        notifications, the logs. Per loop: its live connections, reload hooks (RESP
        re-checks its own sessions), request counters and loop stats."""
        for wire in ("http", "resp"):
            self.slots_for(wire)  # created before any loop serves: one set for all
        other = dataclasses.replace(
            self,
            live=set(),
            reload_hooks=[],
            metrics=self.metrics.loop_view(),
            loop=LoopStats(index),
        )
        other.budget = self.budget
        other.slots = self.slots
        self.peers.append(other)
        return other

    def loop_view(self) -> list[dict[str, object]]:
        """Per event loop: its index, open connections, requests answered, how busy its
        thread was over the last second and its CPU seconds (`INFO loops`, `/kv/stats`)."""
        out: list[dict[str, object]] = []
        for peer in list(self.peers):
            out.append(
                {
                    "loop": peer.loop.index,
                    "connections": len(peer.live),
                    "requests": peer.metrics.requests(),
                    "busy": round(peer.loop.busy, 3),
                    "cpu_seconds": round(peer.loop.cpu_seconds(), 3),
                }
            )
        return out

    def slots_for(self, wire: str) -> ConnectionSlots:
        """The connection slots of listener `wire` (created on first use)."""
        slots = self.slots.get(wire)
        if slots is None:
            lim = self.limits
            slots = ConnectionSlots(
                SlotLimits(
                    max_connections=lim.max_connections,
                    max_unauthenticated=min(
                        lim.max_unauthenticated_connections, lim.max_connections
                    ),
                    max_unauthenticated_per_peer=lim.max_unauthenticated_connections_per_peer,
                    max_per_peer=lim.max_connections_per_peer,
                    max_per_tenant=lim.tenant_connection_cap,
                )
            )
            self.slots[wire] = slots
            self.open_connections.setdefault(wire, 0)
        return slots

    def readiness(self) -> Readiness:
        """Whether to send traffic here: not while the server drains for a stop or a
        listener has failed; else the store's readiness (`store.health()`), where a
        failing check is "not ready"."""
        life = self.lifecycle
        try:
            h = self.store.health()
        except Exception as exc:  # a failing health check is "not ready", never a crash
            return Readiness(False, f"health check failed: {type(exc).__name__}")
        detail = {
            "writable": h.writable,
            "committer_alive": h.committer_alive,
            "disk_full": h.disk_full,
            "recovering": h.recovering,
            "draining": life.draining,
        }
        if life.draining:
            return Readiness(False, "shutting down", detail)
        faults = dict(life.listener_faults)
        if faults:
            why = "; ".join(f"{name} listener failed: {what}" for name, what in faults.items())
            return Readiness(False, why, detail)
        return Readiness(h.ready, h.reason, detail)

    def get_nowait(self, ns: str, key: str) -> Buffer | WouldBlock | None:
        """The block if RAM answers at once (hit or miss), else `WOULD_BLOCK`; inline."""
        return self.store.get_nowait(ns, key)

    def exists_nowait(self, ns: str, keys: Sequence[str]) -> int | WouldBlock:
        """How many of `keys` exist (Redis `EXISTS`, a key counted once per mention) when
        RAM answers at once, else `WOULD_BLOCK`."""
        return self.store.exists_nowait(ns, keys)

    def size_nowait(self, ns: str, key: str) -> int | WouldBlock | None:
        """The value's length (None: absent) when RAM answers at once, else `WOULD_BLOCK`."""
        return self.store.size_nowait(ns, key)

    async def get(self, ns: str, key: str, account: Account) -> Buffer | None:
        """`store.get`, inline when RAM answers, else on the thread pool with its buffer
        reserved from `account` first (`Busy` when refused)."""
        data = self.get_nowait(ns, key)
        if data is WOULD_BLOCK:
            return await self.run(self.read_reserved, account, ns, key)
        return data

    def read_reserved(self, account: Account, ns: str, key: str) -> Buffer | None:
        """Blocking (thread pool): the block, reading it only once `account` holds room
        for it under "reply" (raises `Busy`); None for a miss."""
        store = self.store
        size = store.size(ns, key)
        if size is None:
            return None
        refused = account.take("reply", size)
        if refused is not None:
            raise Busy(refused, size)
        data = store.get(ns, key)
        got = 0 if data is None else len(data)
        if got != size:  # replaced meanwhile: hold what was really read
            account.set("reply", account.holding("reply") - size + got, force=True)
        return data

    def read_many_reserved(self, account: Account, ns: str, keys: list[str]) -> list[Buffer | None]:
        """Blocking: `get_many`, its answers' size reserved from `account` first; raises
        `BatchTooLarge` over `max_batch_bytes` and `Busy` when refused."""
        store = self.store
        total = sum(s for s in (store.size(ns, k) for k in keys) if s is not None)
        limit = self.limits.max_batch_bytes
        if total > limit:
            raise BatchTooLarge(total, limit)
        refused = account.take("reply", total)
        if refused is not None:
            raise Busy(refused, total)
        blocks = store.get_many(ns, keys)
        got = sum(len(b) for b in blocks if b is not None)
        if got != total:
            account.set("reply", account.holding("reply") - total + got, force=True)
        if got > limit:  # keys were replaced between the two looks
            raise BatchTooLarge(got, limit)
        return blocks

    async def put(self, ns: str, key: str, data: BlockData, cond: PutCond = None) -> PutResult:
        """`store.put`: small PUTs start inline, through the one PUT entry of every wire
        (server/writes.py `start_put`), and a durable one is awaited as a future; the
        others run on the thread pool."""
        started = start_put(self.store, ns, key, data, cond)
        if started is WOULD_BLOCK:
            if cond is None:
                return await self.run(self.store.put, ns, key, data)
            return await self.run(functools.partial(self.store.put, ns, key, data, cond=cond))
        if isinstance(started, PutResult):
            return started
        return await asyncio.wrap_future(started)

    def notify_epoch(self, tenant: str, scope: str, epoch: int) -> None:
        """Publish that `scope` of `tenant` is now at `epoch` (call on the event loop).

        Whoever bumps an epoch through this server calls it with `epoch_bump`'s result;
        RESP subscribers of that tenant get `<scope> <epoch>` on `kvcache:epochs`, and the
        scope is polled from then on for bumps made by other processes."""
        self.epochs.publish(tenant, scope, epoch)

    def watch_epoch(self, tenant: str, scope: str, epoch: int | None = None) -> None:
        """Poll `scope` of `tenant` for bumps by other processes (call on the event loop);
        for routes that read an epoch or write an epoch-tagged entry."""
        self.epochs.watch(tenant, scope, epoch)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run a blocking store call on the thread pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, fn, *args)
