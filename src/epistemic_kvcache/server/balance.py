"""Connections spread evenly over the event loops: each loop accepts, the lightest serves.

How it works
------------
With several event loops (`event_loops` > 1) every loop binds its own listening socket
to each address (`SO_REUSEPORT`) and the kernel hands each new connection to one of them
by a hash of its 4-tuple. Over many short connections that evens out; over the few
long-lived connections an inference fleet keeps (each LMCache instance holds a handful)
it does not: in an hour-long soak, 3 of 4 clients landed on one of two loops, which then
answered three quarters of the requests while the other loop idled.

So a loop does not serve every connection its socket accepts. Each loop's `Listener`
accepts on its sockets itself (a reader callback per socket, instead of the event
loop's `create_server`) and asks the server's one `Balancer` where the connection goes: it
stays unless another loop is lighter, and then goes to the lightest, which opens it on
its own loop (`connect_accepted_socket`, the TLS handshake included). A loop's load is
its open connections (its `ServerContext.live`, both wires) plus those handed to it and
not yet open (`LoopSeat.incoming`): connections arriving one after another end up at
most one apart. The choice and the `incoming` count are made under one lock, so two
loops accepting at once do not both pick the same loop on stale counts; `len()` of a
loop's live set is read from other threads without a lock (a snapshot is enough).

Failure modes: an `accept` that fails for want of descriptors or memory (`EMFILE`,
`ENFILE`, `ENOBUFS`, `ENOMEM`; any other error too, logged as an error) logs once and
retries every `ACCEPT_RETRY_S` until one succeeds, as asyncio's own accept loop does; a
pending connection's own network error (`EPROTO`, `ENETDOWN`, ..., a firewall's `EPERM`)
skips just that one. A hand-over is queued under the balancer's lock, so it always
precedes the target loop's `leave`: a connection handed to a loop that has stopped
accepting (the server is stopping) is closed there, and one handed to a loop that has
ended is closed at once. Once `connect_accepted_socket` has the socket, its transport
owns it (a failed TLS handshake closes it there); `LoopSeat.abort` cancels handshakes
still running when the loop ends. An address family the kernel cannot make sockets of
(IPv6 switched off) is skipped at bind time, as uvloop skips it. With one loop nothing
of this runs: the event loop's own `create_server` accepts (server/loops.py `listen`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Collection
from typing import Final

log = logging.getLogger("epistemic_kvcache.server")

ACCEPT_RETRY_S: Final = 1.0
"""After an accept failed for want of descriptors or memory, retry this much later."""
HANDSHAKE_TIMEOUT_S: Final = 10.0
"""A TLS handshake not done within this is dropped (the same as `create_server`'s)."""
_PAUSE_ERRNOS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_RETRY_NAMES: Final = "EPROTO ENETDOWN ENOPROTOOPT EHOSTDOWN ENONET EHOSTUNREACH EOPNOTSUPP"
_RETRY_ERRNOS: Final = frozenset(
    getattr(errno, name)
    for name in (*_RETRY_NAMES.split(), "ENETUNREACH", "EPERM")
    if hasattr(errno, name)
)
"""accept(2) errors of one pending connection (Linux passes its network errors on, and
a firewall's EPERM): retried at once, as the man page says, not a pause."""
ACCEPT_BATCH: Final = 64
"""Connections one readiness event of a listening socket accepts at most (the rest at the
next turn of the loop, after the others had theirs)."""

Factory = Callable[[], asyncio.BaseProtocol]


class LoopSeat:
    """One event loop's place in the `Balancer`: its load and how to open a connection
    there. Its methods other than `adopt`'s scheduling run on its own loop."""

    def __init__(self, balancer: Balancer, loop: asyncio.AbstractEventLoop) -> None:
        self.balancer = balancer
        self.loop = loop
        self.live: Collection[object] = ()
        """The loop's open connections (its `ServerContext.live`), set by `serve`."""
        self.incoming = 0
        """Connections handed to this loop and not open yet (guarded by the lock)."""
        self.factories: dict[str, tuple[Factory, ssl.SSLContext | None]] = {}
        """Per listener flag (`--addr`, `--resp-addr`): its protocol factory and TLS."""
        self._opening: set[asyncio.Task[None]] = set()

    @property
    def load(self) -> int:
        return len(self.live) + self.incoming

    def serve(self, live: Collection[object]) -> None:
        """Start taking connections: the loop's live set is known now."""
        self.live = live
        self.balancer.join(self)

    def leave(self) -> None:
        """Stop taking connections (the loop stops accepting); those still opening go on."""
        self.balancer.leave(self)

    def adopt(self, flag: str, conn: socket.socket) -> None:
        """Open `conn` on this loop (call on this loop)."""
        if not self.balancer.seated(self) or flag not in self.factories:
            conn.close()  # stopping: not accepted after all
            self.balancer.opened(self)
            return
        task = self.loop.create_task(self._open(flag, conn))
        self._opening.add(task)
        task.add_done_callback(self._opening.discard)

    async def _open(self, flag: str, conn: socket.socket) -> None:
        # `conn.close()` after a failure is always safe: before the transport took the
        # socket it closes it; after, the transport holds an I/O reference (uvloop
        # `_attach_fileobj`), so it only marks the object closed, and the transport
        # closes the descriptor itself, once
        try:
            factory, tls = self.factories[flag]
            await self.loop.connect_accepted_socket(
                factory, conn, ssl=tls, ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S if tls else None
            )
        except (OSError, TimeoutError, EOFError) as exc:  # (ssl.SSLError is an OSError)
            log.debug("%s: connection not opened: %r", flag, exc)  # a peer gone, a handshake
            conn.close()
        except Exception:
            log.exception("%s: connection not opened", flag)
            conn.close()
        finally:
            self.balancer.opened(self)

    def abort(self) -> None:
        """Cancel the connections still opening (TLS handshakes): the loop is ending."""
        for task in list(self._opening):
            task.cancel()


class Balancer:
    """The event loops that take connections, and the choice among them (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seats: list[LoopSeat] = []

    def seat(self, loop: asyncio.AbstractEventLoop) -> LoopSeat:
        """A seat for `loop`, taking connections once `serve`d."""
        return LoopSeat(self, loop)

    def join(self, seat: LoopSeat) -> None:
        with self._lock:
            if seat not in self._seats:
                self._seats.append(seat)

    def leave(self, seat: LoopSeat) -> None:
        with self._lock:
            if seat in self._seats:
                self._seats.remove(seat)

    def seated(self, seat: LoopSeat) -> bool:
        with self._lock:
            return seat in self._seats

    def opened(self, seat: LoopSeat) -> None:
        """One connection handed to `seat` is open (or was dropped)."""
        with self._lock:
            seat.incoming -= 1

    def choose(self, here: LoopSeat) -> LoopSeat:
        """Where a connection `here` accepted goes: `here` unless another seat is
        lighter, else the lightest (first of equals); counted as incoming there."""
        with self._lock:
            return self._choose_locked(here)

    def _choose_locked(self, here: LoopSeat) -> LoopSeat:
        target = here
        if self._seats:
            lightest = min(self._seats, key=_load)
            if here not in self._seats or lightest.load < here.load:
                target = lightest
        target.incoming += 1
        return target

    def place(self, here: LoopSeat, flag: str, conn: socket.socket) -> None:
        """Open `conn`, accepted on `here`'s loop (call there), on the chosen loop.

        A hand-over is queued on the other loop under the lock, so it comes before that
        loop's `leave` (which takes the lock too); the leaving loop runs at least once
        more (its drain), where `adopt` finds it gone and closes the connection."""
        with self._lock:
            target = self._choose_locked(here)
            if target is not here:
                try:
                    target.loop.call_soon_threadsafe(target.adopt, flag, conn)
                    return
                except RuntimeError:  # that loop has ended
                    target.incoming -= 1
        if target is here:
            here.adopt(flag, conn)
        else:
            conn.close()


def _load(seat: LoopSeat) -> int:
    return seat.load


class Listener:
    """A listener flag's sockets on one loop, accepting into the `Balancer`: what the
    server uses of `asyncio.Server` (`sockets`, `start_serving`, `close`). Accepts in a
    reader callback, as asyncio's own server does: every connection waiting (at most
    `ACCEPT_BATCH` a turn) per readiness event, no future or task per accept."""

    def __init__(
        self,
        flag: str,
        socks: list[socket.socket],
        seat: LoopSeat,
        factory: Factory,
        tls: ssl.SSLContext | None,
    ) -> None:
        self.flag = flag
        self._socks = socks
        self._seat = seat
        seat.factories[flag] = (factory, tls)
        self._reading: list[socket.socket] = []
        self._retry: asyncio.TimerHandle | None = None
        self._failing = False
        self._closed = False

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return tuple(self._socks)

    async def start_serving(self) -> None:
        self._read(self._socks)

    def close(self) -> None:
        """Stop accepting and close the sockets; open connections stay."""
        self._closed = True
        self._seat.leave()
        self._unread()
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        for sock in self._socks:
            sock.close()

    def _read(self, socks: list[socket.socket]) -> None:
        loop = self._seat.loop
        for sock in socks:
            if sock.fileno() != -1:
                loop.add_reader(sock.fileno(), self._accept, sock)
                self._reading.append(sock)

    def _unread(self) -> None:
        loop = self._seat.loop
        for sock in self._reading:
            if sock.fileno() != -1:
                loop.remove_reader(sock.fileno())
        self._reading.clear()

    def _accept(self, sock: socket.socket) -> None:
        seat = self._seat
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return  # none waiting
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if exc.errno in _RETRY_ERRNOS:
                    continue  # that connection's own network error: take the next
                self._pause(exc)  # out of descriptors or memory, or anything unexpected
                return
            self._failing = False
            seat.balancer.place(seat, self.flag, conn)

    def _pause(self, exc: OSError) -> None:
        """Stop accepting for `ACCEPT_RETRY_S` (said once until an accept succeeds)."""
        if not self._failing:
            level = logging.WARNING if exc.errno in _PAUSE_ERRNOS else logging.ERROR
            log.log(
                level,
                "%s: accept failed (%s): retrying every %.0f s",
                self.flag,
                exc.strerror or exc,
                ACCEPT_RETRY_S,
            )
        self._failing = True
        self._unread()
        self._retry = self._seat.loop.call_later(ACCEPT_RETRY_S, self._resume)

    def _resume(self) -> None:
        self._retry = None
        if not self._closed:
            self._read(self._socks)


def bind_sockets(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Listening sockets for `host`:`port` as `create_server(reuse_port=True)` makes them
    (one per address `host` resolves to; `SO_REUSEADDR`, `SO_REUSEPORT`, IPv6 only on
    IPv6 sockets), non-blocking; an address family this kernel cannot make sockets of
    is skipped, as uvloop skips it. Raises `OSError` (nothing left open)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, sockaddr in dict.fromkeys(infos):
            try:
                sock = socket.socket(family, kind, proto)
            except OSError as exc:  # e.g. IPv6 switched off in this kernel: as uvloop does
                log.debug("%s:%s: no %s socket (%s)", host, port, family.name, exc)
                continue
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(sockaddr)
            sock.listen(backlog)
            sock.setblocking(False)
        if not socks:
            raise OSError(errno.EADDRNOTAVAIL, f"no address of {host!r} can be bound here")
    except BaseException:
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.close()
        raise
    return socks
