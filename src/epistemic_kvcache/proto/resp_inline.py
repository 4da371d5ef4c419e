"""Inline RESP requests (`SET k "v w"\n`, for telnet and hand-typed input): splitting a
line into arguments the way Redis' `sdssplitargs` does (quotes and escapes)."""

from __future__ import annotations

from typing import Final

from epistemic_kvcache.errors import RemoteProtocolError


def _perr(detail: str) -> RemoteProtocolError:
    return RemoteProtocolError(f"Protocol error: {detail}")


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
        in_dq = in_sq = False
        while True:
            if in_dq:
                if i >= n:
                    raise _perr("unbalanced quotes in request")
                c = data[i]
                if (
                    c == 0x5C  # backslash
                    and i + 3 < n
                    and data[i + 1] == ord("x")
                    and data[i + 2] in _HEX
                    and data[i + 3] in _HEX
                ):
                    cur.append(int(data[i + 2 : i + 4], 16))
                    i += 3
                elif c == 0x5C and i + 1 < n:
                    i += 1
                    cur += _ESCAPES.get(data[i], bytes((data[i],)))
                elif c == 0x22:  # closing double quote must end the argument
                    if i + 1 < n and data[i + 1] not in _SPACE:
                        raise _perr("unbalanced quotes in request")
                    in_dq = False
                    i += 1
                    break
                else:
                    cur.append(c)
            elif in_sq:
                if i >= n:
                    raise _perr("unbalanced quotes in request")
                c = data[i]
                if c == 0x5C and i + 1 < n and data[i + 1] == 0x27:
                    i += 1
                    cur.append(0x27)
                elif c == 0x27:
                    if i + 1 < n and data[i + 1] not in _SPACE:
                        raise _perr("unbalanced quotes in request")
                    in_sq = False
                    i += 1
                    break
                else:
                    cur.append(c)
            else:
                if i >= n:
                    break
                c = data[i]
                if c in _SPACE:
                    break
                if c == 0x22:
                    in_dq = True
                elif c == 0x27:
                    in_sq = True
                else:
                    cur.append(c)
            i += 1
        out.append(bytes(cur))
