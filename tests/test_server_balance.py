"""Connections placed on the lightest event loop (server/balance.py): the choice, the
hand-over to a loop that stopped, and an accept that runs out of descriptors (a real
server process whose descriptor limit is lowered while it runs)."""

from __future__ import annotations

import asyncio
import errno
import os
import resource
import socket
import ssl
from pathlib import Path

import pytest
import redis
import uvloop

from epistemic_kvcache.server.balance import Balancer, LoopSeat, bind_sockets
from helpers import eventually
from servers import TOKEN, ServeProcess


def _seats(balancer: Balancer, loads: list[int]) -> list[LoopSeat]:
    loop = asyncio.new_event_loop()
    seats = []
    for n in loads:
        seat = balancer.seat(loop)
        seat.serve([object() for _ in range(n)])
        seats.append(seat)
    loop.close()
    return seats


def test_a_connection_stays_unless_another_loop_is_lighter() -> None:
    b = Balancer()
    a, c, d = _seats(b, [2, 2, 3])
    assert b.choose(a) is a  # equal loads: no hand-over
    assert a.incoming == 1  # counted until opened
    assert b.choose(a) is c  # a is 3 now (2 open + 1 incoming), c is 2
    assert b.choose(d) is d  # all at 3: it stays
    assert b.choose(d) is a  # d is 4: the first of the lightest
    assert (a.incoming, c.incoming, d.incoming) == (2, 1, 1)
    b.opened(a)
    assert a.incoming == 1


def test_a_loop_that_left_gets_no_connections_and_places_its_own_elsewhere() -> None:
    b = Balancer()
    a, c = _seats(b, [0, 5])
    a.leave()
    assert b.choose(c) is c  # the only loop taking connections
    assert b.choose(a) is c  # accepted by a loop that is stopping: placed on another one
    c.leave()
    assert b.choose(c) is c  # nobody takes any: it stays (and `adopt` closes it)


def test_a_connection_handed_to_a_stopped_loop_is_closed() -> None:
    async def scenario() -> None:
        b = Balancer()
        seat = b.seat(asyncio.get_running_loop())
        seat.serve([])
        seat.leave()
        ours, peer = socket.socketpair()
        b.choose(seat)
        seat.adopt("--resp-addr", ours)
        assert ours.fileno() == -1
        assert seat.incoming == 0
        peer.settimeout(5)
        assert peer.recv(1) == b""  # closed, not left open
        peer.close()

    asyncio.run(scenario())


def test_a_connection_for_an_ended_loop_is_closed() -> None:
    b = Balancer()
    here_loop, gone_loop = asyncio.new_event_loop(), asyncio.new_event_loop()
    here, gone = b.seat(here_loop), b.seat(gone_loop)
    here.serve([object(), object()])
    gone.serve([])
    gone_loop.close()  # its thread ended without leaving (a crash): the hand-over fails
    ours, peer = socket.socketpair()
    b.place(here, "--addr", ours)
    assert ours.fileno() == -1
    assert gone.incoming == 0
    peer.close()
    here_loop.close()


def test_bind_sockets_binds_every_address_a_name_resolves_to() -> None:
    socks = bind_sockets("localhost", 0, 16)
    try:
        assert socks
        families = {s.family for s in socks}
        assert socket.AF_INET in families
        for s in socks:
            assert s.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 1
            assert s.getblocking() is False
    finally:
        for s in socks:
            s.close()


def test_an_address_family_the_kernel_lacks_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel with IPv6 switched off refuses IPv6 sockets (EAFNOSUPPORT; simulated: it
    cannot be switched off here): "" still listens on IPv4, as uvloop's `create_server`
    does; an address of that family alone fails with a clear error, nothing left open."""
    real = socket.socket

    def no_ipv6(family: int = socket.AF_INET, *args: object) -> socket.socket:
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return real(family, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "socket", no_ipv6)
    socks = bind_sockets("", 0, 16)
    try:
        assert [s.family for s in socks] == [socket.AF_INET]
    finally:
        for s in socks:
            s.close()
    with pytest.raises(OSError, match="no address of '::1' can be bound"):
        bind_sockets("::1", 0, 16)


def test_a_tls_handshake_still_running_is_cancelled_when_the_loop_ends(tmp_path: Path) -> None:
    """`LoopSeat.abort` (run after the drain): a connection whose TLS handshake has not
    finished is closed, not opened after the loop's connections were aborted."""
    trustme = pytest.importorskip("trustme")
    cert = trustme.CA().issue_cert("127.0.0.1")
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(tls)

    async def scenario() -> None:
        b = Balancer()
        seat = b.seat(asyncio.get_running_loop())
        seat.factories["--resp-addr"] = (asyncio.Protocol, tls)
        seat.serve([])
        ours, peer = socket.socketpair()
        b.choose(seat)
        seat.adopt("--resp-addr", ours)  # the peer never sends its ClientHello
        await asyncio.sleep(0)
        assert seat.incoming == 1
        seat.abort()
        for _ in range(10):
            await asyncio.sleep(0)
        assert seat.incoming == 0
        peer.setblocking(False)
        loop = asyncio.get_running_loop()
        assert await asyncio.wait_for(loop.sock_recv(peer, 1), 10) == b""  # closed
        peer.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())


def test_out_of_descriptors_the_accept_waits_and_serves_once_some_are_freed(
    tmp_path: Path,
) -> None:
    """A server with 2 loops at its descriptor limit: a new connection is not served
    (the accept fails with EMFILE and says so), the server keeps serving its open
    connections, and once clients leave new connections are served again."""
    proc = ServeProcess(tmp_path, "--event-loops", "2")
    socks: list[socket.socket] = []

    def accept_failed() -> bool:
        return any("accept failed (Too many open files)" in line for line in proc.output)

    def answered(sock: socket.socket) -> bool:
        try:
            return bool(sock.recv(64))
        except BlockingIOError:
            return False

    try:
        port = proc.ports["resp"]
        first = redis.Redis(port=port, password=TOKEN, socket_timeout=30)
        first.ping()
        # the limit caps descriptor numbers: above the highest in use (and its gaps), 3 more
        top = max(int(fd) for fd in os.listdir(f"/proc/{proc.proc.pid}/fd"))
        _, hard = resource.prlimit(proc.proc.pid, resource.RLIMIT_NOFILE)
        resource.prlimit(proc.proc.pid, resource.RLIMIT_NOFILE, (top + 4, hard))
        while not accept_failed():
            assert len(socks) < 40, "the descriptor limit was never reached"
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(b"PING\r\n")  # (NOAUTH or PONG: any answer means served)
            sock.setblocking(False)
            socks.append(sock)
            eventually(lambda s=sock: answered(s) or accept_failed(), what="served or refused")
        assert first.set("still", b"served") is True  # open connections go on
        for sock in socks:
            sock.close()
        retry = redis.Redis(port=port, password=TOKEN, socket_timeout=30)
        assert retry.get("still") == b"served"  # accepted again once descriptors are free
        retry.close()
        first.close()
        assert proc.proc.poll() is None
    finally:
        for sock in socks:
            sock.close()
        proc.stop()
