"""Large replies written to the socket first, without the GIL (server/sendfast.py).

The writer's split (direct part, then the transport) on a real socket pair, with the
project's FakeTransport and with uvloop's own transport; then real servers on both wires:
exact bytes of large GETs to a fast reader, to a slow reader (small receive buffer, many
pipelined GETs of distinct values: order and bytes), to a reader that hangs up mid-reply
(the others keep being served, the budget is given back), and over TLS (never direct).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import trustme
import urllib3
import uvloop

from epistemic_kvcache.client import EpistemicGraphKVBackend
from epistemic_kvcache.server.sendfast import (
    DIRECT_MIN_BYTES,
    ReplyWriter,
    direct_fd,
    unsent,
)
from helpers import FakeTransport, eventually, eventually_async
from servers import TOKEN, Listener, RunningServer, running_listener, running_server

MiB = 1024 * 1024
TENANTS = {TOKEN: "default"}


def _pair(sndbuf: int = 32 * 1024) -> tuple[socket.socket, socket.socket]:
    """A Unix socket pair; the writing end is non-blocking with a small send buffer."""
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    a.setblocking(False)
    return a, b


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(min(1 << 20, n - len(out)))
        if not chunk:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


# -- the split ------------------------------------------------------------------------------


def test_unsent_cuts_at_the_byte_without_copying() -> None:
    pieces = [b"head", bytearray(b"body-body"), memoryview(b"tail")]
    assert unsent(pieces, 0) == pieces
    assert [bytes(p) for p in unsent(pieces, 2)] == [b"ad", b"body-body", b"tail"]
    assert [bytes(p) for p in unsent(pieces, 4)] == [b"body-body", b"tail"]
    rest = unsent(pieces, 6)
    assert [bytes(p) for p in rest] == [b"dy-body", b"tail"]
    assert isinstance(rest[0], memoryview)  # a view of the piece, not a copy
    assert unsent(pieces, 17) == []
    wide = memoryview(bytearray(range(16))).cast("I")  # items of 4 bytes: cut in bytes
    assert bytes(unsent([wide], 5)[0]) == bytes(range(5, 16))


Split = tuple[ReplyWriter, FakeTransport, socket.socket, socket.socket]


@pytest.fixture
def split() -> Iterator[Split]:
    """A writer whose direct writes go to a socket pair's small-buffered end `a` (read
    at `b`) and the rest to a FakeTransport."""
    a, b = _pair()
    with a, b:
        yield ReplyWriter(fd=a.fileno()), FakeTransport(), a, b


def test_the_socket_takes_part_and_the_transport_the_rest_in_order(
    split: Split,
) -> None:
    writer, transport, _, b = split
    head, body, tail = b"$4194304\r\n", os.urandom(4 * MiB), b"\r\n"
    writer.write(transport, [head, body, tail])
    direct = writer.direct_bytes
    assert 0 < direct < len(body)  # the socket took part of it, not all
    assert bytes(transport.written) == (head + body + tail)[direct:]
    assert _read_exactly(b, direct) == (head + body + tail)[:direct]


def test_what_is_not_written_directly_goes_whole_to_the_transport(
    split: Split,
) -> None:
    writer, transport, a, b = split
    big = os.urandom(DIRECT_MIN_BYTES)
    # small: the transport as before
    writer.write(transport, [b"+OK\r\n", b"x" * 100])
    assert writer.direct_bytes == 0
    assert transport.take() == b"+OK\r\n" + b"x" * 100
    # something queued in the transport: never around it
    transport.buffered = 10
    writer.write(transport, [big])
    assert writer.direct_bytes == 0
    assert transport.take() == big
    transport.buffered = 0
    # a full socket (EAGAIN): nothing direct
    while True:
        try:
            a.send(b"\0" * 65536)
        except BlockingIOError:
            break
    writer.write(transport, [b"head", big])
    assert writer.direct_bytes == 0
    assert transport.take() == b"head" + big
    # a peer gone (EPIPE): the transport gets it all (and reports the error)
    b.close()
    writer.write(transport, [big])
    assert writer.direct_bytes == 0
    assert transport.take() == big
    # a closing transport: not even tried
    transport.closing = True
    writer.write(transport, [big])
    assert writer.direct_bytes == 0


def test_uvloop_transport_queues_the_remainder_and_the_peer_gets_every_byte() -> None:
    """uvloop's own transport: the direct part, then the remainder through libuv (its
    write buffer counts it, flow control pauses the protocol), exact bytes in order."""
    paused: list[str] = []

    class Quiet(asyncio.Protocol):
        def pause_writing(self) -> None:
            paused.append("pause")

        def resume_writing(self) -> None:
            paused.append("resume")

    async def scenario() -> None:
        a, b = _pair()
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_unix_connection(Quiet, sock=a)
        got: list[bytes] = []
        replies = [os.urandom(2 * MiB) for _ in range(3)]
        try:
            assert direct_fd(transport) == a.fileno()
            writer = ReplyWriter()
            writer.write(transport, [b"first:", replies[0]])
            first_direct = writer.direct_bytes
            assert 0 < first_direct < len(replies[0])
            assert transport.get_write_buffer_size() == len(replies[0]) + 6 - first_direct
            assert paused == ["pause"]  # the remainder is over the high-water mark
            writer.write(transport, [replies[1]])  # queued behind: not direct
            writer.write(transport, [replies[2]])
            assert writer.direct_bytes == first_direct
            total = 6 + sum(map(len, replies))
            reader = threading.Thread(target=lambda: got.append(_read_exactly(b, total)))
            reader.start()
            await asyncio.to_thread(reader.join, 30)
            assert got[0] == b"first:" + b"".join(replies)
            await eventually_async(lambda: paused == ["pause", "resume"], what="resumed")
            assert transport.get_write_buffer_size() == 0
        finally:
            transport.close()
            b.close()

    uvloop.run(scenario())


# -- real servers -------------------------------------------------------------------------


def _values(n: int, size: int) -> dict[str, bytes]:
    return {f"big-{i}": os.urandom(size + i) for i in range(n)}  # distinct sizes too


def _resp_gets(keys: list[str]) -> bytes:
    return b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k.encode()) for k in keys)


def _http_gets(keys: list[str]) -> bytes:
    return b"".join(
        f"GET /kv/{k} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()
        for k in keys
    )


class SlowReader:
    """A raw client with a small receive buffer that reads a few KiB at a time and digests
    each reply as it goes (the reading is paced by the data: the kernel holds only a
    little of a reply at any moment, the server's transport queues the rest)."""

    def __init__(self, wire: str, port: int) -> None:
        self.wire = wire
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.settimeout(30)
        self.sock.connect(("127.0.0.1", port))
        self.pending = bytearray()

    def _fill(self) -> None:
        chunk = self.sock.recv(4096)
        if not chunk:
            raise ConnectionError("closed")
        self.pending += chunk

    def line(self) -> bytes:
        while b"\r\n" not in self.pending:
            self._fill()
        head, _, rest = bytes(self.pending).partition(b"\r\n")
        self.pending = bytearray(rest)
        return head

    def digest_of(self, n: int) -> str:
        """The sha256 of the next `n` bytes, read in small pieces."""
        h = hashlib.sha256()
        while n:
            if not self.pending:
                self._fill()
            take = bytes(self.pending[:n])
            del self.pending[: len(take)]
            h.update(take)
            n -= len(take)
        return h.hexdigest()

    def resp_bulk(self) -> str:
        head = self.line()
        assert head.startswith(b"$"), head
        digest = self.digest_of(int(head[1:]))
        assert self.line() == b""
        return digest

    def http_body(self) -> str:
        status = self.line()
        assert status.startswith(b"HTTP/1.1 200"), status
        length = -1
        while line := self.line():
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return self.digest_of(length)

    def ask(self, keys: list[str]) -> None:
        """GET every key, pipelined in one send."""
        self.sock.sendall((_resp_gets if self.wire == "resp" else _http_gets)(keys))

    def reply(self) -> str:
        """The digest of the next reply's value."""
        return self.resp_bulk() if self.wire == "resp" else self.http_body()

    def close(self) -> None:
        self.sock.close()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(params=["resp", "http"])
def listener(request: pytest.FixtureRequest) -> Iterator[Listener]:
    with running_listener(request.param, tokens=TENANTS) as lst:
        yield lst


def _stored(lst: Listener, n: int, size: int) -> dict[str, bytes]:
    """`n` distinct values of about `size` bytes, SET through the listener's own wire."""
    values = _values(n, size)
    if lst.wire == "resp":
        r = redis.Redis(port=lst.port, password=TOKEN)
        try:
            for k, v in values.items():
                assert r.set(k, v)
        finally:
            r.close()
    else:
        pool = urllib3.HTTPConnectionPool("127.0.0.1", lst.port, retries=False)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        try:
            for k, v in values.items():
                resp = pool.request("PUT", f"/kv/{k}", body=v, headers=auth)
                assert resp.status in (200, 201), resp.data
        finally:
            pool.close()
    return values


def _connect(lst: Listener) -> SlowReader:
    reader = SlowReader(lst.wire, lst.port)
    if lst.wire == "resp":
        reader.sock.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(TOKEN), TOKEN.encode()))
        assert reader.line() == b"+OK"
    return reader


def _small_send_buffers(lst: Listener) -> None:
    """(On the listener's loop.) A 64 KiB send buffer for every open connection."""
    for conn in lst.ctx.live:
        conn.transport.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024
        )


def _served_directly(lst: Listener) -> int:
    return int(lst.call(lambda: sum(c.writer.direct_bytes for c in lst.ctx.live)))


def test_pipelined_large_gets_to_a_slow_reader_arrive_whole_and_in_order(
    listener: Listener,
) -> None:
    values = _stored(listener, 8, 2 * MiB)
    reader = _connect(listener)
    try:
        # the server's side of this connection gets a small send buffer too: no reply
        # fits it at once (the kernel copies far faster than this reader reads), so each
        # one leaves a remainder for the transport
        listener.call(_small_send_buffers, listener)
        keys = list(values) * 2  # each twice, pipelined in one send
        reader.ask(keys)
        assert [reader.reply() for _ in keys] == [_sha(values[k]) for k in keys]
        direct = _served_directly(listener)
        total = sum(len(values[k]) for k in keys)
        assert 0 < direct < total // 2  # both paths carried bytes of these replies
    finally:
        reader.close()


def test_a_reader_that_hangs_up_mid_reply_costs_nothing_and_others_are_served(
    listener: Listener, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    values = _stored(listener, 4, 4 * MiB)
    keys = list(values)
    for _ in range(3):
        quitter = _connect(listener)
        quitter.ask(keys * 2)
        quitter.digest_of(64 * 1024)  # part of the first reply, then gone
        quitter.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
        quitter.close()  # a reset: the server's next write fails
    other = _connect(listener)
    try:
        other.ask(keys)
        assert [other.reply() for _ in keys] == [_sha(values[k]) for k in keys]
    finally:
        other.close()
    budget = listener.ctx.budget
    eventually(
        lambda: len(listener.ctx.live) == 0 and budget.used == 0,
        timeout=10,
        what="every connection closed, every byte given back",
    )
    budget.check()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def _both_wires_serve_exact_bytes(
    srv: RunningServer, values: dict[str, bytes], ca: Path | None
) -> None:
    """SET `values` over RESP, read each back over RESP (GET, then one MGET) and HTTP
    (GET /kv/<key>, then one batch GET), comparing digests; TLS with `ca` as the trust
    root when given."""
    assert srv.resp is not None
    tls: dict[str, Any] = {"ssl": True, "ssl_ca_certs": str(ca)} if ca is not None else {}
    r = redis.Redis(host=srv.resp.host, port=srv.resp.port, password=TOKEN, **tls)
    pool: urllib3.HTTPConnectionPool
    if ca is None:
        pool = urllib3.HTTPConnectionPool(srv.http.host, srv.http.port, retries=False)
    else:
        ctx = ssl.create_default_context(cafile=str(ca))
        pool = urllib3.HTTPSConnectionPool(
            srv.http.host, srv.http.port, retries=False, ssl_context=ctx
        )
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        for k, v in values.items():
            assert r.set(k, v)
        for k, v in values.items():
            assert _sha(r.get(k) or b"") == _sha(v)
            got = pool.request("GET", f"/kv/{k}", headers=auth)
            assert got.status == 200
            assert _sha(got.data) == _sha(v)
        want = [_sha(v) for v in values.values()]
        assert [_sha(x or b"") for x in r.mget(list(values))] == want
        cafile = str(ca) if ca is not None else None
        with EpistemicGraphKVBackend(base_url=srv.url, token=TOKEN, ca_file=cafile) as c:
            assert [_sha(x or b"") for x in c.get_many(list(values))] == want  # a batch
    finally:
        r.close()
        pool.close()


def test_large_gets_over_both_wires_of_the_whole_server(tmp_path: Path) -> None:
    with running_server(tmp_path) as srv:
        _both_wires_serve_exact_bytes(srv, _values(3, 4 * MiB), None)


def test_tls_replies_go_through_the_transport_and_arrive_exact(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert_path, key_path, ca_path = tmp_path / "c.pem", tmp_path / "k.pem", tmp_path / "ca.pem"
    cert.cert_chain_pems[0].write_to_path(str(cert_path))
    cert.private_key_pem.write_to_path(str(key_path))
    ca.cert_pem.write_to_path(str(ca_path))
    with running_server(tmp_path, tls_cert=str(cert_path), tls_key=str(key_path)) as srv:
        _both_wires_serve_exact_bytes(srv, _values(2, 4 * MiB), ca_path)


def test_a_tls_transport_is_never_written_directly(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    cert.configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    values = _values(1, 2 * MiB)
    with running_listener("resp", tokens=TENANTS, ssl=server_ctx) as lst:
        r = redis.Redis(port=lst.port, password=TOKEN, ssl=True, ssl_ca_certs=None)
        r.connection_pool.connection_kwargs["ssl_cert_reqs"] = "none"
        try:
            for k, v in values.items():
                assert r.set(k, v)
                assert _sha(r.get(k) or b"") == _sha(v)
            fds = lst.call(lambda: [direct_fd(c.transport) for c in lst.ctx.live])
            assert fds == [-1]
            assert _served_directly(lst) == 0
        finally:
            r.close()
