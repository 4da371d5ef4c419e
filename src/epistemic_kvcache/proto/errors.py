"""One table: each store/auth error -> HTTP status and JSON code, RESP error text, exception.

The server answers an exception with the row that matches it (most specific first);
the client turns an HTTP error (JSON code, else status) back into the row's exception
class and the row's `client` action (`client_rule`). Rows marked `private` carry messages
with server paths or OS errors: clients get the row's fixed text, the server logs the
detail. `applied` says what the caller may assume about a write that got this error:
"no" (nothing was stored), "unknown" (it may have been applied), or "n/a" (not a write
failure). No sockets, no server imports: the client uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from epistemic_kvcache.errors import (
    AuthError,
    BlockTooLargeError,
    CapacityError,
    ClusterUnavailableError,
    DiskFullError,
    ForbiddenError,
    InvalidKeyError,
    KvCacheError,
    LocalProtocolError,
    NotFoundError,
    QuotaExceededError,
    RemoteProtocolError,
    StorageIOError,
    StoreClosedError,
    StoreError,
    StoreFaultError,
)

ClientAction = Literal["raise", "degrade", "refused", "unknown", "split"]
"""What the client does with an HTTP error (docs/client.md, "Errors"):
- "raise": raise the row's exception (retrying cannot fix it: credentials, a bad key or
  request);
- "degrade": the server cannot serve now (5xx, 408, 429): a read is a miss, a write fails
  (`PutOutcome.FAILED`), calls that must not fail silently raise `KvCacheUnavailableError`;
- "refused": this request was refused for what it carries (too large, no room, quota):
  the write fails, nothing was stored, the server is fine;
- "unknown": as "degrade", but a write may have been applied (`PutOutcome.UNKNOWN`, or
  the row's exception, an `OutcomeUnknownError`);
- "split": a batch answer over the server's limit: the client splits the batch."""
Applied = Literal["no", "unknown", "n/a"]


@dataclass(frozen=True, slots=True)
class ErrorRow:
    """How one kind of error is answered on both wires."""

    exc: type[KvCacheError]
    status: int
    """HTTP status."""
    code: str
    """JSON `error` field (stable, machine-readable)."""
    resp: str
    """RESP error text; `{detail}` is replaced by the exception's message when public."""
    text: str
    """HTTP `message` when the detail is private (or as a prefix when public)."""
    private: bool = False
    """The exception's message is logged, never sent (paths, OS errors)."""
    retry: bool = False
    """Retrying later can succeed (HTTP adds `Retry-After`)."""
    client: ClientAction = "raise"
    """What the client does when it gets this row's answer (see `ClientAction`)."""
    applied: Applied = "n/a"
    """What a write that failed with this row may assume about its effect."""


ERROR_ROWS: Final[tuple[ErrorRow, ...]] = (
    ErrorRow(InvalidKeyError, 400, "bad_key", "ERR {detail}", "", applied="no"),
    ErrorRow(
        BlockTooLargeError,
        413,
        "block_too_large",
        "ERR block too large: {detail}",
        "",
        client="refused",
        applied="no",
    ),
    ErrorRow(NotFoundError, 404, "not_found", "ERR not found: {detail}", ""),
    ErrorRow(
        QuotaExceededError,
        507,
        "quota_exceeded",
        "ERR quota exceeded: {detail}",
        "tenant quota exceeded: ",
        client="refused",
        applied="no",
    ),
    ErrorRow(
        CapacityError,
        507,
        "insufficient_storage",
        "ERR no room in the cache: {detail}",
        "no room to store the block: ",
        client="refused",
        applied="no",
    ),
    ErrorRow(
        DiskFullError,
        507,
        "insufficient_storage",
        "ERR disk full, nothing was stored",
        "no room to store the block: disk full",
        private=True,
        retry=True,
        client="refused",
        applied="no",
    ),
    ErrorRow(
        ClusterUnavailableError,
        503,
        "outcome_unknown",
        "ERR cluster unavailable: the write may or may not have been applied",
        "cluster unavailable: the write may or may not have been applied",
        private=True,
        retry=True,
        client="unknown",
        applied="unknown",
    ),
    ErrorRow(
        StorageIOError,
        503,
        "storage_io_error",
        "ERR storage I/O error, nothing was stored",
        "storage I/O error, nothing was stored",
        private=True,
        retry=True,
        client="degrade",
        applied="no",
    ),
    ErrorRow(
        StoreFaultError,
        503,
        "store_fault",
        "ERR store fault: the store is read-only until the server restarts",
        "store fault: the store is read-only until the server restarts",
        private=True,
        client="degrade",
        applied="no",
    ),
    ErrorRow(
        StoreClosedError,
        503,
        "unavailable",
        "ERR the store is closed",
        "the store is closed",
        private=True,
        retry=True,
        client="degrade",
        applied="no",
    ),
    ErrorRow(
        StoreError,
        500,
        "internal",
        "ERR internal error",
        "internal store error",
        private=True,
        client="degrade",
        applied="unknown",
    ),
    ErrorRow(ForbiddenError, 403, "forbidden", "NOPERM {detail}", ""),
    ErrorRow(
        AuthError,
        401,
        "unauthorized",
        "WRONGPASS invalid username-password pair or user is disabled.",
        "invalid credentials",
        private=True,
    ),
    ErrorRow(RemoteProtocolError, 400, "bad_request", "ERR {detail}", ""),
)
"""Most specific first: the first row whose `exc` matches answers."""

INTERNAL: Final = ErrorRow(
    KvCacheError,
    500,
    "internal",
    "ERR internal error",
    "internal server error",
    private=True,
    client="degrade",
    applied="unknown",
)


@dataclass(frozen=True, slots=True)
class HttpOnlyRow:
    """An HTTP error the connection layer answers itself (no store exception behind it)."""

    status: int
    code: str
    client: ClientAction
    exc: type[KvCacheError]
    """What the client raises when `client` is "raise"."""


HTTP_ONLY_ROWS: Final[tuple[HttpOnlyRow, ...]] = (
    HttpOnlyRow(400, "bad_request", "raise", LocalProtocolError),
    HttpOnlyRow(405, "method_not_allowed", "raise", LocalProtocolError),
    HttpOnlyRow(408, "request_timeout", "degrade", KvCacheError),
    HttpOnlyRow(411, "length_required", "refused", LocalProtocolError),
    HttpOnlyRow(413, "batch_too_large", "split", LocalProtocolError),
    HttpOnlyRow(429, "tenant_busy", "degrade", KvCacheError),
    HttpOnlyRow(429, "too_many_connections", "degrade", KvCacheError),
    HttpOnlyRow(431, "headers_too_large", "raise", LocalProtocolError),
    HttpOnlyRow(503, "overloaded", "degrade", KvCacheError),
)
"""Codes the HTTP layer sends before any store call (overload, framing, limits)."""


@dataclass(frozen=True, slots=True)
class ClientRule:
    """What the client does with one HTTP error answer."""

    action: ClientAction
    exc: type[KvCacheError]
    applied: Applied


_BY_CODE: Final = {row.code: row.exc for row in reversed(ERROR_ROWS)}
_RULE_BY_CODE: Final = {
    **{r.code: ClientRule(r.client, r.exc, "no") for r in HTTP_ONLY_ROWS},
    **{r.code: ClientRule(r.client, r.exc, r.applied) for r in reversed(ERROR_ROWS)},
}
_RULE_BY_STATUS: Final = {
    **{r.status: ClientRule(r.client, r.exc, "no") for r in reversed(HTTP_ONLY_ROWS)},
    **{r.status: ClientRule(r.client, r.exc, r.applied) for r in reversed(ERROR_ROWS)},
}
for _status in (500, 502, 503, 504):  # without a code these say nothing about the outcome
    _RULE_BY_STATUS.pop(_status, None)


def client_rule(status: int, code: str | None) -> ClientRule:
    """The client's rule for an HTTP error: by the JSON `error` code when it is a table
    code, else by the status (an older server or a proxy), else by the status class
    (5xx: degrade with an unknown outcome; other 4xx: raise `LocalProtocolError`)."""
    rule = _RULE_BY_CODE.get(code) if code is not None else None
    if rule is not None:
        return rule
    rule = _RULE_BY_STATUS.get(status)
    if rule is not None:
        return rule
    if status >= 500:
        return ClientRule("degrade", KvCacheError, "unknown")
    return ClientRule("raise", LocalProtocolError, "n/a")


def row_for(exc: BaseException) -> ErrorRow:
    """The table row answering `exc` (`INTERNAL` for anything unexpected)."""
    for row in ERROR_ROWS:
        if isinstance(exc, row.exc):
            return row
    return INTERNAL


def http_message(row: ErrorRow, exc: BaseException) -> str:
    """The JSON `message` for `exc` under `row` (the fixed text when private)."""
    if row.private:
        return row.text
    return row.text + str(exc)


def resp_text(row: ErrorRow, exc: BaseException, limit: int = 400) -> str:
    """The RESP error line for `exc` under `row`: one line, at most ~`limit` characters."""
    detail = str(exc)[:limit].replace("\r", " ").replace("\n", " ")
    return row.resp.replace("{detail}", detail)


def exception_for_code(code: str) -> type[KvCacheError] | None:
    """The exception a client raises for an HTTP error code (None: not a table code)."""
    return _BY_CODE.get(code)


__all__ = [
    "ERROR_ROWS",
    "HTTP_ONLY_ROWS",
    "INTERNAL",
    "ClientAction",
    "ClientRule",
    "ErrorRow",
    "HttpOnlyRow",
    "client_rule",
    "exception_for_code",
    "http_message",
    "resp_text",
    "row_for",
]
