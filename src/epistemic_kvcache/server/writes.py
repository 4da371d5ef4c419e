"""Every write the server makes to a tenant's keys, seen in one place: the one PUT entry,
the tenant gates (MULTI/EXEC isolation) and the key watches (WATCH).

How it works
------------
- `start_put`: the one way any wire starts a PUT (RESP's inline fast path, the
  connection's task and MULTI's transaction job, HTTP's `ServerContext.put`): the
  received value handed to the store without a copy, the store's `put_nowait`, and its
  answer (a result, a future resolved once the PUT is durable, or `WOULD_BLOCK`); the
  caller keeps its gate and its reply.
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
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Final, TypeVar

from epistemic_kvcache.buffers import received_block
from epistemic_kvcache.store.api import BlockData, PutCond, PutResult, SharedKvBackend, WouldBlock

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


def start_put(
    store: SharedKvBackend, ns: str, key: str, value: BlockData, cond: PutCond = None
) -> PutResult | concurrent.futures.Future[PutResult] | WouldBlock:
    """Start a PUT of `value` under `key` of `ns`: the one entry every wire and MULTI
    starts a PUT through (the caller holds the tenant's gate).

    A memoryview is handed over as it was received (`received_block`: a whole receive
    buffer is kept by the store without a copy); bytes, a `Handover` or anything else go
    as they are (the store copies what is mutable). Returns the store's `put_nowait`:
    its `PutResult`, a future resolved once the PUT is durable, or `WOULD_BLOCK` (the
    caller makes the blocking `put` off the event loop). A `StoreError` is raised as by
    `put`; each wire maps it through proto/errors.py's table."""
    data = received_block(value) if type(value) is memoryview else value
    if cond is None:
        return store.put_nowait(ns, key, data)
    return store.put_nowait(ns, key, data, cond=cond)


class _Gate:
    """A tenant an EXEC holds: who waits for it (only a held tenant has one)."""

    __slots__ = ("drain", "waiters")

    def __init__(self) -> None:
        self.drain: asyncio.Future[None] | None = None
        """The holder's wait for the tenant's running commands to finish."""
        self.waiters: list[asyncio.Future[None]] | None = None
        """Parked `enter`s and `hold`s, woken by `release` (None: none yet)."""


class TenantGates:
    """Per tenant, across event loops: plain commands share the tenant, EXEC holds it alone.

    A RESP command of a tenant enters its gate while it runs (`enter_nowait`/`enter`,
    then `leave`); `EXEC` takes it exclusively (`hold`): new commands of the tenant wait,
    the running ones finish, then the transaction's commands run with no other RESP
    command of that tenant in between. `held` is the set of held tenants (written under
    the lock, read by anyone: the fast path checks it before it takes a command).

    One table serves every event loop of the server (`event_loops`), so a transaction
    is isolated from the tenant's commands on the other loops too; a waiter parked on
    one loop is woken from another through its own loop's `call_soon_threadsafe` (on
    the same loop, at once).

    Entering and leaving take no lock (every write pays them: the fast path once per
    read that SETs). Each thread counts its own commands inside, per tenant, in a table
    only it writes (`_mine`: a plain dict in a `threading.local`; a tenant with none
    inside has no entry), so no count is lost to a read-modify-write racing another
    thread. Against `hold` the order does it (Dekker's), every step one atomic,
    sequentially consistent operation under the GIL:

    - `enter_nowait` counts itself in, *then* reads `held`; held: it counts itself out
      again (as `leave` does) and answers False.
    - `hold` adds the tenant to `held` under the lock, *then* sums the threads' counts
      under the lock; above 0 it parks (`drain`) under that same lock.
    - `leave` counts itself out, *then* reads `held`; held (rare), it takes the lock and,
      the sum at 0, wakes the parked holder.

    A command that got in read `held` before the tenant was added, so it had counted
    itself in before `hold` summed, and is in the sum until it leaves: a holder that
    saw 0 runs alone. A holder that parked did so under the lock after summing; the last
    command to leave counted itself out after that sum, so it sees `held`, takes the
    lock once the holder has parked, and finds the sum at 0. The lock remains for the
    rare steps: holding, releasing, parking, waking, and a thread's first entry (its
    table joins `_tables`, which `hold` sums over)."""

    __slots__ = ("_gates", "_local", "_lock", "_tables", "held")

    def __init__(self) -> None:
        self._gates: dict[str, _Gate] = {}
        """Held tenants' gates (under the lock); a tenant is in `held` iff it has one."""
        self.held: set[str] = set()
        self._tables: dict[int, dict[str, int]] = {}
        """Thread id -> that thread's table (under the lock). A thread that ends leaves
        its table (empty, unless it died inside) until a thread of the same id, which
        the system reuses, takes its place: as many as threads ever entered at once."""
        self._local = threading.local()
        self._lock = threading.Lock()

    def _mine(self) -> dict[str, int]:
        """This thread's table (made and registered on its first entry)."""
        try:
            return self._local.counts  # type: ignore[no-any-return]
        except AttributeError:
            pass
        counts: dict[str, int] = {}
        with self._lock:
            self._tables[threading.get_ident()] = counts
        self._local.counts = counts
        return counts

    def _active(self, tenant: str) -> int:
        """The tenant's commands inside, summed over the threads (call under the lock)."""
        return sum(table.get(tenant, 0) for table in self._tables.values())

    def enter_nowait(self, tenant: str) -> bool:
        """Enter as a plain command; False while an EXEC holds the tenant."""
        try:
            mine = self._local.counts
        except AttributeError:
            mine = self._mine()
        if tenant in mine:  # counted in first ...
            mine[tenant] += 1
        else:
            mine[tenant] = 1
        if tenant in self.held:  # ... then the flag read (see the class docstring)
            self.leave(tenant)
            return False
        return True

    async def enter(self, tenant: str) -> None:
        """Enter as a plain command, waiting for an EXEC that holds the tenant."""
        while not self.enter_nowait(tenant):
            with self._lock:
                gate = self._gates.get(tenant)
                if gate is None:  # released meanwhile: try again
                    continue
                fut = self._park(gate)
            await self._wait(tenant, fut)

    def leave(self, tenant: str) -> None:
        try:
            mine = self._local.counts
        except AttributeError:
            mine = self._mine()
        try:
            left = mine[tenant] - 1
        except KeyError:  # (it entered on another thread)
            left = -1
        if left:
            mine[tenant] = left
        else:
            del mine[tenant]
        if tenant in self.held:  # counted out first, then the flag read
            self._drained(tenant)

    def _drained(self, tenant: str) -> None:
        """A command of a held tenant left: wake the holder once none is inside."""
        with self._lock:
            gate = self._gates.get(tenant)
            if gate is None or gate.drain is None or self._active(tenant):
                return
            fut, gate.drain = gate.drain, None
        _wake([fut])

    async def hold(self, tenant: str) -> None:
        """Take the tenant alone: wait for another EXEC, then for running commands."""
        while True:
            with self._lock:
                gate = self._gates.get(tenant)
                if gate is None:
                    gate = self._gates[tenant] = _Gate()
                    self.held.add(tenant)  # the flag first ...
                    break
                fut = self._park(gate)
            await self._wait(tenant, fut)
        try:
            while True:
                with self._lock:
                    if not self._active(tenant):  # ... then the counts
                        return
                    fut = gate.drain = asyncio.get_running_loop().create_future()
                await fut
        except BaseException:
            self.release(tenant)
            raise

    def release(self, tenant: str) -> None:
        with self._lock:
            gate = self._gates.pop(tenant)
            self.held.discard(tenant)
        _wake(gate.waiters)

    @staticmethod
    def _park(gate: _Gate) -> asyncio.Future[None]:
        """A future for the running loop, queued on `gate` (call under the lock)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if gate.waiters is None:
            gate.waiters = [fut]
        else:
            gate.waiters.append(fut)
        return fut

    async def _wait(self, tenant: str, fut: asyncio.Future[None]) -> None:
        try:
            await fut
        finally:
            with self._lock:
                gate = self._gates.get(tenant)
                if gate is not None and gate.waiters is not None and fut in gate.waiters:
                    gate.waiters.remove(fut)

    def active(self, tenant: str) -> int:
        """Commands (and HTTP writes) of `tenant` inside its gate now."""
        with self._lock:
            return self._active(tenant)

    def __len__(self) -> int:
        """Tenants in use: held, or with commands inside."""
        with self._lock:
            counted = set().union(*self._tables.values())
            return len(self._gates.keys() | {t for t in counted if self._active(t)})


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
