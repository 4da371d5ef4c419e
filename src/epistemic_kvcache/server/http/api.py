"""The shapes every HTTP route shares: `Request`, `Response`, `HttpError`, the route table's rows.

A route (`Route`) names, per method, the handler and the body it accepts (`BodyRule`:
the largest body, the 413 code, whether the buffer goes to the store whole); the
connection (server/http/connection.py) decides everything from the head alone with
this table — authentication, method, body length — before one body byte is read.
Handlers receive a complete `Request` and return a `Response` or raise `HttpError`
(or a store error, mapped by proto/errors.py's table).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from epistemic_kvcache.buffers import Handover, received_block
from epistemic_kvcache.errors import RemoteProtocolError
from epistemic_kvcache.proto.http import (
    JSON_CONTENT_TYPE,
    OCTET_CONTENT_TYPE,
    OUTCOME_CONFLICT,
    OUTCOME_CREATED,
    OUTCOME_DUPLICATE,
    OUTCOME_HEADER,
    OUTCOME_MISSING,
    OUTCOME_REPLACED,
    BatchPutReceiver,
    error_body,
    parse_json,
)
from epistemic_kvcache.server.budget import Account
from epistemic_kvcache.server.context import ServerContext
from epistemic_kvcache.shared import ServerLimits
from epistemic_kvcache.store.api import BlockData, Buffer, PutCond, PutOutcome, PutResult

LARGE_JSON: Final = 64 * 1024
"""JSON answers that may be larger than this are encoded on the thread pool."""


class HttpError(Exception):
    """Raised by a handler (or the admission checks) to answer with a JSON error."""

    def __init__(
        self, status: int, code: str, message: str, headers: Sequence[tuple[str, str]] = ()
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = tuple(headers)

    def response(self) -> Response:
        return Response.error(self.status, self.code, self.message, self.headers)


def bad_request(message: str) -> HttpError:
    return HttpError(400, "bad_request", message)


@dataclass(slots=True)
class Response:
    """Status, headers, body buffers (sent as they are) and Content-Length (None: none)."""

    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)
    parts: Sequence[Buffer] = ()
    length: int | None = 0

    @classmethod
    def json(cls, status: int, doc: object, headers: Sequence[tuple[str, str]] = ()) -> Response:
        """A JSON answer encoded here (small documents only: this runs on the loop)."""
        return cls.encoded_json(status, encode_json(doc), headers)

    @classmethod
    def encoded_json(
        cls, status: int, body: bytes, headers: Sequence[tuple[str, str]] = ()
    ) -> Response:
        return cls(status, [("Content-Type", JSON_CONTENT_TYPE), *headers], [body], len(body))

    @classmethod
    def error(
        cls, status: int, code: str, message: str, headers: Sequence[tuple[str, str]] = ()
    ) -> Response:
        body = error_body(code, message)
        return cls(status, [("Content-Type", JSON_CONTENT_TYPE), *headers], [body], len(body))

    @classmethod
    def octets(cls, data: Buffer) -> Response:
        return cls(200, [("Content-Type", OCTET_CONTENT_TYPE)], [data], len(data))

    @classmethod
    def empty(cls, status: int = 204) -> Response:
        return cls(status, [], [], None)


OUTCOME_WORD: Final = {
    PutOutcome.NEW: OUTCOME_CREATED,
    PutOutcome.DUPLICATE: OUTCOME_DUPLICATE,
    PutOutcome.REPLACED: OUTCOME_REPLACED,
    PutOutcome.CONFLICT: OUTCOME_CONFLICT,
    PutOutcome.MISSING: OUTCOME_MISSING,
}
"""A PUT's outcome as the API names it (`outcome` field, `X-Kv-Outcome` header)."""


def put_status(result: PutResult, *, conditional: bool) -> int:
    """201 created; 200 replaced or duplicate; refused: 412 when the request carried a
    precondition (`If-None-Match: *` / `If-Match: *`), else 409 (a first-write-wins
    tenant's key holding other bytes)."""
    if result.created:
        return 201
    if result.applied:
        return 200
    return 412 if conditional else 409


def put_answer(
    result: PutResult,
    extra: Mapping[str, object] | None = None,
    *,
    conditional: bool = False,
) -> Response:
    """The answer to a PUT (`put_status`), with its outcome and the key's digest."""
    word = OUTCOME_WORD[result.outcome]
    doc: dict[str, object] = {
        "outcome": word,
        "digest": result.digest.hex(),
        "size": result.size,
        **(extra or {}),
    }
    status = put_status(result, conditional=conditional)
    if status >= 400:
        doc = {
            "error": "precondition_failed" if status == 412 else "conflict",
            "message": _REFUSED[result.outcome],
            **doc,
        }
    headers = [("X-Kv-Digest", result.digest.hex()), (OUTCOME_HEADER, word)]
    return Response.json(status, doc, headers)


_REFUSED: Final = {
    PutOutcome.CONFLICT: "the key exists (create-only PUT, or a first-write-wins tenant's key "
    "holding other bytes): nothing was written",
    PutOutcome.MISSING: "the key does not exist (replace-only PUT): nothing was written",
}


def put_condition(req: Request) -> PutCond:
    """`If-None-Match: *` -> create only ("nx"); `If-Match: *` -> replace only ("xx").
    Other values are refused (keys have no entity tags to compare)."""
    none_match = req.headers.get(b"if-none-match")
    match = req.headers.get(b"if-match")
    if none_match is not None and match is not None:
        raise HttpError(400, "bad_request", "give If-None-Match or If-Match, not both")
    if none_match is not None:
        if none_match.strip() != b"*":
            raise HttpError(400, "bad_request", "If-None-Match supports only '*' (create only)")
        return "nx"
    if match is not None:
        if match.strip() != b"*":
            raise HttpError(400, "bad_request", "If-Match supports only '*' (replace only)")
        return "xx"
    return None


def encode_json(doc: object) -> bytes:
    """Every JSON body in one style: compact, ending with a newline (`curl` output ends
    its line; `jq` and `json.loads` do not mind)."""
    return json.dumps(doc, separators=(",", ":")).encode("utf-8") + b"\n"


CHUNK_ITEMS: Final = 64
"""Lists longer than this are encoded this many items at a time (`encode_json_chunked`)."""


def encode_json_chunked(doc: object) -> list[Buffer]:
    """`encode_json` as a list of buffers, long lists encoded `CHUNK_ITEMS` at a time.

    One `json.dumps` of a 10 MB document is a single C call that holds the GIL for tens
    of milliseconds, so running it on a pool thread would still stall the event loop.
    Slice by slice, the GIL can pass to the loop between slices (every switch
    interval); the pieces are sent as they are (no joined copy of the whole document),
    and they are of similar sizes, which the allocator reuses well.

    Plain functions, not a recursive closure: a closure that calls itself is a
    reference cycle, and one holding the answer kept every piece of it alive until the
    cyclic garbage collector happened to run (~10 MB per answer)."""
    out: list[Buffer] = []
    _walk_json(doc, out)
    out.append(b"\n")  # as `encode_json`
    return out


def _dumps(o: object) -> bytes:
    return json.dumps(o, separators=(",", ":")).encode("utf-8")


def _walk_json(o: object, out: list[Buffer]) -> None:
    if isinstance(o, list | tuple) and len(o) > CHUNK_ITEMS:
        out.append(b"[")
        for start in range(0, len(o), CHUNK_ITEMS):
            if start:
                out.append(b",")
            piece = _dumps(list(o[start : start + CHUNK_ITEMS]))
            out.append(memoryview(piece)[1:-1])  # without its brackets, no copy
        out.append(b"]")
    elif isinstance(o, dict) and any(isinstance(v, list | tuple | dict) for v in o.values()):
        out.append(b"{")
        for i, (k, v) in enumerate(o.items()):
            out.append((b"," if i else b"") + _dumps(str(k)) + b":")
            _walk_json(v, out)
        out.append(b"}")
    else:
        out.append(_dumps(o))


async def large_json(
    ctx: ServerContext, status: int, doc: object, headers: Sequence[tuple[str, str]] = ()
) -> Response:
    """A JSON answer that may be large, encoded on the thread pool and item by item (the
    loop never waits for one long `json.dumps`)."""
    chunks = await ctx.run(encode_json_chunked, doc)
    return Response(
        status,
        [("Content-Type", JSON_CONTENT_TYPE), *headers],
        chunks,
        sum(len(c) for c in chunks),
    )


def load_json(body: Buffer | None, *, empty_ok: bool) -> dict[str, Any]:
    """Parse a JSON object body; `HttpError` 400 for anything else (including documents
    nested too deeply to parse, which would otherwise surface as RecursionError)."""
    if not body:
        if empty_ok:
            return {}
        raise bad_request("this route needs a JSON object body")
    try:
        doc = parse_json(body)
    except RemoteProtocolError as exc:
        raise bad_request(str(exc)) from exc
    if not isinstance(doc, dict):
        raise bad_request("the body must be a JSON object")
    return doc


@dataclass(slots=True)
class Request:
    """A complete, authenticated (unless the route needs none), admitted request."""

    ctx: ServerContext
    account: Account
    """The connection's memory account (reserve read buffers under "reply")."""
    method: str
    route: str
    target: bytes
    """The raw request target (path and query, still percent-encoded)."""
    tenant: str | None
    key: str | None
    """The decoded `{key}` segment, for routes that have one."""
    headers: Mapping[bytes, bytes]
    body: bytearray | memoryview | BatchPutReceiver | None
    """None for a route without a body; a `BatchPutReceiver` for batch PUTs."""

    @property
    def data(self) -> bytearray | memoryview:
        """The body's bytes (the routes that take a plain body)."""
        body = self.plain
        if body is None:
            raise TypeError(f"route {self.route} has no plain body")
        return body

    @property
    def block(self) -> BlockData:
        """The body as the store takes it, handed over: the connection never touches a
        body again once its request is dispatched (a `block` route's receive buffer, or a
        plain body's own bytearray), so the store keeps it without a copy."""
        body = self.data
        if isinstance(body, bytearray):
            return Handover(body)
        return received_block(body)

    @property
    def batch(self) -> BatchPutReceiver:
        """The batch PUT body, its blocks received into buffers of their own."""
        body = self.body
        if not isinstance(body, BatchPutReceiver):
            raise TypeError(f"route {self.route} has no batch body")
        return body

    @property
    def plain(self) -> bytearray | memoryview | None:
        """The body's bytes, None when the request has none."""
        body = self.body
        if isinstance(body, BatchPutReceiver):
            raise TypeError(f"route {self.route} has a batch body")
        return body

    @property
    def ns(self) -> str:
        """The caller's namespace (routes needing authentication only)."""
        if self.tenant is None:
            raise RemoteProtocolError("this route needs credentials", status_hint=401)
        return self.tenant


Handler = Callable[[Request], Awaitable[Response]]
BufferKind = Literal["block", "batch", "bytes"]


@dataclass(frozen=True, slots=True)
class BodyRule:
    """The body a method of a route accepts."""

    limit: Callable[[ServerLimits, int], int]
    """(limits, the store's max block bytes) -> the largest body."""
    code: str
    """The 413 error code above the limit."""
    buffer: BufferKind = "bytes"
    """`block`: a receive buffer handed to the store whole; `batch`: a batch PUT, each of
    its blocks received into a buffer of its own (`proto.http.BatchPutReceiver`);
    `bytes`: a plain buffer, parsed."""


def block_body(limits: ServerLimits, store_max: int) -> int:
    return min(limits.max_block_bytes, store_max)


BLOCK: Final = BodyRule(block_body, "block_too_large", "block")


@dataclass(frozen=True, slots=True)
class Endpoint:
    handler: Handler
    body: BodyRule | None = None
    """None: the method takes no body (one that arrives anyway is read and dropped,
    up to `max_block_bytes`)."""


@dataclass(frozen=True, slots=True)
class Route:
    """One route template and what each method does there."""

    template: str
    methods: Mapping[str, Endpoint]
    auth: bool = True
    """False: answered without credentials (`/healthz`, `/readyz`)."""
    operators_only: bool = False
    """Only tenants in `metrics_tenants` may call it (`/metrics`)."""

    @property
    def allow(self) -> str:
        """The `Allow` header: the methods, HEAD wherever GET is."""
        methods = list(self.methods)
        if "GET" in methods and "HEAD" not in methods:
            methods.insert(methods.index("GET") + 1, "HEAD")
        return ", ".join(methods)

    def endpoint(self, method: str) -> Endpoint | None:
        """The endpoint answering `method` (HEAD is answered by GET, without the body)."""
        found = self.methods.get(method)
        if found is None and method == "HEAD":
            found = self.methods.get("GET")
        return found
