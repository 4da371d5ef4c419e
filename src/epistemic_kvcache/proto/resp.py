"""Sans-IO Redis wire protocol (RESP2 and RESP3): the request parser and the reply serializer.

The parser (`RespParser`: bytes in, commands out) lives in proto/resp_parser.py and is
re-exported here (its compiled twin when built: proto/resp_framer.py picks); see that
module for how it frames. This module holds the serializer:
`serialize` turns a Python value into a list of buffers; a large bulk payload is its own
buffer (never concatenated) so the I/O layer can `writelines` it.
"""

from __future__ import annotations

import math
from typing import Final

from epistemic_kvcache.errors import LocalProtocolError
from epistemic_kvcache.proto.resp_framer import RespParser
from epistemic_kvcache.proto.resp_inline import split_inline
from epistemic_kvcache.proto.resp_parser import (
    ARG_OVERHEAD,
    COMMAND_OVERHEAD,
    FIRST_READ_AFTER_BIG,
)
from epistemic_kvcache.proto.resp_rules import (
    DEFAULT_LARGE_BULK_THRESHOLD,
    DEFAULT_MAX_BULK_BYTES,
    DEFAULT_MAX_INLINE_BYTES,
    DEFAULT_MAX_MULTIBULK_LEN,
    DEFAULT_READ_BUFFER_BYTES,
    DEFAULT_UNAUTHENTICATED_MAX_BULK_BYTES,
    DEFAULT_UNAUTHENTICATED_MAX_MULTIBULK_LEN,
)
from epistemic_kvcache.proto.resp_types import (
    NEED_DATA,
    Arg,
    Buffer,
    Command,
    Event,
    RefusedCommand,
    args_size,
    command_size,
)

__all__ = [
    "ARG_OVERHEAD",
    "COMMAND_OVERHEAD",
    "DEFAULT_LARGE_BULK_THRESHOLD",
    "DEFAULT_MAX_BULK_BYTES",
    "DEFAULT_MAX_INLINE_BYTES",
    "DEFAULT_MAX_MULTIBULK_LEN",
    "DEFAULT_READ_BUFFER_BYTES",
    "DEFAULT_SERIALIZE_CUTOFF",
    "DEFAULT_UNAUTHENTICATED_MAX_BULK_BYTES",
    "DEFAULT_UNAUTHENTICATED_MAX_MULTIBULK_LEN",
    "FIRST_READ_AFTER_BIG",
    "NEED_DATA",
    "NULL_ARRAY",
    "Arg",
    "Buffer",
    "Command",
    "ErrorReply",
    "Event",
    "NullArray",
    "RefusedCommand",
    "RespParser",
    "SimpleString",
    "Verbatim",
    "args_size",
    "command_size",
    "pack_command",
    "serialize",
    "split_inline",
]

DEFAULT_SERIALIZE_CUTOFF: Final = 16 * 1024
"""Bulk replies this long or longer are returned as their own buffer, never copied."""
_INT64_MAX: Final = 2**63 - 1
_INT64_MIN: Final = -(2**63)


# -- the reply serializer -------------------------------------------------------------


class SimpleString(str):
    """A status reply: `+OK`. Must not contain CR or LF."""

    __slots__ = ()


class ErrorReply(str):
    """An error reply; the text starts with its code: `ErrorReply("ERR syntax error")`."""

    __slots__ = ()


class Verbatim(str):
    """A RESP3 verbatim string (`=txt:...`, e.g. INFO); a bulk string in RESP2."""

    __slots__ = ()


class NullArray:
    """A RESP2 null array (`*-1`); `_` in RESP3."""

    __slots__ = ()


NULL_ARRAY: Final = NullArray()


class _Writer:
    __slots__ = ("cur", "cutoff", "out", "protocol")

    def __init__(self, protocol: int, cutoff: int) -> None:
        self.protocol = protocol
        self.cutoff = cutoff
        self.out: list[Buffer] = []
        self.cur = bytearray()

    def line(self, prefix: bytes, text: str) -> None:
        if "\r" in text or "\n" in text:
            raise LocalProtocolError(f"CR or LF in a RESP {prefix!r} line: {text[:64]!r}")
        self.cur += prefix
        self.cur += text.encode("utf-8")
        self.cur += b"\r\n"

    def bulk(self, data: Buffer) -> None:
        n = memoryview(data).nbytes if isinstance(data, memoryview) else len(data)
        self.cur += b"$%d\r\n" % n
        if n >= self.cutoff:
            self.out.append(self.cur)
            self.out.append(data)
            self.cur = bytearray(b"\r\n")
        else:
            self.cur += data
            self.cur += b"\r\n"

    def value(self, v: object) -> None:
        resp3 = self.protocol == 3
        if v is None or isinstance(v, NullArray):
            if resp3:
                self.cur += b"_\r\n"
            else:
                self.cur += b"*-1\r\n" if isinstance(v, NullArray) else b"$-1\r\n"
        elif isinstance(v, ErrorReply):
            self.line(b"-", v)
        elif isinstance(v, SimpleString):
            self.line(b"+", v)
        elif isinstance(v, Verbatim):
            if resp3:
                raw = v.encode("utf-8")
                self.cur += b"=%d\r\ntxt:" % (len(raw) + 4)
                self.cur += raw
                self.cur += b"\r\n"
            else:
                self.bulk(v.encode("utf-8"))
        elif isinstance(v, str):
            self.bulk(v.encode("utf-8"))
        elif isinstance(v, bytes | bytearray | memoryview):
            self.bulk(v)
        elif isinstance(v, bool):
            if resp3:
                self.cur += b"#t\r\n" if v else b"#f\r\n"
            else:
                self.cur += b":1\r\n" if v else b":0\r\n"
        elif isinstance(v, int):
            if _INT64_MIN <= v <= _INT64_MAX:
                self.cur += b":%d\r\n" % v
            elif resp3:
                self.cur += b"(%d\r\n" % v
            else:
                self.bulk(b"%d" % v)
        elif isinstance(v, float):
            if math.isnan(v):
                text = "nan"
            elif math.isinf(v):
                text = "inf" if v > 0 else "-inf"
            else:
                text = repr(v)
            if resp3:
                self.line(b",", text)
            else:
                self.bulk(text.encode("ascii"))
        elif isinstance(v, dict):
            if resp3:
                self.cur += b"%%%d\r\n" % len(v)
            else:
                self.cur += b"*%d\r\n" % (2 * len(v))
            for key, item in v.items():
                self.value(key)
                self.value(item)
        elif isinstance(v, set | frozenset):
            self.cur += (b"~%d\r\n" if resp3 else b"*%d\r\n") % len(v)
            for item in v:
                self.value(item)
        elif isinstance(v, list | tuple):
            self.cur += b"*%d\r\n" % len(v)
            for item in v:
                self.value(item)
        else:
            raise LocalProtocolError(f"cannot serialize {type(v).__name__} as RESP")


def serialize(
    value: object, protocol: int = 2, *, cutoff: int = DEFAULT_SERIALIZE_CUTOFF
) -> list[Buffer]:
    """Encode one reply as a list of buffers (write them with `transport.writelines`).

    Python -> RESP: None -> null; `SimpleString` -> `+`; `ErrorReply` -> `-`; `str`/bytes
    -> bulk; bool -> `#` (RESP3) or `:1`/`:0`; int -> `:`; float -> `,` (RESP3) or bulk;
    dict -> map (RESP3) or flat array; set -> `~` (RESP3) or array; list/tuple -> array;
    `Verbatim` -> `=txt:` (RESP3) or bulk. Bulk payloads of `cutoff` bytes or more are
    returned as their own buffer, untouched. Raises `LocalProtocolError` for values RESP
    cannot carry.
    """
    if protocol not in (2, 3):
        raise LocalProtocolError(f"unsupported RESP protocol version {protocol!r}")
    w = _Writer(protocol, cutoff)
    w.value(value)
    if w.cur:
        w.out.append(w.cur)
    return w.out


def pack_command(*args: Buffer | str | int, cutoff: int = DEFAULT_SERIALIZE_CUTOFF) -> list[Buffer]:
    """Encode a request as multibulk (what a client sends); big arguments stay separate."""
    w = _Writer(2, cutoff)
    w.cur += b"*%d\r\n" % len(args)
    for arg in args:
        if isinstance(arg, str):
            w.bulk(arg.encode("utf-8"))
        elif isinstance(arg, int):
            w.bulk(b"%d" % arg)
        else:
            w.bulk(arg)
    if w.cur:
        w.out.append(w.cur)
    return w.out
