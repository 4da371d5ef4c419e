"""What an HTTP connection decides from a request's head alone, and the request's state.

`PendingRequest` is one request while it is read (head, body buffer, flags);
`check_credentials` turns an `Authorization` header into an identity or the 401/403
answer (counting the failure for the peer); `body_buffer` gives an accepted body the
buffer it is read into (a receive buffer the store keeps, a batch receiver, or plain
bytes); `busy_error` and `store_error_response` are the refusals of the budget and of
the store. The connection (server/http/connection.py) drives the I/O around them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Final

from epistemic_kvcache.buffers import alloc_block
from epistemic_kvcache.errors import AuthError, ForbiddenError, StoreError
from epistemic_kvcache.proto.errors import http_message, row_for
from epistemic_kvcache.proto.http import BatchPutReceiver, Buffer
from epistemic_kvcache.server.budget import Limit
from epistemic_kvcache.server.context import Identity, ServerContext
from epistemic_kvcache.server.http.api import BufferKind, HttpError, Response
from epistemic_kvcache.server.http.core import batch_header_limit
from epistemic_kvcache.shared import ServerLimits

log = logging.getLogger("epistemic_kvcache.server.http")

WIRE: Final = "http"


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
