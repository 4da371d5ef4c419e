"""Inline RESP requests (`SET k "v w"\n`, for telnet and hand-typed input).

How it works: the framer (proto/resp_parser.py) hands a command that does not start
with `*` to `inline_command`, which finds its line, holds it to the parser's limits and
splits it into arguments the way Redis' `sdssplitargs` does (`split_inline`: quotes and
escapes). Inline requests are rare (a person at a terminal), so this stays plain Python
beside the compiled framer."""

from __future__ import annotations

from typing import Final, Protocol

from epistemic_kvcache.proto.resp_rules import protocol_error as _perr
from epistemic_kvcache.proto.resp_types import Command

_ESCAPES: Final = {
    ord("n"): b"\n",
    ord("r"): b"\r",
    ord("t"): b"\t",
    ord("b"): b"\b",
    ord("a"): b"\a",
}
_HEX: Final = frozenset(b"0123456789abcdefABCDEF")
_SPACE: Final = frozenset(b" \n\r\t\v\f\x00")


def split_inline(line: bytes | bytearray | memoryview) -> list[bytes]:
    """Split an inline request like Redis' `sdssplitargs` (quotes and escapes).

    Raises `RemoteProtocolError("Protocol error: unbalanced quotes in request")`.
    """
    data = bytes(line)
    n = len(data)
    i = 0
    out: list[bytes] = []
    while True:
        while i < n and data[i] in _SPACE:
            i += 1
        if i >= n:
            return out
        cur = bytearray()
        quote = 0  # the quote the argument is inside of: 0x22 ("), 0x27 (') or none (0)
        while True:
            if not quote:
                if i >= n or data[i] in _SPACE:
                    break
                c = data[i]
                if c in {0x22, 0x27}:
                    quote = c
                else:
                    cur.append(c)
            elif i >= n:
                raise _perr("unbalanced quotes in request")
            elif data[i] == quote:  # a closing quote must end the argument
                if i + 1 < n and data[i + 1] not in _SPACE:
                    raise _perr("unbalanced quotes in request")
                i += 1
                break
            elif data[i] == 0x5C and i + 1 < n:  # backslash
                i += _unescape(data, i, quote, cur)
            else:
                cur.append(data[i])
            i += 1
        out.append(bytes(cur))


def _unescape(data: bytes, i: int, quote: int, cur: bytearray) -> int:
    """The backslash at `data[i]` inside quotes (a next byte exists): appends what it
    stands for to `cur` and returns how many bytes after the backslash that took. In
    double quotes `\\xHH` is a byte and `\\n` `\\r` `\\t` `\\b` `\\a` what C means by them,
    any other escaped byte itself; in single quotes only `\\'` is an escape."""
    nxt = data[i + 1]
    if quote == 0x27:
        if nxt != 0x27:
            cur.append(0x5C)
            return 0
        cur.append(0x27)
        return 1
    if nxt == ord("x") and i + 3 < len(data) and data[i + 2] in _HEX and data[i + 3] in _HEX:
        cur.append(int(data[i + 2 : i + 4], 16))
        return 3
    cur += _ESCAPES.get(nxt, bytes((nxt,)))
    return 1


class InlineLimits(Protocol):
    """The limits an inline request is held to: `RespParser`'s own attributes."""

    max_inline_bytes: int
    authenticated: bool
    unauthenticated_max_multibulk_len: int
    unauthenticated_max_bulk_bytes: int


def inline_command(
    data: bytearray, pos: int, end: int, limits: InlineLimits
) -> tuple[Command, int] | None:
    """The inline request whose line starts at `data[pos]`: its arguments (none for a
    blank line) and where the next command starts, or None while its line is not
    complete (before `end`). Raises Redis' "too big inline request" for a line longer
    than `max_inline_bytes`, and before AUTH its "unauthenticated inline request" for
    more or longer arguments than the unauthenticated limits allow."""
    max_bytes = limits.max_inline_bytes
    nl = data.find(b"\n", pos, end)
    if nl < 0:
        if end - pos > max_bytes:
            raise _perr("too big inline request")
        return None
    if nl - pos > max_bytes:
        raise _perr("too big inline request")
    stop = nl - 1 if nl > pos and data[nl - 1] == 0x0D else nl
    args: Command = list(split_inline(data[pos:stop]))
    if not limits.authenticated and (
        len(args) > limits.unauthenticated_max_multibulk_len
        or any(len(a) > limits.unauthenticated_max_bulk_bytes for a in args)
    ):
        raise _perr("unauthenticated inline request")
    return args, nl + 1
