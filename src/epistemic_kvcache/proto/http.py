"""Sans-IO pieces of the `/kv` HTTP API: routes, keys, batch framing, response heads.

HTTP/1.1 itself is parsed by httptools (llhttp); this module holds what is specific to
this API, shared by the server (`server/http.py`) and the client:

- `quote_key` / `decode_key_segment`: a key is ONE percent-encoded path segment.
- `match_route`: request path -> route template (`"/kv/{key}"`, ...) and raw key segment.
- Batch framing (`application/x-kvcache-batch`): ``u32 BE header_len``, a JSON header,
  then the blocks back to back. Encoders return a list of buffers (header first, blocks
  as they are) for `transport.writelines` / vectored sends; decoders return memoryviews
  into the body, never copies.

No sockets, no asyncio, no store: bytes in, values out; violations raise
`RemoteProtocolError` with an HTTP `status_hint`.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from email.utils import formatdate
from http import HTTPStatus
from types import MappingProxyType
from typing import Any, Final
from urllib.parse import quote, unquote_to_bytes

from epistemic_kvcache.errors import RemoteProtocolError
from epistemic_kvcache.shared import MAX_KEY_BYTES, RESERVED_SEGMENTS

Buffer = bytes | bytearray | memoryview


BATCH_CONTENT_TYPE = "application/x-kvcache-batch"
JSON_CONTENT_TYPE = "application/json"
OCTET_CONTENT_TYPE = "application/octet-stream"

# A PUT's outcome as the API names it: the `outcome` field and `X-Kv-Outcome` header of a
# PUT's answer, and each entry of a batch PUT's `results` (the client's `PutOutcome`
# values are these words; the server maps the store's `PutOutcome` onto them).
OUTCOME_CREATED: Final = "created"
OUTCOME_DUPLICATE: Final = "duplicate"
OUTCOME_REPLACED: Final = "replaced"
OUTCOME_CONFLICT: Final = "conflict"
OUTCOME_MISSING: Final = "missing"
OUTCOME_ERROR_PREFIX: Final = "error:"
"""A batch PUT result for a key the server refused: `error:<code>` (the error table's
code, e.g. `error:block_too_large`)."""
OUTCOME_HEADER: Final = "X-Kv-Outcome"
EPOCH_SCOPE_HEADER: Final = "X-Kv-Epoch-Scope"
"""A PUT tagged with an epoch scope names it in this header (docs/engine-features.md)."""

DEFAULT_MAX_BATCH_HEADER_BYTES = 8 * 1024 * 1024
"""A batch JSON header for 1024 keys of 1024 bytes, each JSON-escaped up to 6x, fits."""

_U32 = struct.Struct(">I")
BATCH_LENGTH_BYTES: Final = _U32.size
"""A framed batch body starts with its JSON header's length, big-endian u32."""

# -- routes -------------------------------------------------------------------------------

ROUTE_HEALTHZ = "/healthz"
ROUTE_READYZ = "/readyz"
ROUTE_METRICS = "/metrics"
ROUTE_STATS = "/kv/stats"
ROUTE_BATCH_EXISTS = "/kv/batch/exists"
ROUTE_BATCH_GET = "/kv/batch/get"
ROUTE_BATCH_PUT = "/kv/batch/put"
ROUTE_KEY = "/kv/{key}"
ROUTE_KEY_EXISTS = "/kv/{key}/exists"
# Engine routes (snapshots, branches, epochs, paging, listing; `server/http/engine.py`).
ROUTE_SNAPSHOTS = "/kv/snapshot"
ROUTE_SNAPSHOT = "/kv/snapshot/{id}"
ROUTE_SNAPSHOT_KEY = "/kv/snapshot/{id}/{key}"
ROUTE_SNAPSHOT_FORK = "/kv/snapshot/{id}/fork"
ROUTE_BRANCHES = "/kv/branch"
ROUTE_BRANCH = "/kv/branch/{id}"
ROUTE_BRANCH_KEY = "/kv/branch/{id}/{key}"
ROUTE_EPOCH = "/kv/epoch/{scope}"
ROUTE_EPOCH_BUMP = "/kv/epoch/{scope}/bump"
ROUTE_PAGE_IN = "/kv/page-in"
ROUTE_KEYS = "/kv/keys"
ROUTE_OTHER = "other"
"""Metrics label for unknown paths and requests too malformed to route."""

_FIXED_ROUTES = {
    b"/healthz": ROUTE_HEALTHZ,
    b"/readyz": ROUTE_READYZ,
    b"/metrics": ROUTE_METRICS,
    b"/kv/stats": ROUTE_STATS,
    b"/kv/batch/exists": ROUTE_BATCH_EXISTS,
    b"/kv/batch/get": ROUTE_BATCH_GET,
    b"/kv/batch/put": ROUTE_BATCH_PUT,
}
_RESERVED_SEGMENTS = tuple(sorted(s.encode() for s in RESERVED_SEGMENTS))
"""First segments under `/kv/` that name routes, not keys."""
_ESCAPED_KEYS = (*_RESERVED_SEGMENTS, b"fork")
"""Keys `quote_key` sends with a letter encoded (`fork`: `/kv/snapshot/<id>/fork`)."""
_ENGINE_FIXED = {
    b"snapshot": ROUTE_SNAPSHOTS,
    b"branch": ROUTE_BRANCHES,
    b"page-in": ROUTE_PAGE_IN,
    b"keys": ROUTE_KEYS,
}


def request_path(target: bytes) -> bytes:
    """The path of a request target (origin-form or absolute-form), query dropped."""
    if target.startswith(b"/"):
        path = target
    else:
        scheme_end = target.find(b"://")
        if scheme_end < 0:  # "*" (OPTIONS) or authority-form (CONNECT)
            return target
        slash = target.find(b"/", scheme_end + 3)
        path = target[slash:] if slash >= 0 else b"/"
    for sep in (b"?", b"#"):
        cut = path.find(sep)
        if cut >= 0:
            path = path[:cut]
    return path


def match_route(path: bytes) -> tuple[str | None, bytes | None]:
    """Map a raw (still percent-encoded) path to `(route template, raw key segment)`.

    Route names are matched on the raw segment, so `/kv/stats` is the stats route while
    `/kv/%73tats` addresses the key `stats`. Unknown paths give `(None, None)`.
    """
    fixed = _FIXED_ROUTES.get(path)
    if fixed is not None:
        return fixed, None
    if not path.startswith(b"/kv/"):
        return None, None
    parts = path[4:].split(b"/")
    if parts[0] in _RESERVED_SEGMENTS:
        return _match_engine_route(parts)
    if len(parts) == 1:
        return ROUTE_KEY, parts[0]
    if len(parts) == 2 and parts[1] == b"exists" and parts[0] not in _RESERVED_SEGMENTS:
        return ROUTE_KEY_EXISTS, parts[0]
    return None, None


def _match_engine_route(parts: list[bytes]) -> tuple[str | None, bytes | None]:
    """Routes under a reserved first segment; the second value is the raw key segment."""
    head, n = parts[0], len(parts)
    if n == 1:
        return _ENGINE_FIXED.get(head), None
    if not parts[1]:  # an empty id or scope
        return None, None
    if head == b"snapshot":
        if n == 2:
            return ROUTE_SNAPSHOT, None
        if n == 3:
            return (
                (ROUTE_SNAPSHOT_FORK, None)
                if parts[2] == b"fork"
                else (ROUTE_SNAPSHOT_KEY, parts[2])
            )
    elif head == b"branch":
        if n == 2:
            return ROUTE_BRANCH, None
        if n == 3:
            return ROUTE_BRANCH_KEY, parts[2]
    elif head == b"epoch":
        if n == 2:
            return ROUTE_EPOCH, None
        if n == 3 and parts[2] == b"bump":
            return ROUTE_EPOCH_BUMP, None
    return None, None


def route_id_segment(path: bytes) -> bytes:
    """The raw `{id}` / `{scope}` segment of an engine route's path (`/kv/<name>/<id>/...`)."""
    parts = path[4:].split(b"/")
    if len(parts) < 2 or not parts[1]:
        raise RemoteProtocolError("this route needs an id segment", status_hint=400)
    return parts[1]


def decode_key_segment(segment: bytes) -> str:
    """Percent-decode one path segment into a key; `RemoteProtocolError` (400) if invalid."""
    raw = unquote_to_bytes(segment)
    if not raw:
        raise RemoteProtocolError("invalid key: empty", status_hint=400)
    if len(raw) > MAX_KEY_BYTES:
        raise RemoteProtocolError(
            f"invalid key: {len(raw)} bytes, limit is {MAX_KEY_BYTES}", status_hint=400
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RemoteProtocolError(
            f"invalid key: not valid UTF-8 ({exc.reason})", status_hint=400
        ) from exc


def quote_key(key: str) -> str:
    """Percent-encode a key as one path segment (everything outside RFC 3986 unreserved).

    Keys equal to a route name (`stats`, `batch`, `snapshot`, `branch`, `epoch`,
    `page-in`, `keys`, `fork`) are sent with their first letter encoded, so they do not
    collide with the routes and every key is reachable.
    """
    quoted = quote(key, safe="")
    if quoted.encode("ascii") in _ESCAPED_KEYS:
        return f"%{ord(quoted[0]):02X}{quoted[1:]}"
    return quoted


# -- batch framing ------------------------------------------------------------------------


def _frame(header: dict[str, object], blocks: Sequence[Buffer]) -> list[Buffer]:
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return [_U32.pack(len(head)) + head, *blocks]


def parse_json(data: Buffer, what: str = "invalid JSON body") -> Any:
    """`json.loads`, every failure a `RemoteProtocolError` (400) starting with `what`:
    bad UTF-8, bad JSON, and documents nested too deeply to parse (RecursionError)."""
    try:
        return json.loads(bytes(data))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RemoteProtocolError(f"{what} ({exc})") from exc
    except RecursionError:
        raise RemoteProtocolError(f"{what} (nested too deeply)") from None


def _split_frame(body: Buffer, max_header_bytes: int) -> tuple[dict[str, object], memoryview]:
    view = memoryview(body).cast("B")
    if len(view) < _U32.size:
        raise RemoteProtocolError("batch body: shorter than its 4-byte header length")
    (header_len,) = _U32.unpack_from(view, 0)
    _check_header_len(header_len, len(view) - _U32.size, max_header_bytes)
    end = _U32.size + header_len
    return _parse_header(view[_U32.size : end]), view[end:]


def _check_header_len(header_len: int, following: int, max_header_bytes: int) -> None:
    """A batch header of `header_len` bytes, with `following` bytes after the length."""
    if header_len > max_header_bytes:
        raise RemoteProtocolError(
            f"batch body: header of {header_len} bytes exceeds {max_header_bytes}",
            status_hint=413,
        )
    if header_len > following:
        raise RemoteProtocolError("batch body: truncated JSON header")


def _parse_header(raw: Buffer) -> dict[str, object]:
    header = parse_json(raw, "batch body: invalid JSON header")
    if not isinstance(header, dict):
        raise RemoteProtocolError("batch body: JSON header is not an object")
    return header


def _check_total(sizes: Sequence[int], following: int) -> None:
    """The blocks' sizes must account for exactly the `following` bytes."""
    total = sum(s for s in sizes if s > 0)
    if total != following:
        raise RemoteProtocolError(
            f"batch body: sizes add up to {total} bytes but {following} follow the header"
        )


def _int_list(header: dict[str, object], name: str, *, allow_miss: bool) -> list[int]:
    values = header.get(name)
    if not isinstance(values, list):
        raise RemoteProtocolError(f"batch body: {name!r} must be a list")
    low = -1 if allow_miss else 0
    for v in values:
        if type(v) is not int or v < low:
            raise RemoteProtocolError(f"batch body: {name!r} holds an invalid size {v!r}")
    return values


def _slice_blocks(payload: memoryview, sizes: Sequence[int]) -> list[memoryview | None]:
    _check_total(sizes, len(payload))
    out: list[memoryview | None] = []
    pos = 0
    for s in sizes:
        if s < 0:
            out.append(None)
        else:
            out.append(payload[pos : pos + s])
            pos += s
    return out


def encode_batch_get_response(blocks: Sequence[Buffer | None]) -> list[Buffer]:
    """Frame a `POST /kv/batch/get` answer: `{"sizes": [n | -1]}` then the hits in order."""
    sizes = [-1 if b is None else len(b) for b in blocks]
    return _frame({"sizes": sizes}, [b for b in blocks if b is not None])


def decode_batch_get_response(
    body: Buffer, *, max_header_bytes: int = DEFAULT_MAX_BATCH_HEADER_BYTES
) -> list[memoryview | None]:
    """Split a batch-get answer into one view per key (`None` = miss)."""
    header, payload = _split_frame(body, max_header_bytes)
    return _slice_blocks(payload, _int_list(header, "sizes", allow_miss=True))


def encode_batch_put_request(keys: Sequence[str], blocks: Sequence[Buffer]) -> list[Buffer]:
    """Frame a `POST /kv/batch/put` body: `{"keys", "sizes"}` then the blocks in order."""
    if len(keys) != len(blocks):
        raise ValueError(f"{len(keys)} keys but {len(blocks)} blocks")
    return _frame({"keys": list(keys), "sizes": [len(b) for b in blocks]}, list(blocks))


def decode_batch_put_request(
    body: Buffer,
    *,
    max_keys: int,
    max_header_bytes: int = DEFAULT_MAX_BATCH_HEADER_BYTES,
) -> list[tuple[str, memoryview]]:
    """Split a batch-put body into `(key, view)` pairs (keys are not validated here)."""
    header, payload = _split_frame(body, max_header_bytes)
    keys, sizes = _put_header(header, max_keys)
    views = _slice_blocks(payload, sizes)
    return [(k, v) for k, v in zip(keys, views, strict=True) if v is not None]


def _put_header(header: dict[str, object], max_keys: int) -> tuple[list[str], list[int]]:
    """The keys and sizes of a batch-put header (keys are not validated here)."""
    keys = header.get("keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise RemoteProtocolError("batch body: 'keys' must be a list of strings")
    if len(keys) > max_keys:
        raise RemoteProtocolError(
            f"batch of {len(keys)} keys exceeds max_batch_keys={max_keys}", status_hint=413
        )
    sizes = _int_list(header, "sizes", allow_miss=False)
    if len(sizes) != len(keys):
        raise RemoteProtocolError(f"batch body: {len(keys)} keys but {len(sizes)} sizes")
    return keys, sizes


class BatchPutReceiver:
    """Receives a `POST /kv/batch/put` body of a known length straight into the buffers
    its blocks are kept in: the framing (`u32` length, JSON header) into a small buffer,
    then each block into its own buffer from `alloc`, so a receive buffer the store keeps
    without a copy (`buffers.alloc_block`) is filled by the socket in place. The same
    rules as `decode_batch_put_request`.

    Sans-IO: the I/O layer reads into `buffer()` and reports the bytes with `advance(n)`,
    or copies in bytes it already holds with `feed(data)`; `items()` gives the
    `(key, block)` pairs once all `content_length` bytes arrived. A malformed header does
    not stop the reading: the rest of the body is read and dropped (so the connection
    stays usable) and `items()` raises the `RemoteProtocolError`.
    """

    _DISCARD = 64 * 1024

    def __init__(
        self,
        content_length: int,
        *,
        max_keys: int,
        alloc: Callable[[int], memoryview],
        max_header_bytes: int = DEFAULT_MAX_BATCH_HEADER_BYTES,
    ) -> None:
        self._left = content_length
        self._max_keys = max_keys
        self._max_header = max_header_bytes
        self._alloc = alloc
        self._head = bytearray(_U32.size)
        self._target = memoryview(self._head)
        self._filled = 0
        self._phase = 0  # 0: length, 1: header, 2: blocks, 3: dropping the rest
        self._keys: list[str] = []
        self._blocks: list[Buffer] = []
        self._next = 0
        self._error: RemoteProtocolError | None = None
        if content_length < _U32.size:
            self._fail(RemoteProtocolError("batch body: shorter than its 4-byte header length"))

    @property
    def done(self) -> bool:
        """Whether all the body's bytes arrived."""
        return self._left == 0

    def buffer(self) -> memoryview:
        """Where the next body bytes go (read into it, then `advance`); never empty
        while bytes are still due."""
        return self._target[self._filled : self._filled + self._left]

    def advance(self, n: int) -> None:
        """`n` bytes were written into the last `buffer()`."""
        self._left -= n
        self._filled += n
        if self._filled >= len(self._target):
            self._next_target()

    def feed(self, data: Buffer) -> None:
        """Copy in body bytes the I/O layer already holds."""
        view = memoryview(data).cast("B")
        while view and self._left:
            target = self.buffer()
            n = min(len(target), len(view))
            target[:n] = view[:n]
            view = view[n:]
            self.advance(n)

    def items(self) -> list[tuple[str, Buffer]]:
        """The `(key, block)` pairs, in order; raises `RemoteProtocolError` for a
        malformed body (or one that did not arrive whole)."""
        if self._error is not None:
            raise self._error
        if self._left or self._phase != 2 or self._next != len(self._blocks):
            raise RemoteProtocolError("batch body: incomplete")
        return list(zip(self._keys, self._blocks, strict=True))

    def _next_target(self) -> None:
        self._filled = 0
        if self._phase == 0:
            (header_len,) = _U32.unpack_from(self._head)
            try:
                _check_header_len(header_len, self._left, self._max_header)
            except RemoteProtocolError as exc:
                self._fail(exc)
                return
            self._phase = 1
            self._head = bytearray(header_len)
            self._target = memoryview(self._head)
            if header_len == 0:
                self._next_target()
            return
        if self._phase == 1:
            try:
                keys, sizes = _put_header(_parse_header(self._head), self._max_keys)
                _check_total(sizes, self._left)
            except RemoteProtocolError as exc:
                self._fail(exc)
                return
            self._phase = 2
            self._keys = keys
            self._blocks = [self._alloc(size) if size else b"" for size in sizes]
            self._next = 0
        elif self._phase == 2:
            self._next += 1
        else:  # dropping: the same window again
            return
        while self._next < len(self._blocks) and not len(self._blocks[self._next]):
            self._next += 1  # empty blocks take no bytes
        if self._next < len(self._blocks):
            self._target = memoryview(self._blocks[self._next])
        else:
            self._target = memoryview(b"")

    def _fail(self, exc: RemoteProtocolError) -> None:
        self._error = exc
        self._phase = 3
        self._blocks = []
        self._filled = 0
        self._target = memoryview(bytearray(min(self._DISCARD, max(self._left, 1))))


def encode_key_list(keys: Sequence[str]) -> bytes:
    """The JSON `{"keys": [...]}` body of a batch exists/get request."""
    return json.dumps({"keys": list(keys)}).encode()


def batch_exists_doc(found: Sequence[bool]) -> dict[str, object]:
    """The JSON answer to `POST /kv/batch/exists`: one flag per key, in order."""
    return {"exists": list(found)}


def batch_put_doc(results: Sequence[str]) -> dict[str, object]:
    """The JSON answer to `POST /kv/batch/put`: one outcome word (or `error:<code>`) per
    key, in order."""
    return {"results": list(results)}


def _answer_list(body: Buffer, name: str, n: int, what: str) -> list[object]:
    """The `name` list of a JSON batch answer, checked to hold `n` entries."""
    try:
        values = json.loads(bytes(body))[name]
    except (ValueError, KeyError, TypeError) as exc:
        raise RemoteProtocolError(f"{what}: bad answer ({exc})") from exc
    if not isinstance(values, list) or len(values) != n:
        raise RemoteProtocolError(f"{what}: answer does not match the request")
    return values


def decode_batch_exists_response(body: Buffer, n: int) -> list[bool]:
    """The flags of a batch-exists answer for `n` keys (`RemoteProtocolError` if it is
    not one)."""
    return [bool(f) for f in _answer_list(body, "exists", n, "batch exists")]


def decode_batch_put_response(body: Buffer, n: int) -> list[object]:
    """The per-key results of a batch-put answer for `n` keys (words not checked here)."""
    return _answer_list(body, "results", n, "batch put")


def batch_header_length(
    prefix: Buffer, max_header_bytes: int = DEFAULT_MAX_BATCH_HEADER_BYTES
) -> int:
    """The JSON header's length from the first `BATCH_LENGTH_BYTES` of a framed body (for
    a reader that streams the body: `decode_batch_get_header` next)."""
    (header_len,) = _U32.unpack(prefix)
    if header_len > max_header_bytes:
        raise RemoteProtocolError(
            f"batch body: header of {header_len} bytes exceeds {max_header_bytes}",
            status_hint=413,
        )
    return int(header_len)


def decode_batch_get_header(raw: Buffer, n: int) -> list[int]:
    """The block sizes (-1: miss) of a batch-get answer's JSON header, for `n` keys."""
    sizes = _int_list(_parse_header(raw), "sizes", allow_miss=True)
    if len(sizes) != n:
        raise RemoteProtocolError("batch get: header does not match the request")
    return sizes


def decode_key_list(body: Buffer, *, max_keys: int) -> list[str]:
    """Parse a JSON `{"keys": [...]}` body (batch exists/get)."""
    doc = parse_json(body)
    keys = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise RemoteProtocolError('body must be {"keys": [<string>, ...]}')
    if len(keys) > max_keys:
        raise RemoteProtocolError(
            f"batch of {len(keys)} keys exceeds max_batch_keys={max_keys}", status_hint=413
        )
    return keys


# -- responses ----------------------------------------------------------------------------

STATUS_LINES: Final[Mapping[int, bytes]] = MappingProxyType(
    {int(s): f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode("ascii") for s in HTTPStatus}
)
"""The status line of every status `http.HTTPStatus` knows, with its standard reason
phrase (a hand-written table lacked 409 and 412 and sent `412 Unknown`)."""


def status_line(status: int) -> bytes:
    """`HTTP/1.1 <status> <reason>` and CRLF; a code the standard library does not know
    gets an empty reason (RFC 9112 section 4 allows it), never an invented one."""
    line = STATUS_LINES.get(status)
    if line is None:
        if not 100 <= status <= 999:
            raise ValueError(f"invalid HTTP status {status!r}: expected three digits")
        line = b"HTTP/1.1 %d \r\n" % status
    return line


_date_cache: tuple[int, bytes] = (0, b"")


def http_date() -> bytes:
    """The current IMF-fixdate (`Date` header), formatted once per second."""
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, formatdate(now, usegmt=True).encode("ascii"))
    return _date_cache[1]


def response_head(
    status: int,
    headers: Sequence[tuple[str, str]],
    *,
    content_length: int | None,
    close: bool = False,
    keep_alive_header: bool = False,
) -> bytes:
    """The status line and headers of a response, ending with the blank line.

    `content_length=None` omits the header (204, 1xx). `close` adds `Connection: close`;
    `keep_alive_header` adds `Connection: keep-alive` (HTTP/1.0 clients).
    """
    parts = [status_line(status), b"Date: ", http_date(), b"\r\n"]
    for name, value in headers:
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} holds a line break")
        parts.append(f"{name}: {value}\r\n".encode("latin-1"))
    if content_length is not None:
        parts.append(b"Content-Length: %d\r\n" % content_length)
    if close:
        parts.append(b"Connection: close\r\n")
    elif keep_alive_header:
        parts.append(b"Connection: keep-alive\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def error_body(code: str, message: str) -> bytes:
    """The JSON error document `{"error":code,"message":message}`, in the one style of
    every JSON body the server sends: compact, ending with a newline."""
    return json.dumps({"error": code, "message": message}, separators=(",", ":")).encode() + b"\n"
