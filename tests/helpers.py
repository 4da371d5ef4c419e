"""Test helpers shared by every module: waiting for a condition, holding a port.

- `eventually(predicate, timeout=..., interval=...)` polls until `predicate()` returns a
  truthy value and returns it, or fails with the last value after `timeout` seconds.
  `eventually_async` is its twin for coroutines (the predicate may be sync or async).
  Use these instead of a fixed `sleep` whenever a test waits for something to happen.
- `reserve_port()` returns a `PortReservation`: a loopback port held by a bound,
  non-listening socket with SO_REUSEADDR for as long as the reservation lives. Nobody
  else can take the port (a plain bind fails, and the kernel never hands it out for
  `bind(port 0)` or an outgoing connection), but a server that binds with SO_REUSEADDR
  (redis-server, asyncio, uvicorn) can listen on it, be killed, and be started again on
  it later. See the rule in tests/conftest.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

T = TypeVar("T")


def eventually(
    predicate: Callable[[], T],
    *,
    timeout: float = 10.0,
    interval: float = 0.02,
    what: str = "",
) -> T:
    """Poll `predicate()` until it returns a truthy value (returned); AssertionError after
    `timeout` seconds, naming `what` and the last value (or exception) seen."""
    deadline = time.monotonic() + timeout
    while True:
        last: object
        try:
            value = predicate()
        except AssertionError as exc:  # an assert inside the predicate: not yet
            last = exc
        else:
            if value:
                return value
            last = value
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"not within {timeout} s: {what or repr(predicate)}; last: {last!r}"
            )
        time.sleep(interval)


async def eventually_async(
    predicate: Callable[[], T | Awaitable[T]],
    *,
    timeout: float = 10.0,
    interval: float = 0.02,
    what: str = "",
) -> T:
    """`eventually` for coroutines: the predicate may return a value or an awaitable."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        last: object
        try:
            got = predicate()
            value: T = await got if inspect.isawaitable(got) else got  # type: ignore[assignment]
        except AssertionError as exc:
            last = exc
        else:
            if value:
                return value
            last = value
        if loop.time() >= deadline:
            raise AssertionError(
                f"not within {timeout} s: {what or repr(predicate)}; last: {last!r}"
            )
        await asyncio.sleep(interval)


class PortReservation:
    """A loopback TCP port held for the life of this object (see the module docstring)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self.port: int = int(self._sock.getsockname()[1])

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reserve_port(host: str = "127.0.0.1") -> PortReservation:
    """A port that stays ours until `.close()` (a server with SO_REUSEADDR may use it)."""
    return PortReservation(host)


_HELD: list[PortReservation] = []


def held_port(host: str = "127.0.0.1") -> int:
    """A port reserved for the rest of this test process: use it where a test needs a
    port with nothing listening (connections are refused) or starts a server on it
    (with SO_REUSEADDR, as asyncio, uvloop, uvicorn, zmq and redis-server bind), also
    again after killing that server."""
    held = PortReservation(host)
    _HELD.append(held)
    return held.port


class FakeClock:
    """A clock for stores' `clock=` parameter that moves only when the test says so."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of `size` mounted at `path` (created) for the block; the test is
    skipped where mounting is not allowed (needs root and mount)."""
    path.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            check=True,
            capture_output=True,
        )
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here (needs root and mount): {exc}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
