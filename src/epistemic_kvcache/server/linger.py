"""The lingering close both wires use after a connection's last answer.

How it works: closing a TCP socket while unread input waits in it makes the kernel send
a reset, and a reset can overtake the answers still in flight, so the peer would never
read its last answer. After a final answer (an HTTP error that ends the connection, a
graceful stop's last reply) a connection therefore shuts only its write side
(`write_eof`: the peer reads its answers, then EOF), keeps reading and dropping input,
and closes when the peer does, after `LINGER_S`, or once it has dropped more than
`LINGER_MAX_BYTES`. A transport that cannot half-close (TLS) is closed at once.
`DRAIN_IDLE_S` is how long either wire waits, in a graceful stop, for a request from a
connection that sent none before closing it.
"""

from __future__ import annotations

import asyncio
from typing import Final

LINGER_S: Final = 2.0
"""After the write side is shut, read and drop input this long at most."""
LINGER_MAX_BYTES: Final = 16 * 1024 * 1024
"""... and drop at most this much before cutting the connection."""
DRAIN_IDLE_S: Final = 0.25
"""Graceful stop: a connection that sent nothing for this long since the stop began is
closed (one that sends a request first is closed right after its answer)."""


class Linger:
    """One connection's lingering close (see the module docstring)."""

    __slots__ = ("dropped", "timer")

    def __init__(self) -> None:
        self.dropped = 0
        """Bytes of input read and dropped since the write side was shut."""
        self.timer: asyncio.TimerHandle | None = None
        """The close `LINGER_S` after the shut (None: not lingering)."""

    @property
    def active(self) -> bool:
        """Whether the write side was shut and the connection lingers."""
        return self.timer is not None

    def start(self, loop: asyncio.AbstractEventLoop, transport: asyncio.Transport) -> bool:
        """Shut `transport`'s write side and close it `LINGER_S` from now. False when it
        was closed at once instead (it cannot half-close, or the shut failed)."""
        if not transport.can_write_eof():
            transport.close()
            return False
        try:
            transport.write_eof()
        except (OSError, RuntimeError):
            transport.close()
            return False
        self.timer = loop.call_later(LINGER_S, transport.close)
        return True

    def drop(self, transport: asyncio.BaseTransport | None, nbytes: int) -> None:
        """`nbytes` more input was read and dropped; past `LINGER_MAX_BYTES` the
        connection is cut."""
        self.dropped += nbytes
        if self.dropped > LINGER_MAX_BYTES and transport is not None:
            transport.close()

    def cancel(self) -> None:
        """The connection is gone: the close is no longer due."""
        if self.timer is not None:
            self.timer.cancel()
