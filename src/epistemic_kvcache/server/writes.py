"""Every write the server makes to a tenant's keys, seen in one place: the tenant gates
(MULTI/EXEC isolation) and the key watches (WATCH).

How it works
------------
- `TenantGates`: per tenant, across event loops, a command that writes (any RESP
  command; an HTTP PUT, DELETE, batch PUT or epoch bump) enters the tenant's gate while
  it runs, and `EXEC` (or a read-then-write command) takes it alone (`hold`): it waits
  for the writes in flight to finish, runs, and lets the waiting ones go.
- `KeyWatches`: RESP `WATCH` registers a connection's `Watcher` for `(namespace, key)`
  pairs in one table for the whole server (every event loop, both wires). Each write
  marks the watchers of the keys it wrote changed (`touch`; `touch_all` for a write
  that may change any key of a namespace: FLUSHDB, an epoch bump), *after* the store
  applied it and *before* it leaves the gate. `EXEC` holds the gate, then asks
  `changed`: a write that landed after `WATCH` was counted by then, and none can land
  between that answer and the transaction's own writes.
- `Writes` bundles the two for the server context (`ctx.writes`); `guard` is how an HTTP
  write goes through them.

The table is bounded and shared fairly (DESIGN.md, fairness): at most
`MAX_WATCHED_PER_CONNECTION` keys per connection (a WATCH over it is refused), and past
`MAX_WATCHED_PER_TENANT` keys of one tenant, or `MAX_WATCHED` in all, the oldest watcher
of the tenant (in all: of the tenant watching the most) is dropped and marked changed:
its `EXEC` answers nil, as if its keys had been written, and the client retries. A
watch is never forgotten silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Final, TypeVar

T = TypeVar("T")

MAX_WATCHED_PER_CONNECTION: Final = 1024
"""Keys one connection may watch (redis-py's `transaction()` watches a few)."""
MAX_WATCHED_PER_TENANT: Final = 4096
"""Keys one tenant's connections may watch together; past it its oldest watcher goes."""
MAX_WATCHED: Final = 16384
"""Keys watched in all; past it the oldest watcher of the tenant watching the most goes.
A key is at most 1 KiB: the table holds at most ~20 MiB of keys."""

WatchKey = tuple[str, str]
"""(namespace, key)."""


class _Gate:
    __slots__ = ("active", "held", "waiters")

    def __init__(self) -> None:
        self.active = 0
        """Plain commands of the tenant running now."""
        self.held = False
        """An EXEC holds (or is draining) the tenant."""
        self.waiters: list[asyncio.Future[None]] | None = None
        """Parked `enter`s and `hold`s (None: none yet; most gates never have one)."""


class TenantGates:
    """Per tenant, across event loops: plain commands share the tenant, EXEC holds it alone.

    A RESP command of a tenant enters its gate while it runs (`enter_nowait`/`enter`,
    then `leave`); `EXEC` takes it exclusively (`hold`): new commands of the tenant wait,
    the running ones finish, then the transaction's commands run with no other RESP
    command of that tenant in between. `held` is the set the fast path checks (a hint:
    `enter_nowait` decides under the lock).

    One table serves every event loop of the server (`event_loops`), so a transaction
    is isolated from the tenant's commands on the other loops too: the table is guarded
    by a lock, and a waiter parked on one loop is woken from another through its own
    loop's `call_soon_threadsafe` (on the same loop, at once)."""

    def __init__(self) -> None:
        self._gates: dict[str, _Gate] = {}
        self.held: set[str] = set()
        self._lock = threading.Lock()

    def _gate(self, tenant: str) -> _Gate:
        gate = self._gates.get(tenant)
        if gate is None:
            gate = self._gates[tenant] = _Gate()
        return gate

    def enter_nowait(self, tenant: str) -> bool:
        """Enter as a plain command; False while an EXEC holds the tenant. (Every write
        pays this and `leave`: the lock taken without a `with` block, a gate made only
        for a tenant not in use, cost half as much.)"""
        lock = self._lock
        lock.acquire()
        try:
            gate = self._gates.get(tenant)
            if gate is None:
                gate = self._gates[tenant] = _Gate()
            elif gate.held:
                return False
            gate.active += 1
            return True
        finally:
            lock.release()

    async def enter(self, tenant: str) -> None:
        """Enter as a plain command, waiting for an EXEC that holds the tenant."""
        while True:
            with self._lock:
                gate = self._gate(tenant)
                if not gate.held:
                    gate.active += 1
                    return
                fut = self._park(gate)
            await self._wait(gate, fut)

    def leave(self, tenant: str) -> None:
        lock = self._lock
        lock.acquire()
        try:
            gate = self._gates[tenant]
            gate.active -= 1
            if gate.active:
                return
            if not gate.held:  # (no waiter then: only a held gate parks anyone)
                if not gate.waiters:
                    del self._gates[tenant]
                return
            waiters, gate.waiters = gate.waiters, None
        finally:
            lock.release()
        _wake(waiters)

    async def hold(self, tenant: str) -> None:
        """Take the tenant alone: wait for another EXEC, then for running commands."""
        while True:
            # fetched again after each wait: `release` drops a gate nobody is using, and
            # the waiters it wakes must take the tenant's current gate, not the dropped one
            with self._lock:
                gate = self._gate(tenant)
                if not gate.held:
                    gate.held = True
                    self.held.add(tenant)
                    break
                fut = self._park(gate)
            await self._wait(gate, fut)
        try:
            while True:
                with self._lock:
                    if not gate.active:
                        return
                    fut = self._park(gate)
                await self._wait(gate, fut)
        except BaseException:
            self.release(tenant)
            raise

    def release(self, tenant: str) -> None:
        with self._lock:
            gate = self._gates[tenant]
            gate.held = False
            self.held.discard(tenant)
            waiters, gate.waiters = gate.waiters, None
            if gate.active == 0:
                del self._gates[tenant]
        _wake(waiters)

    @staticmethod
    def _park(gate: _Gate) -> asyncio.Future[None]:
        """A future for the running loop, queued on `gate` (call under the lock)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if gate.waiters is None:
            gate.waiters = [fut]
        else:
            gate.waiters.append(fut)
        return fut

    async def _wait(self, gate: _Gate, fut: asyncio.Future[None]) -> None:
        try:
            await fut
        finally:
            with self._lock:
                if gate.waiters is not None and fut in gate.waiters:
                    gate.waiters.remove(fut)

    def active(self, tenant: str) -> int:
        """Commands (and HTTP writes) of `tenant` inside its gate now."""
        gate = self._gates.get(tenant)
        return 0 if gate is None else gate.active

    def __len__(self) -> int:
        return len(self._gates)


def _set_done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _wake(waiters: list[asyncio.Future[None]] | None) -> None:
    """Wake each waiter on its own loop (at once when that is the running loop)."""
    if not waiters:
        return
    try:
        here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    for fut in waiters:
        loop = fut.get_loop()
        if loop is here:
            _set_done(fut)
        else:
            with contextlib.suppress(RuntimeError):  # that loop has stopped
                loop.call_soon_threadsafe(_set_done, fut)


class Watcher:
    """One connection's watched keys (RESP `WATCH`), and whether one of them changed."""

    __slots__ = ("changed", "keys")

    def __init__(self) -> None:
        self.keys: dict[WatchKey, None] = {}
        """The watched (namespace, key) pairs, in the order watched."""
        self.changed = False
        """A watched key was written since it was watched (or the watch was dropped)."""


class KeyWatches:
    """Which connections watch which keys, for the whole server (thread-safe).

    `count` (how many watched keys there are) is read without the lock: a write
    touches nothing, at the cost of one attribute read, while nobody watches."""

    def __init__(
        self,
        per_connection: int = MAX_WATCHED_PER_CONNECTION,
        per_tenant: int = MAX_WATCHED_PER_TENANT,
        total: int = MAX_WATCHED,
    ) -> None:
        self.per_connection = per_connection
        self.per_tenant = per_tenant
        self.total = total
        self.count = 0
        self._by_key: dict[WatchKey, dict[Watcher, None]] = {}
        self._by_tenant: dict[str, dict[Watcher, int]] = {}
        """namespace -> its watchers (oldest first) and how many of its keys each holds."""
        self._held: dict[str, int] = {}
        """namespace -> keys of it watched."""
        self._lock = threading.Lock()

    def watch(self, watcher: Watcher, pairs: Iterable[WatchKey]) -> str | None:
        """Add `pairs` to `watcher`; why not (nothing added) when over its own share.
        A watcher already changed watches nothing more (its EXEC fails anyway)."""
        with self._lock:
            if watcher.changed:
                return None
            new = [p for p in dict.fromkeys(pairs) if p not in watcher.keys]
            if len(watcher.keys) + len(new) > self.per_connection:
                return (
                    f"at most {self.per_connection} keys may be watched per connection "
                    f"(this one watches {len(watcher.keys)})"
                )
            for pair in new:
                if watcher.changed:  # dropped to make room: nothing more to watch
                    break
                ns = pair[0]
                watcher.keys[pair] = None
                self._by_key.setdefault(pair, {})[watcher] = None
                mine = self._by_tenant.setdefault(ns, {})
                mine[watcher] = mine.get(watcher, 0) + 1
                self._held[ns] = self._held.get(ns, 0) + 1
                self.count += 1
                while self._held.get(ns, 0) > self.per_tenant:
                    self._drop(self._oldest(ns, watcher))
                while self.count > self.total:
                    largest = max(self._held, key=self._held.__getitem__)
                    self._drop(self._oldest(largest, watcher))
            return None

    def forget(self, watcher: Watcher) -> None:
        """UNWATCH (EXEC, DISCARD, RESET, a closed connection): drop its keys; it is
        unchanged again."""
        with self._lock:
            self._remove(watcher)
            watcher.changed = False

    def touch(self, ns: str, keys: Iterable[str]) -> None:
        """`keys` of `ns` were written: their watchers are changed (call after the write
        is applied, before it leaves the tenant's gate)."""
        if not self.count:
            return
        with self._lock:
            for key in keys:
                watchers = self._by_key.get((ns, key))
                if watchers:
                    for w in list(watchers):
                        w.changed = True
                        self._remove(w)

    def touch_all(self, ns: str) -> None:
        """Any key of `ns` may have been written (FLUSHDB, an epoch bump)."""
        if not self.count:
            return
        with self._lock:
            for w in list(self._by_tenant.get(ns, ())):
                w.changed = True
                self._remove(w)

    def watched_by(self, ns: str) -> int:
        """Keys of `ns` watched now."""
        return self._held.get(ns, 0)

    def _oldest(self, ns: str, sparing: Watcher) -> Watcher:
        """The oldest watcher of `ns` other than `sparing` (it, when alone)."""
        for w in self._by_tenant[ns]:
            if w is not sparing:
                return w
        return sparing

    def _drop(self, watcher: Watcher) -> None:
        """Over a share: the watcher loses its keys and reads as changed (lock held)."""
        watcher.changed = True
        self._remove(watcher)

    def _remove(self, watcher: Watcher) -> None:
        """Forget every key of `watcher` (lock held). A changed watcher needs no keys:
        nothing can make it unchanged but `forget`."""
        for pair in watcher.keys:
            ns = pair[0]
            watchers = self._by_key.get(pair)
            if watchers is not None:
                watchers.pop(watcher, None)
                if not watchers:
                    del self._by_key[pair]
            mine = self._by_tenant.get(ns)
            if mine is not None and mine.pop(watcher, None) is not None and not mine:
                del self._by_tenant[ns]
            left = self._held.get(ns, 0) - 1
            if left > 0:
                self._held[ns] = left
            else:
                self._held.pop(ns, None)
            self.count -= 1
        watcher.keys = {}


class Writes:
    """The server's tenant gates and key watches (one object for every event loop)."""

    __slots__ = ("gates", "watches")

    def __init__(self) -> None:
        self.gates = TenantGates()
        self.watches = KeyWatches()

    async def guard(
        self,
        ns: str,
        keys: Iterable[str] | None,
        write: Coroutine[Any, Any, T],
        changed: Callable[[T], bool] | None = None,
    ) -> T:
        """Run `write` (a write to `keys` of `ns`; None: any key of it) inside the
        tenant's gate, then mark its keys' watchers changed before leaving it: unless
        `changed(result)` says it wrote nothing (a refused conditional PUT, a DELETE of
        an absent key). A write that raised is taken to have written."""
        gates = self.gates
        if not gates.enter_nowait(ns):
            try:
                await gates.enter(ns)
            except BaseException:
                write.close()
                raise
        wrote = True
        try:
            result = await write
            wrote = changed is None or changed(result)
            return result
        finally:
            if wrote:
                if keys is None:
                    self.watches.touch_all(ns)
                else:
                    self.watches.touch(ns, keys)
            gates.leave(ns)
