"""Large replies copied into the socket without the GIL (both wires' reply writes).

How it works
------------
uvloop's `transport.write` first tries `write(2)` itself (`UVStream._try_write`) while
holding the GIL, so the kernel copy of a 4 MiB GET reply (most of that request's CPU)
holds the GIL: the event-loop thread's GIL-held share of its CPU was 0.94-0.95 for 4 MiB
GETs, which caps what several loops in one process can gain (docs/benchmarks.md,
"Event-loop scaling"). `os.write`/`os.writev` release the GIL around the system call.

`ReplyWriter.write(transport, buffers)` therefore writes a reply of at least
`DIRECT_MIN_BYTES` straight to the socket's fd when that is safe, and hands whatever the
socket did not take (or everything, on any error) to `transport.write`/`writelines`,
after it, so bytes keep their order. Direct is safe only when:
- the transport is a plain stream transport whose own first step is the same write(2)
  on the same fd: uvloop's `TCPTransport`/`UnixTransport` or asyncio's selector
  transport (`_DIRECT_TRANSPORTS`). A TLS transport (uvloop's or asyncio's
  `_SSLProtocolTransport`, whose `get_extra_info("socket")` is the raw socket) or any
  other transport always goes through `transport.write`;
- the transport is not closing (its fd may already be closed and reused);
- nothing is queued: `get_write_buffer_size() == 0`. For uvloop that is libuv's
  `write_queue_size` (bytes of `uv_write` requests not yet written) plus uvloop's own
  buffer (`stream.pyx` `_get_write_buffer_size`), so 0 means no write is in flight in
  libuv either; for asyncio it is its buffer. A transport with nothing queued is not
  paused for writing either (it resumes at its low-water mark).

Errors: `BlockingIOError` (the socket is full) wrote nothing; any other `OSError`
(a reset or closed peer) also wrote nothing, and the whole reply goes to the transport,
which meets the same error in its own write and reports it its usual way (connection
lost with the exception). Flow control and the output accounting are untouched: the
caller still reads `get_write_buffer_size()` after the call, which now counts only the
remainder the transport holds, and the transport pauses the protocol as before when that
remainder crosses its high-water mark.

Below `DIRECT_MIN_BYTES` the reply goes to the transport as before: releasing and
retaking the GIL costs more than the copy it frees. At most `IOV_MAX` pieces go in one
`writev`; the pieces after them follow through the transport.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Final

Buffer = bytes | bytearray | memoryview

DIRECT_MIN_BYTES: Final = 64 * 1024
"""Replies this large or larger are written to the socket directly (GIL released)."""
IOV_MAX: Final = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
"""Pieces per `writev` call."""
_DIRECT_TRANSPORTS: Final = frozenset(
    {
        ("uvloop.loop", "TCPTransport"),
        ("uvloop.loop", "UnixTransport"),
        ("asyncio.selector_events", "_SelectorSocketTransport"),
    }
)
"""(module, class) of the transports whose first write is a plain write(2) on the fd."""
_UNKNOWN: Final = -2
_NOT_DIRECT: Final = -1


def direct_fd(transport: asyncio.BaseTransport) -> int:
    """The socket fd `transport` writes to, when writing to it directly is equivalent to
    the transport's own first write (plain TCP or Unix stream, no TLS); else -1."""
    kind = type(transport)
    if (kind.__module__, kind.__qualname__) not in _DIRECT_TRANSPORTS:
        return _NOT_DIRECT
    if transport.get_extra_info("sslcontext") is not None:
        return _NOT_DIRECT
    sock = transport.get_extra_info("socket")
    if sock is None:
        return _NOT_DIRECT
    try:
        fd = int(sock.fileno())
    except (OSError, ValueError):
        return _NOT_DIRECT
    return fd if fd >= 0 else _NOT_DIRECT


def nbytes_of(buffers: Sequence[Buffer]) -> int:
    """Bytes in `buffers` (a memoryview counts its bytes, not its items)."""
    total = 0
    for buf in buffers:
        total += buf.nbytes if type(buf) is memoryview else len(buf)
    return total


def unsent(buffers: Sequence[Buffer], sent: int) -> list[Buffer]:
    """What is left of `buffers` after their first `sent` bytes went out (no copy: the
    piece cut in two becomes a byte view of its tail)."""
    for i, buf in enumerate(buffers):
        size = buf.nbytes if type(buf) is memoryview else len(buf)
        if sent < size:
            rest: list[Buffer] = list(buffers[i + 1 :])
            if sent:
                view = buf if type(buf) is memoryview else memoryview(buf)
                rest.insert(0, view.cast("B")[sent:] if view.format != "B" else view[sent:])
            else:
                rest.insert(0, buf)
            return rest
        sent -= size
    return []


class ReplyWriter:
    """One connection's reply writes: large ones to the socket first, without the GIL
    (see the module docstring). Create one per connection; `fd` (tests) overrides the
    transport's socket."""

    __slots__ = ("_fd", "direct_bytes", "min_bytes")

    def __init__(self, *, fd: int = _UNKNOWN, min_bytes: int = DIRECT_MIN_BYTES) -> None:
        self._fd = fd
        self.min_bytes = min_bytes
        self.direct_bytes = 0
        """Bytes written directly so far (tests, diagnostics)."""

    def write(self, transport: asyncio.WriteTransport, buffers: Sequence[Buffer]) -> None:
        """Write `buffers` in order: directly while the socket takes them (large replies,
        nothing queued, no TLS), the rest through `transport`."""
        if not buffers:
            return
        if len(buffers) == 1:
            one = buffers[0]
            size = one.nbytes if type(one) is memoryview else len(one)
            if size < self.min_bytes:
                transport.write(one)
                return
        elif nbytes_of(buffers) < self.min_bytes:
            transport.writelines(buffers)
            return
        fd = self._fd
        if fd == _UNKNOWN:
            self._fd = fd = direct_fd(transport)
        sent = 0
        if fd >= 0 and not transport.is_closing() and transport.get_write_buffer_size() == 0:
            try:
                if len(buffers) == 1:
                    sent = os.write(fd, buffers[0])
                else:
                    sent = os.writev(fd, buffers[:IOV_MAX])
            except OSError:
                sent = 0  # full (EAGAIN), or broken: the transport's own write tells
            self.direct_bytes += sent
        rest = unsent(buffers, sent) if sent else buffers
        if len(rest) == 1:
            transport.write(rest[0])
        elif rest:
            transport.writelines(rest)
