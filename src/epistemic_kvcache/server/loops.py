"""Listeners and event loops: binding, the extra loops of `event_loops`, the graceful drain.

How it works:
- With `event_loops` N > 1 the server runs N event loops over its one store: the
  runner's own loop (loop 0: signals, background tasks, start and stop) and N-1
  `LoopWorker` threads, each with its own uvloop and its own listeners for both wires.
  Every listener socket of every loop is bound with `SO_REUSEPORT` to the same address,
  so the kernel spreads new connections over the loops (by a hash of the 4-tuple); a
  connection lives on the loop that accepted it. Loop 0 binds first (port 0: the
  kernel picks the port) and the workers bind to the addresses it got. Before loop 0
  binds a fixed port with `SO_REUSEPORT` it probes it with a plain bind: a port held by
  anyone, even another server that set `SO_REUSEPORT` too, is refused as "in use"
  instead of silently shared.
- Each loop has its own `ServerContext` (`ServerContext.sibling`): its live connections,
  receive scratch and request counters; the store, budgets, connection slots,
  authenticator, epoch notifier and thread pool are the one set all loops share.
- A worker binds while the runner binds (before any file is written), with a late
  factory (`LateFactory`) the runner fills once the store exists; `serve` starts
  accepting, `stop` drains it (`drain`, the same bounded wait as loop 0's, run on each
  loop at once) and ends its thread. Every call into a worker is thread-safe.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import logging
import os
import socket
import ssl
import sys
import threading
from collections.abc import Callable, Collection
from typing import Any, Final, ParamSpec, Protocol, TypeVar

from epistemic_kvcache.config import Address
from epistemic_kvcache.errors import KvCacheError
from epistemic_kvcache.server.background import sample_loop_forever
from epistemic_kvcache.server.balance import (
    HANDSHAKE_TIMEOUT_S,
    Balancer,
    Listener,
    LoopSeat,
    bind_sockets,
)
from epistemic_kvcache.server.context import Lifecycle, LiveConnection, ServerContext

log = logging.getLogger("epistemic_kvcache.server")

P = ParamSpec("P")
T = TypeVar("T")

POLL_S = 0.02
"""How often the drain looks whether every connection has reached its boundary."""


class ListenerError(KvCacheError):
    """A listener could not be opened (address in use, permission denied, ...)."""


class Serving(Protocol):
    """A bound listener: `asyncio.Server`, or a balanced `Listener` (several loops)."""

    @property
    def sockets(self) -> tuple[Any, ...]: ...

    async def start_serving(self) -> None: ...

    def close(self) -> None: ...


class CountingExecutor(concurrent.futures.ThreadPoolExecutor):
    """A thread pool that knows how many submitted calls have not finished yet."""

    def __init__(self, max_workers: int, thread_name_prefix: str = "kvcache-store") -> None:
        super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix)
        self._pending = 0
        self._pending_lock = threading.Lock()

    @property
    def pending(self) -> int:
        """Calls submitted and not finished."""
        return self._pending

    def submit(
        self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs
    ) -> concurrent.futures.Future[T]:
        with self._pending_lock:
            self._pending += 1
        try:
            future = super().submit(fn, *args, **kwargs)
        except BaseException:
            self._done(None)
            raise
        future.add_done_callback(self._done)
        return future

    def _done(self, _future: object) -> None:
        with self._pending_lock:
            self._pending -= 1


class LateFactory:
    """A protocol factory bound before the context exists (nothing is accepted before).

    A protocol that cannot be made (a bug, or a limit the build cannot hold) must not
    stop the listener or go unnoticed: the connection is closed at once, the listener
    keeps accepting, and the fault is recorded in `lifecycle` (readiness fails) and
    logged once per listener.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        """The listener: "http" or "resp"."""
        self.factory: Callable[[], asyncio.BaseProtocol] | None = None
        self.lifecycle: Lifecycle | None = None

    def set(self, factory: Callable[[], asyncio.BaseProtocol], lifecycle: Lifecycle) -> None:
        self.factory, self.lifecycle = factory, lifecycle

    def __call__(self) -> asyncio.BaseProtocol:
        if self.factory is None:  # start_serving() is called only after it is set
            raise RuntimeError("listener accepted before the server was ready")
        try:
            return self.factory()
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            faults = self.lifecycle.listener_faults if self.lifecycle is not None else {}
            if self.name not in faults:
                faults[self.name] = why
                log.error(
                    "%s listener cannot serve connections (%s): closing them; not ready",
                    self.name,
                    why,
                    exc_info=True,
                )
            return _Refused()


class _Refused(asyncio.Protocol):
    """A connection its listener cannot serve (see `LateFactory`): closed at once."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


# -- binding ---------------------------------------------------------------------------


def _sock_address(sockname: Any) -> Address:
    return Address(str(sockname[0]), int(sockname[1]))


def _free_port_hint(flag: str, addr: Address, tries: int = 20) -> str:
    """`; the next free port is 6380 (--resp-addr 127.0.0.1:6380)` for a taken port: the
    first of the following `tries` ports this host can bind now (a hint, not a promise:
    another process may take it first), or nothing."""
    if addr.port == 0:
        return ""
    family = socket.AF_INET6 if ":" in addr.host else socket.AF_INET
    for port in range(addr.port + 1, min(addr.port + 1 + tries, 65536)):
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((addr.host, port))
            except OSError:
                continue
        suggested = Address(addr.host, port)
        return f"; the next free port is {port} ({flag} {suggested})"
    return ""


def _probe_unshared(addr: Address) -> None:
    """Raise `OSError(EADDRINUSE)` when something already listens on `addr`: a plain
    bind (no `SO_REUSEPORT`) fails on a port anyone holds, even with `SO_REUSEPORT`."""
    if addr.port == 0:
        return
    for family, kind, proto, _, sockaddr in socket.getaddrinfo(
        addr.host, addr.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    ):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            probe.bind(sockaddr)


_PROC_NET: Final[dict[int, str]] = {
    socket.AF_INET: "/proc/net/tcp",
    socket.AF_INET6: "/proc/net/tcp6",
}
_LISTEN: Final = "0A"
"""`TCP_LISTEN` in /proc/net/tcp's `st` column."""


def _proc_address(field: str) -> tuple[bytes, int]:
    """A /proc/net/tcp `local_address` ("0100007F:1F90"): packed IP bytes and port. The
    address is printed as 32-bit words in host byte order."""
    ip_hex, port_hex = field.split(":")
    words = [int(ip_hex[i : i + 8], 16) for i in range(0, len(ip_hex), 8)]
    return b"".join(w.to_bytes(4, sys.byteorder) for w in words), int(port_hex, 16)


def listeners_on(family: int, host: str, port: int) -> set[int] | None:
    """Inodes of every TCP socket listening on exactly (`host`, `port`) in this network
    namespace, whoever owns it; None where /proc/net/tcp cannot be read (not Linux)."""
    try:
        packed = socket.inet_pton(family, host)
        with open(_PROC_NET[family]) as f:
            lines = f.read().splitlines()[1:]
    except (OSError, KeyError, ValueError):
        return None
    found: set[int] = set()
    for line in lines:
        cols = line.split()
        if len(cols) < 10 or cols[3] != _LISTEN:
            continue
        with contextlib.suppress(ValueError):
            if _proc_address(cols[1]) == (packed, port):
                found.add(int(cols[9]))
    return found


def socket_inodes(servers: Collection[Serving]) -> set[int]:
    """Inodes of `servers`' listening sockets."""
    return {os.fstat(s.fileno()).st_ino for srv in servers for s in srv.sockets}


def check_unshared(flag: str, addrs: Collection[Address], ours: set[int]) -> None:
    """Raise `ListenerError` when a socket that is not one of `ours` listens on any of
    `addrs`: another process joined the port's `SO_REUSEPORT` group between the probe
    (`_probe_unshared`) and the binds, and the kernel would split connections between
    two servers. Run once every loop has bound and before any accepts; the other
    server's own check sees these sockets too, so both fail rather than share."""
    for addr in addrs:
        family = socket.AF_INET6 if ":" in addr.host else socket.AF_INET
        found = listeners_on(family, addr.host, addr.port)
        if found is None:
            log.debug("cannot list the listeners on %s: not checked for sharing", addr)
            continue
        foreign = found - ours
        if foreign:
            raise ListenerError(
                f"{flag} {addr}: address already in use (another process started listening "
                "on it with SO_REUSEPORT while this server was binding)"
            )


async def listen(
    loop: asyncio.AbstractEventLoop,
    flag: str,
    addr: Address,
    factory: Callable[[], asyncio.BaseProtocol],
    tls: ssl.SSLContext | None,
    backlog: int,
    *,
    reuse_port: bool = False,
    probe: bool = False,
    seat: LoopSeat | None = None,
) -> tuple[Serving, tuple[Address, ...]]:
    """Bind `addr` without accepting yet (`start_serving()` later); with `reuse_port`,
    other loops may bind the same address (after `probe`: it must be free first). With
    `seat` (several loops), the loop accepts itself and places each connection on the
    lightest loop (server/balance.py; implies `reuse_port`)."""
    server: Serving
    try:
        if probe:
            await loop.run_in_executor(None, _probe_unshared, addr)
        if seat is not None:
            socks = await loop.run_in_executor(None, bind_sockets, addr.host, addr.port, backlog)
            server = Listener(flag, socks, seat, factory, tls)
        else:
            server = await loop.create_server(
                factory,
                host=addr.host,
                port=addr.port,
                ssl=tls,
                backlog=backlog,
                ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S if tls else None,
                start_serving=False,
                reuse_port=reuse_port or None,
            )
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            reason = "address already in use" + _free_port_hint(flag, addr)
        elif exc.errno in (errno.EACCES, errno.EPERM):
            reason = "permission denied (ports below 1024 need privileges)"
        elif exc.errno == errno.EADDRNOTAVAIL:
            reason = "address not available on this machine"
        else:
            reason = exc.strerror or str(exc)
        raise ListenerError(f"{flag} {addr}: {reason}") from None
    return server, tuple(_sock_address(s.getsockname()) for s in server.sockets)


# -- the graceful drain ----------------------------------------------------------------


def _write_buffer_size(transport: asyncio.BaseTransport | None) -> int:
    """Bytes `transport` has not sent yet. Duck-typed: uvloop's transports are not
    subclasses of `asyncio.WriteTransport` (an `isinstance` check read 0 for every
    connection under uvloop, so the stop never waited for a response being sent)."""
    size = getattr(transport, "get_write_buffer_size", None)
    if size is None:
        return 0
    try:
        return int(size())
    except (AttributeError, RuntimeError):
        return 0


async def drain(
    live: Collection[LiveConnection], executor: CountingExecutor, timeout_s: float
) -> None:
    """Let every connection of `live` (one loop's: each loop drains its own, all at
    once) finish what is in flight and close at its next boundary between requests
    (`LiveConnection.begin_drain`); return once none is in flight, every answer is
    sent and no store call runs, or after `timeout_s` (the hard bound: what is left is
    closed then).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    for conn in list(live):
        conn.begin_drain()
    while True:
        busy = [c for c in list(live) if not c.drained or _write_buffer_size(c.transport)]
        if not busy and executor.pending == 0:
            break
        if loop.time() >= deadline:
            log.warning(
                "shutdown_timeout_s=%s elapsed: closing %d connection(s) with requests in "
                "flight, %d store call(s) running",
                timeout_s,
                len(busy),
                executor.pending,
            )
            break
        await asyncio.sleep(POLL_S)
    for conn in list(live):
        if conn.transport is not None and not conn.transport.is_closing():
            conn.transport.close()
    # Let the protocols see connection_lost and flush what close() allows.
    for _ in range(3):
        await asyncio.sleep(0)


def abort_all(live: Collection[LiveConnection]) -> None:
    """Abort what is still open (after the drain, or when start-up failed)."""
    for conn in list(live):
        abort = getattr(conn.transport, "abort", None)  # duck-typed, as above
        if abort is not None:
            abort()


# -- the extra loops -------------------------------------------------------------------


class LoopWorker:
    """Event loop `index` (>= 1) on a thread of its own, serving the listeners `binds`
    ((flag, address, factory) each) beside loop 0. Methods are safe from any thread.

    `start()` -> a future done once every listener is bound (its exception: a bind that
    failed); `serve(ctx, executor)` -> a future done once it accepts; `stop(timeout_s)`
    -> a future done once it drained and its thread is ending (`join()` waits for it).
    """

    def __init__(
        self,
        index: int,
        binds: list[tuple[str, Address, LateFactory]],
        tls: ssl.SSLContext | None,
        backlog: int,
        balancer: Balancer | None = None,
    ) -> None:
        self.index = index
        self._binds, self._tls, self._backlog = binds, tls, backlog
        self._balancer = balancer
        self._ctx: ServerContext | None = None
        self._executor: CountingExecutor | None = None
        self._timeout_s = 0.0
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._go: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None
        self._ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._serving: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._main, name=f"kvcache-loop-{index}", daemon=True
        )
        self.inodes: set[int] = set()
        """Inodes of this loop's listening sockets, once bound (`check_unshared`)."""

    def start(self) -> concurrent.futures.Future[None]:
        self._thread.start()
        return self._ready

    def serve(
        self, ctx: ServerContext, executor: CountingExecutor
    ) -> concurrent.futures.Future[None]:
        self._ctx, self._executor = ctx, executor
        self._wake(self._go)
        return self._serving

    def stop(self, timeout_s: float) -> concurrent.futures.Future[None]:
        self._timeout_s = timeout_s
        self._stopping = True  # seen by _run if it has not published its loop yet
        self._wake(self._stop)
        self._wake(self._go)
        return self._done

    def join(self, timeout_s: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _wake(self, event: asyncio.Event | None) -> None:
        loop = self._loop
        if loop is None or event is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop has ended already
            loop.call_soon_threadsafe(event.set)

    def _main(self) -> None:
        import uvloop

        try:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(self._run())
        except BaseException as exc:
            log.exception("event loop %d failed", self.index)
            for fut in (self._ready, self._serving):
                if not fut.done():
                    fut.set_exception(exc)
        finally:
            for fut in (self._ready, self._serving, self._done):
                if not fut.done():
                    fut.set_result(None)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        self._go, self._stop = asyncio.Event(), asyncio.Event()
        servers: list[Serving] = []
        seat = self._balancer.seat(loop) if self._balancer is not None else None
        try:
            for flag, addr, factory in self._binds:
                server, _ = await listen(
                    loop, flag, addr, factory, self._tls, self._backlog, reuse_port=True, seat=seat
                )
                servers.append(server)
        except BaseException as exc:
            for server in servers:
                server.close()
            self._ready.set_exception(exc)
            return
        self.inodes = socket_inodes(servers)
        self._loop = loop  # from here on, serve() and stop() reach this loop
        self._ready.set_result(None)
        if self._stopping:
            self._stop.set()
        else:
            await self._go.wait()
        ctx, executor = self._ctx, self._executor
        sampler: asyncio.Task[None] | None = None
        try:
            if ctx is not None and executor is not None and not self._stop.is_set():
                ctx.loop.event_loop = loop
                if seat is not None:
                    seat.serve(ctx.live)
                for server in servers:
                    await server.start_serving()
                sampler = loop.create_task(sample_loop_forever(ctx), name="kvcache-loop-sample")
                self._serving.set_result(None)
                await self._stop.wait()
                for server in servers:
                    server.close()
                await drain(ctx.live, executor, self._timeout_s)
        finally:
            for server in servers:
                server.close()
            if sampler is not None:
                sampler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampler
            if seat is not None:
                seat.abort()  # TLS handshakes still running: no connection after the drain
            if ctx is not None:
                abort_all(ctx.live)
            await asyncio.sleep(0)
