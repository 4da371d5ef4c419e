"""RESP's one inline dispatcher (`run_fast`, a `Dispatcher` method): the commands the
store answers at once, run in the read callback.

How it works
------------
While a connection's task is parked (nothing of the connection runs), the read callback
(server/resp/connection.py `buffer_updated`) calls `run_fast` over what the read framed.
It takes commands (`next_command`) while they are GET, SET, EXISTS or STRLEN and the
store's `*_nowait` capability answers them (`SharedKvBackend`: an answer, a future for a
durable PUT, or `WOULD_BLOCK`); the first one it cannot answer goes back (`unread`) to
the task, in order. Replies are written together (one write per read, or per
`FAST_FLUSH_BYTES`). A durable SET is started (its future goes to `started`, with the
plain SETs pipelined right behind it, so they share one group commit) and the task
awaits it (`Dispatcher.finish_started`). A read that SETs enters the tenant's gate
first (server/writes.py), as every write does, and marks the watchers of the keys it
wrote before leaving it. Per command it does only what an answer needs:
one dict lookup for the route, the store call, the reply bytes, one clock reading and
its latency bucket; the tenant's tallies (INFO) are summed in locals and added once.
A SET starts through the one PUT entry of every wire (server/writes.py `start_put`).

One source, two twins, like proto/resp_parser.py: this file is the pure-Python
reference, and server/resp/_fastpath_c is the same file compiled by Cython (setup.py,
with the C types of server/resp/_fastpath_c.pxd); server/resp/fast.py picks the twin at
import, and `Dispatcher.run_fast` is the one it picked.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, NamedTuple, Protocol

from epistemic_kvcache.errors import RemoteProtocolError, StoreError
from epistemic_kvcache.proto.resp import NEED_DATA, Arg, Buffer, Command, ErrorReply, Event
from epistemic_kvcache.server.resp.common import INVALID_KEY, OK, Reply, store_error_reply
from epistemic_kvcache.server.writes import start_put
from epistemic_kvcache.store.api import WOULD_BLOCK, PutResult, SharedKvBackend

_Future: Final = concurrent.futures.Future
_perf_counter: Final = time.perf_counter

if TYPE_CHECKING:
    from epistemic_kvcache.server.metrics import RequestSeries
    from epistemic_kvcache.server.oplog import AccessLog
    from epistemic_kvcache.server.resp.session import Activity, Session
    from epistemic_kvcache.server.writes import KeyWatches, TenantGates

MAX_PIPELINED_SETS: Final = 64
"""Plain SETs queued for one group commit before their replies are awaited."""
INLINE_MAX_COMMANDS: Final = 64
"""Commands the fast path answers in one read callback before leaving the rest to the
connection's task (which yields to other connections between time slices)."""
SMALL_REPLY: Final = 16 * 1024
"""Bulk replies shorter than this are sent as one buffer (head + bytes + CRLF)."""
FAST_NAMES: Final = {
    b"get": "get", b"GET": "get", b"set": "set", b"SET": "set",
    b"exists": "exists", b"EXISTS": "exists", b"strlen": "strlen", b"STRLEN": "strlen",
}  # fmt: skip
FAST_ROUTES: Final = ("get", "set", "exists", "strlen")
_FAST_READS: Final = frozenset({"get", "strlen"})
FAST_FLUSH_BYTES: Final = 64 * 1024
"""The fast path hands its replies to the transport once they reach this many bytes,
so a client that does not read is noticed (`pause_writing`) before more are made."""


class CommandQueue(Protocol):
    """The connection's framed commands, in order (the parser: `RespParser`)."""

    def peek(self) -> Command | None: ...

    def next_command(self) -> Event:
        """Take the next command (`NEED_DATA` when none is framed)."""

    def unread(self, commands: list[Command]) -> None:
        """Put commands back at the front, in order."""


class FastLane(NamedTuple):
    """What `run_fast` reads of a connection that never changes, in one tuple: one read
    per call in place of a chain of attribute reads and a bound method's creation."""

    store: SharedKvBackend
    take: Callable[[], Event]
    """The queue's `next_command`."""
    series: dict[str, RequestSeries]
    """The fast routes' metric series (successes)."""
    gates: TenantGates
    activity: Callable[[str], Activity]
    """The listener's `Shared.activity`."""
    access_log: AccessLog
    watches: KeyWatches
    """WATCHed keys (server/writes.py): a SET answered here marks its watchers changed."""


class InlineDispatcher(Protocol):
    """What `run_fast` uses of the connection's dispatcher (server/resp/dispatch.py
    `Dispatcher`, whose method it is)."""

    session: Session
    queue: CommandQueue
    started: list[tuple[object, float, Command]]
    _gate: str | None
    fast_ended: float
    lane: FastLane

    def encode(self, reply: object) -> list[Buffer]: ...

    def observe(
        self,
        route: str,
        reply: object,
        seconds: float,
        cmd: Command | None = None,
        *,
        count_activity: bool = True,
    ) -> None: ...

    def exists_nowait(self, cmd: Command) -> object: ...

    def strlen_nowait(self, cmd: Command) -> object: ...


def fast_name(name: Arg) -> str | None:
    """The fast path's route for any spelling of GET, SET, EXISTS, STRLEN, else None."""
    if len(name) not in {3, 6}:
        return None
    return FAST_NAMES.get(bytes(name).lower())


def run_fast(
    self: InlineDispatcher,
    write: Callable[[list[Buffer]], bool],
    limit: int = INLINE_MAX_COMMANDS,
    t0: float | None = None,
) -> int:
    """The one inline dispatcher: answer the framed commands at the head of the queue
    that the store answers at once (`*_nowait`); the connection's task is parked, so
    nothing of this connection runs meanwhile.

    Each command is taken (`next_command`) and answered; the first one it cannot
    answer is put back (`unread`) for the task, in order. Replies are handed to
    `write` as buffers, in order, in one call per `FAST_FLUSH_BYTES`; `write` says
    whether the peer keeps up, and when it does not, this stops. A SET the store
    starts but cannot finish at once (durable: a future) goes to `started` with the
    plain SETs right behind it; the task sends their replies (`finish_started`).
    Stops after `limit` commands; returns how many it took. `t0`: when the read
    began (`perf_counter`). Successes are counted straight into their metric series,
    the rest (errors, or all while the access log is on) through `observe`; the
    tenant's tallies (INFO) are summed here and added once per call and route.
    """
    s = self.session
    identity = s.identity
    if identity is None or s.multi is not None:
        return 0  # (a transaction queues its commands: the task)
    ns = identity.tenant
    store, take, series, gates, activity_of, access_log, watches = self.lane
    if ns in gates.held:
        return 0  # a transaction of the tenant runs: the task waits for it
    started = self.started
    plain = not access_log.enabled
    perf = _perf_counter
    out: list[Buffer] = []
    taken = 0
    queued = 0
    # the current route's tallies in locals; `tallies`: earlier routes' [calls, s, failed]
    route_now = ""
    calls = failures = 0
    seconds = 0.0
    tallies: dict[str, list[Any]] | None = None
    mark = perf() if t0 is None else t0  # when the current command began
    while taken < limit:
        if queued >= FAST_FLUSH_BYTES:
            queued = 0
            more, out = write(out), []
            if not more:
                break
        try:
            cmd = take()
        except RemoteProtocolError:
            break  # (the task takes the error)
        if cmd is NEED_DATA:
            break
        argc = len(cmd)
        name = cmd[0] if argc > 1 else b""  # (a refused command is empty: the task)
        kind = FAST_NAMES.get(name) if type(name) is bytes else None
        if kind is None:
            kind = fast_name(name)
        if kind == "set" and argc == 3 and len(started) < MAX_PIPELINED_SETS:
            route = "set"
        elif not started and (kind == "exists" or (argc == 2 and kind in _FAST_READS)):
            route = kind
        else:  # behind a started SET only plain SETs may start
            self.queue.unread([cmd])
            break
        reply: object
        try:
            if route == "get":
                reply = store.get_nowait(ns, str(cmd[1], "utf-8"))
            elif route == "set":
                if self._gate is None:  # a write holds the tenant's gate while it lands
                    if not gates.enter_nowait(ns):  # a transaction took the tenant
                        self.queue.unread([cmd])
                        break
                    self._gate = ns
                reply = start_put(store, ns, str(cmd[1], "utf-8"), cmd[2])
            elif route == "exists":
                reply = (
                    store.exists_nowait(ns, (str(cmd[1], "utf-8"),))
                    if argc == 2
                    else self.exists_nowait(cmd)
                )
            else:
                reply = self.strlen_nowait(cmd)
        except UnicodeDecodeError:
            reply = INVALID_KEY
        except Reply as exc:
            reply = exc.reply
        except StoreError as exc:
            reply = store_error_reply(exc, route)
        if reply is WOULD_BLOCK:
            self.queue.unread([cmd])
            break
        taken += 1
        if started or isinstance(reply, _Future):  # (the gate is left once they are acked)
            started.append((reply, mark, cmd))
            mark = perf()
            continue
        if type(reply) is PutResult:
            reply = OK if reply.applied else None
            if reply is OK and watches.count:  # applied: the key's watchers see it
                watches.touch(ns, (str(cmd[1], "utf-8"),))
        failed = False  # (the common replies first, encoded as `encode` does)
        if reply is OK:
            out.append(b"+OK\r\n")
            queued += 5
        elif type(reply) is bytes and len(reply) < SMALL_REPLY:
            head = b"".join((b"$%d\r\n" % len(reply), reply, b"\r\n"))
            out.append(head)
            queued += len(head)
        elif type(reply) is int:
            head = b":%d\r\n" % reply
            out.append(head)
            queued += len(head)
        else:
            failed = isinstance(reply, ErrorReply)
            for buf in self.encode(reply):
                out.append(buf)
                queued += len(buf)
        t1 = perf()
        if plain and not failed:
            series[route].observe(t1 - mark)
        else:
            self.observe(route, reply, t1 - mark, cmd, count_activity=False)
        if route != route_now:
            if calls:
                if tallies is None:
                    tallies = {}
                tally = tallies.setdefault(route_now, [0, 0.0, 0])
                tally[0] += calls
                tally[1] += seconds
                tally[2] += failures
            route_now, calls, seconds, failures = route, 0, 0.0, 0
        calls += 1
        seconds += t1 - mark
        failures += failed
        mark = t1
    if out:
        write(out)
    if self._gate is not None and not started:
        gates.leave(ns)  # every SET of this read is applied (and its watchers marked)
        self._gate = None
    self.fast_ended = mark
    if calls:
        activity = activity_of(ns)
        activity.count(route_now, seconds, failures, calls)
        total = calls
        if tallies is not None:
            for other, (more_calls, more_s, more_failures) in tallies.items():
                activity.count(other, more_s, more_failures, more_calls)
                total += more_calls
        activity.commands += total
        s.last_command = mark
        s.last_route = route_now
    return taken
