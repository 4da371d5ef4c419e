"""A small load generator for the RESP and HTTP wires: same client for every server.

It exists because redis-benchmark sends the same bytes for every SET (our
content-addressed store would store them once, which flatters us) and redis-py's
parser copies large replies chunk by chunk (it would measure the client). This client
pre-builds unique payloads, writes header and payload as separate buffers, and reads
replies into preallocated buffers with `asyncio.BufferedProtocol`, on uvloop.

Each of `clients` connections runs one request at a time (no pipelining), like a cache
client on a serving path; latency is measured per request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import uvloop


@dataclass
class Result:
    ops: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)

    def pct(self, p: float) -> float:
        s = sorted(self.latencies)
        return s[min(len(s) - 1, int(p / 100 * len(s)))] * 1000 if s else 0.0

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds else 0.0

    @property
    def ops_s(self) -> float:
        return self.ops / self.seconds if self.seconds else 0.0


class _Conn(asyncio.BufferedProtocol):
    """Reads one reply at a time; the body lands in a preallocated buffer."""

    def __init__(self, max_body: int) -> None:
        self.transport: asyncio.Transport | None = None
        self.body = bytearray(max_body + 64)
        self.head = bytearray()
        self.small = bytearray(65536)
        self.need: int | None = None  # body bytes still expected
        self.got = 0
        self.waiter: asyncio.Future[bytes] | None = None
        self.mode = "resp"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.need is not None:
            return memoryview(self.body)[self.got : self.need]
        return memoryview(self.small)

    def buffer_updated(self, nbytes: int) -> None:
        if self.need is not None:
            self.got += nbytes
        else:
            self.head += self.small[:nbytes]
            self._parse_head()
        self._maybe_done()

    def _parse_head(self) -> None:
        h = self.head
        if self.mode == "resp":
            i = h.find(b"\r\n")
            if i < 0:
                return
            line = bytes(h[:i])
            if line[:1] == b"$" and int(line[1:]) >= 0:
                n = int(line[1:]) + 2
                rest = h[i + 2 :]
                self.body[: len(rest)] = rest
                self.got, self.need = len(rest), n
                self.head = bytearray()
            else:
                self._resolve(line)
        else:
            i = h.find(b"\r\n\r\n")
            if i < 0:
                return
            head = bytes(h[:i]).lower()
            n = 0
            for ln in head.split(b"\r\n"):
                if ln.startswith(b"content-length:"):
                    n = int(ln.split(b":", 1)[1])
            if head.startswith(b"http/1.1 404") or self.method == "HEAD":
                n = 0 if self.method == "HEAD" else n
            rest = h[i + 4 :]
            self.body[: len(rest)] = rest
            self.got, self.need = len(rest), n
            self.head = bytearray()
            self.status = head[:12]

    method = "GET"
    status = b""

    def _maybe_done(self) -> None:
        if self.need is not None and self.got >= self.need:
            self.need = None
            self._resolve(b"body")

    def _resolve(self, v: bytes) -> None:
        self.head = bytearray()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(v)

    async def request(self, bufs: list[bytes | memoryview], method: str = "GET") -> bytes:
        assert self.transport is not None
        self.method = method
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.writelines(bufs)
        return await self.waiter

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("closed"))


def resp_cmd(*args: bytes | memoryview) -> list[bytes | memoryview]:
    out: list[bytes | memoryview] = []
    head = b"*%d\r\n" % len(args)
    for a in args:
        if len(a) > 16384:
            out.append(head + b"$%d\r\n" % len(a))
            out.append(a)
            head = b"\r\n"
        else:
            head += b"$%d\r\n" % len(a) + bytes(a) + b"\r\n"
    out.append(head)
    return out


async def _connect(host: str, port: int, max_body: int) -> _Conn:
    loop = asyncio.get_running_loop()
    _, proto = await loop.create_connection(lambda: _Conn(max_body), host, port)
    return proto


async def _drive(
    conns: list[_Conn], n: int, size: int, one: Callable[[_Conn, int], Awaitable[None]]
) -> Result:
    """Run `one(conn, i)` for i in [0, n) split over the connections, one in flight each;
    time each request and the whole run; close the connections."""
    res = Result()
    per = n // len(conns)

    async def worker(ci: int) -> None:
        c = conns[ci]
        for i in range(ci * per, (ci + 1) * per):
            t = time.perf_counter()
            await one(c, i)
            res.latencies.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(len(conns))))
    res.seconds = time.perf_counter() - t0
    res.ops = per * len(conns)
    res.nbytes = res.ops * size
    for c in conns:
        assert c.transport is not None
        c.transport.close()
    return res


async def run_resp(
    host: str,
    port: int,
    token: str | None,
    op: str,
    keys: list[bytes],
    payloads: list[bytes],
    clients: int,
) -> Result:
    size = len(payloads[0])
    conns = [await _connect(host, port, size) for _ in range(clients)]
    for c in conns:
        if token:
            await c.request(resp_cmd(b"AUTH", token.encode()))

    async def one(c: _Conn, i: int) -> None:
        if op == "set":
            r = await c.request(resp_cmd(b"SET", keys[i], payloads[i]))
            if r != b"+OK":
                raise RuntimeError(f"SET failed: {r!r}")
        else:
            r = await c.request(resp_cmd(b"GET", keys[i]))
            if r != b"body" or c.got != size + 2:
                raise RuntimeError(f"GET miss or wrong size: {r!r}")

    return await _drive(conns, len(keys), size, one)


async def run_http(
    host: str,
    port: int,
    token: str,
    op: str,
    keys: list[bytes],
    payloads: list[bytes],
    clients: int,
) -> Result:
    size = len(payloads[0])
    conns = [await _connect(host, port, size) for _ in range(clients)]
    for c in conns:
        c.mode = "http"
    auth = b"Authorization: Bearer " + token.encode() + b"\r\n"

    async def one(c: _Conn, i: int) -> None:
        path = b"/kv/" + keys[i]
        if op == "set":
            head = b"PUT " + path + b" HTTP/1.1\r\nHost: b\r\n" + auth
            head += b"Content-Length: %d\r\n\r\n" % size
            await c.request([head, payloads[i]], "PUT")
            if not c.status.startswith(b"http/1.1 20"):
                raise RuntimeError(f"PUT failed: {c.status!r}")
        else:
            head = b"GET " + path + b" HTTP/1.1\r\nHost: b\r\n" + auth + b"\r\n"
            await c.request([head])
            if not c.status.startswith(b"http/1.1 200") or c.got != size:
                raise RuntimeError(f"GET failed: {c.status!r} {c.got}")

    return await _drive(conns, len(keys), size, one)


def run(coro: object) -> Result:
    return uvloop.run(coro)  # type: ignore[arg-type]
