"""One table: each store/auth error -> HTTP status and JSON code, RESP error text, exception.

The server answers an exception with the row that matches it (most specific first);
the client turns an HTTP JSON code back into the row's exception class. Rows marked
`private` carry messages with server paths or OS errors: clients get the row's fixed
text, the server logs the detail. No sockets, no server imports: the client uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from epistemic_kvcache.errors import (
    AuthError,
    BlockTooLargeError,
    CapacityError,
    DiskFullError,
    ForbiddenError,
    InvalidKeyError,
    KvCacheError,
    NotFoundError,
    QuotaExceededError,
    RemoteProtocolError,
    StorageIOError,
    StoreClosedError,
    StoreError,
    StoreFaultError,
)


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


ERROR_ROWS: Final[tuple[ErrorRow, ...]] = (
    ErrorRow(InvalidKeyError, 400, "bad_key", "ERR {detail}", ""),
    ErrorRow(BlockTooLargeError, 413, "block_too_large", "ERR block too large: {detail}", ""),
    ErrorRow(NotFoundError, 404, "not_found", "ERR not found: {detail}", ""),
    ErrorRow(
        QuotaExceededError,
        507,
        "quota_exceeded",
        "ERR quota exceeded: {detail}",
        "tenant quota exceeded: ",
    ),
    ErrorRow(
        CapacityError,
        507,
        "insufficient_storage",
        "ERR no room in the cache: {detail}",
        "no room to store the block: ",
    ),
    ErrorRow(
        DiskFullError,
        507,
        "insufficient_storage",
        "ERR disk full, nothing was stored",
        "no room to store the block: disk full",
        private=True,
        retry=True,
    ),
    ErrorRow(
        StorageIOError,
        503,
        "storage_io_error",
        "ERR storage I/O error, nothing was stored",
        "storage I/O error, nothing was stored",
        private=True,
        retry=True,
    ),
    ErrorRow(
        StoreFaultError,
        503,
        "store_fault",
        "ERR store fault: the store is read-only until the server restarts",
        "store fault: the store is read-only until the server restarts",
        private=True,
    ),
    ErrorRow(
        StoreClosedError,
        503,
        "unavailable",
        "ERR the store is closed",
        "the store is closed",
        private=True,
        retry=True,
    ),
    ErrorRow(
        StoreError, 500, "internal", "ERR internal error", "internal store error", private=True
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
    KvCacheError, 500, "internal", "ERR internal error", "internal server error", private=True
)

_BY_CODE: Final = {row.code: row.exc for row in reversed(ERROR_ROWS)}


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
    "INTERNAL",
    "ErrorRow",
    "exception_for_code",
    "http_message",
    "resp_text",
    "row_for",
]
