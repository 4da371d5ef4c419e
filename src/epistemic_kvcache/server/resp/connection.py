"""The Redis (RESP2/RESP3) listener's connection: framing, back-pressure, accounting, timers.

How it works
------------
One `RespConnection` (an `asyncio.BufferedProtocol`) per client. The event loop reads
into a read buffer shared by the listener's connections (the parser frames it in place
and copies out what it keeps before `buffer_updated` returns); a large SET payload is
read straight into its final preallocated array. The parser frames at most
`MAX_FRAMED_AHEAD` commands per read (the rest stays buffered), so one read never costs
more than a bounded amount of work.
A per-connection task takes commands in order and hands each to the `Dispatcher`
(server/resp/dispatch.py), writing replies before taking the next, so pipelined replies
keep request order. While the task is parked waiting for input and the peer reads its
replies (writing is not paused), `buffer_updated` runs the dispatcher's inline path
(`run_fast`) over what the read framed, without waking it: GET/SET/EXISTS/STRLEN the
store answers at once are answered and their replies written together; durable SETs
are started there and the task, woken, sends their replies once committed; the first
command the store cannot answer inline stays queued in the parser for the task, in
order.

Fairness: the task yields to the event loop once a time slice (`SLICE_S`) of commands
has run, so no connection holds the loop. Before AUTH too: the parser's pre-AUTH limits
keep those commands small, and yielding after each one made a flood of unauthenticated
PINGs cost one loop turn per command; with several loops every turn retakes the GIL
from the others: a quiet tenant's GET p99 on the flooded loop was 40-250 ms, 5-10 ms
without that yield (one loop: 4-7 ms; tests/test_abuse.py `unauth_ping_flood`, 2 loops
on 2 cores).

Accounting and back-pressure (server/resp/accounting.py): the connection's memory
("bulk", "input", "reply", "output") is held in its tenant's account, and a client over
its query or output limit is disconnected, as Redis does. Reading pauses while too much
is buffered, and resumes when the task drains it or needs data. While the peer does not
read its replies (`pause_writing`) the task goes on running commands as long as its
tenant and the server have budget left for the replies, as Redis does: a client may
write a whole pipeline before it reads (redis-py's pipeline does). Over
`client_output_buffer_limit_bytes` the client is disconnected (Redis's rule); with the
budget spent the task waits until the peer reads, and reading pauses.

The graceful stop (`begin_drain`): the task runs what is buffered and, once it waits
for input with no command half-received and no MULTI open, shuts the write side after
its last reply and lingers, reading and dropping input, until the peer closes
(server/linger.py).

State: the connection's phase of life (open, draining, close due, lingering, closed),
what its task does (running, parked, waiting for the peer) and why it does not read
(back-pressure, a yield) are named in one `ConnState` (server/resp/state.py, sans-IO,
with its transition table); this class does the I/O they call for.

Slots (server/budget.py `ConnectionSlots`): a connection takes an unauthenticated slot
when it opens and moves to its tenant's share on AUTH; a tenant at its share is refused
there. Timers: not authenticated within `auth_timeout_s` -> closed; idle, a command
half-received or replies unread for too long -> closed (server/resp/deadlines.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import Final, cast

from epistemic_kvcache.errors import RemoteProtocolError
from epistemic_kvcache.proto.resp import (
    NEED_DATA,
    Buffer,
    ErrorReply,
    RespParser,
    serialize,
)
from epistemic_kvcache.server.budget import Account, Slot, peer_of
from epistemic_kvcache.server.context import Identity, on_loop
from epistemic_kvcache.server.linger import DRAIN_IDLE_S, Linger
from epistemic_kvcache.server.resp.accounting import Accounting, RefusalNote
from epistemic_kvcache.server.resp.commands import EPOCH_CHANNEL
from epistemic_kvcache.server.resp.common import WIRE, log, push
from epistemic_kvcache.server.resp.deadlines import MIN_CHECK_S, Deadlines, check_delay
from epistemic_kvcache.server.resp.dispatch import Dispatcher
from epistemic_kvcache.server.resp.fastpath import INLINE_MAX_COMMANDS
from epistemic_kvcache.server.resp.session import Session, Shared
from epistemic_kvcache.server.resp.state import ConnState, Event, Phase, Task
from epistemic_kvcache.server.sendfast import ReplyWriter
from epistemic_kvcache.shared import MAX_KEY_BYTES

MAX_FRAMED_AHEAD: Final = 256
"""Commands the parser frames ahead of the one running (the rest stays raw bytes)."""
SLICE_S: Final = 0.001
"""A connection's task yields to the event loop after running commands this long."""
READ_SLICE_S: Final = 0.001
"""A read whose parsing (and fast-path answers) took longer than this makes the
connection skip reading until the event loop has served everyone else once."""
PUBSUB_OUTPUT_LIMIT: Final = 8 * 1024 * 1024
"""A subscriber whose unread messages exceed this is disconnected (Redis' soft pubsub
client-output-buffer-limit is 8 MiB)."""


class RespConnection(asyncio.BufferedProtocol):
    """One RESP client connection. Create through `make_resp_factory` (listener.py)."""

    def __init__(self, shared: Shared) -> None:
        self._shared = shared
        self._ctx = ctx = shared.ctx
        self._limits = limits = ctx.limits
        self._slots = ctx.slots_for(WIRE)
        self._account = Account(ctx.budget)
        self._refused = RefusalNote(ctx.refusals)
        """Why this connection was refused something, for the refusal log (it holds no
        reference back to the connection: no reference cycle through `Accounting`)."""
        self._acc = Accounting(self._account, limits, self._refused)
        """The account over the parser, and when reading pauses (accounting.py)."""
        self.session = Session(shared, self._account, self)
        self._parser = RespParser(
            max_multibulk_len=limits.resp_max_args,
            max_bulk_bytes=max(limits.max_block_bytes, MAX_KEY_BYTES),
            unauthenticated_max_multibulk_len=limits.resp_unauthenticated_max_args,
            unauthenticated_max_bulk_bytes=limits.resp_unauthenticated_max_bulk_bytes,
            reserve=self._acc.reserve,
            scratch=shared.scratch,
            max_ready=MAX_FRAMED_AHEAD,
        )
        self._dispatcher = Dispatcher(self.session, self._parser)
        self.get_buffer = self._parser.get_buffer  # type: ignore[method-assign]
        self._slot: Slot | None = None
        self.peer = "?"

        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self.writer = ReplyWriter()
        """Reply writes: large ones straight to the socket, without the GIL."""
        self._task: asyncio.Task[None] | None = None
        self._wakeup = asyncio.Event()
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._st = ConnState()
        """Phase, task and reading, named (server/resp/state.py)."""
        self._clocks = Deadlines(self._loop.time())
        """Idle, partial-command and stall clocks (server/resp/deadlines.py)."""
        self._timer: asyncio.TimerHandle | None = None
        self._auth_timer: asyncio.TimerHandle | None = None
        self._sub_tenant: str | None = None
        self._counted_tenant: str | None = None
        self._linger = Linger()
        """After the last reply of a graceful stop: input dropped (server/linger.py)."""

    @property
    def transport(self) -> asyncio.Transport | None:
        """The connection's transport (None before `connection_made`)."""
        return self._transport

    # -- asyncio callbacks ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport = cast(asyncio.Transport, transport)
        self._ctx.live.add(self)
        self.peer = self._refused.peer = peer_of(transport)
        self.session.peer = self.peer
        self.session.addr = _host_port(transport.get_extra_info("peername"))
        self.session.laddr = _host_port(transport.get_extra_info("sockname"))
        admitted = self._slots.admit(self.peer, self._evicted)
        self._ctx.open_connections[WIRE] = self._slots.open
        if isinstance(admitted, str):
            self._st.on(Event.CLOSE)
            self._note(admitted)
            transport.write(f"-ERR {admitted}\r\n".encode())
            transport.close()
            return
        self._slot = admitted
        self._shared.live.add(self)
        self._task = self._loop.create_task(self._serve())
        self._task.add_done_callback(self._task_done)
        self._arm_timer(check_delay(self._limits))
        self.arm_auth_deadline()

    def get_buffer(self, sizehint: int) -> memoryview:
        # (uvloop looks this up once per connection, and `__init__` binds the parser's
        # own in its place: one Python call less per read; this one is for the record)
        return self._parser.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        started = time.perf_counter()
        parser = self._parser
        st = self._st
        if st.closing:  # lingering (else no read comes)
            self._discard(nbytes)
            return
        parser.buffer_updated(nbytes)
        dispatcher = self._dispatcher
        s = self.session
        if st.fast and s.identity is not None and not s.channels and not dispatcher.started:
            # The fast path: the task is parked (nothing of this connection runs), the
            # peer reads its replies, no SET started here waits for its reply. What the
            # store answers at once is answered here, with the task left parked;
            # durable SETs are started here and finished by the task.
            dispatcher.run_fast(self._write, INLINE_MAX_COMMANDS, started)
            now = dispatcher.fast_ended  # (its last clock reading: no need for another)
        else:
            now = time.perf_counter()
        if parser.pending_bytes or parser.has_error:  # (a framed command counts in it)
            self._after_read()  # something is left: the general bookkeeping
        else:
            clocks = self._clocks
            clocks.last_activity = self._loop.time()
            clocks.partial_since = None
            if self._acc.holds_input:
                self._acc.clear_input()
            if dispatcher.started:
                self._wakeup.set()
        if now - started > READ_SLICE_S:
            self._yield_reading()

    def _after_read(self) -> None:
        """Bookkeeping after the parser took a read: progress, accounting, waking the
        task, back-pressure."""
        parser = self._parser
        now, parsed = self._loop.time(), parser.commands_parsed
        self._clocks.read(now, has_partial=parser.has_partial, commands_parsed=parsed)
        if not self._account_input():
            return
        self._wakeup.set()
        if self._st.backpressure or self._transport is None:
            return
        if self._acc.over_high_water(parser, authenticated=self.session.identity is not None):
            self._st.backpressure = True
            self._apply_reading()

    def _task_done(self, task: asyncio.Task[None]) -> None:
        # A cancelled task keeps its CancelledError, whose traceback holds the task's
        # frame and with it this connection: without this link dropped, a client that
        # hung up mid-command left a reference cycle for the garbage collector.
        if self._task is task:
            self._task = None

    def eof_received(self) -> bool:
        self._st.eof = True
        self._wakeup.set()
        # keep the write side open until the queued replies are sent (the task closes)
        return self._task is not None and not self._task.done()

    def connection_lost(self, exc: Exception | None) -> None:
        self._st.on(Event.CLOSE)
        self._ctx.live.discard(self)
        self._shared.live.discard(self)  # CLIENT LIST shows open connections only
        self._parser.close()  # buffered commands go now, not at the next full GC
        self._dispatcher.abandon()
        self._account.close()
        self.session.unwatch()
        self.session.channels.clear()
        self.on_subscriptions()
        if self._slot is not None:
            self._slots.release(self._slot)
            self._slot = None
            self._ctx.open_connections[WIRE] = self._slots.open
        for handle in (self._timer, self._auth_timer):
            if handle is not None:
                handle.cancel()
        self._timer = self._auth_timer = None
        self._linger.cancel()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._can_write.set()
        self._st.set_writable(True)
        self._wakeup.set()

    def pause_writing(self) -> None:
        self._st.set_writable(False)
        self._can_write.clear()
        self._clocks.write_paused_since = self._loop.time()

    def resume_writing(self) -> None:
        self._clocks.last_activity = self._loop.time()
        self._clocks.write_paused_since = None
        self._account_output()
        self._st.set_writable(True)
        self._can_write.set()

    # -- the command loop -------------------------------------------------------------------
    async def _serve(self) -> None:
        loop_time = time.perf_counter
        slice_start = loop_time()
        st = self._st
        try:
            while not st.closing:
                if self._dispatcher.started:  # SETs the read callback started
                    self._reply(await self._dispatcher.finish_started())
                    if st.closing:
                        return
                    continue
                try:
                    event = self._parser.next_command()
                except RemoteProtocolError as exc:
                    error = ErrorReply(f"ERR {exc}")
                    self._dispatcher.observe("protocol_error", error, 0.0)
                    self._write(serialize(error, self.session.protocol_version))
                    self._close()
                    return
                if event is NEED_DATA:
                    self._acc.settle(self._parser)
                    if st.phase is Phase.CLOSE_DUE and self._at_boundary():
                        self._close_at_boundary()
                        return
                    self._resume_reading(force=True)
                    if st.eof:
                        self._close()
                        return
                    self._wakeup.clear()
                    st.set_task(Task.PARKED)
                    try:
                        await self._wakeup.wait()
                    finally:
                        st.set_task(Task.RUNNING)
                    slice_start = loop_time()
                    continue
                self._resume_reading(force=False)
                if not st.writable and not self._may_run_ahead():
                    st.set_task(Task.WAITING_PEER)
                    try:
                        await self._can_write.wait()
                    finally:
                        st.set_task(Task.RUNNING)
                    if st.closing:
                        return
                    slice_start = loop_time()
                self._reply(await self._dispatcher.execute(event))
                if st.closing:
                    return
                self._clocks.last_activity = self._loop.time()
                if loop_time() - slice_start > SLICE_S:
                    await asyncio.sleep(0)  # let other connections run
                    slice_start = loop_time()
        except asyncio.CancelledError:
            self._close(abort=True)  # nobody would serve (or close) it any more
            raise
        except Exception:
            log.exception("RESP connection %d failed", self.session.client_id)
            self._close(abort=True)

    def _reply(self, replies: list[object]) -> None:
        """Send the replies of commands the task ran (closing after QUIT)."""
        st = self._st
        if st.closing:
            return
        self._acc.settle(self._parser)
        buffers: list[Buffer] = []
        for reply in replies:
            buffers += self._dispatcher.encode(reply)
        self._write(buffers)
        self._account.give_back("reply")
        if self.session.quit_requested:
            self._close()
        elif st.phase is not Phase.OPEN:
            st.on(Event.REPLIED)

    # -- accounting (server/resp/accounting.py) ---------------------------------------------
    def _note(self, why: str) -> None:
        """Record in the refusal log why this connection was refused something."""
        self._refused(why)

    def _account_input(self) -> bool:
        """Count what the parser buffers; False (connection closed) over the query limit."""
        if self._acc.count_input(self._parser) is None:
            return True
        error = "ERR Protocol error: query buffer limit reached (resp_max_query_buffer_bytes)"
        self._write(serialize(ErrorReply(error), self.session.protocol_version))
        self._close()
        return False

    def _account_output(self) -> None:
        queued = self._acc.count_output(self._transport)
        if queued is not None and not self._st.closing:
            self._note(f"{queued} bytes of unread replies (client_output_buffer_limit_bytes)")
            self._close(abort=True)

    def _may_run_ahead(self) -> bool:
        """Writing is paused (the peer has not read its replies yet): whether to run the
        next command anyway. Yes while this tenant and the server have room for more
        replies, as Redis does: a client may send a whole pipeline before it reads. Past
        `client_output_buffer_limit_bytes` the client is disconnected (`_account_output`,
        Redis's rule); with the tenant's or the server's budget spent, the task waits
        for the peer to read (and reading pauses once enough is buffered)."""
        self._account_output()
        if self._st.closing or self.session.identity is None:
            return False
        return self._account.headroom() > 0

    # -- I/O helpers ------------------------------------------------------------------------
    def _write(self, buffers: list[Buffer]) -> bool:
        """Write `buffers`, and say whether the peer keeps up (more may be written)."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return False
        if buffers:
            one, writer = buffers[0], self.writer
            if len(buffers) == 1 and type(one) is bytes and len(one) < writer.min_bytes:
                transport.write(one)  # (a small reply: what `writer` does, one call less)
            else:
                writer.write(transport, buffers)
            # "output" counts what the transport holds back (most writes: nothing)
            if self._acc.output_held or transport.get_write_buffer_size():
                self._account_output()
        st = self._st
        return st.writable and not st.closing

    def _close(self, *, abort: bool = False) -> None:
        self._st.on(Event.CLOSE)
        transport = self._transport
        if transport is not None and not transport.is_closing():
            if abort:
                transport.abort()
            else:
                transport.close()

    # -- the graceful stop ------------------------------------------------------------------
    def begin_drain(self) -> None:
        """`LiveConnection.begin_drain`: the task runs what is buffered and, once it
        waits for input between commands outside MULTI (`_at_boundary`), closes: right
        after a reply, or when no command came for `DRAIN_IDLE_S`. Replies are corked
        from now on (TCP_CORK), so the last one and the end of the stream leave in one
        segment: a client that reads a reply sees the EOF with it, before it sends again."""
        if self._st.phase is not Phase.OPEN:
            return
        self._st.on(Event.DRAIN)
        transport = self._transport
        if transport is not None and transport.get_extra_info("sslcontext") is None:
            sock = transport.get_extra_info("socket")
            with contextlib.suppress(OSError, AttributeError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(DRAIN_IDLE_S, self._drain_idle)
        self._wakeup.set()

    def _drain_idle(self) -> None:
        """`DRAIN_IDLE_S` after `begin_drain`: close at the next boundary even if no
        command comes (an idle connection)."""
        self._timer = None
        self._st.on(Event.DRAIN_IDLE)
        self._wakeup.set()

    @property
    def drained(self) -> bool:
        """`LiveConnection.drained`: closed, or shut after its last reply."""
        return self._st.closing

    def _at_boundary(self) -> bool:
        """No command is half-received and no transaction is open."""
        return not self._parser.has_partial and self.session.multi is None

    def _close_at_boundary(self) -> None:
        """Shut the write side after the replies written so far (the peer reads them,
        then EOF, and reconnects before it sends again), then keep reading and dropping
        input until the peer closes, `LINGER_S` passes or the drain ends: closing with
        unread input would reset the connection and could lose replies in flight."""
        transport = self._transport
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if (
            transport is None
            or transport.is_closing()
            or not self._linger.start(self._loop, transport)
        ):
            self._close()
            return
        st = self._st
        st.on(Event.SHUT)
        self._parser.close()
        self._parser.reserve = _refuse_all
        st.backpressure = st.yielding = False
        self._apply_reading()

    def _discard(self, nbytes: int) -> None:
        """Input after `_close_at_boundary`: framed (so large bulks are skipped, never
        stored) and dropped; a peer that sends more than `LINGER_MAX_BYTES` is cut."""
        parser = self._parser
        parser.buffer_updated(nbytes)
        parser.close()
        parser.reserve = _refuse_all
        self._linger.drop(self._transport, nbytes)

    def revoke(self) -> None:
        """The session's credential no longer verifies (credentials reloaded): close."""
        log.warning(
            "RESP connection %d (%s) of tenant %r closed: its credential was revoked",
            self.session.client_id,
            self.peer,
            self.session.identity.tenant if self.session.identity else None,
        )
        self._close(abort=True)

    def kill(self) -> None:
        """CLIENT KILL from another connection of the tenant: close now (on this
        connection's own event loop, whichever loop the killer runs on)."""
        on_loop(self._loop, self._killed)()

    def _killed(self) -> None:
        log.info("RESP connection %d (%s) closed by CLIENT KILL", self.session.client_id, self.peer)
        self._close(abort=True)

    def _evicted(self) -> None:
        """Our unauthenticated slot went to a newer connection (the pool was full)."""
        log.debug("RESP connection from %s closed: unauthenticated pool full", self.peer)
        self._slot = None
        self._close(abort=True)

    def _yield_reading(self) -> None:
        """This read cost more than `READ_SLICE_S`: stop reading until the event loop
        has run everything else once (libuv would otherwise read again at once)."""
        st = self._st
        if st.yielding or st.closing:
            return
        st.yielding = True
        self._apply_reading()
        self._loop.call_soon(self._end_read_yield)

    def _end_read_yield(self) -> None:
        self._st.yielding = False
        self._apply_reading()

    def _apply_reading(self) -> None:
        """Pause or resume the transport: paused while back-pressure or a yield holds."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        pause = self._st.apply()
        if pause is True:
            transport.pause_reading()
        elif pause is False:
            transport.resume_reading()

    def _resume_reading(self, *, force: bool) -> None:
        if not self._st.backpressure or self._transport is None:
            return
        authenticated = self.session.identity is not None
        if force or self._acc.below_low_water(self._parser, authenticated=authenticated):
            self._st.backpressure = False
            self._clocks.partial_since = None  # the wait was ours, not the client's
            self._apply_reading()

    def arm_auth_deadline(self) -> None:
        """Close the connection unless it authenticates within `auth_timeout_s`."""
        if self._auth_timer is not None:
            self._auth_timer.cancel()
        self._auth_timer = self._loop.call_later(self._limits.auth_timeout_s, self._on_auth_timeout)

    def _on_auth_timeout(self) -> None:
        self._auth_timer = None
        if self._st.closing or self.session.identity is not None:
            return
        log.debug("RESP connection from %s not authenticated in time, closing", self.peer)
        self._close(abort=True)

    def _arm_timer(self, delay: float) -> None:
        self._timer = self._loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self._st.closing:
            return
        now = self._loop.time()
        deadline, why = self._clocks.due(
            now,
            self._limits,
            busy=self._dispatcher.busy,
            subscribed=bool(self.session.channels),
            backpressure=self._st.backpressure,
        )
        if now < deadline:
            self._arm_timer(max(MIN_CHECK_S, min(deadline - now, check_delay(self._limits))))
            return
        if why == "idle":
            log.debug("RESP connection from %s closed: idle", self.peer)
        else:
            self._note(why)
        self._close(abort=True)

    # -- session hooks ------------------------------------------------------------------------
    def on_login(self, identity: Identity) -> ErrorReply | None:
        """`SessionHooks.on_login`: move to the tenant's slots and memory share."""
        slot = self._slot
        if slot is not None:
            refused = self._slots.authenticate(slot, identity.tenant)
            if refused is not None:
                self._note(f"tenant {identity.tenant!r}: {refused}")
                self.session.quit_requested = True
                return ErrorReply(f"ERR {refused}")
        self._account.move_to(identity.tenant)
        self._parser.authenticated = True
        if self._auth_timer is not None:
            self._auth_timer.cancel()
            self._auth_timer = None
        if self._counted_tenant != identity.tenant:
            self._counted_tenant = identity.tenant
            self._shared.activity(identity.tenant).connections += 1
        return None

    def on_reset(self) -> None:
        """`SessionHooks.on_reset`: unauthenticated again."""
        if self._slot is not None:
            self._slots.deauthenticate(self._slot)
        self._account.move_to(None)
        self._parser.authenticated = False
        self.arm_auth_deadline()

    def on_subscriptions(self) -> None:
        """Listen to the current tenant's epoch bumps iff subscribed to EPOCH_CHANNEL."""
        s = self.session
        want = None
        if s.identity is not None and EPOCH_CHANNEL in s.channels:
            want = s.identity.tenant
        if want == self._sub_tenant:
            return
        epochs = self._ctx.epochs
        if self._sub_tenant is not None:
            epochs.unsubscribe(self._sub_tenant, self.deliver_epoch)
        if want is not None:
            epochs.subscribe(want, self.deliver_epoch)
        self._sub_tenant = want

    def deliver_epoch(self, scope: str, epoch: int) -> None:
        """Send one `message` frame on EPOCH_CHANNEL (on the event loop)."""
        transport = self._transport
        if transport is None or transport.is_closing() or self._st.closing:
            return
        if transport.get_write_buffer_size() > PUBSUB_OUTPUT_LIMIT:
            self._note("subscriber does not read its messages")
            self._close(abort=True)
            return
        payload = f"{scope} {epoch}".encode()
        self._write(push([b"message", EPOCH_CHANNEL, payload], self.session.protocol_version))


def _refuse_all(nbytes: int) -> str:
    """The parser's `reserve` hook while lingering: no large bulk is allocated."""
    return "closing"


def _host_port(name: object) -> str:
    """`host:port` of a socket address (`?:0` when unknown, e.g. a unix socket)."""
    if isinstance(name, tuple) and len(name) >= 2:
        return f"{name[0]}:{name[1]}"
    return "?:0"
