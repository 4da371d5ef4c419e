"""Sans-IO RESP request framing: `RespParser`, bytes in, commands out.

Surface
-------
Input: `get_buffer(sizehint)` / `buffer_updated(n)` (the zero-copy pair that
`asyncio.BufferedProtocol` calls) or `feed(data)`. Output: `next_command()` (a list of
arguments, or `NEED_DATA`), `peek()`, and `unread(commands)` to put commands the owner
took but did not run back at the front. A few read-only figures serve the owner's
accounting (`held_bytes`, `pending_bytes`, `buffered_bytes`, `has_partial`,
`commands_parsed`, `has_error`), `refuse_partial` and `close` its memory limits. That is
the whole seam: this file is also compiled by Cython into its twin, proto/_resp_parser_c
(setup.py; the C types are in proto/_resp_parser_c.pxd, proto/resp_framer.py picks the
twin at import), the way hiredis slots under redis-py. tests/test_proto_resp_framer.py
holds this class to the byte-at-a-time reference, tests/test_proto_resp_twins.py the
twin to this class.

How it frames
-------------
One resumable state machine (`_frame`) runs over whatever holds the unread bytes: the
read buffer itself when nothing was left over from the previous read (so a read of
complete commands is framed without being copied), else the receive buffer the leftover
went to. Per state it takes as much as the bytes allow: a `*N` / `$N` header in
canonical form is read in one step (`_canonical_head`; anything else goes to the careful
path, proto/resp_rules.py `careful_head`, which applies every limit and raises Redis'
wording), and a run of small bulks is framed in one inner loop. Fed one byte at a time
it is the byte-at-a-time state machine; fed a whole read it is the fast framer: the
same code, so the two agree.

Two request forms, as Redis' `networking.c`: multibulk (`*N\\r\\n$len\\r\\n<bytes>\\r\\n...`)
and inline (`SET k v\\n`, for telnet and hand-typed input; proto/resp_inline.py).

A bulk argument of at least `large_bulk_threshold` bytes gets a `bytearray` of exactly
its announced size as soon as its `$len` header is parsed; from then on `get_buffer`
hands out the unfilled tail of that array, so the socket reads the payload straight into
its final home (no chunk list, no join, no second copy). This is the one place where own
RESP code beats hiredis, which buffers a whole bulk before returning it.

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
ran. Once authenticated it frames eagerly (at most `max_ready` commands ahead), which
lets big pipelined payloads land in preallocated buffers.

A violation is raised as `RemoteProtocolError` carrying Redis' own wording. Commands
framed before the bad bytes are still delivered first, then `next_command()` raises.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Final

from epistemic_kvcache.buffers import alloc_block
from epistemic_kvcache.errors import RemoteProtocolError
from epistemic_kvcache.proto import resp_rules as rules
from epistemic_kvcache.proto.resp_inline import inline_command
from epistemic_kvcache.proto.resp_rules import KiB, careful_head, show_byte
from epistemic_kvcache.proto.resp_rules import protocol_error as _perr
from epistemic_kvcache.proto.resp_types import NEED_DATA, RefusedCommand, args_size

if TYPE_CHECKING:
    from epistemic_kvcache.proto.resp_types import Arg, Buffer, Command, Event, ReserveFn

_NO_ROOM: Final = memoryview(b"")
FIRST_READ_AFTER_BIG: Final = 4 * KiB
"""After a large bulk, the next read into the scratch buffer asks for this much: enough
for the next command's header, so a following large bulk is read in place (not copied
out of a full scratch read); a read that fills it asks for the whole buffer again."""

COMMAND_OVERHEAD: Final = 128
"""Memory a framed command costs beyond its arguments (list, queue entry), estimated."""
ARG_OVERHEAD: Final = 48
"""Memory one argument costs beyond its bytes (object header, list slot), estimated."""

_HEAD_DIGITS: Final = 18
"""Most digits of a header read in one step (`_canonical_head`); 10**18 - 1 fits a C
64-bit integer, so the compiled twin scans it without Python integers."""
_COMPACT_AT: Final = 64 * KiB


def _canonical_head(
    data: bytearray, pos: int, end: int, marker: int, max_line: int
) -> tuple[int, int]:
    """The `*N` / `$N` header at `pos` in one step: (N, where its CRLF ends), when it is
    complete and canonical (`marker`, an unsigned decimal of at most `_HEAD_DIGITS`
    digits without a leading zero, CRLF, the line no longer than `max_line`); else
    (-1, pos), and the caller's careful path applies every limit and Redis' wording.
    A byte loop rather than a regular expression: compiled, it runs on C integers."""
    if data[pos] != marker:
        return -1, pos
    i = pos + 1
    stop = min(end, pos + _HEAD_DIGITS + 2)  # the digits and the CR
    value = 0
    while i < stop:
        c = data[i]
        if c == 0x0D:
            break
        if c < 0x30 or c > 0x39:
            return -1, pos
        value = value * 10 + (c - 0x30)
        i += 1
    else:
        return -1, pos  # no CR yet (or too many digits)
    digits = i - pos - 1
    if (
        digits == 0
        or (digits > 1 and data[pos + 1] == 0x30)
        or i + 1 >= end
        or data[i + 1] != 0x0A
        or i - pos > max_line
    ):
        return -1, pos
    return value, i + 2


# -- the request parser ---------------------------------------------------------------


# The framer's states (plain ints: the compiled twin keeps them in a C integer).
_START: Final = 0
"""Between commands: expect `*` (multibulk) or an inline line."""
_ARG_HEADER: Final = 1
"""Inside a multibulk: expect `$len\\r\\n`."""
_ARG_BODY: Final = 2
"""A small bulk: wait until `len + 2` bytes are buffered."""
_BIG_BODY: Final = 3
"""A large bulk: fill the preallocated array, then expect `\\r\\n`."""
_SKIP_BODY: Final = 4
"""A refused large bulk: drop its bytes, then expect `\\r\\n`."""


class RespParser:
    """Sans-IO RESP request parser. See the module docstring for how it works.

    Every limit is a constructor argument; the defaults are Redis' own (resp_rules.py).
    `authenticated` selects which argument limits apply (set it after AUTH succeeds).
    """

    def __init__(
        self,
        *,
        max_inline_bytes: int = rules.DEFAULT_MAX_INLINE_BYTES,
        max_multibulk_len: int = rules.DEFAULT_MAX_MULTIBULK_LEN,
        max_bulk_bytes: int = rules.DEFAULT_MAX_BULK_BYTES,
        unauthenticated_max_multibulk_len: int = rules.DEFAULT_UNAUTHENTICATED_MAX_MULTIBULK_LEN,
        unauthenticated_max_bulk_bytes: int = rules.DEFAULT_UNAUTHENTICATED_MAX_BULK_BYTES,
        large_bulk_threshold: int = rules.DEFAULT_LARGE_BULK_THRESHOLD,
        read_buffer_bytes: int = rules.DEFAULT_READ_BUFFER_BYTES,
        authenticated: bool = False,
        reserve: ReserveFn | None = None,
        scratch: bytearray | None = None,
        max_ready: int | None = None,
    ) -> None:
        rules.check_limits(
            max_inline_bytes=max_inline_bytes,
            max_multibulk_len=max_multibulk_len,
            max_bulk_bytes=max_bulk_bytes,
            unauthenticated_max_multibulk_len=unauthenticated_max_multibulk_len,
            unauthenticated_max_bulk_bytes=unauthenticated_max_bulk_bytes,
            large_bulk_threshold=large_bulk_threshold,
            read_buffer_bytes=read_buffer_bytes,
        )
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
        self.max_ready = max_ready
        """Frame at most this many commands ahead (None: all that are complete); the rest
        stays buffered and is framed as commands are taken, which bounds the work one
        read can cause."""
        self.commands_parsed = 0
        """Total commands framed so far (the owner uses it to see progress)."""

        self._buf = bytearray()
        """Unread bytes left over from earlier reads (from `_pos` on)."""
        self._pos = 0
        self._shared_scratch = scratch is not None
        self._scratch = scratch if scratch is not None else bytearray(read_buffer_bytes)
        self._lent_big = False
        self._after_big = False

        self._state = _START
        self._args: Command = []
        self._args_bytes = 0
        self._args_left = 0
        self._bulk_len = 0
        self._args_held = 0
        self._args_cost = 0
        self._big: bytearray | memoryview = bytearray()
        self._big_room: memoryview = _NO_ROOM
        """`_big` and two bytes after it: lent to the socket, so the CRLF that ends the
        bulk arrives in the payload's read, not in a read of its own."""
        self._big_filled = 0
        self._refused = False
        self._refusal = ""
        self._skip = 0

        self._ready: deque[tuple[Command, int, int, int]] = deque()
        """Framed commands not yet taken: (command, size, held, cost)."""
        self._ready_bytes = 0
        self._ready_cost = 0
        self._error: RemoteProtocolError | None = None

    # -- input ------------------------------------------------------------------------
    def feed(self, data: Buffer) -> None:
        """Feed received bytes. Never raises; errors surface from `next_command()`."""
        if data:
            self._buf += data
            self._advance()

    receive_data = feed

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """A writable buffer for the next read (`asyncio.BufferedProtocol.get_buffer`).

        While a large bulk is being received this is the unfilled tail of its
        preallocated array, so the payload is read in place; otherwise a scratch buffer.
        Call `buffer_updated(n)` after writing `n` bytes into it, before the next call.
        """
        if (
            self._state == _BIG_BODY
            and self._big_filled < len(self._big)
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
        """`nbytes` were written into the buffer from the last `get_buffer()`: frame them.

        When nothing was left over from earlier reads the bytes are framed where they
        lie (the scratch buffer); only what is left unframed is copied out."""
        if nbytes <= 0:
            return
        if self._lent_big:
            self._lent_big = False
            filled = self._big_filled + nbytes
            if filled > len(self._big):  # the read went on into the room for the CRLF
                self._buf += self._big_room[len(self._big) : filled]
                filled = len(self._big)
            self._big_filled = filled
            self._advance()
            return
        if nbytes >= FIRST_READ_AFTER_BIG:
            self._after_big = False
        if self._pos < len(self._buf) or self._error is not None:
            self._buf += memoryview(self._scratch)[:nbytes]
            self._advance()
            return
        scratch = self._scratch
        try:
            done = self._frame(scratch, 0, nbytes)
        except RemoteProtocolError as exc:
            self._fail(exc)
            return
        if done < nbytes:
            self._buf += memoryview(scratch)[done:nbytes]

    # -- output -----------------------------------------------------------------------
    def next_command(self) -> Event:
        """The next complete command, or `NEED_DATA`.

        Raises `RemoteProtocolError` (again on every call) once the input is broken and
        every command framed before the bad bytes has been returned.
        """
        ready = self._ready
        if not ready and self._error is None and self._pos < len(self._buf):
            self._advance()  # bytes left unframed (`max_ready`, or lazy before AUTH)
        if ready:
            cmd, size, held, cost = ready.popleft()
            self._ready_bytes -= size
            self._ready_cost -= cost
            self.held_bytes -= held
            return cmd
        if self._error is not None:
            raise self._error
        return NEED_DATA

    next_event = next_command

    def peek(self) -> Command | None:
        """The command `next_command()` would return next, if one is framed (not taken)."""
        return self._ready[0][0] if self._ready else None

    def unread(self, commands: list[Command]) -> None:
        """Put commands taken with `next_command` back at the front, in order (the owner
        did not run them); they count as buffered and held again."""
        for cmd in reversed(commands):
            size = held = 0
            if not isinstance(cmd, RefusedCommand):
                for arg in cmd:  # (large bulks, held apart, are the non-`bytes` ones)
                    size += len(arg)
                    if type(arg) is not bytes:
                        held += len(arg)
            cost = size - held + COMMAND_OVERHEAD + ARG_OVERHEAD * len(cmd)
            self._ready.appendleft((cmd, size, held, cost))
            self._ready_bytes += size
            self._ready_cost += cost
            self.held_bytes += held

    # -- what the owner accounts ------------------------------------------------------
    @property
    def has_error(self) -> bool:
        """Whether the input is broken (`next_command()` raises once nothing is ready)."""
        return self._error is not None

    @property
    def has_partial(self) -> bool:
        """Whether bytes of a not-yet-complete command are buffered."""
        return self._state != _START or (not self._ready and self._pos < len(self._buf))

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

    def refuse_partial(self, reason: str = "") -> bool:
        """Drop the arguments of the command being framed; the rest of it is read and
        dropped, and it is framed as a `RefusedCommand`. False when none is in progress."""
        if self._state == _START or self._refused:
            return False
        self._refuse(reason)
        return True

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
        self._state = _START
        self._refused = False
        self.reserve = None

    # -- the framer -------------------------------------------------------------------
    def _advance(self) -> None:
        """Frame what the receive buffer holds, then compact it."""
        buf = self._buf
        if self._error is not None:
            buf.clear()  # nothing after the bad bytes is framed
            self._pos = 0
            return
        try:
            self._pos = self._frame(buf, self._pos, len(buf))
        except RemoteProtocolError as exc:
            self._fail(exc)
        if self._pos >= len(buf):
            buf.clear()
            self._pos = 0
        elif self._pos >= _COMPACT_AT:
            del buf[: self._pos]
            self._pos = 0

    def _fail(self, exc: RemoteProtocolError) -> None:
        """The input is broken: keep the error, drop the command being framed and the
        unread bytes (nothing after the bad bytes is ever framed)."""
        self._error = exc
        self.held_bytes -= len(self._big) + self._args_held
        self._drop_big()
        self._args = []
        self._args_bytes = self._args_held = self._args_cost = 0
        self._buf = bytearray()
        self._pos = 0

    def _frame(self, data: bytearray, pos: int, end: int) -> int:
        """Frame the bytes `data[pos:end]` as far as they go; return where it stopped.

        The one framer: a resumable state machine (`_state` and the command being framed
        carry over to the next call), each state taking as much as the bytes allow.
        Raises `RemoteProtocolError` at the first bad byte.

        START and ARG_HEADER share one loop over a command's arguments that keeps the
        command in local variables (written back to the parser only when the bytes run
        out mid-command or a large bulk starts), so a read of complete small commands
        is framed without a call per argument or per command."""
        ready = self._ready
        with memoryview(data) as view:
            while True:
                state = self._state
                if state == _START:
                    if pos >= end or (ready and not self.authenticated):
                        return pos  # lazy before AUTH: limits may change after a command
                    max_ready = self.max_ready
                    if max_ready is not None and len(ready) >= max_ready:
                        return pos
                    if data[pos] != 0x2A:  # not '*': an inline command (proto/resp_inline.py)
                        found = inline_command(data, pos, end, self)
                        if found is None:
                            return pos
                        if found[0]:
                            self._finish(found[0], args_size(found[0]))
                        pos = found[1]
                        continue
                    value, after = _canonical_head(data, pos, end, 0x2A, self.max_inline_bytes)
                    if value >= 0:
                        count: int | None = value
                        pos = after
                    else:
                        count, after = careful_head(data, pos, end, "mbulk", self.max_inline_bytes)
                        if after < 0:
                            return pos
                        pos = after
                    if count is None or count < -1 or count > self.max_multibulk_len:
                        raise _perr("invalid multibulk length")
                    if not self.authenticated and count > self.unauthenticated_max_multibulk_len:
                        raise _perr("unauthenticated multibulk length")
                    if count <= 0:  # `*0` / `*-1`: an empty request, ignored like Redis
                        continue
                    args: Command = []
                    nbytes = held = 0
                    left = count
                    refused = False
                elif state == _ARG_HEADER:
                    args = self._args
                    nbytes = self._args_bytes
                    held = self._args_held
                    left = self._args_left
                    refused = self._refused
                elif state == _ARG_BODY:
                    stop = pos + self._bulk_len
                    if end < stop + 2:
                        return pos
                    if data[stop] != 0x0D or data[stop + 1] != 0x0A:
                        raise _perr("expected '\\r\\n' after bulk data")
                    self._push_arg(bytes(view[pos:stop]))
                    pos = stop + 2
                    continue
                elif state == _BIG_BODY:
                    big = self._big
                    missing = len(big) - self._big_filled
                    if missing:
                        avail = min(missing, end - pos)
                        if avail:
                            filled = self._big_filled
                            big[filled : filled + avail] = view[pos : pos + avail]
                            self._big_filled = filled + avail
                            pos += avail
                        if avail < missing:
                            return pos
                    if end - pos < 2:
                        return pos
                    if data[pos] != 0x0D or data[pos + 1] != 0x0A:
                        raise _perr("expected '\\r\\n' after bulk data")
                    pos += 2
                    self._drop_big()
                    self._args_held += len(big)
                    self._push_arg(big, big=True)
                    continue
                else:  # SKIP_BODY
                    drop = min(self._skip, end - pos)
                    self._skip -= drop
                    pos += drop
                    if self._skip or end - pos < 2:
                        return pos
                    if data[pos] != 0x0D or data[pos + 1] != 0x0A:
                        raise _perr("expected '\\r\\n' after bulk data")
                    pos += 2
                    self._push_arg(b"")
                    continue

                # The arguments of the command (`left` to go), small ones in this loop.
                max_line = self.max_inline_bytes
                max_bulk = self.max_bulk_bytes
                auth_limit = None if self.authenticated else self.unauthenticated_max_bulk_bytes
                small_max = min(self.large_bulk_threshold - 1, max_bulk, auth_limit or max_bulk)
                while left:
                    if pos >= end:
                        length = -1  # waiting for a header
                        break
                    length, start = _canonical_head(data, pos, end, 0x24, max_line)
                    if length < 0:
                        if data[pos] != 0x24:  # '$'
                            raise _perr(f"expected '$', got '{show_byte(data[pos])}'")
                        parsed, start = careful_head(data, pos, end, "bulk", max_line)
                        if start < 0:
                            length = -1
                            break
                        if parsed is None or parsed < 0:
                            raise _perr("invalid bulk length")
                        length = parsed
                    if length > small_max:
                        if length > max_bulk:
                            raise _perr("invalid bulk length")
                        if auth_limit is not None and length > auth_limit:
                            raise _perr("unauthenticated bulk length")
                        pos = start
                        break  # a large bulk
                    stop = start + length
                    if end < stop + 2:
                        pos = start
                        break  # a small bulk cut short
                    if data[stop] != 0x0D or data[stop + 1] != 0x0A:
                        raise _perr("expected '\\r\\n' after bulk data")
                    if not refused:
                        args.append(bytes(view[start:stop]))
                        nbytes += length
                    pos = stop + 2
                    left -= 1
                if left:  # stopped inside the command: it carries over in the parser
                    self._args = args
                    self._args_bytes = nbytes
                    self._args_held = held
                    self._args_left = left
                    self._args_cost = (
                        0
                        if refused
                        else COMMAND_OVERHEAD + ARG_OVERHEAD * len(args) + nbytes - held
                    )
                    self._refused = refused
                    self._state = _ARG_HEADER
                    if length < 0:
                        return pos
                    self._bulk_len = length
                    if length > small_max:
                        self._open_large(length)
                        continue
                    self._state = _ARG_BODY
                    return pos
                # The command is complete.
                if state != _START:
                    self._args = []
                    self._args_bytes = self._args_held = self._args_cost = 0
                    self._refused = False
                    self._state = _START
                if refused:
                    self.held_bytes -= held  # large bulks read after the refusal
                    self._finish(RefusedCommand(self._refusal), 0)
                    continue
                cost = nbytes - held + COMMAND_OVERHEAD + ARG_OVERHEAD * len(args)
                ready.append((args, nbytes, held, cost))
                self._ready_bytes += nbytes
                self._ready_cost += cost
                self.commands_parsed += 1

    def _open_large(self, length: int) -> None:
        """A large bulk's header was read: its preallocated array (once `reserve`
        grants it), or dropping its bytes when refused."""
        if self._refused or not self._granted(length):
            self._refuse(self._refusal)
            self._skip = length
            self._state = _SKIP_BODY
        else:
            self._big_room = alloc_block(length, slack=2)
            self._big = self._big_room[:length]
            self._big_filled = 0
            self._after_big = True
            self.held_bytes += length
            self._state = _BIG_BODY

    def _drop_big(self) -> None:
        self._big = bytearray()
        self._big_room = _NO_ROOM
        self._big_filled = 0

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
        if self._state == _BIG_BODY and not self._lent_big:
            # refused while its large bulk arrives: let the buffer go, skip the rest
            self.held_bytes -= len(self._big)
            self._skip = len(self._big) - self._big_filled
            self._drop_big()
            self._state = _SKIP_BODY
        self._args = []
        self._args_bytes = 0
        self._args_held = 0
        self._args_cost = 0

    def _push_arg(self, arg: Arg, *, big: bool = False) -> bool:
        """One argument framed; True when it completed the command (state START)."""
        if not self._refused:
            self._args.append(arg)
            self._args_bytes += len(arg)
            self._args_cost += ARG_OVERHEAD + (0 if big else len(arg))
        self._args_left -= 1
        if self._args_left:
            self._state = _ARG_HEADER
            return False
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
        self._state = _START
        return True

    def _finish(self, cmd: Command, size: int, held: int = 0) -> None:
        """A command framed (`_frame` does the same inline for a complete small one)."""
        cost = size - held + COMMAND_OVERHEAD + ARG_OVERHEAD * len(cmd)
        self._ready.append((cmd, size, held, cost))
        self._ready_bytes += size
        self._ready_cost += cost
        self.commands_parsed += 1
