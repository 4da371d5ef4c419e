"""RESP dispatch: checks, batching on the thread pool, and the one inline dispatcher.

How it works
------------
`COMMANDS` (server/resp/registry.py) maps a lowercase command name to its `CommandSpec`
(Redis arity, flags, key positions, and exactly one handler: `handler` runs on the event
loop, `blocking_handler` on the store's thread pool). The handlers live in
server/resp/commands*.py.

A connection owns one `Dispatcher`, reading its framed commands straight from the
parser (`peek` / `next_command` / `unread`). Two entry points:
- `run_fast` (the read callback, while the connection's task is parked) is the one inline
  dispatcher, in server/resp/fastpath.py: GET, SET, EXISTS and STRLEN that the store
  answers at once (`*_nowait`), a durable SET started and left to the task
  (`finish_started`), anything else put back (`unread`) for the task, in order.
- `execute(cmd)` (the task) checks the command (known, allowed before AUTH, arity,
  subscribed mode) and runs it: the same `*_nowait` answers for the four commands; a
  blocking command in one thread-pool job together with the blocking commands framed
  right behind it (at most `MAX_BATCH_COMMANDS`, arguments under `MAX_BATCH_ARG_BYTES`;
  the job stops early once its replies reach `MAX_BATCH_REPLY_BYTES` and the rest is
  `unread`); anything else by awaiting its loop handler; MULTI/EXEC as transactions
  (with WATCH: `observe` marks the watchers of the keys each write wrote changed).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from epistemic_kvcache.errors import StoreError
from epistemic_kvcache.proto.resp import (
    NULL_ARRAY,
    Buffer,
    Command,
    ErrorReply,
    RefusedCommand,
    SimpleString,
    args_size,
    command_size,
    serialize,
)
from epistemic_kvcache.server.resp.commands_txn import EVERY_KEY, WRITES, written
from epistemic_kvcache.server.resp.common import (
    HELLO_NOAUTH,
    INTERNAL_ERROR,
    NOAUTH,
    OK,
    WIRE,
    Frames,
    Reply,
    busy_reply,
    store_error_reply,
    to_key,
    wrong_args,
)
from epistemic_kvcache.server.resp.fast import run_fast as _run_fast
from epistemic_kvcache.server.resp.fastpath import (
    FAST_ROUTES,
    MAX_PIPELINED_SETS,
    SMALL_REPLY,
    CommandQueue,
    FastLane,
)
from epistemic_kvcache.server.resp.refusals import (
    REFUSED_ROUTES,
    ProbeAnswer,
    logged_name,
    refusal,
)
from epistemic_kvcache.server.resp.registry import (
    COMMANDS,
    BlockingHandler,
    CommandSpec,
)
from epistemic_kvcache.server.writes import start_put
from epistemic_kvcache.store.api import WOULD_BLOCK, PutCond, PutResult

if TYPE_CHECKING:
    from epistemic_kvcache.server.resp.session import Session

log = logging.getLogger("epistemic_kvcache.server.resp")

MAX_BATCH_COMMANDS: Final = 64
"""Pipelined store commands run in one thread-pool job, at most this many..."""
MAX_BATCH_ARG_BYTES: Final = 1024 * 1024
"""...while their arguments total less than this..."""
MAX_BATCH_REPLY_BYTES: Final = 4 * 1024 * 1024
"""...and the job stops early once its replies reach this (the rest runs next)."""
_RUN_INSIDE_MULTI: Final = frozenset({"exec", "discard", "multi", "quit", "reset", "watch"})
"""Commands that run at once inside MULTI (WATCH to refuse itself, as Redis does)."""
_NOT_IN_MULTI: Final = frozenset(
    {"subscribe", "unsubscribe", "psubscribe", "punsubscribe", "auth", "hello"}
)
"""Commands refused inside MULTI (which aborts it): pub/sub changes the connection's
mode, AUTH/HELLO its tenant, and a transaction runs in one tenant."""
NOT_IN_MULTI: Final = ErrorReply("ERR Command not allowed inside a transaction")
EXECABORT: Final = ErrorReply("EXECABORT Transaction discarded because of previous errors.")
QUEUED: Final = SimpleString("QUEUED")
_NO_BARRIER: Final = frozenset({"mset", "del", "unlink", "flushdb"})
"""Writes inside EXEC that go to the store's committer in order behind the SETs started
before them, so they need not wait for those SETs first (a read does)."""

_HOLDS_TENANT: Final = frozenset({"getset", "getdel", "set"})
"""Commands that read a key and then write it (SET only with GET; the handler decides):
the dispatcher runs them holding the tenant alone (`TenantGates.hold`), like EXEC."""
_SUBSCRIBED_MODE_COMMANDS: Final = frozenset(
    {"subscribe", "unsubscribe", "psubscribe", "punsubscribe", "ping", "quit", "reset"}
)


def reply_bytes(reply: object) -> int:
    """Approximate payload size of a reply (bulk strings, arrays of them, SCAN's)."""
    if isinstance(reply, bytes | bytearray | memoryview):
        return len(reply)
    if isinstance(reply, list):
        return sum(
            len(r) if isinstance(r, bytes | bytearray | memoryview) else reply_bytes(r)
            for r in reply
            if isinstance(r, bytes | bytearray | memoryview | list)
        )
    if isinstance(reply, Frames):
        return sum(len(b) for b in reply.buffers)
    return 0


def _set_with_get(cmd: Command) -> bool:
    return any(len(a) == 3 and bytes(a).upper() == b"GET" for a in cmd[3:])


class Dispatcher:
    """Runs one connection's commands (see the module docstring)."""

    def __init__(self, session: Session, queue: CommandQueue) -> None:
        self.session = session
        self.ctx = session.ctx
        self.queue = queue
        self.busy = False
        """A command is running (the connection is not idle)."""
        self.store = self.ctx.store
        metrics = self.ctx.metrics
        self._series = {route: metrics.series(WIRE, route, "ok") for route in FAST_ROUTES}
        self._watches = self.ctx.writes.watches
        self.started: list[tuple[object, float, Command]] = []
        """Plain SETs begun inline whose replies are not sent yet (a durable one's is a
        future): `finish_started` awaits them, in order, on the connection's task."""
        self._gate: str | None = None
        """The tenant whose gate `run_fast` entered for its SETs: left at its end, or,
        with SETs `started`, once they are acknowledged (server/writes.py)."""
        self.fast_ended = 0.0
        """`perf_counter` when `run_fast` last finished its last command (or began)."""
        shared = session.shared
        self.lane = FastLane(
            self.store, queue.next_command, self._series, shared.gates, shared.activity,
            self.ctx.access_log, self._watches,
        )  # fmt: skip

    # -- checks and metrics ---------------------------------------------------------------
    def check(self, cmd: Command) -> tuple[str, CommandSpec | None, ErrorReply | None]:
        """The command's metrics route, its spec, and an error reply if it may not run."""
        s = self.session
        if isinstance(cmd, RefusedCommand):
            return "busy", None, busy_reply(cmd.reason)
        spec = COMMANDS.get(bytes(cmd[0]).lower())
        if spec is None:  # (looked up, then arity, then AUTH: redis-server's order)
            route, refused = refusal(cmd, s.identity is not None)
            return route, None, NOAUTH if refused is None else refused
        if (spec.arity > 0 and len(cmd) != spec.arity) or len(cmd) < -spec.arity:
            return spec.name, spec, wrong_args(spec.name)
        if s.identity is None and not spec.no_auth:
            return spec.name, spec, NOAUTH
        if s.channels and s.protocol_version == 2 and spec.name not in _SUBSCRIBED_MODE_COMMANDS:
            return (
                spec.name,
                spec,
                ErrorReply(
                    f"ERR Can't execute '{spec.name}': only (P|S)SUBSCRIBE / "
                    "(P|S)UNSUBSCRIBE / PING / QUIT / RESET are allowed in this context"
                ),
            )
        return spec.name, spec, None

    def observe(
        self,
        route: str,
        reply: object,
        seconds: float,
        cmd: Command | None = None,
        *,
        count_activity: bool = True,
    ) -> None:
        """Count one answered command; with the access log on, log it with the bytes it
        took on the wire: `cmd` as a RESP array (`command_size`; 0 when unknown) and the
        reply as this connection's protocol encodes it. A write marks the watchers of
        the keys it wrote changed (the tenant's gate is still held); a command refused
        with NOAUTH is an authentication failure (logged, counted)."""
        status = "ok"
        s = self.session
        if isinstance(reply, ErrorReply):
            if type(reply) is not ProbeAnswer:
                status = "error"
            if reply is NOAUTH or reply is HELLO_NOAUTH:
                self._unauthenticated(route, cmd)
        elif route in WRITES and self._watches.count and cmd is not None and reply is not QUEUED:
            keys = written(route, cmd, reply)
            if keys is EVERY_KEY:
                self._watches.touch_all(s.namespace)
            elif keys:
                self._watches.touch(s.namespace, [to_key(k) for k in keys])
        s.last_command = time.monotonic()
        s.last_route = route
        if count_activity and s.identity is not None:
            activity = s.shared.activity(s.identity.tenant)
            activity.commands += 1
            activity.count(route, seconds, status == "error")
        access = self.ctx.access_log
        if access.enabled:
            access.record(
                WIRE,
                s.peer,
                s.identity.tenant if s.identity is not None else None,
                logged_name(route, cmd[0]) if route in REFUSED_ROUTES and cmd else route,
                status,
                command_size(cmd) if cmd is not None else 0,
                sum(memoryview(b).nbytes for b in self.encode(reply)),
                seconds,
            )
        try:
            self.ctx.metrics.observe_request(wire=WIRE, route=route, status=status, seconds=seconds)
        except Exception:  # metrics must never break serving
            log.exception("metrics.observe_request failed")

    def _unauthenticated(self, route: str, cmd: Command | None) -> None:
        """A command refused with NOAUTH: an authentication failure (rate-limited log
        line with the peer's address and port, `kvcache_auth_failures_total`)."""
        name = route
        if route in REFUSED_ROUTES and cmd:  # (only a command of the refusals table)
            name = bytes(cmd[0]).decode("ascii", "replace").lower()
        self.ctx.auth_failures.failed(WIRE, self.session.addr, f"{name.upper()} before AUTH")

    # -- execution ------------------------------------------------------------------------
    async def execute(self, cmd: Command) -> list[object]:
        """Run `cmd`, and the store commands framed right behind it in the same job
        (inside MULTI: queue it; EXEC: run the transaction)."""
        started = time.perf_counter()
        route, spec, error = self.check(cmd)
        s = self.session
        if s.multi is not None:
            if error is not None or spec is None:
                s.multi_aborted = True  # Redis: a refused command aborts the transaction
                self.observe(route, error, time.perf_counter() - started, cmd)
                return [error]
            if route not in _RUN_INSIDE_MULTI:
                reply = self._queue_in_multi(spec, cmd)
                self.observe(route, reply, time.perf_counter() - started, cmd)
                return [reply]
            if route == "exec":
                return [await self.exec_transaction(started)]
        if error is not None or spec is None:
            self.observe(route, error, time.perf_counter() - started, cmd)
            return [error]
        identity = s.identity
        if identity is None:
            return await self._execute(cmd, route, spec, started)
        tenant = identity.tenant
        gates = s.shared.gates
        # read-then-write commands (GETSET, GETDEL, SET ... GET) hold the tenant alone, as
        # EXEC does, so no other RESP command of it lands in between; the rest share it
        alone = route in _HOLDS_TENANT and (route != "set" or _set_with_get(cmd))
        if alone or not gates.enter_nowait(tenant):
            self.busy = True  # waiting on a transaction of this tenant is not idling
            try:
                await (gates.hold(tenant) if alone else gates.enter(tenant))
            finally:
                self.busy = False
        try:
            return await self._execute(cmd, route, spec, started)
        finally:
            (gates.release if alone else gates.leave)(tenant)

    async def _execute(
        self, cmd: Command, route: str, spec: CommandSpec, started: float
    ) -> list[object]:
        if route in _READ_NOWAIT:
            try:
                fast = _READ_NOWAIT[route](self, cmd)
            except Reply as exc:
                fast = exc.reply
            if fast is not WOULD_BLOCK:
                self.observe(route, fast, time.perf_counter() - started, cmd)
                return [fast]
        elif route == "set" and len(cmd) == 3:
            outcome = self._start_set(self.session.namespace, cmd)
            if outcome is not WOULD_BLOCK:
                self.started.append((outcome, started, cmd))
                self._start_following_sets()
                return await self.finish_started()
        if spec.blocking_handler is not None:
            return await self._batch(route, spec.blocking_handler, cmd)
        return [await self._run_loop_handler(spec, cmd, started)]

    async def _batch(self, route: str, handler: BlockingHandler, cmd: Command) -> list[object]:
        batch = [(route, handler, cmd)]
        size = args_size(cmd)
        queue = self.queue
        while len(batch) < MAX_BATCH_COMMANDS and size < MAX_BATCH_ARG_BYTES:
            following = queue.peek()
            if following is None:
                break
            route2, spec2, error2 = self.check(following)
            if error2 is not None or spec2 is None or spec2.blocking_handler is None:
                break
            queue.next_command()
            batch.append((route2, spec2.blocking_handler, following))
            size += args_size(following)
        self.busy = True
        try:
            results = await self.ctx.run(self._run_batch, batch)
        finally:
            self.busy = False
        for (route_i, _, cmd_i), (reply_i, seconds) in zip(batch, results, strict=False):
            self.observe(route_i, reply_i, seconds, cmd_i)
        # Commands the job left undone (replies grew too big) run next, in order.
        queue.unread([item[2] for item in batch[len(results) :]])
        return [reply_i for reply_i, _ in results]

    def _run_batch(
        self, batch: list[tuple[str, BlockingHandler, Command]]
    ) -> list[tuple[object, float]]:
        """Thread-pool job: run store commands in order until their replies grow big."""
        out: list[tuple[object, float]] = []
        total = 0
        for route, handler, cmd in batch:
            started = time.perf_counter()
            reply: object
            try:
                reply = handler(self.session, cmd)
            except Reply as exc:
                reply = exc.reply
            except Exception:
                log.exception("RESP %s failed", route)
                reply = INTERNAL_ERROR
            size = reply_bytes(reply)
            if isinstance(reply, list | dict) and size >= SMALL_REPLY:
                # a big array (SCAN, MGET) is serialized here, not on the event loop
                reply = Frames(serialize(reply, self.session.protocol_version))
            out.append((reply, time.perf_counter() - started))
            total += size
            if total >= MAX_BATCH_REPLY_BYTES:
                break
        return out

    # -- MULTI / EXEC -----------------------------------------------------------------------
    def _queue_in_multi(self, spec: CommandSpec, cmd: Command) -> object:
        """A command after MULTI: +QUEUED, or an error that aborts the transaction."""
        s = self.session
        if spec.name in _NOT_IN_MULTI:
            s.multi_aborted = True
            return NOT_IN_MULTI
        # A large bulk was counted under "bulk" while it arrived; from now on the
        # transaction holds it (so it is not counted twice).
        large = sum(len(arg) for arg in cmd if type(arg) is not bytes)
        if large:
            s.account.give_back("bulk", large)
        refused = s.queue_command(cmd, args_size(cmd))
        return refused if refused is not None else QUEUED

    async def exec_transaction(self, started: float) -> object:
        """EXEC: the queued commands' replies as one array, EXECABORT, or nil (a null
        array, nothing run) when a WATCHed key was written since WATCH.

        The tenant's gate is held throughout (no other RESP command of the tenant runs
        in between); store commands run on the thread pool in as few jobs as the queue
        allows, SETs started back to back so that durable ones share one group commit,
        and the reply is sent only once every write of the transaction is acknowledged.
        """
        s = self.session
        queued, aborted = s.end_multi()
        if aborted:
            s.unwatch()
            self.observe("exec", EXECABORT, time.perf_counter() - started)
            return EXECABORT
        tenant = s.namespace
        gates = s.shared.gates
        self.busy = True
        await gates.hold(tenant)
        replies: list[object] = []
        result: object = replies
        try:
            # held: every write of the tenant before this point has marked its watchers,
            # and none lands between this answer and the transaction's own writes
            changed = s.watch_changed()
            s.unwatch()
            if changed:
                result, queued = NULL_ARRAY, []
            i = 0
            while i < len(queued):
                spec = COMMANDS[bytes(queued[i][0]).lower()]
                if spec.blocking_handler is None:
                    replies.append(await self._run_loop_handler(spec, queued[i]))
                    i += 1
                    continue
                j = i + 1
                while j < len(queued):
                    if COMMANDS[bytes(queued[j][0]).lower()].blocking_handler is None:
                        break
                    j += 1
                done, observed = await self.ctx.run(self._run_transaction_job, queued[i:j])
                replies += done
                for route, reply, seconds, cmd in observed:  # metrics: event loop only
                    self.observe(route, reply, seconds, cmd)
                i = j
        finally:
            gates.release(tenant)
            self.busy = False
        self.observe("exec", result, time.perf_counter() - started)
        return result

    async def _run_loop_handler(
        self, spec: CommandSpec, cmd: Command, started: float | None = None
    ) -> object:
        """Await `cmd`'s event-loop handler (busy meanwhile) and count it."""
        handler = spec.handler
        if handler is None:  # every spec has exactly one of the two handlers
            raise RuntimeError(f"command {spec.name!r} has no handler")
        t0 = time.perf_counter() if started is None else started
        was_busy, self.busy = self.busy, True
        reply: object
        try:
            reply = await handler(self.session, cmd)
        except Reply as exc:
            reply = exc.reply
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("RESP %s failed", spec.name)
            reply = INTERNAL_ERROR
        finally:
            self.busy = was_busy
        self.observe(spec.name, reply, time.perf_counter() - t0, cmd)
        return reply

    def _run_transaction_job(
        self, cmds: list[Command]
    ) -> tuple[list[object], list[tuple[str, object, float, Command]]]:
        """Thread-pool job: run a transaction's store commands in order; returns their
        replies and what the event loop counts (route, reply, seconds, command).

        A SET (plain, NX or XX) is started without waiting for it (`_start_set`), so the
        SETs of a transaction reach a durable store's committer together; a command that
        reads first waits for the SETs started before it (it sees their writes)."""
        s = self.session
        ns = s.namespace
        replies: list[object] = [None] * len(cmds)
        observed: list[tuple[str, object, float, Command]] = []
        pending: list[tuple[int, concurrent.futures.Future[PutResult], float]] = []

        def settle() -> None:
            for index, future, t0 in pending:
                reply: object
                try:
                    reply = OK if future.result().applied else None
                except StoreError as exc:
                    reply = store_error_reply(exc, "set")
                except Exception:
                    log.exception("RESP set failed")
                    reply = INTERNAL_ERROR
                replies[index] = reply
                observed.append(("set", reply, time.perf_counter() - t0, cmds[index]))
            pending.clear()

        try:
            for index, cmd in enumerate(cmds):
                spec = COMMANDS[bytes(cmd[0]).lower()]
                t0 = time.perf_counter()
                reply: object = WOULD_BLOCK
                if spec.name == "set":
                    reply = self._start_set(ns, cmd)
                    if isinstance(reply, concurrent.futures.Future):
                        pending.append((index, reply, t0))
                        continue
                    if isinstance(reply, PutResult):
                        reply = OK if reply.applied else None
                if reply is WOULD_BLOCK:
                    if spec.name not in _NO_BARRIER:
                        settle()
                    handler = spec.blocking_handler
                    if handler is None:  # the caller sends only blocking commands
                        raise RuntimeError(f"command {spec.name!r} has no blocking handler")
                    try:
                        reply = handler(s, cmd)
                    except Reply as exc:
                        reply = exc.reply
                    except Exception:
                        log.exception("RESP %s failed", spec.name)
                        reply = INTERNAL_ERROR
                replies[index] = reply
                observed.append((spec.name, reply, time.perf_counter() - t0, cmd))
        finally:
            settle()
        return replies, observed

    def _start_set(self, ns: str, cmd: Command) -> object:
        """Start `SET key value [NX|XX]` without waiting, through the one PUT entry
        (server/writes.py `start_put`: the received value without a copy): its
        `PutResult`, a future (durable), an error reply, or `WOULD_BLOCK` (another form
        of SET, or the store cannot start it inline). The connection's task and MULTI's
        transaction job start their SETs here; the read callback's through `start_put`
        directly (server/resp/fastpath.py)."""
        cond: PutCond = None
        if len(cmd) == 4:
            opt = bytes(cmd[3]).upper()
            if opt == b"NX":
                cond = "nx"
            elif opt == b"XX":
                cond = "xx"
            else:
                return WOULD_BLOCK
        elif len(cmd) != 3:
            return WOULD_BLOCK
        try:
            return start_put(self.store, ns, to_key(cmd[1]), cmd[2], cond)
        except Reply as exc:
            return exc.reply
        except StoreError as exc:
            return store_error_reply(exc, "set")

    # -- fast paths -------------------------------------------------------------------------
    run_fast = _run_fast  # (server/resp/fastpath.py: the twin server/resp/fast.py picked)

    def get_nowait(self, cmd: Command) -> object:
        """A plain GET's reply if RAM answers it, else `WOULD_BLOCK` (arity checked)."""
        try:
            return self.store.get_nowait(self.session.namespace, to_key(cmd[1]))
        except StoreError as exc:
            raise Reply(store_error_reply(exc, "get")) from None

    def exists_nowait(self, cmd: Command) -> object:
        """EXISTS's reply (the count) if RAM answers it, else `WOULD_BLOCK`."""
        try:
            return self.store.exists_nowait(self.session.namespace, [to_key(k) for k in cmd[1:]])
        except StoreError as exc:
            raise Reply(store_error_reply(exc, "exists")) from None

    def strlen_nowait(self, cmd: Command) -> object:
        """STRLEN's reply (0 for an absent key) if RAM answers it, else `WOULD_BLOCK`."""
        try:
            size = self.store.size_nowait(self.session.namespace, to_key(cmd[1]))
        except StoreError as exc:
            raise Reply(store_error_reply(exc, "strlen")) from None
        return 0 if size is None else size

    def _start_following_sets(self) -> None:
        """Start the plain SETs framed right behind the started ones (task side), so
        durable ones share one group commit."""
        started = self.started
        while len(started) < MAX_PIPELINED_SETS:
            following = self.queue.peek()
            if not self._plain_set_ok(following):
                return
            assert following is not None  # _plain_set_ok is False for None
            t0 = time.perf_counter()
            outcome = self._start_set(self.session.namespace, following)
            if outcome is WOULD_BLOCK:
                return
            self.queue.next_command()
            started.append((outcome, t0, following))

    async def finish_started(self) -> list[object]:
        """The replies of the `started` SETs, in order, each awaited once durable."""
        begun, self.started = self.started, []
        replies: list[object] = []
        self.busy = True
        try:
            for outcome, t0, sent in begun:
                reply = outcome
                if isinstance(outcome, concurrent.futures.Future):
                    try:
                        result = await asyncio.wrap_future(outcome)
                        reply = OK if result.applied else None
                    except StoreError as exc:
                        reply = store_error_reply(exc, "set")
                elif isinstance(outcome, PutResult):
                    reply = OK if outcome.applied else None
                replies.append(reply)
                self.observe("set", reply, time.perf_counter() - t0, sent)
        finally:
            self.busy = False
            self.abandon()
        return replies

    def abandon(self) -> None:
        """Forget started SETs (the connection is gone) and leave the tenant's gate."""
        self.started = []
        if self._gate is not None:
            self.session.shared.gates.leave(self._gate)
            self._gate = None

    def encode(self, reply: object) -> list[Buffer]:
        """`serialize`, with the fast path's replies (bulk, OK, nil, integer) written
        without its machinery."""
        if isinstance(reply, bytes | bytearray | memoryview):
            n = reply.nbytes if isinstance(reply, memoryview) else len(reply)
            if n < SMALL_REPLY:
                return [b"".join((b"$%d\r\n" % n, reply, b"\r\n"))]
            return [b"$%d\r\n" % n, reply, b"\r\n"]
        if reply is OK:
            return [b"+OK\r\n"]
        if type(reply) is int:
            return [b":%d\r\n" % reply]
        if reply is None:
            return [b"$-1\r\n" if self.session.protocol_version == 2 else b"_\r\n"]
        if isinstance(reply, Frames):
            return reply.buffers
        return serialize(reply, self.session.protocol_version)

    def _plain_set_ok(self, cmd: Command | None) -> bool:
        """Whether `cmd` is a `SET key value` this connection may run now."""
        s = self.session
        if cmd is None or len(cmd) != 3 or s.identity is None or s.channels:
            return False
        return bytes(cmd[0]).lower() == b"set"


_READ_NOWAIT: Final[dict[str, Callable[[Dispatcher, Command], object]]] = {
    "get": Dispatcher.get_nowait,
    "exists": Dispatcher.exists_nowait,
    "strlen": Dispatcher.strlen_nowait,
}
"""Read-only commands RAM answers inline (arity already checked): their `*_nowait`."""
