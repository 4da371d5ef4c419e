"""Clients that go away halfway, for the tests of what a server releases then."""

from __future__ import annotations

import socket
import struct
import time

from epistemic_kvcache.server.budget import MemoryBudget


def reset(sock: socket.socket, *, settle_s: float = 0.05) -> None:
    """Let the server read what was sent, then close with a RST (no FIN, no reading).

    The settle time is a delay on purpose, not a wait for a state: had the server not
    read everything yet, it sees the reset mid-request, which is a hang-up as well."""
    time.sleep(settle_s)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def wait_released(budget: MemoryBudget, timeout_s: float = 10.0) -> int:
    """Wait until the server holds no in-flight bytes; returns what is still held."""
    deadline = time.monotonic() + timeout_s
    while budget.used and time.monotonic() < deadline:
        time.sleep(0.01)
    return budget.used
