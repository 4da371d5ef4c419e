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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar

from epistemic_kvcache.shared import ServerLimits
from epistemic_kvcache.store.api import Buffer, PutResult, SharedKvBackend
from epistemic_kvcache.store.engine import WOULD_BLOCK, TieredEngine, WouldBlock

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


class EpochNotifier:
    """Fan-out of epoch bumps to one server's RESP subscribers, per tenant (event loop only).

    Also remembers the `(tenant, scope)` pairs this server has seen (bumped or watched) and
    their last known epoch, so a watcher can poll the shared registry for bumps made by
    other processes; each epoch is published at most once per server.
    """

    def __init__(self, max_watched: int = 10_000) -> None:
        self.max_watched = max_watched
        self.subscribers: dict[str, set[EpochCallback]] = {}
        self.known: dict[tuple[str, str], int | None] = {}
        """(tenant, scope) -> last epoch published or seen; None: not read yet."""

    def subscribe(self, tenant: str, deliver: EpochCallback) -> None:
        self.subscribers.setdefault(tenant, set()).add(deliver)

    def unsubscribe(self, tenant: str, deliver: EpochCallback) -> None:
        subs = self.subscribers.get(tenant)
        if subs is not None:
            subs.discard(deliver)
            if not subs:
                del self.subscribers[tenant]

    def watch(self, tenant: str, scope: str, epoch: int | None = None) -> None:
        """Poll `scope` from now on (its current epoch, if known, is not published)."""
        key = (tenant, scope)
        if key not in self.known:
            self.known[key] = epoch
            while len(self.known) > self.max_watched:  # forget the oldest
                del self.known[next(iter(self.known))]
        elif epoch is not None:
            last = self.known[key]
            self.known[key] = epoch if last is None else max(last, epoch)

    def publish(self, tenant: str, scope: str, epoch: int) -> bool:
        """Deliver `<scope> <epoch>` to the tenant's subscribers unless already known."""
        key = (tenant, scope)
        last = self.known.get(key)
        if last is not None and last >= epoch:
            return False
        self.watch(tenant, scope)
        self.known[key] = epoch
        for deliver in list(self.subscribers.get(tenant, ())):
            deliver(scope, epoch)
        return True


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
    """Live connections per listener name ("http", "resp"), for the connection cap."""
    metrics_tenants: frozenset[str] = frozenset({"default"})
    """Tenants that may read `/metrics` (store-wide totals: operators only)."""
    epochs: EpochNotifier = field(default_factory=EpochNotifier)
    """Epoch bump notifications (RESP pub/sub channel `kvcache:epochs`)."""
    inflight_body_bytes: int = field(default=0, init=False)
    """Bytes reserved by request bodies and bulks being received or served (event loop)."""
    inline_puts: bool = field(init=False)
    """`put_nowait` answers PUTs without a future (the memory backend)."""
    _engine: TieredEngine | None = field(init=False)

    def __post_init__(self) -> None:
        from epistemic_kvcache.store import SharedKvIndex

        self._engine = self.store if isinstance(self.store, TieredEngine) else None
        self.inline_puts = isinstance(self.store, SharedKvIndex)

    def reserve_body(self, nbytes: int) -> bool:
        """Reserve `nbytes` of the in-flight body budget before allocating a body (call on
        the event loop); False when that would exceed `max_inflight_body_bytes`. Whoever
        gets True calls `release_body(nbytes)` once the body is no longer needed."""
        if nbytes <= 0:
            return True
        if self.inflight_body_bytes + nbytes > self.limits.max_inflight_body_bytes:
            return False
        self.inflight_body_bytes += nbytes
        return True

    def release_body(self, nbytes: int) -> None:
        """Give back a reservation made by `reserve_body` (call on the event loop)."""
        self.inflight_body_bytes -= nbytes

    def get_nowait(self, ns: str, key: str) -> Buffer | WouldBlock | None:
        """The block if RAM answers at once (hit or miss), else `WOULD_BLOCK`; inline."""
        engine = self._engine
        if engine is None:
            return WOULD_BLOCK
        return engine.get_nowait(ns, key)

    def put_nowait(
        self, ns: str, key: str, data: Buffer
    ) -> PutResult | concurrent.futures.Future[PutResult] | WouldBlock:
        """Start a PUT inline when that is cheap (see `TieredEngine.put_nowait`)."""
        engine = self._engine
        if engine is None:
            return WOULD_BLOCK
        return engine.put_nowait(ns, key, data)

    async def get(self, ns: str, key: str) -> Buffer | None:
        """`store.get`, inline when RAM answers, else on the thread pool."""
        data = self.get_nowait(ns, key)
        if data is WOULD_BLOCK:
            return await self.run(self.store.get, ns, key)
        return data

    async def put(self, ns: str, key: str, data: Buffer) -> PutResult:
        """`store.put`: small PUTs start inline and a durable one is awaited as a future;
        the others run on the thread pool."""
        started = self.put_nowait(ns, key, data)
        if started is WOULD_BLOCK:
            return await self.run(self.store.put, ns, key, data)
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
