"""The HTTP/1.1 `/kv` connection (docs/http-api.md): an asyncio protocol over httptools.

How it works
- One `HttpConnection` (an `asyncio.BufferedProtocol`) per connection. Request heads
  are read into a read buffer shared by the listener's connections and fed to httptools
  (llhttp) in slices of at most `FEED_SLICE` bytes and never past the remaining header
  budget (431 once spent). Once `MAX_QUEUED` requests wait, the rest of the read is
  kept as a backlog and fed only when they are answered: one read never costs more
  than a bounded amount of parsing.
- When a head is complete the request is checked against the route table
  (server/http/routes.py) — authentication, route, method, key, Content-Length — before
  one body byte is read (server/http/admission.py `admit`). A refused request whose body
  is still to come is answered and the connection closed (lingering, server/linger.py:
  the write side is shut, unread input is discarded for a moment so the peer sees the
  answer, not a reset).
- An accepted body gets one buffer of its Content-Length after its size is taken from
  the connection's memory account under the caller's tenant (server/budget.py): over
  the server's budget 503 `overloaded`, over the tenant's share 429 `tenant_busy`
  (both with `Retry-After`, connection closed). Body bytes that arrived with the head
  are copied in; the rest is read by the transport straight into the buffer.
- Complete requests queue up and one task answers them in order (pipelining: the
  handler's answer or the error answer, admission.py `respond`), yielding to the event
  loop between time slices (`SLICE_S`; before authentication after every request).
  Reading is paused while that task works. Answers are sent as separate
  buffers (`writelines([head, payload])`); what the transport has not sent yet is
  counted under "output" and a connection over `client_output_buffer_limit_bytes` is
  dropped. Cold-read answers reserve their size under "reply" before they are read.
- Slots: a connection opens in the small unauthenticated pool and moves to its tenant's
  share with its first authenticated request (a tenant at its share: 429 and close).
- Timers: a request deadline from a request's first byte (slowloris -> 408 and close),
  an idle keep-alive timeout, a stall timeout while the peer does not read our output,
  and an authentication deadline: a connection that has sent no request with valid
  credentials `auth_timeout_s` after it opened is closed (`/healthz` alone does not count).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final, cast

import httptools

from epistemic_kvcache.proto.http import ROUTE_OTHER, BatchPutReceiver, response_head
from epistemic_kvcache.server.budget import Account, Slot, peer_of
from epistemic_kvcache.server.context import ServerContext
from epistemic_kvcache.server.http.admission import (
    WIRE,
    PendingRequest,
    admit,
    check_credentials,
    head_error,
    respond,
    write_body,
)
from epistemic_kvcache.server.http.api import HttpError, Response
from epistemic_kvcache.server.linger import DRAIN_IDLE_S, Linger
from epistemic_kvcache.server.oplog import peer_address
from epistemic_kvcache.server.sendfast import ReplyWriter

log = logging.getLogger("epistemic_kvcache.server.http")

READ_BUFFER_BYTES: Final = 64 * 1024
"""The listener's shared read buffer for heads and small bodies; big bodies bypass it."""
DIRECT_MIN_BYTES: Final = 64 * 1024
"""A batch PUT block at least this large is read straight into its buffer; smaller
pieces (the framing, small blocks) are read many at a time and copied in."""
FEED_SLICE: Final = 4096
"""Bytes fed to the HTTP parser at a time (between checks of the queue length)."""
MAX_QUEUED: Final = 32
"""Complete requests waiting to be answered before parsing stops for this read."""
SLICE_S: Final = 0.001
"""The answering task yields to the event loop after working this long."""
_CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"


def make_http_factory(ctx: ServerContext) -> Callable[[], asyncio.BufferedProtocol]:
    """Protocol factory for `loop.create_server` serving the `/kv` API of `ctx`."""
    ctx.metrics.watch_connections(ctx.open_connections)
    ctx.slots_for(WIRE)
    scratch = memoryview(bytearray(READ_BUFFER_BYTES))

    def factory() -> asyncio.BufferedProtocol:
        return HttpConnection(ctx, scratch)

    return factory


class _Stop(Exception):
    """Raised inside a parser callback to stop parsing (the reason is already queued)."""


class HttpConnection(asyncio.BufferedProtocol):
    """One client connection. See the module docstring for the mechanism."""

    def __init__(self, ctx: ServerContext, scratch: memoryview) -> None:
        self._ctx = ctx
        self._limits = ctx.limits
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self.writer = ReplyWriter()
        """Answer writes: large ones straight to the socket, without the GIL."""
        self._scratch = scratch
        self._backlog = bytearray()
        """Input read but not parsed yet (parsing stopped at `MAX_QUEUED` requests)."""
        self._parser: Any = None
        self._cur: PendingRequest | None = None
        self._head_used = 0
        self._queue: deque[PendingRequest] = deque()
        self._task: asyncio.Task[None] | None = None
        self._account = Account(ctx.budget)
        self._slots = ctx.slots_for(WIRE)
        self._slot: Slot | None = None
        self._tenant: str | None = None
        self.peer = "?"
        self._stopped = False
        """No more input is parsed: a final answer (and a close) is queued or sent."""
        self._closed = False
        self._eof = False
        self._reading_paused = False
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._stall: asyncio.TimerHandle | None = None
        self._auth_timer: asyncio.TimerHandle | None = None
        self._linger = Linger()
        """After a final answer: the write side shut, input dropped (server/linger.py)."""
        self._draining = False
        """The server is stopping: the next answer with nothing after it closes."""
        self._lent_body = False
        """The last `get_buffer` lent the current body's own buffer (not the scratch)."""

    @property
    def transport(self) -> asyncio.Transport | None:
        """The connection's transport (None before `connection_made`)."""
        return self._transport

    # -- transport callbacks --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._ctx.live.add(self)
        self.peer = peer_of(transport)
        admitted = self._slots.admit(self.peer, self._evicted)
        self._ctx.open_connections[WIRE] = self._slots.open
        if isinstance(admitted, str):
            self._ctx.refusals.note(WIRE, self.peer, admitted)
            self._stopped = True
            err = HttpError(503, "overloaded", f"{admitted}, retry later", (("Retry-After", "1"),))
            self._send(err.response(), head_only=False, close=True, http10=False)
            self._ctx.metrics.observe_request(WIRE, ROUTE_OTHER, "503", 0.0)
            self._close_gracefully()
            return
        self._slot = admitted
        self._auth_timer = self._loop.call_later(self._limits.auth_timeout_s, self._on_auth_timeout)
        self._arm_idle()

    def get_buffer(self, sizehint: int) -> memoryview:
        req = self._cur
        if (
            req is not None
            and req.direct
            and req.body is not None
            and not self._stopped
            and not self._backlog
        ):
            body = req.body
            if not isinstance(body, BatchPutReceiver):
                self._lent_body = True
                return memoryview(body)[req.received :]
            target = body.buffer()
            if len(target) >= DIRECT_MIN_BYTES:
                self._lent_body = True
                return target
            # a batch's framing or small blocks: read many at once, copied in from here
        self._lent_body = False
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._stopped:
                self._linger.drop(self._transport, nbytes)
                return
            req = self._cur
            if self._lent_body and req is not None:
                self._lent_body = False
                req.received += nbytes
                if isinstance(req.body, BatchPutReceiver):
                    req.body.advance(nbytes)
                if req.received == req.content_length:
                    self._complete(req)
            else:
                self._consume(self._scratch[:nbytes])
            self._after_input()
        except Exception:
            log.exception("http: internal error while reading a request")
            self._abort()

    def eof_received(self) -> bool:
        self._eof = True
        if self._linger.active:
            return False
        # Answer what is queued, then close (see _queue_drained).
        return self._task is not None or bool(self._queue) or bool(self._backlog)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._ctx.live.discard(self)
        for handle in (self._deadline, self._idle, self._stall, self._auth_timer):
            if handle is not None:
                handle.cancel()
        self._linger.cancel()
        if self._slot is not None:
            self._slots.release(self._slot)
            self._slot = None
            self._ctx.open_connections[WIRE] = self._slots.open
        self._wake_drain()
        self._queue.clear()
        self._cur = None
        self._parser = None
        self._backlog = bytearray()
        self._account.close()

    def pause_writing(self) -> None:
        self._write_paused = True
        if self._stall is None:
            self._stall = self._loop.call_later(self._limits.request_timeout_s, self._on_stall)

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        self._account_output()
        self._wake_drain()

    # -- input ---------------------------------------------------------------------------

    def _consume(self, data: memoryview) -> None:
        """Feed bytes: heads to the parser, body bytes to buffers; keep what is left over
        once `MAX_QUEUED` requests wait (it is fed when they are answered)."""
        pos, end = 0, len(data)
        limit = self._limits.max_header_bytes
        while pos < end and not self._stopped:
            req = self._cur
            if req is not None and req.direct:
                take = min(req.content_length - req.received, end - pos)
                write_body(req, data[pos : pos + take])
                req.received += take
                pos += take
                if req.received == req.content_length:
                    self._complete(req)
                continue
            if len(self._queue) >= MAX_QUEUED:
                self._backlog += data[pos:end]
                return
            if self._head_used >= limit:
                self._fail(
                    HttpError(431, "headers_too_large", f"request head exceeds {limit} bytes")
                )
                break
            take = min(limit - self._head_used, end - pos, FEED_SLICE)
            self._head_used += take
            if self._parser is None:
                self._parser = httptools.HttpRequestParser(self)
            try:
                self._parser.feed_data(data[pos : pos + take])
            except httptools.HttpParserUpgrade:
                # The upgrade request itself is complete and queued: answer it, then close.
                if self._queue:
                    self._queue[-1].keep_alive = False
                self._stopped = True
                break
            except httptools.HttpParserCallbackError as exc:
                if not self._stopped:  # not our own _Stop: a bug in a callback
                    log.error("http: parser callback failed", exc_info=exc.__context__)
                    self._fail(HttpError(500, "internal", "internal error while parsing"))
                break
            except httptools.HttpParserError as exc:
                self._fail(HttpError(400, "bad_request", f"malformed HTTP request: {exc}"))
                break
            pos += take
            req = self._cur
            if req is not None and req.headers_done:
                # The head is in, the body is not complete: read it straight into its buffer.
                req.direct = True
                self._parser = None

    def _after_input(self) -> None:
        if self._queue and self._task is None:
            self._task = self._loop.create_task(self._serve_queue())
        if self._task is not None or self._stopped or self._backlog:
            self._pause_reading()

    # -- parser callbacks (called by httptools inside feed_data) --------------------------

    def on_message_begin(self) -> None:
        self._cancel_idle()
        self._cur = PendingRequest(time.perf_counter())
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self._loop.call_later(self._limits.request_timeout_s, self._on_deadline)

    def on_url(self, fragment: bytes) -> None:
        req = self._cur
        assert req is not None
        req.url += fragment
        req.head_bytes += len(fragment)
        self._check_head(req)

    def on_header(self, name: bytes, value: bytes) -> None:
        req = self._cur
        assert req is not None
        req.n_headers += 1
        req.head_bytes += len(name) + len(value) + 4
        self._check_head(req)
        lname = name.lower()
        old = req.headers.get(lname)
        req.headers[lname] = value if old is None else old + b", " + value

    def on_headers_complete(self) -> None:
        req = self._cur
        assert req is not None
        err, has_body = admit(req, self._parser, self._ctx, self._account, self._authenticate)
        if err is None:
            if req.expect_continue and not self._queue and self._task is None:
                self._write_continue(req)
            return
        req.error = err
        if has_body:
            # Refused before its body: answer, close, never read the body.
            self._fail(err, req)
            raise _Stop
        # No body follows: the request completes at once and is answered in its turn.

    def on_body(self, chunk: bytes) -> None:
        # Only body bytes that share a read with their head come through here.
        req = self._cur
        assert req is not None
        n = len(chunk)
        write_body(req, chunk)
        req.received += n

    def on_message_complete(self) -> None:
        req = self._cur
        if req is not None and not self._stopped:
            self._complete(req)

    def _check_head(self, req: PendingRequest) -> None:
        err = head_error(req, self._limits)
        if err is not None:
            self._fail(err)
            raise _Stop

    # -- admission (server/http/admission.py decides from the head alone) ----------------

    def _authenticate(self, req: PendingRequest) -> HttpError | None:
        found = check_credentials(
            self._ctx, peer_address(self._transport), req.headers.get(b"authorization")
        )
        if isinstance(found, HttpError):
            return found
        identity = found
        if identity.tenant != self._tenant:
            slot = self._slot
            if slot is not None:
                refused = self._slots.authenticate(slot, identity.tenant)
                if refused is not None:
                    self._ctx.refusals.note(
                        WIRE, self.peer, f"tenant {identity.tenant!r}: {refused}"
                    )
                    return HttpError(429, "too_many_connections", refused, (("Retry-After", "1"),))
            self._tenant = identity.tenant
            self._account.move_to(identity.tenant)
        req.identity = identity
        if self._auth_timer is not None:
            self._auth_timer.cancel()
            self._auth_timer = None
        return None

    # -- request lifecycle ----------------------------------------------------------------

    def _complete(self, req: PendingRequest) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._cur = None
        self._head_used = 0
        if req.direct:
            self._parser = None
        self._queue.append(req)

    def _release(self, req: PendingRequest) -> None:
        """Give back the request body's share of the account (idempotent)."""
        if req.reserved:
            self._account.give_back("body", req.reserved)
            req.reserved = 0

    def _fail(self, err: HttpError, req: PendingRequest | None = None) -> None:
        """Queue a final error answer and stop reading requests on this connection."""
        if req is None:
            req = self._cur or PendingRequest(time.perf_counter())
        req.error = err
        req.keep_alive = False
        req.body = None
        self._release(req)
        self._cur = None
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._stopped = True
        self._backlog = bytearray()
        self._queue.append(req)

    def _on_deadline(self) -> None:
        self._deadline = None
        if self._cur is None or self._stopped or self._closed:
            return
        if self._task is not None or self._backlog:
            # We paused reading to answer earlier requests: not the client's fault.
            timeout = self._limits.request_timeout_s
            self._deadline = self._loop.call_later(timeout, self._on_deadline)
            return
        msg = f"request not received within {self._limits.request_timeout_s:g}s"
        self._fail(HttpError(408, "request_timeout", msg))
        self._after_input()

    async def _serve_queue(self) -> None:
        closing = True
        try:
            closing = await self._serve_all()
        except asyncio.CancelledError:
            self._abort()  # nobody would answer (or close) it any more
            raise
        except Exception:
            log.exception("http: internal error while answering")
            self._abort()
        finally:
            self._task = None
        if not closing:
            self._queue_drained()

    async def _serve_all(self) -> bool:
        """Answer queued requests in order. True when the connection is being closed."""
        slice_start = time.perf_counter()
        while self._queue and not self._closed:
            req = self._queue.popleft()
            close = await self._answer(req)
            await self._drain()
            if close:
                self._close_gracefully()
                return True
            if self._tenant is None or time.perf_counter() - slice_start > SLICE_S:
                await asyncio.sleep(0)  # let other connections run
                slice_start = time.perf_counter()
        return self._closed

    def _queue_drained(self) -> None:
        transport = self._transport
        if self._closed or transport is None:
            return
        if self._backlog:
            backlog, self._backlog = self._backlog, bytearray()
            self._consume(memoryview(backlog))
            if self._queue or self._stopped:
                self._after_input()
                return
        if self._eof:
            transport.close()
            return
        if self._reading_paused and not self._stopped:
            self._reading_paused = False
            transport.resume_reading()
        req = self._cur
        if req is None:
            self._arm_idle()
        elif req.expect_continue and not req.continue_sent:
            self._write_continue(req)

    async def _answer(self, req: PendingRequest) -> bool:
        resp = await respond(self._ctx, self._account, req)
        req.body = None
        self._release(req)
        close = not req.keep_alive or (self._draining and self._nothing_follows())
        self._send(resp, head_only=req.method == "HEAD", close=close, http10=req.http10)
        self._account.give_back("reply")
        elapsed = time.perf_counter() - req.t_start
        route = req.route or ROUTE_OTHER
        self._ctx.metrics.observe_request(WIRE, route, str(resp.status), elapsed)
        if self._ctx.access_log.enabled:
            self._ctx.access_log.record(
                WIRE,
                self.peer,
                req.identity.tenant if req.identity is not None else None,
                f"{req.method} {bytes(req.url[:200]).decode('latin-1')}",
                str(resp.status),
                req.content_length,
                0 if req.method == "HEAD" else resp.length or 0,  # HEAD sends no body
                elapsed,
            )
        return close

    def _send(self, resp: Response, *, head_only: bool, close: bool, http10: bool) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        head = response_head(
            resp.status,
            resp.headers,
            content_length=resp.length,
            close=close,
            keep_alive_header=http10 and not close,
        )
        if head_only or not resp.parts:
            transport.write(head)
        else:
            self.writer.write(transport, [head, *resp.parts])
        self._account_output()

    def _account_output(self) -> None:
        limit = self._limits.client_output_buffer_limit_bytes
        queued = self._account.track_output(self._transport, limit)
        if queued is not None and not self._closed:
            self._ctx.refusals.note(
                WIRE,
                self.peer,
                f"{queued} bytes of unread answers (client_output_buffer_limit_bytes)",
            )
            self._abort()

    # -- flow control, timers, closing ----------------------------------------------------

    def begin_drain(self) -> None:
        """`LiveConnection.begin_drain`: a busy connection answers what it has received,
        the last answer with `Connection: close`; an idle one is closed once it sent
        nothing for `DRAIN_IDLE_S` (a request that comes first is answered so)."""
        self._draining = True
        if self._closed or self._stopped:
            return
        if self._task is None and self._nothing_follows():
            self._arm_idle()  # the drain's short idle time from now

    @property
    def drained(self) -> bool:
        """`LiveConnection.drained`: closed, or shut after its last answer."""
        if self._closed or self._linger.active:
            return True
        return self._stopped and self._task is None and not self._queue

    def _nothing_follows(self) -> bool:
        """No request of this connection is queued, being received or left unparsed."""
        return not self._queue and self._cur is None and not self._backlog

    def _write_continue(self, req: PendingRequest) -> None:
        req.continue_sent = True
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(_CONTINUE)

    async def _drain(self) -> None:
        while self._write_paused and not self._closed:
            fut = self._loop.create_future()
            self._drain_waiter = fut
            await fut
        self._account_output()

    def _wake_drain(self) -> None:
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _pause_reading(self) -> None:
        transport = self._transport
        if self._reading_paused or transport is None or transport.is_closing():
            return
        self._reading_paused = True
        transport.pause_reading()

    def _arm_idle(self) -> None:
        self._cancel_idle()
        timeout = DRAIN_IDLE_S if self._draining else self._limits.idle_timeout_s
        self._idle = self._loop.call_later(timeout, self._on_idle)

    def _cancel_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def _on_idle(self) -> None:
        self._idle = None
        idle = self._cur is None and self._task is None and not self._queue
        if idle and self._transport is not None:
            self._transport.close()

    def _on_auth_timeout(self) -> None:
        self._auth_timer = None
        if self._closed or self._transport is None:
            return
        log.debug("http: %s sent no authenticated request in time, closing", self.peer)
        self._stopped = True
        self._transport.close()

    def _evicted(self) -> None:
        """Our unauthenticated slot went to a newer connection (the pool was full)."""
        log.debug("http: connection from %s closed: unauthenticated pool full", self.peer)
        self._slot = None
        self._abort()

    def _on_stall(self) -> None:
        self._stall = None
        if self._write_paused:
            self._ctx.refusals.note(WIRE, self.peer, "stopped reading our answers")
            self._abort()

    def _abort(self) -> None:
        self._stopped = True
        if self._transport is not None:
            self._transport.abort()

    def _close_gracefully(self) -> None:
        """Shut our write side after the last answer; drop input for a moment, then close."""
        self._stopped = True
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if self._linger.start(self._loop, transport) and self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
