"""Reply constants and argument helpers shared by the RESP dispatcher and command handlers."""

from __future__ import annotations

import logging
import re
from typing import Final

from epistemic_kvcache.errors import RemoteProtocolError, StoreError
from epistemic_kvcache.proto.errors import resp_text, row_for
from epistemic_kvcache.proto.glob import Glob
from epistemic_kvcache.proto.resp import Buffer, ErrorReply, SimpleString, serialize
from epistemic_kvcache.server.budget import Limit

log = logging.getLogger("epistemic_kvcache.server.resp")

WIRE: Final = "resp"
REDIS_COMPAT_VERSION: Final = "7.0.0"
"""The Redis version we answer in INFO/HELLO: the command set we implement is 7.0's."""

OK: Final = SimpleString("OK")
NOAUTH: Final = ErrorReply("NOAUTH Authentication required.")
HELLO_NOAUTH: Final = ErrorReply(
    "NOAUTH HELLO must be called with the client already authenticated, otherwise the "
    "HELLO AUTH <user> <pass> option can be used to authenticate the client and select "
    "the RESP protocol version at the same time"
)
"""HELLO without AUTH before authentication: Redis 7.0's words (7.2 writes `HELLO <proto>
AUTH`)."""
WRONGPASS: Final = ErrorReply("WRONGPASS invalid username-password pair or user is disabled.")
NOT_AN_INTEGER: Final = ErrorReply("ERR value is not an integer or out of range")
SYNTAX_ERROR: Final = ErrorReply("ERR syntax error")
INTERNAL_ERROR: Final = ErrorReply("ERR internal error")
BUSY: Final = ErrorReply("ERR server busy, retry")
TENANT_BUSY: Final = ErrorReply(
    "ERR this tenant holds its whole share of in-flight memory (max_tenant_inflight_bytes), retry"
)


class Reply(Exception):
    """Raised inside a handler to answer with an error reply."""

    def __init__(self, reply: ErrorReply) -> None:
        super().__init__(reply)
        self.reply = reply


class Frames:
    """A reply already serialized (several frames, or push frames)."""

    __slots__ = ("buffers",)

    def __init__(self, buffers: list[Buffer]) -> None:
        self.buffers = buffers


def busy_reply(limit: Limit | str) -> ErrorReply:
    """The error for a command refused by the in-flight budget (`limit`: which one)."""
    return TENANT_BUSY if limit == "tenant" else BUSY


def text(arg: Buffer, limit: int = 128) -> str:
    """Client bytes for an error message: truncated, CR/LF-free."""
    s = bytes(arg[:limit]).decode("utf-8", "backslashreplace")
    return s.replace("\r", " ").replace("\n", " ")


def to_int(arg: Buffer, error: ErrorReply = NOT_AN_INTEGER) -> int:
    raw = bytes(arg)
    if re.fullmatch(rb"-?(?:0|[1-9][0-9]{0,18})", raw) is None:
        raise Reply(error)
    value = int(raw)
    if not -(2**63) <= value < 2**63:
        raise Reply(error)
    return value


INVALID_KEY: Final = ErrorReply("ERR invalid key: not valid UTF-8")


def to_key(arg: Buffer) -> str:
    try:
        return str(arg, "utf-8")
    except UnicodeDecodeError:
        raise Reply(INVALID_KEY) from None


def to_glob(pattern: Buffer) -> Glob:
    try:
        return Glob(bytes(pattern))
    except RemoteProtocolError as exc:
        raise Reply(ErrorReply(f"ERR {exc}")) from None


def valid_client_name(raw: Buffer) -> str:
    """A client name (CLIENT SETNAME, HELLO SETNAME): printable ASCII without spaces."""
    data = bytes(raw)
    if any(b < 0x21 or b > 0x7E for b in data):
        raise Reply(
            ErrorReply("ERR Client names cannot contain spaces, newlines or special characters.")
        )
    return data.decode("ascii")


def wrong_args(name: str) -> ErrorReply:
    return ErrorReply(f"ERR wrong number of arguments for '{name}' command")


def unknown_subcommand(sub: Buffer, cmd: str) -> ErrorReply:
    return ErrorReply(f"ERR unknown subcommand '{text(sub)}'. Try {cmd} HELP.")


def push(items: list[object], protocol: int) -> list[Buffer]:
    """A pub/sub frame: a RESP3 push (`>`) or, in RESP2, a plain array."""
    out = serialize(items, protocol)
    if protocol == 3:
        out[0] = b">" + bytes(out[0])[1:]
    return out


def store_error_reply(exc: StoreError, what: str) -> ErrorReply:
    """The RESP error for a store failure (proto/errors.py's table); private details
    (paths, OS errors) are logged, not sent."""
    row = row_for(exc)
    if row.private:
        if row.status >= 500 and row.code == "internal":
            log.error("store call %s failed", what, exc_info=exc)
        else:
            log.error("store call %s failed: %s", what, exc)
    return ErrorReply(resp_text(row, exc))
