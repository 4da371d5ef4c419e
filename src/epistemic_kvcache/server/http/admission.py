"""What an HTTP connection decides about a request, from its head to its answer.

How it works: the connection (server/http/connection.py) does the I/O and calls these
at fixed points of a request's life. `PendingRequest` is one request while it is read
(head, body buffer, flags). While the head arrives, `head_error` counts its headers and
bytes (431). Once it is complete, `admit` checks it against the route table (server/
http/routes.py) before one body byte is read: `check_credentials` turns an
`Authorization` header into an identity or the 401/403 answer (counting the failure for
the peer), then route, method, key, Content-Length and the body's limit; the body's
size is taken from the connection's memory account and `body_buffer` gives it the
buffer it is read into (a receive buffer the store keeps, a batch receiver, or plain
bytes). A complete request is answered by `respond`: its handler's answer, or the error
answer for what the handler raised (`busy_error` and `store_error_response`: the
refusals of the budget and of the store).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from epistemic_kvcache.buffers import alloc_block
from epistemic_kvcache.errors import AuthError, ForbiddenError, RemoteProtocolError, StoreError
from epistemic_kvcache.proto.errors import http_message, row_for
from epistemic_kvcache.proto.http import (
    BatchPutReceiver,
    Buffer,
    decode_key_segment,
    match_route,
    request_path,
)
from epistemic_kvcache.server.budget import Account, BatchTooLarge, Busy, Limit
from epistemic_kvcache.server.context import Identity, ServerContext
from epistemic_kvcache.server.http.api import BufferKind, HttpError, Request, Response
from epistemic_kvcache.server.http.core import batch_header_limit
from epistemic_kvcache.server.http.routes import ROUTES
from epistemic_kvcache.shared import ServerLimits

log = logging.getLogger("epistemic_kvcache.server.http")

WIRE: Final = "http"
_STATUS_CODES: Final = {400: "bad_request", 413: "batch_too_large", 411: "length_required"}
"""The error code of a protocol error the HTTP parsing layer raised, by its status."""


@dataclass(slots=True)
class PendingRequest:
    """A request being read: its head as parsed so far, its body buffer, its state."""

    t_start: float
    """`time.perf_counter()` at the request's first byte (not `loop.time()`: 1 ms steps
    under uvloop, too coarse for the latency histogram's sub-millisecond buckets)."""
    url: bytearray = field(default_factory=bytearray)
    headers: dict[bytes, bytes] = field(default_factory=dict)
    n_headers: int = 0
    head_bytes: int = 0
    method: str = ""
    route: str | None = None
    key: str | None = None
    identity: Identity | None = None
    content_length: int = 0
    body: bytearray | memoryview | BatchPutReceiver | None = None
    reserved: int = 0
    """Bytes of the connection's account this request's body holds (see `_release`)."""
    received: int = 0
    headers_done: bool = False
    direct: bool = False
    """The rest of the body is read by the transport straight into `body`."""
    keep_alive: bool = True
    http10: bool = False
    expect_continue: bool = False
    continue_sent: bool = False
    error: HttpError | None = None
    """Set when the request was refused while parsing; answered in its turn."""


def write_body(req: PendingRequest, data: Buffer) -> None:
    """Copy body bytes the connection already read into the request's body."""
    body = req.body
    if isinstance(body, BatchPutReceiver):
        body.feed(data)
    elif body is not None:
        body[req.received : req.received + len(data)] = data


def busy_error(limit: Limit) -> HttpError:
    retry = (("Retry-After", "1"),)
    if limit == "tenant":
        msg = "this tenant holds its whole share of in-flight memory, retry later"
        return HttpError(429, "tenant_busy", msg, retry)
    msg = "server busy: too many bytes in flight, retry later"
    return HttpError(503, "overloaded", msg, retry)


def store_error_response(exc: StoreError) -> Response:
    """The answer to a store failure (proto/errors.py's table); private details logged."""
    row = row_for(exc)
    if row.private:
        log.error("http: store failure: %s", exc)
    headers = (("Retry-After", "1"),) if row.retry else ()
    return Response.error(row.status, row.code, http_message(row, exc), headers)


def check_credentials(ctx: ServerContext, peer: str, raw: bytes | None) -> Identity | HttpError:
    """The identity an `Authorization: Bearer <credential>` header proves, or the answer
    refusing it (401 without or with bad credentials, 403 forbidden); failures are
    counted for `peer`."""
    if raw is None:
        ctx.auth_failures.failed(WIRE, peer, "no credentials")
        challenge = (("WWW-Authenticate", "Bearer"),)
        return HttpError(401, "unauthorized", "missing credentials: send Bearer <token>", challenge)
    scheme, _, cred = raw.decode("latin-1").strip().partition(" ")
    cred = cred.strip()
    if scheme.lower() != "bearer" or not cred:
        ctx.auth_failures.failed(WIRE, peer, "malformed Authorization header")
        msg = "malformed Authorization header: expected Bearer <token>"
        return HttpError(
            401, "unauthorized", msg, (("WWW-Authenticate", 'Bearer error="invalid_request"'),)
        )
    try:
        return ctx.auth.authenticate(cred)
    except ForbiddenError as exc:
        ctx.auth_failures.failed(WIRE, peer, str(exc) or "forbidden")
        return HttpError(403, "forbidden", str(exc) or "forbidden")
    except AuthError as exc:
        ctx.auth_failures.failed(WIRE, peer, str(exc) or "invalid credentials")
        invalid = (("WWW-Authenticate", 'Bearer error="invalid_token"'),)
        return HttpError(401, "unauthorized", "invalid credentials", invalid)
    except Exception:
        log.exception("http: authenticator failed")
        return HttpError(500, "internal", "authentication failed internally")


def body_buffer(
    kind: BufferKind, content_length: int, limits: ServerLimits
) -> bytearray | memoryview | BatchPutReceiver:
    """The buffer an accepted body is read into. A body the store takes whole is a
    receive buffer it keeps as it is; a batch PUT's blocks each go into one; parsed
    bodies are plain bytearrays."""
    if kind == "block":
        return alloc_block(content_length)
    if kind == "batch":
        max_keys = limits.max_batch_keys
        return BatchPutReceiver(
            content_length,
            max_keys=max_keys,
            alloc=alloc_block,
            max_header_bytes=batch_header_limit(max_keys),
        )
    return bytearray(content_length)


def head_error(req: PendingRequest, limits: ServerLimits) -> HttpError | None:
    """The 431 a head being read has earned (too many headers, too many bytes), or None."""
    if req.n_headers > limits.max_headers:
        return HttpError(431, "headers_too_large", f"more than {limits.max_headers} headers")
    if req.head_bytes > limits.max_header_bytes:
        msg = f"request head exceeds {limits.max_header_bytes} bytes"
        return HttpError(431, "headers_too_large", msg)
    return None


def admit(
    req: PendingRequest,
    p: Any,
    ctx: ServerContext,
    account: Account,
    authenticate: Callable[[PendingRequest], HttpError | None],
) -> tuple[HttpError | None, bool]:
    """Check a complete head (`p`, the httptools parser that read it) against the route
    table: credentials (`authenticate`, which also moves the connection to the caller's
    tenant), route, method, key, Content-Length and the body's limit; then take the
    body's size from `account` and give the request its body buffer. Returns (the
    refusal or None, whether a body follows the head)."""
    limits = ctx.limits
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
        return HttpError(400, "bad_request", "invalid Content-Length"), True
    has_body = chunked or bool(cl)
    req.content_length = cl or 0
    req.expect_continue = has_body and b"100-continue" in h.get(b"expect", b"").lower()

    template, segment = match_route(request_path(bytes(req.url)))
    route = ROUTES.get(template) if template is not None else None
    req.route = template
    if route is None or route.auth:
        err = authenticate(req)
        if err is not None:
            return err, has_body
    if route is None:
        return HttpError(404, "not_found", "no such route"), has_body
    if route.operators_only and (
        req.identity is None or req.identity.tenant not in ctx.metrics_tenants
    ):
        msg = "/metrics shows server-wide totals: only operator tenants may read it"
        return HttpError(403, "forbidden", msg), has_body
    endpoint = route.endpoint(req.method)
    if endpoint is None:
        msg = f"{req.method} is not allowed on {route.template}"
        return HttpError(405, "method_not_allowed", msg, (("Allow", route.allow),)), has_body
    if segment is not None:
        try:
            req.key = decode_key_segment(segment)
        except RemoteProtocolError as exc:
            return HttpError(400, "bad_key", str(exc)), has_body
    if chunked:
        msg = "chunked request bodies are not accepted: send Content-Length"
        return HttpError(411, "length_required", msg), has_body
    rule = endpoint.body
    if rule is None:
        limit, code = limits.max_block_bytes, "block_too_large"
    else:
        limit = rule.limit(limits, ctx.store.max_block_bytes)
        code = rule.code
        if cl is None:
            return HttpError(411, "length_required", "this route needs Content-Length"), has_body
    if req.content_length > limit:
        msg = f"body of {req.content_length} bytes exceeds the limit of {limit} bytes"
        return HttpError(413, code, msg), has_body
    if rule is not None:
        refused = account.take("body", req.content_length)
        if refused is not None:
            return busy_error(refused), has_body
        req.reserved = req.content_length
        req.body = body_buffer(rule.buffer, req.content_length, limits)
    return None, has_body


async def respond(ctx: ServerContext, account: Account, req: PendingRequest) -> Response:
    """The answer to a complete request: its handler's, or the error answer for what the
    handler raised (or for the refusal admission already queued in `req.error`)."""
    if req.error is not None:
        return req.error.response()
    route = ROUTES.get(req.route or "")
    endpoint = route.endpoint(req.method) if route is not None else None
    if endpoint is None:  # admission let only routed requests through
        return Response.error(500, "internal", "unrouted request")
    request = Request(
        ctx=ctx,
        account=account,
        method=req.method,
        route=req.route or "",
        target=bytes(req.url),
        tenant=req.identity.tenant if req.identity is not None else None,
        key=req.key,
        headers=req.headers,
        body=req.body,
    )
    try:
        return await endpoint.handler(request)
    except HttpError as exc:
        return exc.response()
    except StoreError as exc:
        return store_error_response(exc)
    except Busy as exc:
        return busy_error(exc.limit).response()
    except BatchTooLarge as exc:
        return Response.error(413, "batch_too_large", str(exc))
    except RemoteProtocolError as exc:
        code = _STATUS_CODES.get(exc.status_hint, "bad_request")
        return Response.error(exc.status_hint, code, str(exc))
    except Exception:
        log.exception("http: %s %s failed", req.method, req.route)
        return Response.error(500, "internal", "internal server error")
