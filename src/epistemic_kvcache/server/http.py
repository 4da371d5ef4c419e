"""The HTTP/1.1 `/kv` listener (docs/http-api.md): an asyncio protocol over httptools.

How it works
- One `_HttpConnection` (an `asyncio.BufferedProtocol`) per connection. Request heads
  are read into a reused scratch buffer and fed to httptools (llhttp) in slices no longer
  than the remaining header budget, so an endless header line cannot pile up inside the
  parser; 431 once the budget is spent.
- When a head is complete the request is authenticated and checked (route, method, key,
  Content-Length) before one body byte is read. A refused request whose body is still to
  come is answered and the connection closed (lingering: the write side is shut, unread
  input is discarded for a moment so the peer sees the answer, not a reset).
- An accepted body gets one `bytearray(content_length)`, after reserving its size from
  the server-wide in-flight budget (`ServerContext.reserve_body`; over budget: 503
  `overloaded` + `Retry-After`, connection closed). The reservation is released once the
  request is answered or its connection dies. Body bytes that arrived with the head are
  copied in; the rest is read by the transport straight into the buffer
  (`get_buffer` returns its unfilled tail), so big bodies are never copied in Python.
  The parser does not see those bytes; a fresh parser starts the next request.
- Complete requests queue up and one task answers them in order (pipelining). Reading is
  paused while that task works and resumed when the queue is empty and the transport's
  write buffer has drained (`pause_writing` / `resume_writing`). Responses go out as
  separate buffers (`writelines([head, payload])`), never concatenated.
- Timers: a request deadline from a request's first byte (slowloris -> 408 and close),
  an idle keep-alive timeout, a stall timeout while the peer does not read our output,
  and an authentication deadline: a connection that has sent no request with valid
  credentials `auth_timeout_s` after it opened is closed (`/healthz` alone does not count).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import httptools

from epistemic_kvcache.buffers import alloc_block
from epistemic_kvcache.errors import (
    AuthError,
    BlockTooLargeError,
    CapacityError,
    DiskFullError,
    ForbiddenError,
    InvalidKeyError,
    RemoteProtocolError,
    StorageIOError,
    StoreClosedError,
    StoreError,
)
from epistemic_kvcache.proto.http import (
    BATCH_CONTENT_TYPE,
    JSON_CONTENT_TYPE,
    OCTET_CONTENT_TYPE,
    ROUTE_BATCH_EXISTS,
    ROUTE_BATCH_GET,
    ROUTE_BATCH_PUT,
    ROUTE_HEALTHZ,
    ROUTE_KEY,
    ROUTE_KEY_EXISTS,
    ROUTE_METHODS,
    ROUTE_METRICS,
    ROUTE_OTHER,
    ROUTE_STATS,
    decode_batch_put_request,
    decode_key_list,
    decode_key_segment,
    encode_batch_get_response,
    error_body,
    match_route,
    request_path,
    response_head,
)
from epistemic_kvcache.server import routes_engine
from epistemic_kvcache.server.context import Identity, ServerContext
from epistemic_kvcache.shared import MAX_KEY_BYTES, validate_key
from epistemic_kvcache.store.api import Buffer, PutOutcome

log = logging.getLogger(__name__)

WIRE = "http"

READ_BUFFER_BYTES = 64 * 1024
"""Per-connection scratch for heads and small bodies; big bodies bypass it."""
LINGER_S = 2.0
"""After a final answer with input still coming, keep reading (and dropping) this long."""
LINGER_MAX_BYTES = 16 * 1024 * 1024
"""... but drop at most this much before cutting the connection."""
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

_OUTCOME_WORD = {
    PutOutcome.NEW: "created",
    PutOutcome.DUPLICATE: "duplicate",
    PutOutcome.REPLACED: "replaced",
    PutOutcome.CONFLICT: "conflict",
    PutOutcome.MISSING: "missing",
}


def make_http_factory(ctx: ServerContext) -> Callable[[], asyncio.BufferedProtocol]:
    """Protocol factory for `loop.create_server` serving the `/kv` API of `ctx`."""
    ctx.metrics.watch_connections(ctx.open_connections)
    ctx.open_connections.setdefault(WIRE, 0)

    def factory() -> asyncio.BufferedProtocol:
        return _HttpConnection(ctx)

    return factory


def batch_header_limit(max_batch_keys: int) -> int:
    """Bytes a batch JSON header may take: every key at its size limit, JSON-escaped 6x."""
    return max_batch_keys * (6 * MAX_KEY_BYTES + 24) + 1024


class _Stop(Exception):
    """Raised inside a parser callback to stop parsing (the reason is already queued)."""


@dataclass(frozen=True, slots=True)
class _Err:
    status: int
    code: str
    message: str
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(slots=True)
class _Response:
    status: int
    headers: list[tuple[str, str]]
    parts: Sequence[Buffer]
    length: int | None


@dataclass(slots=True)
class _Request:
    t_start: float
    url: bytearray = field(default_factory=bytearray)
    headers: dict[bytes, bytes] = field(default_factory=dict)
    n_headers: int = 0
    head_bytes: int = 0
    method: str = ""
    route: str | None = None
    key: str | None = None
    identity: Identity | None = None
    content_length: int = 0
    body: bytearray | memoryview | None = None
    reserved: int = 0
    """Bytes of the in-flight body budget this request holds (see `_release`)."""
    received: int = 0
    headers_done: bool = False
    direct: bool = False
    """The rest of the body is read by the transport straight into `body`."""
    keep_alive: bool = True
    http10: bool = False
    expect_continue: bool = False
    continue_sent: bool = False
    error: _Err | None = None
    """Set when the request was refused while parsing; answered in its turn."""


def _json(status: int, doc: object, headers: Sequence[tuple[str, str]] = ()) -> _Response:
    body = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    return _Response(
        status, [("Content-Type", JSON_CONTENT_TYPE), *headers], [body] if body else [], len(body)
    )


def _error(err: _Err) -> _Response:
    body = error_body(err.code, err.message)
    return _Response(
        err.status, [("Content-Type", JSON_CONTENT_TYPE), *err.headers], [body], len(body)
    )


def _store_error(exc: StoreError) -> _Err:
    """Map a store failure to the status and code of docs/http-api.md.

    Disk and internal failures get generic text (their messages name server paths and
    OS errors); the detail is logged."""
    if isinstance(exc, InvalidKeyError):
        return _Err(400, "bad_key", str(exc))
    if isinstance(exc, BlockTooLargeError):
        return _Err(413, "block_too_large", str(exc))
    if isinstance(exc, CapacityError):
        return _Err(507, "insufficient_storage", f"no room to store the block: {exc}")
    if isinstance(exc, StoreClosedError):
        return _Err(503, "unavailable", "the store is closed")
    log.error("http: store failure: %s", exc)
    if isinstance(exc, DiskFullError):
        return _Err(507, "insufficient_storage", "no room to store the block: disk full")
    if isinstance(exc, StorageIOError):
        return _Err(503, "storage_io_error", "storage I/O error, nothing was stored")
    return _Err(500, "internal", "internal store error")


_STATUS_CODES = {400: "bad_request", 413: "batch_too_large", 411: "length_required"}


class _HttpConnection(asyncio.BufferedProtocol):
    """One client connection. See the module docstring for the mechanism."""

    def __init__(self, ctx: ServerContext) -> None:
        self._ctx = ctx
        self._limits = ctx.limits
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._scratch = memoryview(bytearray(READ_BUFFER_BYTES))
        self._parser: Any = None
        self._cur: _Request | None = None
        self._head_used = 0
        self._queue: deque[_Request] = deque()
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        """No more input is parsed: a final answer (and a close) is queued or sent."""
        self._closed = False
        self._eof = False
        self._counted = False
        self._reading_paused = False
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._stall: asyncio.TimerHandle | None = None
        self._linger: asyncio.TimerHandle | None = None
        self._auth_timer: asyncio.TimerHandle | None = None
        self._lingering = False
        self._linger_bytes = 0

    # -- transport callbacks --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # not TCP (unix socket)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conns = self._ctx.open_connections
        conns[WIRE] = conns.get(WIRE, 0) + 1
        self._counted = True
        if conns[WIRE] > self._limits.max_connections:
            self._stopped = True
            err = _Err(503, "overloaded", "too many connections, retry later")
            self._send(_error(err), head_only=False, close=True, http10=False)
            self._ctx.metrics.observe_request(WIRE, ROUTE_OTHER, "503", 0.0)
            self._close_gracefully()
            return
        self._auth_timer = self._loop.call_later(self._limits.auth_timeout_s, self._on_auth_timeout)
        self._arm_idle()

    def get_buffer(self, sizehint: int) -> memoryview:
        req = self._cur
        if req is not None and req.direct and req.body is not None and not self._stopped:
            return memoryview(req.body)[req.received :]
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._stopped:
                self._discard(nbytes)
                return
            req = self._cur
            if req is not None and req.direct and req.body is not None:
                req.received += nbytes
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
        if self._lingering:
            return False
        # Answer what is queued, then close (see _queue_drained).
        return self._task is not None or bool(self._queue)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        for handle in (self._deadline, self._idle, self._stall, self._linger, self._auth_timer):
            if handle is not None:
                handle.cancel()
        if self._counted:
            self._ctx.open_connections[WIRE] -= 1
            self._counted = False
        self._wake_drain()
        for req in self._queue:
            self._release(req)
        if self._cur is not None:
            self._release(self._cur)
        self._queue.clear()
        self._cur = None
        self._parser = None

    def pause_writing(self) -> None:
        self._write_paused = True
        if self._stall is None:
            self._stall = self._loop.call_later(self._limits.request_timeout_s, self._on_stall)

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        self._wake_drain()

    # -- input ---------------------------------------------------------------------------

    def _consume(self, data: memoryview) -> None:
        """Feed bytes from the scratch buffer: heads to the parser, body bytes to buffers."""
        pos, end = 0, len(data)
        limit = self._limits.max_header_bytes
        while pos < end and not self._stopped:
            req = self._cur
            if req is not None and req.direct:
                take = min(req.content_length - req.received, end - pos)
                if req.body is not None:
                    req.body[req.received : req.received + take] = data[pos : pos + take]
                req.received += take
                pos += take
                if req.received == req.content_length:
                    self._complete(req)
                continue
            if self._head_used >= limit:
                self._fail(_Err(431, "headers_too_large", f"request head exceeds {limit} bytes"))
                break
            take = min(limit - self._head_used, end - pos)
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
                    self._fail(_Err(500, "internal", "internal error while parsing"))
                break
            except httptools.HttpParserError as exc:
                self._fail(_Err(400, "bad_request", f"malformed HTTP request: {exc}"))
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
        if self._task is not None or self._stopped:
            self._pause_reading()

    def _discard(self, nbytes: int) -> None:
        self._linger_bytes += nbytes
        if self._linger_bytes > LINGER_MAX_BYTES and self._transport is not None:
            self._transport.close()

    # -- parser callbacks (called by httptools inside feed_data) --------------------------

    def on_message_begin(self) -> None:
        self._cancel_idle()
        self._cur = _Request(self._loop.time())
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
        err, has_body = self._admit(req)
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
        if req.body is not None:
            req.body[req.received : req.received + n] = chunk
        req.received += n

    def on_message_complete(self) -> None:
        req = self._cur
        if req is not None and not self._stopped:
            self._complete(req)

    def _check_head(self, req: _Request) -> None:
        lim = self._limits
        if req.n_headers > lim.max_headers:
            self._fail(_Err(431, "headers_too_large", f"more than {lim.max_headers} headers"))
            raise _Stop
        if req.head_bytes > lim.max_header_bytes:
            msg = f"request head exceeds {lim.max_header_bytes} bytes"
            self._fail(_Err(431, "headers_too_large", msg))
            raise _Stop

    # -- admission: everything decided from the head alone --------------------------------

    def _admit(self, req: _Request) -> tuple[_Err | None, bool]:
        """Check a complete head; allocate the body buffer. Returns (refusal, has_body)."""
        p = self._parser
        req.headers_done = True
        req.method = p.get_method().decode("ascii", "replace")
        req.http10 = p.get_http_version() == "1.0"
        req.keep_alive = bool(p.should_keep_alive()) and not p.should_upgrade()
        h = req.headers
        chunked = b"transfer-encoding" in h
        cl_raw = h.get(b"content-length")
        try:
            cl = int(cl_raw) if cl_raw is not None else None
        except ValueError:
            return _Err(400, "bad_request", "invalid Content-Length"), True
        has_body = chunked or bool(cl)
        req.content_length = cl or 0
        req.expect_continue = has_body and b"100-continue" in h.get(b"expect", b"").lower()

        route, segment = match_route(request_path(bytes(req.url)))
        req.route = route
        if route != ROUTE_HEALTHZ:
            err = self._authenticate(req)
            if err is not None:
                return err, has_body
            if self._auth_timer is not None:
                self._auth_timer.cancel()
                self._auth_timer = None
        if route is None:
            return _Err(404, "not_found", "no such route"), has_body
        if route == ROUTE_METRICS and (
            req.identity is None or req.identity.tenant not in self._ctx.metrics_tenants
        ):
            msg = "/metrics shows server-wide totals: only operator tenants may read it"
            return _Err(403, "forbidden", msg), has_body
        allowed = ROUTE_METHODS[route]
        if req.method not in allowed:
            msg = f"{req.method} is not allowed on {route}"
            return _Err(405, "method_not_allowed", msg, (("Allow", ", ".join(allowed)),)), has_body
        if segment is not None:
            try:
                req.key = decode_key_segment(segment)
            except RemoteProtocolError as exc:
                return _Err(400, "bad_key", str(exc)), has_body
        if chunked:
            msg = "chunked request bodies are not accepted: send Content-Length"
            return _Err(411, "length_required", msg), has_body
        limit, code = self._body_limit(route, req.method)
        wants_body = code is not None
        if wants_body and cl is None:
            return _Err(411, "length_required", "this route needs Content-Length"), has_body
        if req.content_length > limit:
            msg = f"body of {req.content_length} bytes exceeds the limit of {limit} bytes"
            return _Err(413, code or "block_too_large", msg), has_body
        if wants_body:
            if not self._ctx.reserve_body(req.content_length):
                msg = "server busy: too many request bodies in flight, retry later"
                return _Err(503, "overloaded", msg, (("Retry-After", "1"),)), has_body
            req.reserved = req.content_length
            # a single-key PUT hands its buffer to the store (mmap-backed when large);
            # other bodies are parsed, so they stay plain bytearrays
            req.body = (
                alloc_block(req.content_length)
                if route == ROUTE_KEY and req.method == "PUT"
                else bytearray(req.content_length)
            )
        return None, has_body

    def _body_limit(self, route: str, method: str) -> tuple[int, str | None]:
        """(max body bytes, 413 code) for a route; code None means the body is discarded."""
        lim = self._limits
        engine = routes_engine.body_limit(
            route, method, min(lim.max_block_bytes, self._ctx.store.max_block_bytes)
        )
        if engine is not None:
            return engine
        if route == ROUTE_KEY and method == "PUT":
            return min(lim.max_block_bytes, self._ctx.store.max_block_bytes), "block_too_large"
        if route == ROUTE_BATCH_PUT:
            return lim.max_batch_bytes + 4 + batch_header_limit(lim.max_batch_keys), (
                "batch_too_large"
            )
        if route in (ROUTE_BATCH_EXISTS, ROUTE_BATCH_GET):
            return batch_header_limit(lim.max_batch_keys), "batch_too_large"
        return lim.max_block_bytes, None

    def _authenticate(self, req: _Request) -> _Err | None:
        raw = req.headers.get(b"authorization")
        challenge = (("WWW-Authenticate", "Bearer"),)
        if raw is None:
            return _Err(401, "unauthorized", "missing credentials: send Bearer <token>", challenge)
        scheme, _, cred = raw.decode("latin-1").strip().partition(" ")
        cred = cred.strip()
        if scheme.lower() != "bearer" or not cred:
            msg = "malformed Authorization header: expected Bearer <token>"
            return _Err(
                401, "unauthorized", msg, (("WWW-Authenticate", 'Bearer error="invalid_request"'),)
            )
        try:
            req.identity = self._ctx.auth.authenticate(cred)
        except ForbiddenError as exc:
            return _Err(403, "forbidden", str(exc) or "forbidden")
        except AuthError:
            invalid = (("WWW-Authenticate", 'Bearer error="invalid_token"'),)
            return _Err(401, "unauthorized", "invalid credentials", invalid)
        except Exception:
            log.exception("http: authenticator failed")
            return _Err(500, "internal", "authentication failed internally")
        return None

    # -- request lifecycle ----------------------------------------------------------------

    def _complete(self, req: _Request) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._cur = None
        self._head_used = 0
        if req.direct:
            self._parser = None
        self._queue.append(req)

    def _release(self, req: _Request) -> None:
        """Give back the request's share of the in-flight body budget (idempotent)."""
        if req.reserved:
            self._ctx.release_body(req.reserved)
            req.reserved = 0

    def _fail(self, err: _Err, req: _Request | None = None) -> None:
        """Queue a final error answer and stop reading requests on this connection."""
        if req is None:
            req = self._cur or _Request(self._loop.time())
        req.error = err
        req.keep_alive = False
        req.body = None
        self._release(req)
        self._cur = None
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._stopped = True
        self._queue.append(req)

    def _on_deadline(self) -> None:
        self._deadline = None
        if self._cur is None or self._stopped or self._closed:
            return
        if self._task is not None:
            # We paused reading to answer earlier requests: not the client's fault.
            timeout = self._limits.request_timeout_s
            self._deadline = self._loop.call_later(timeout, self._on_deadline)
            return
        msg = f"request not received within {self._limits.request_timeout_s:g}s"
        self._fail(_Err(408, "request_timeout", msg))
        self._after_input()

    async def _serve_queue(self) -> None:
        closing = True
        try:
            closing = await self._serve_all()
        except Exception:
            log.exception("http: internal error while answering")
            self._abort()
        finally:
            self._task = None
        if not closing:
            self._queue_drained()

    async def _serve_all(self) -> bool:
        """Answer queued requests in order. True when the connection is being closed."""
        while self._queue and not self._closed:
            req = self._queue.popleft()
            close = await self._answer(req)
            await self._drain()
            if close:
                self._close_gracefully()
                return True
        return self._closed

    def _queue_drained(self) -> None:
        transport = self._transport
        if self._closed or transport is None:
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

    async def _answer(self, req: _Request) -> bool:
        try:
            resp = await self._dispatch(req)
        except StoreError as exc:
            resp = _error(_store_error(exc))
        except RemoteProtocolError as exc:
            code = _STATUS_CODES.get(exc.status_hint, "bad_request")
            resp = _error(_Err(exc.status_hint, code, str(exc)))
        except Exception:
            log.exception("http: %s %s failed", req.method, req.route)
            resp = _error(_Err(500, "internal", "internal server error"))
        finally:
            req.body = None
            self._release(req)
        close = not req.keep_alive
        self._send(resp, head_only=req.method == "HEAD", close=close, http10=req.http10)
        elapsed = self._loop.time() - req.t_start
        route = req.route or ROUTE_OTHER
        self._ctx.metrics.observe_request(WIRE, route, str(resp.status), elapsed)
        return close

    def _send(self, resp: _Response, *, head_only: bool, close: bool, http10: bool) -> None:
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
            transport.writelines([head, *resp.parts])

    # -- routes ---------------------------------------------------------------------------

    async def _dispatch(self, req: _Request) -> _Response:
        if req.error is not None:
            return _error(req.error)
        ctx, store, route, method = self._ctx, self._ctx.store, req.route, req.method
        if route == ROUTE_HEALTHZ:
            return _json(200, {"status": "ok"})
        assert req.identity is not None
        ns = req.identity.tenant
        if route is not None and routes_engine.wants_engine(route, method, req.headers):
            er = routes_engine.EngineRequest(
                method, route, bytes(req.url), ns, req.key, req.headers, req.body
            )
            r = await routes_engine.handle(ctx, er)
            return _Response(r.status, r.headers, r.parts, r.length)
        if route == ROUTE_METRICS:
            body, ctype = await ctx.run(ctx.metrics.render)
            return _Response(200, [("Content-Type", ctype)], [body], len(body))
        if route == ROUTE_STATS:
            stats = await ctx.run(store.stats, ns)
            return _json(200, {"namespace": ns, **stats.to_dict()})
        if route == ROUTE_BATCH_EXISTS:
            keys = self._batch_keys(req)
            return _json(200, {"exists": await ctx.run(store.exists_many, ns, keys)})
        if route == ROUTE_BATCH_GET:
            keys = self._batch_keys(req)
            blocks = await ctx.run(self._batch_get, ns, keys)
            parts = encode_batch_get_response(blocks)
            framed = [("Content-Type", BATCH_CONTENT_TYPE)]
            return _Response(200, framed, parts, sum(len(p) for p in parts))
        if route == ROUTE_BATCH_PUT:
            assert req.body is not None
            items = decode_batch_put_request(
                req.body,
                max_keys=self._limits.max_batch_keys,
                max_header_bytes=batch_header_limit(self._limits.max_batch_keys),
            )
            return _json(200, {"results": await ctx.run(self._batch_put, ns, items)})
        key = req.key
        assert key is not None
        if route == ROUTE_KEY_EXISTS:
            return _json(200, {"hash": key, "exists": await ctx.run(store.exists, ns, key)})
        not_found = _Err(404, "not_found", "no such key")
        if method == "GET":
            data = await ctx.get(ns, key)
            if data is None:
                return _error(not_found)
            return _Response(200, [("Content-Type", OCTET_CONTENT_TYPE)], [data], len(data))
        if method == "HEAD":
            size = await ctx.run(store.size, ns, key)
            if size is None:
                return _error(not_found)
            return _Response(200, [("Content-Type", OCTET_CONTENT_TYPE)], [], size)
        if method == "DELETE":
            if await ctx.run(store.delete, ns, key):
                return _Response(204, [], [], None)
            return _error(not_found)
        assert method == "PUT"
        assert req.body is not None
        result = await ctx.put(ns, key, req.body)
        word = _OUTCOME_WORD[result.outcome]
        doc = {"outcome": word, "digest": result.digest.hex(), "size": result.size}
        headers = [("X-Kv-Digest", result.digest.hex()), ("X-Kv-Outcome", word)]
        return _json(201 if result.created else 200, doc, headers)

    def _batch_keys(self, req: _Request) -> list[str]:
        assert req.body is not None
        keys = decode_key_list(req.body, max_keys=self._limits.max_batch_keys)
        for i, key in enumerate(keys):
            try:
                validate_key(key)
            except InvalidKeyError as exc:
                raise InvalidKeyError(f"keys[{i}]: {exc}") from exc
        return keys

    def _batch_get(self, ns: str, keys: list[str]) -> list[Buffer | None]:
        """Runs on the store pool: refuse batches over `max_batch_bytes` before reading."""
        store, limit = self._ctx.store, self._limits.max_batch_bytes
        total = sum(s for s in (store.size(ns, k) for k in keys) if s is not None)
        if total > limit:
            raise RemoteProtocolError(
                f"batch answer of {total} bytes exceeds max_batch_bytes={limit}; split it",
                status_hint=413,
            )
        blocks = store.get_many(ns, keys)
        total = sum(len(b) for b in blocks if b is not None)
        if total > limit:  # keys were replaced between the two looks
            raise RemoteProtocolError(
                f"batch answer of {total} bytes exceeds max_batch_bytes={limit}; split it",
                status_hint=413,
            )
        return blocks

    def _batch_put(self, ns: str, items: list[tuple[str, memoryview]]) -> list[str]:
        """Runs on the store pool: one `put_many` for the valid items, per-key errors."""
        store = self._ctx.store
        max_block = min(self._limits.max_block_bytes, store.max_block_bytes)
        results: list[str] = [""] * len(items)
        valid: list[int] = []
        for i, (key, view) in enumerate(items):
            try:
                validate_key(key)
            except InvalidKeyError:
                results[i] = "error:bad_key"
                continue
            if len(view) > max_block:
                results[i] = "error:block_too_large"
                continue
            valid.append(i)
        existed = store.exists_many(ns, [items[i][0] for i in valid])
        try:
            done = store.put_many(ns, [items[i] for i in valid])
        except StoreError:
            # put_many stops at its first failure: redo one by one for per-key answers.
            # Items it stored already read as duplicates now; `existed` tells them apart.
            for i, was in zip(valid, existed, strict=True):
                try:
                    outcome = store.put(ns, *items[i]).outcome
                except StoreError as exc:
                    results[i] = "error:" + _store_error(exc).code
                    continue
                if outcome is PutOutcome.DUPLICATE and not was:
                    outcome = PutOutcome.NEW
                results[i] = _OUTCOME_WORD[outcome]
        else:
            for i, res in zip(valid, done, strict=True):
                results[i] = _OUTCOME_WORD[res.outcome]
        return results

    # -- flow control, timers, closing ----------------------------------------------------

    def _write_continue(self, req: _Request) -> None:
        req.continue_sent = True
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(_CONTINUE)

    async def _drain(self) -> None:
        while self._write_paused and not self._closed:
            fut = self._loop.create_future()
            self._drain_waiter = fut
            await fut

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
        self._idle = self._loop.call_later(self._limits.idle_timeout_s, self._on_idle)

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
        log.info("http: no authenticated request within %ss, closing", self._limits.auth_timeout_s)
        self._stopped = True
        self._transport.close()

    def _on_stall(self) -> None:
        self._stall = None
        if self._write_paused:
            log.info("http: peer stopped reading for %ss, aborting", self._limits.request_timeout_s)
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
        if not transport.can_write_eof():
            transport.close()
            return
        try:
            transport.write_eof()
        except (OSError, RuntimeError):
            transport.close()
            return
        self._lingering = True
        self._linger = self._loop.call_later(LINGER_S, transport.close)
        if self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
