"""The RESP request framer's events and argument types, shared by both twins.

`RespParser` has two implementations (proto/resp_parser.py, the pure-Python reference,
and proto/_resp_parser_c, the same source compiled by Cython; proto/resp_framer.py picks
one). What their callers compare by identity (`NEED_DATA`) or by class
(`RefusedCommand`) lives here, once, so a command or an event from either twin is the
same object to the dispatcher; so do the sizes a command is accounted by (`args_size`,
`command_size`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Final, Literal

Buffer = bytes | bytearray | memoryview
Arg = bytes | bytearray | memoryview
Command = list[Arg]
ReserveFn = Callable[[int], bool | str]
"""Asked before a large bulk is allocated: may the parser hold this many more bytes?
True grants; False or a reason string refuses (the reason ends up in `RefusedCommand`)."""


MAX_LIMIT: Final = 2**62
"""The largest value a framer limit may take (`RespParser` refuses more, and so does the
configuration, for every integer limit of `ServerLimits`). The compiled twin holds its
limits, and the lengths and buffer positions they bound, in C `Py_ssize_t` (at most
2**63 - 1) and adds to them (a bulk's length and its CRLF, offsets in a buffer): 2**62
(4 EiB, more than any memory) leaves that arithmetic room."""


class RefusedCommand(list[Arg]):
    """Framed in place of a command one of whose large bulks `reserve` refused (or that
    the owner refused while it was being framed, `refuse_partial`).

    It is empty: the command's arguments were read off the wire and dropped. `reason` is
    what `reserve` (or the owner) gave as the reason, `""` if none."""

    __slots__ = ("reason",)

    def __init__(self, reason: str = "") -> None:
        super().__init__()
        self.reason = reason


class _NeedData(enum.Enum):
    NEED_DATA = "NEED_DATA"

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = _NeedData.NEED_DATA
"""Returned by `RespParser.next_command()` when no complete command is buffered."""

Event = Command | Literal[_NeedData.NEED_DATA]


def args_size(cmd: Command) -> int:
    """Bytes of a command's arguments together."""
    size = 0
    for arg in cmd:
        size += len(arg)
    return size


def command_size(cmd: Command) -> int:
    """Bytes of `cmd` as a RESP array on the wire: `*<n>\\r\\n`, then `$<len>\\r\\n`,
    the argument and `\\r\\n` for each (what client libraries send; an inline command
    is counted as if sent this way). 0 for a `RefusedCommand` (its arguments were
    dropped as they arrived)."""
    if isinstance(cmd, RefusedCommand):
        return 0
    size = 3 + len(str(len(cmd)))
    for arg in cmd:
        n = len(arg)
        size += 5 + len(str(n)) + n
    return size
