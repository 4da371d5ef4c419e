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
- `FakeClock`: a clock for the stores' `clock=` parameter that moves when told to.
- `FakeTransport` + `feed(protocol, data)`: an `asyncio.Transport` stand-in that records
  what the protocol does to it (bytes written, pause/resume reading, close, abort,
  write_eof), so a connection protocol can be driven directly, bytes in and bytes out,
  inside a running event loop. `receive(data, read_size)` delivers the peer's bytes in
  reads of that size while the protocol reads, and holds them while it paused reading
  (delivered after `resume_reading`, as a socket transport does). `close()` calls
  `connection_lost(None)` on the next loop turn as a real transport does; `fill(n)` /
  `drain()` make the write buffer look full or empty and call `pause_writing` /
  `resume_writing` like the loop would.
- `compiled_twin(module)`: a compiled twin's extension module (None where it is not
  built) and the mark that skips a test needing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import os
import signal
import socket
import subprocess
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

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


def sigstop(pid: int, timeout_s: float = 30.0) -> None:
    """SIGSTOP process `pid` and return once every one of its threads has stopped.

    kill() only queues the stop: one thread takes it and then stops the others, and
    until each has stopped it may still run. On a loaded machine a server with several
    event loops answered a request after kill() had returned (a stalled-server test
    saw a hit). /proc/PID/task/*/stat shows each thread's state: `T` once stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):  # a thread that just ended
                stat = (task / "stat").read_text()
                states.append(stat[stat.rindex(")") + 2])
        if states and all(state in "Tt" for state in states):
            return
        assert time.monotonic() < deadline, f"pid {pid} not stopped: thread states {states}"
        time.sleep(0.002)  # polling, with the deadline above


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


class FakeTransport(asyncio.Transport):
    """A transport that records (see the module docstring). Create inside a running loop."""

    def __init__(
        self,
        peer: tuple[str, int] = ("127.0.0.1", 40000),
        sock: tuple[str, int] = ("127.0.0.1", 9130),
        *,
        high_water: int = 64 * 1024,
    ) -> None:
        super().__init__()
        self.written = bytearray()
        self.events: list[str] = []
        """"pause_reading", "resume_reading", "close", "abort", "write_eof", in order."""
        self.reading = True
        self.closing = False
        self.aborted = False
        self.eof_written = False
        self.buffered = 0
        """What `get_write_buffer_size` answers (see `fill`)."""
        self.high_water = high_water
        self._extra: dict[str, Any] = {"peername": peer, "sockname": sock, "socket": None}
        self._protocol: asyncio.BaseProtocol | None = None
        self._lost = False
        self._inbox: deque[bytes] = deque()
        """Reads not delivered yet (`receive` while reading is paused)."""

    # -- wiring -------------------------------------------------------------------------
    def connect(self, protocol: asyncio.BaseProtocol) -> FakeTransport:
        """`protocol.connection_made(self)`; returns self."""
        self._protocol = protocol
        protocol.connection_made(self)
        return self

    def receive(self, data: bytes, read_size: int | None = None) -> None:
        """Bytes from the peer, delivered as reads of at most `read_size` bytes, as a real
        transport does: at once while reading, else held until `resume_reading`."""
        step = read_size or len(data) or 1
        self._inbox.extend(bytes(data[i : i + step]) for i in range(0, len(data), step))
        self._deliver()

    def _deliver(self) -> None:
        while self._inbox and self.reading and not self.closing and self._protocol is not None:
            feed(self._protocol, self._inbox.popleft())

    def take(self) -> bytes:
        """The bytes written since the last `take` (and forget them)."""
        out = bytes(self.written)
        self.written.clear()
        return out

    def fill(self, nbytes: int) -> None:
        """The peer stops reading: `nbytes` wait in the write buffer (pause_writing at the
        high-water mark)."""
        was = self.buffered
        self.buffered = nbytes
        if was <= self.high_water < nbytes and self._protocol is not None:
            self._protocol.pause_writing()

    def drain(self) -> None:
        """The peer read everything: the buffer empties (resume_writing if paused)."""
        was = self.buffered
        self.buffered = 0
        if was > self.high_water and self._protocol is not None:
            self._protocol.resume_writing()

    def _lose(self, exc: Exception | None) -> None:
        if not self._lost and self._protocol is not None:
            self._lost = True
            asyncio.get_running_loop().call_soon(self._protocol.connection_lost, exc)

    # -- asyncio.Transport --------------------------------------------------------------
    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._extra.get(name, default)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            self.events.append("close")
            self._lose(None)

    def abort(self) -> None:
        self.aborted = True
        self.closing = True
        self.events.append("abort")
        self._lose(None)

    def write(self, data: Any) -> None:
        if self.closing:
            return
        self.written += bytes(data)

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def write_eof(self) -> None:
        self.eof_written = True
        self.events.append("write_eof")

    def can_write_eof(self) -> bool:
        return True

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (self.high_water // 4, self.high_water)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is not None:
            self.high_water = high

    def is_reading(self) -> bool:
        return self.reading

    def pause_reading(self) -> None:
        if self.reading:
            self.reading = False
            self.events.append("pause_reading")

    def resume_reading(self) -> None:
        if not self.reading:
            self.reading = True
            self.events.append("resume_reading")
            asyncio.get_running_loop().call_soon(self._deliver)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        assert self._protocol is not None
        return self._protocol


def feed(protocol: asyncio.BaseProtocol, data: bytes) -> None:
    """Deliver `data` as the event loop does: `get_buffer` / `buffer_updated` (in as many
    reads as the lent buffers take) for a buffered protocol, else `data_received`."""
    if isinstance(protocol, asyncio.BufferedProtocol):
        view = memoryview(data)
        while view:
            buf = protocol.get_buffer(len(view))
            n = min(len(buf), len(view))
            assert n > 0, "the protocol lent an empty buffer"
            buf[:n] = view[:n]
            protocol.buffer_updated(n)
            view = view[n:]
    else:
        protocol.data_received(data)  # type: ignore[attr-defined]


def compiled_twin(module: str) -> tuple[Any, pytest.MarkDecorator]:
    """(the compiled twin `module`, or None where it is not built; a mark that skips the
    test then). tests/test_twins.py requires it built where CI says so."""
    found: ModuleType | None
    try:
        found = importlib.import_module(module)
    except ImportError:
        found = None
    reason = "the compiled twin is not built (setup.py build_ext --inplace)"
    return found, pytest.mark.skipif(found is None, reason=reason)
