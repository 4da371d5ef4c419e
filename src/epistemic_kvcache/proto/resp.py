"""Sans-IO Redis wire protocol (RESP2 and RESP3): a request parser and a reply serializer.

How the parser works
--------------------
`RespParser` takes bytes (`receive_data`, or the zero-copy pair `get_buffer` /
`buffer_updated` that `asyncio.BufferedProtocol` calls) and yields commands
(`next_event()` -> list of arguments, or `NEED_DATA`). It frames two request forms, as
Redis' `networking.c` does: multibulk (`*N\\r\\n$len\\r\\n<bytes>\\r\\n...`) and inline
(`SET k v\\n`, for telnet and hand-typed input).

Small arguments are sliced out of one growing receive buffer. A bulk argument of at
least `large_bulk_threshold` bytes gets a `bytearray` of exactly its announced size as
soon as its `$len` header is parsed; from then on `get_buffer` hands out the unfilled
tail of that array, so the socket reads the payload straight into its final home (no
chunk list, no join, no second copy). This is the one place where own RESP code beats
hiredis, which buffers a whole bulk before returning it.

Because that array is allocated before its bytes arrive, the owner may pass `reserve`:
it is asked for each large bulk's size first, and may refuse (a server-wide memory
budget). A refused bulk is read and dropped instead, the rest of its command too, and
the command is framed as an empty `RefusedCommand`, so the connection stays usable.
`held_bytes` says how many bytes of preallocated bulks the parser still holds (in the
command being framed and in framed commands not yet returned): the owner releases what
it reserved beyond that once the commands it took out are done.

While the connection is unauthenticated the parser applies tiny limits (Redis
CVE-2021-32675) and parses lazily: at most one complete command is framed ahead, so the
limits in force for a command are the ones set after the previous command (e.g. AUTH)
ran. Once authenticated it frames eagerly, which lets big pipelined payloads land in
preallocated buffers; the I/O layer bounds how much it reads ahead (`buffered_bytes`).

A violation is raised as `RemoteProtocolError` carrying Redis' own wording. Commands
framed before the bad bytes are still delivered first, then `next_event()` raises.

The serializer (`serialize`) turns a Python value into a list of buffers; a large bulk
payload is its own buffer (never concatenated) so the I/O layer can `writelines` it.
"""

from __future__ import annotations

import enum
import itertools
import math
import re
from collections import deque
from collections.abc import Callable
from typing import Final, Literal

from epistemic_kvcache.buffers import alloc_block
from epistemic_kvcache.errors import LocalProtocolError, RemoteProtocolError

Buffer = bytes | bytearray | memoryview
Arg = bytes | bytearray | memoryview
Command = list[Arg]
ReserveFn = Callable[[int], bool | str]
"""Asked before a large bulk is allocated: may the parser hold this many more bytes?
True grants; False or a reason string refuses (the reason ends up in `RefusedCommand`)."""


class RefusedCommand(list[Arg]):
    """Framed in place of a command one of whose large bulks `reserve` refused (or that
    the owner refused while it was being framed, `refuse_partial`).

    It is empty: the command's arguments were read off the wire and dropped. `reason` is
    what `reserve` (or the owner) gave as the reason, `""` if none."""

    __slots__ = ("reason",)

    def __init__(self, reason: str = "") -> None:
        super().__init__()
        self.reason = reason


KiB: Final = 1024
MiB: Final = 1024 * 1024

DEFAULT_MAX_INLINE_BYTES: Final = 64 * KiB
"""Longest inline request, and longest `*N` / `$N` header line (Redis PROTO_INLINE_MAX_SIZE)."""
DEFAULT_MAX_MULTIBULK_LEN: Final = 1024 * 1024
"""Most arguments in one command (Redis' historic multibulk limit, 1024*1024)."""
DEFAULT_MAX_BULK_BYTES: Final = 512 * MiB
"""Longest bulk argument (Redis `proto-max-bulk-len` default, 512 MiB)."""
DEFAULT_UNAUTHENTICATED_MAX_MULTIBULK_LEN: Final = 10
"""Before AUTH: Redis refuses more than 10 arguments (CVE-2021-32675 fix)."""
DEFAULT_UNAUTHENTICATED_MAX_BULK_BYTES: Final = 16 * KiB
"""Before AUTH: Redis refuses bulk arguments over 16 KiB (CVE-2021-32675 fix)."""
DEFAULT_LARGE_BULK_THRESHOLD: Final = 32 * KiB
"""Bulks this long or longer get a preallocated buffer (Redis PROTO_MBULK_BIG_ARG, 32 KiB)."""
DEFAULT_READ_BUFFER_BYTES: Final = 256 * KiB
"""Size of the scratch buffer lent to the socket for everything but large bulks."""
_NO_ROOM: Final = memoryview(b"")
FIRST_READ_AFTER_BIG: Final = 4 * KiB
"""After a large bulk, the next read into the scratch buffer asks for this much: enough
for the next command's header, so a following large bulk is read in place (not copied
out of a full scratch read); a read that fills it asks for the whole buffer again."""
DEFAULT_SERIALIZE_CUTOFF: Final = 16 * KiB
"""Bulk replies this long or longer are returned as their own buffer, never copied."""

COMMAND_OVERHEAD: Final = 128
"""Memory a framed command costs beyond its arguments (list, queue entry), estimated."""
ARG_OVERHEAD: Final = 48
"""Memory one argument costs beyond its bytes (object header, list slot), estimated."""

_INT_RE: Final = re.compile(rb"-?(?:0|[1-9][0-9]{0,18})")
# The fast framer's headers: a count or length `_parse_int` accepts, without the sign
# (the framer leaves negative ones to the state machine), and its CRLF.
_MULTIBULK_HEAD: Final = re.compile(rb"\*(0|[1-9][0-9]{0,18})\r\n")
_BULK_HEAD: Final = re.compile(rb"\$(0|[1-9][0-9]{0,18})\r\n")
_INT64_MAX: Final = 2**63 - 1
_INT64_MIN: Final = -(2**63)
_COMPACT_AT: Final = 64 * KiB


class _NeedData(enum.Enum):
    NEED_DATA = "NEED_DATA"

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = _NeedData.NEED_DATA
"""Returned by `RespParser.next_event()` when no complete command is buffered."""

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


def _perr(detail: str) -> RemoteProtocolError:
    return RemoteProtocolError(f"Protocol error: {detail}")


def _parse_int(raw: Buffer) -> int | None:
    """Strict signed 64-bit decimal (Redis `string2ll`), or None."""
    if _INT_RE.fullmatch(raw) is None:
        return None
    value = int(raw)
    if value > _INT64_MAX or value < _INT64_MIN:
        return None
    return value


def _show_byte(b: int) -> str:
    """A byte as Redis shows it in "expected '$', got 'x'", escaped when unprintable."""
    return chr(b) if 0x20 <= b < 0x7F else f"\\x{b:02x}"


# -- inline commands ------------------------------------------------------------------

_ESCAPES: Final = {
    ord("n"): b"\n",
    ord("r"): b"\r",
    ord("t"): b"\t",
    ord("b"): b"\b",
    ord("a"): b"\a",
}
_HEX: Final = frozenset(b"0123456789abcdefABCDEF")
_SPACE: Final = frozenset(b" \n\r\t\v\f\x00")


def split_inline(line: Buffer) -> list[bytes]:
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


# -- the request parser ---------------------------------------------------------------


class _State(enum.Enum):
    START = 0
    """Between commands: expect `*` (multibulk) or an inline line."""
    ARG_HEADER = 1
    """Inside a multibulk: expect `$len\\r\\n`."""
    ARG_BODY = 2
    """A small bulk: wait until `len + 2` bytes are buffered."""
    BIG_BODY = 3
    """A large bulk: fill the preallocated array, then expect `\\r\\n`."""
    SKIP_BODY = 4
    """A refused large bulk: drop its bytes, then expect `\\r\\n`."""


class RespParser:
    """Sans-IO RESP request parser. See the module docstring for how it works.

    Every limit is a constructor argument; the defaults are Redis' own.
    `authenticated` selects which argument limits apply (set it after AUTH succeeds).
    """

    def __init__(
        self,
        *,
        max_inline_bytes: int = DEFAULT_MAX_INLINE_BYTES,
        max_multibulk_len: int = DEFAULT_MAX_MULTIBULK_LEN,
        max_bulk_bytes: int = DEFAULT_MAX_BULK_BYTES,
        unauthenticated_max_multibulk_len: int = DEFAULT_UNAUTHENTICATED_MAX_MULTIBULK_LEN,
        unauthenticated_max_bulk_bytes: int = DEFAULT_UNAUTHENTICATED_MAX_BULK_BYTES,
        large_bulk_threshold: int = DEFAULT_LARGE_BULK_THRESHOLD,
        read_buffer_bytes: int = DEFAULT_READ_BUFFER_BYTES,
        authenticated: bool = False,
        reserve: ReserveFn | None = None,
        scratch: bytearray | None = None,
        max_ready: int | None = None,
    ) -> None:
        for name, value in (
            ("max_inline_bytes", max_inline_bytes),
            ("max_multibulk_len", max_multibulk_len),
            ("max_bulk_bytes", max_bulk_bytes),
            ("unauthenticated_max_multibulk_len", unauthenticated_max_multibulk_len),
            ("unauthenticated_max_bulk_bytes", unauthenticated_max_bulk_bytes),
            ("large_bulk_threshold", large_bulk_threshold),
            ("read_buffer_bytes", read_buffer_bytes),
        ):
            if value < 1:
                raise ValueError(f"invalid {name}: expected a positive integer (got {value!r})")
        self.max_inline_bytes = max_inline_bytes
        self.max_multibulk_len = max_multibulk_len
        self.max_bulk_bytes = max_bulk_bytes
        self.unauthenticated_max_multibulk_len = unauthenticated_max_multibulk_len
        self.unauthenticated_max_bulk_bytes = unauthenticated_max_bulk_bytes
        self.large_bulk_threshold = large_bulk_threshold
        self.authenticated = authenticated
        self.reserve = reserve
        self.held_bytes = 0
        """Bytes of preallocated bulks held: being filled, in `_args`, in `_ready`."""

        self._buf = bytearray()
        self._pos = 0
        self._shared_scratch = scratch is not None
        self._scratch = scratch if scratch is not None else bytearray(read_buffer_bytes)
        self._lent_big = False
        self._after_big = False
        self.max_ready = max_ready
        """Frame at most this many commands ahead (None: all that are complete); the rest
        stays buffered and is framed as commands are taken, which bounds the work one
        read can cause."""

        self._state = _State.START
        self._args: Command = []
        self._args_bytes = 0
        self._args_left = 0
        self._bulk_len = 0
        self._args_held = 0
        self._big: bytearray | memoryview = bytearray()
        self._big_room: memoryview = _NO_ROOM
        """`_big` and two bytes after it: lent to the socket, so the CRLF that ends the
        bulk arrives in the payload's read, not in a read of its own."""
        self._big_filled = 0
        self._refused = False
        self._refusal = ""
        self._skip = 0

        self._ready: deque[tuple[Command, int, int]] = deque()
        self._ready_bytes = 0
        self._ready_cost = 0
        self._args_cost = 0
        self._error: RemoteProtocolError | None = None
        self.commands_parsed = 0
        """Total commands framed so far (the I/O layer uses it to see progress)."""

    # -- input ------------------------------------------------------------------------
    def receive_data(self, data: Buffer) -> None:
        """Feed received bytes. Never raises; errors surface from `next_event()`."""
        if data:
            self._buf += data
            self._advance()

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """A writable buffer for the next read (`asyncio.BufferedProtocol.get_buffer`).

        While a large bulk is being received this is the unfilled tail of its
        preallocated array, so the payload is read in place; otherwise a scratch buffer.
        Call `buffer_updated(n)` after writing `n` bytes into it, before the next call.
        """
        big = self._big
        if (
            self._state is _State.BIG_BODY
            and self._big_filled < len(big)
            and self._pos == len(self._buf)
            and self._error is None
        ):
            self._lent_big = True
            return self._big_room[self._big_filled :]
        self._lent_big = False
        if sizehint > len(self._scratch) and not self._shared_scratch:
            self._scratch = bytearray(sizehint)
        if self._after_big:
            return memoryview(self._scratch)[:FIRST_READ_AFTER_BIG]
        return memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> None:
        """`nbytes` were written into the buffer from the last `get_buffer()`."""
        if nbytes <= 0:
            return
        if nbytes >= FIRST_READ_AFTER_BIG and not self._lent_big:
            self._after_big = False
        if self._lent_big:
            self._lent_big = False
            filled = self._big_filled + nbytes
            if filled > len(self._big):  # the read went on into the room for the CRLF
                self._buf += self._big_room[len(self._big) : filled]
                filled = len(self._big)
            self._big_filled = filled
        elif (
            self._state is _State.START
            and self._pos >= len(self._buf)
            and self.authenticated
            and self._error is None
        ):
            # Between commands with nothing buffered: frame the complete commands
            # straight from the scratch buffer; only a partial tail is kept.
            room = self._room()
            if room > 0:
                framed: list[Command] = []
                done = self._scan_scratch(nbytes, room, framed)
                for cmd in framed:
                    self._finish(cmd, args_size(cmd))
            else:
                done = 0
            if done == nbytes:
                return
            self._keep_tail(done, nbytes)
        else:
            self._buf += memoryview(self._scratch)[:nbytes]
        self._advance()

    @property
    def can_take(self) -> bool:
        """Whether `take_commands` may be called for the bytes just read: authenticated,
        between commands, nothing buffered, framed or broken, and the read went into
        the scratch buffer (not into a large bulk's array)."""
        return (
            not self._lent_big
            and self._state is _State.START
            and not self._ready
            and self._pos >= len(self._buf)
            and self.authenticated
            and self._error is None
        )

    def take_commands(self, nbytes: int, limit: int) -> list[Command]:
        """The zero-queue variant of `buffer_updated(nbytes)` (only when `can_take`).

        Frames up to `limit` complete small commands at the start of the scratch
        buffer's first `nbytes` bytes and returns them to the caller instead of queueing
        them; the bytes after them are kept, not yet parsed. The caller runs what it can
        at once, hands the rest back in order with `defer`, then calls `advance` to frame
        the kept bytes (which may hold more commands, a large bulk's start or bad input).
        What is taken is exactly what `buffer_updated` would have framed.
        """
        if nbytes >= FIRST_READ_AFTER_BIG:
            self._after_big = False
        framed: list[Command] = []
        done = self._scan_scratch(nbytes, limit, framed)
        self.commands_parsed += len(framed)
        if done < nbytes:
            self._keep_tail(done, nbytes)
        return framed

    def _keep_tail(self, done: int, n: int) -> None:
        """Keep what `_scan_scratch` left of the scratch buffer's first `n` bytes: the
        start of a command with a large bulk goes straight into that bulk's array (no
        copy through the receive buffer), anything else to the state machine."""
        pos = self._begin_big(done, n) if self._room() > 0 else done
        if pos < n:
            self._buf += memoryview(self._scratch)[pos:n]

    def _begin_big(self, pos: int, n: int) -> int:
        """Frame, straight from the scratch buffer, the start of the multibulk command at
        `pos` when its next unread argument is a large bulk: the small arguments before
        it, its preallocated array (`reserve` asked, as by the state machine) and the
        payload bytes already read. Returns where it stopped: `pos` when the input is
        anything else (partial headers, small bulks cut short, bad input), which the
        state machine then frames from the receive buffer as usual."""
        data = self._scratch
        max_line = self.max_inline_bytes
        m = _MULTIBULK_HEAD.match(data, pos, n)
        if m is None or m.end() - 2 - pos > max_line:
            return pos
        count = int(m.group(1))
        if count <= 0 or count > self.max_multibulk_len:
            return pos
        p = m.end()
        small: list[tuple[int, int]] = []
        for _ in range(count):
            m = _BULK_HEAD.match(data, p, n)
            if m is None or m.end() - 2 - p > max_line:
                return pos
            length = int(m.group(1))
            start = m.end()
            if length >= self.large_bulk_threshold:
                if length > self.max_bulk_bytes:
                    return pos  # the state machine raises the protocol error
                break
            end = start + length
            if end + 2 > n or not data.startswith(b"\r\n", end):
                return pos
            small.append((start, end))
            p = end + 2
        else:
            return pos  # all small: a complete command would have been framed
        # The same steps as the state machine's, from `*<count>` to the large bulk.
        view = memoryview(data)
        self._begin_command(count)
        for a, b in small:
            self._push_arg(bytes(view[a:b]))
        self._bulk_len = length
        self._open_large(length)
        avail = min(length, n - start)
        if self._state is _State.BIG_BODY:
            self._big[:avail] = view[start : start + avail]
            self._big_filled = avail
        else:  # refused: its bytes are dropped
            self._skip -= avail
        return start + avail

    def defer(self, commands: list[Command]) -> None:
        """Queue commands `take_commands` returned that the caller did not run, ahead of
        anything framed later (so request order holds)."""
        for cmd in commands:
            self._finish(cmd, args_size(cmd))
            self.commands_parsed -= 1  # counted once, when taken

    def advance(self) -> None:
        """Frame what `take_commands` left buffered (no-op when nothing is)."""
        if self._pos < len(self._buf):
            self._advance()

    def _scan_scratch(self, n: int, room: int, out: list[Command]) -> int:
        """Append to `out` the well-formed, complete, small multibulk commands (at most
        `room`) at the start of the scratch buffer's first `n` bytes; return how many
        bytes they took.

        Anything else (a partial command, a large bulk, an inline or empty request, a
        malformed header) is left to the state machine, which applies every limit and
        raises the errors; what this frames is exactly what it would have framed.
        """
        data = self._scratch
        view = memoryview(data)
        max_line = self.max_inline_bytes
        max_args = self.max_multibulk_len
        max_bulk = min(self.max_bulk_bytes, self.large_bulk_threshold - 1)
        head = _MULTIBULK_HEAD.match
        bulk_head = _BULK_HEAD.match
        crlf = data.startswith
        pos = 0
        while pos < n and room > 0:
            m = head(data, pos, n)  # "*<count>\r\n"
            if m is None or m.end() - 2 - pos > max_line:
                break
            count = int(m.group(1))
            if count <= 0 or count > max_args:
                break
            p = m.end()
            args: Command = []
            for _ in range(count):
                m = bulk_head(data, p, n)  # "$<length>\r\n"
                if m is None or m.end() - 2 - p > max_line:
                    break
                start = m.end()
                end = start + int(m.group(1))
                if end - start > max_bulk or end + 2 > n or not crlf(b"\r\n", end):
                    break
                args.append(bytes(view[start:end]))
                p = end + 2
            else:
                out.append(args)
                room -= 1
                pos = p
                continue
            break
        return pos

    def _room(self) -> int:
        """How many more commands may be framed ahead now."""
        if self.max_ready is None:
            return 1 << 62
        return self.max_ready - len(self._ready)

    def close(self) -> None:
        """Drop everything buffered (the connection is gone) and the `reserve` hook, so
        the memory goes at once rather than when the owner is garbage-collected."""
        self._buf = bytearray()
        self._pos = 0
        self._args = []
        self._args_bytes = self._args_held = self._args_cost = 0
        self._drop_big()
        self._ready.clear()
        self._ready_bytes = self._ready_cost = 0
        self.held_bytes = 0
        self._state = _State.START
        self._refused = False
        self.reserve = None

    # -- output -----------------------------------------------------------------------
    def next_event(self) -> Event:
        """The next complete command, or `NEED_DATA`.

        Raises `RemoteProtocolError` (again on every call) once the input is broken and
        every command framed before the bad bytes has been returned.
        """
        if not self._ready and self._error is None:
            self._advance()
        if self._ready:
            cmd, size, held = self._ready.popleft()
            self._ready_bytes -= size
            self._ready_cost -= size - held + COMMAND_OVERHEAD + ARG_OVERHEAD * len(cmd)
            self.held_bytes -= held
            return cmd
        if self._error is not None:
            raise self._error
        return NEED_DATA

    @property
    def has_ready(self) -> bool:
        """Whether `next_event()` would return a command right now."""
        return bool(self._ready)

    def peek(self) -> Command | None:
        """The command `next_event()` would return next, if one is framed (not consumed)."""
        return self._ready[0][0] if self._ready else None

    def ready_commands(self, limit: int) -> list[Command]:
        """Up to `limit` framed commands, in order, without taking them (`drop_ready`)."""
        return [item[0] for item in itertools.islice(self._ready, limit)]

    def drop_ready(self, count: int) -> None:
        """Take the first `count` framed commands (as `next_event` would, one by one)."""
        for _ in range(count):
            self.next_event()

    @property
    def ready_count(self) -> int:
        """How many framed commands wait for `next_event()`."""
        return len(self._ready)

    @property
    def has_error(self) -> bool:
        """Whether the input is broken (`next_event()` raises once nothing is ready)."""
        return self._error is not None

    @property
    def has_partial(self) -> bool:
        """Whether bytes of a not-yet-complete command are buffered."""
        return self._state is not _State.START or (not self._ready and self._pos < len(self._buf))

    @property
    def buffered_bytes(self) -> int:
        """Bytes held for commands not yet returned (framed, partial or unparsed)."""
        return (
            self._ready_bytes + self._args_bytes + self._big_filled + (len(self._buf) - self._pos)
        )

    @property
    def pending_bytes(self) -> int:
        """Memory held for commands not yet returned, *except* preallocated large bulks
        (`held_bytes`, reserved separately): small arguments with their object overhead
        (framed and partial commands) and the unparsed receive buffer."""
        return self._ready_cost + self._args_cost + len(self._buf)

    @property
    def framing(self) -> bool:
        """Whether a multibulk command is partly framed (arguments pending)."""
        return self._state is not _State.START

    def refuse_partial(self, reason: str = "") -> bool:
        """Drop the arguments of the command being framed; the rest of it is read and
        dropped, and it is framed as a `RefusedCommand`. False when none is in progress."""
        if self._state is _State.START or self._refused:
            return False
        self._refuse(reason)
        return True

    # -- the state machine --------------------------------------------------------------
    def _fail(self, exc: RemoteProtocolError) -> None:
        self._error = exc
        self.held_bytes -= len(self._big) + self._args_held
        self._drop_big()
        self._args = []
        self._args_held = 0
        self._args_cost = 0

    def _advance(self) -> None:
        try:
            self._advance_inner()
        except RemoteProtocolError as exc:
            self._fail(exc)
        buf = self._buf
        if self._pos >= len(buf):
            buf.clear()
            self._pos = 0
        elif self._pos >= _COMPACT_AT:
            del buf[: self._pos]
            self._pos = 0

    def _header_line(self, what: str) -> int:
        """Index of the CR of the current header line, or -1 (checks its length)."""
        buf = self._buf
        cr = buf.find(b"\r\n", self._pos)
        if cr < 0:
            if len(buf) - self._pos > self.max_inline_bytes:
                raise _perr(f"too big {what} count string")
            return -1
        if cr - self._pos > self.max_inline_bytes:
            raise _perr(f"too big {what} count string")
        return cr

    def _advance_inner(self) -> None:
        buf = self._buf
        while self._error is None:
            state = self._state
            if state is _State.START:
                if self._ready and not self.authenticated:
                    return  # lazy before AUTH: limits may change after this command
                if self._pos >= len(buf) or self._room() <= 0:
                    return
                if buf[self._pos] == 0x2A:  # '*'
                    cr = self._header_line("mbulk")
                    if cr < 0:
                        return
                    count = _parse_int(buf[self._pos + 1 : cr])
                    self._pos = cr + 2
                    if count is None or count < -1 or count > self.max_multibulk_len:
                        raise _perr("invalid multibulk length")
                    if not self.authenticated and count > self.unauthenticated_max_multibulk_len:
                        raise _perr("unauthenticated multibulk length")
                    if count <= 0:
                        continue  # `*0` / `*-1`: an empty request, ignored like Redis
                    self._begin_command(count)
                elif not self._inline():
                    return
            elif state is _State.ARG_HEADER:
                if self._pos >= len(buf):
                    return
                first = buf[self._pos]
                if first != 0x24:  # '$'
                    raise _perr(f"expected '$', got '{_show_byte(first)}'")
                cr = self._header_line("bulk")
                if cr < 0:
                    return
                length = _parse_int(buf[self._pos + 1 : cr])
                self._pos = cr + 2
                if length is None or length < 0 or length > self.max_bulk_bytes:
                    raise _perr("invalid bulk length")
                if not self.authenticated and length > self.unauthenticated_max_bulk_bytes:
                    raise _perr("unauthenticated bulk length")
                self._bulk_len = length
                if length < self.large_bulk_threshold:
                    self._state = _State.ARG_BODY
                else:
                    self._open_large(length)
            elif state is _State.ARG_BODY:
                end = self._pos + self._bulk_len
                if len(buf) < end + 2:
                    return
                if buf[end : end + 2] != b"\r\n":
                    raise _perr("expected '\\r\\n' after bulk data")
                self._push_arg(bytes(buf[self._pos : end]))
                self._pos = end + 2
            elif state is _State.SKIP_BODY:
                drop = min(self._skip, len(buf) - self._pos)
                self._skip -= drop
                self._pos += drop
                if self._skip or len(buf) - self._pos < 2:
                    return
                if buf[self._pos : self._pos + 2] != b"\r\n":
                    raise _perr("expected '\\r\\n' after bulk data")
                self._pos += 2
                self._push_arg(b"")
            else:  # BIG_BODY
                big = self._big
                missing = len(big) - self._big_filled
                if missing:
                    avail = min(missing, len(buf) - self._pos)
                    if avail:
                        big[self._big_filled : self._big_filled + avail] = memoryview(buf)[
                            self._pos : self._pos + avail
                        ]
                        self._big_filled += avail
                        self._pos += avail
                    if avail < missing:
                        return
                if len(buf) - self._pos < 2:
                    return
                if buf[self._pos : self._pos + 2] != b"\r\n":
                    raise _perr("expected '\\r\\n' after bulk data")
                self._pos += 2
                self._drop_big()
                self._args_held += len(big)
                self._push_arg(big, big=True)

    def _open_large(self, length: int) -> None:
        """A large bulk's header was read: its preallocated array (once `reserve`
        grants it), or dropping its bytes when refused."""
        if self._refused or not self._granted(length):
            self._refuse(self._refusal)
            self._skip = length
            self._state = _State.SKIP_BODY
        else:
            self._big_room = alloc_block(length, slack=2)
            self._big = self._big_room[:length]
            self._big_filled = 0
            self._after_big = True
            self.held_bytes += length
            self._state = _State.BIG_BODY

    def _drop_big(self) -> None:
        self._big = bytearray()
        self._big_room = _NO_ROOM
        self._big_filled = 0

    def _begin_command(self, count: int) -> None:
        """A multibulk header `*<count>` was read: expect its `count` arguments."""
        self._args_left = count
        self._args = []
        self._args_bytes = 0
        self._args_held = 0
        self._args_cost = COMMAND_OVERHEAD
        self._refused = False
        self._state = _State.ARG_HEADER

    def _granted(self, length: int) -> bool:
        if self.reserve is None:
            return True
        answer = self.reserve(length)
        if answer is True:
            return True
        self._refusal = answer if isinstance(answer, str) else ""
        return False

    def _refuse(self, reason: str = "") -> None:
        """Drop the command being framed (a large bulk of it was refused)."""
        if not self._refused:
            self._refusal = reason
        self._refused = True
        self.held_bytes -= self._args_held
        if self._state is _State.BIG_BODY and not self._lent_big:
            # refused while its large bulk arrives: let the buffer go, skip the rest
            self.held_bytes -= len(self._big)
            self._skip = len(self._big) - self._big_filled
            self._drop_big()
            self._state = _State.SKIP_BODY
        self._args = []
        self._args_bytes = 0
        self._args_held = 0
        self._args_cost = 0

    def _push_arg(self, arg: Arg, *, big: bool = False) -> None:
        if not self._refused:
            self._args.append(arg)
            self._args_bytes += len(arg)
            self._args_cost += ARG_OVERHEAD + (0 if big else len(arg))
        self._args_left -= 1
        if self._args_left:
            self._state = _State.ARG_HEADER
            return
        if self._refused:
            self.held_bytes -= self._args_held  # large bulks read after the refusal
            self._finish(RefusedCommand(self._refusal), 0)
        else:
            self._finish(self._args, self._args_bytes, self._args_held)
        self._args = []
        self._args_bytes = 0
        self._args_held = 0
        self._args_cost = 0
        self._refused = False
        self._state = _State.START

    def _finish(self, cmd: Command, size: int, held: int = 0) -> None:
        self._ready.append((cmd, size, held))
        self._ready_bytes += size
        self._ready_cost += size - held + COMMAND_OVERHEAD + ARG_OVERHEAD * len(cmd)
        self.commands_parsed += 1

    def _inline(self) -> bool:
        """Frame one inline line; False when more data is needed."""
        buf = self._buf
        nl = buf.find(b"\n", self._pos)
        if nl < 0:
            if len(buf) - self._pos > self.max_inline_bytes:
                raise _perr("too big inline request")
            return False
        if nl - self._pos > self.max_inline_bytes:
            raise _perr("too big inline request")
        end = nl - 1 if nl > self._pos and buf[nl - 1] == 0x0D else nl
        line = buf[self._pos : end]
        self._pos = nl + 1
        args: Command = list(split_inline(line))
        if not args:
            return True
        if not self.authenticated and (
            len(args) > self.unauthenticated_max_multibulk_len
            or any(len(a) > self.unauthenticated_max_bulk_bytes for a in args)
        ):
            raise _perr("unauthenticated inline request")
        self._finish(args, sum(len(a) for a in args))
        return True


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
