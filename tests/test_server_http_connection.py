"""The HTTP connection (server/http/connection.py) driven directly: request bytes in
through the protocol's read callbacks, response bytes out of a recording transport
(`helpers.FakeTransport`), a real `SharedKvIndex` behind it, the answers read back with
httptools (llhttp, the parser the server itself uses for requests). No socket: what a
read of N bytes makes the server write, and when it pauses, closes or lingers.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httptools
import pytest

from epistemic_kvcache.server.context import ServerContext
from epistemic_kvcache.server.http import make_http_factory
from helpers import FakeTransport, eventually_async
from servers import run_in_context

TOKEN_A = "http-connection-token-alpha"
TOKEN_B = "http-connection-token-bravo"


def request(
    method: str,
    path: str,
    body: bytes | None = None,
    *,
    token: str | None = TOKEN_A,
    headers: dict[str, str] | None = None,
) -> bytes:
    """One HTTP/1.1 request's bytes."""
    lines = [f"{method} {path} HTTP/1.1", "Host: test"]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


@dataclass
class Answer:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    def json(self) -> object:
        return json.loads(self.body)


class Answers:
    """httptools' response parser over everything the transport got (answers in order)."""

    def __init__(self) -> None:
        self.done: list[Answer] = []
        self._cur: Answer | None = None
        self._parser = httptools.HttpResponseParser(self)

    def on_message_begin(self) -> None:
        self._cur = Answer(0)

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self._cur is not None
        self._cur.headers[name.decode().lower()] = value.decode()

    def on_headers_complete(self) -> None:
        assert self._cur is not None
        self._cur.status = self._parser.get_status_code()

    def on_body(self, chunk: bytes) -> None:
        assert self._cur is not None
        self._cur.body += chunk

    def on_message_complete(self) -> None:
        assert self._cur is not None
        self.done.append(self._cur)
        self._cur = None

    def feed(self, data: bytes) -> None:
        self._parser.feed_data(data)


class Conn:
    """One HTTP connection over a FakeTransport, inside the running loop."""

    def __init__(self, ctx: ServerContext) -> None:
        self.proto = make_http_factory(ctx)()
        self.transport = FakeTransport().connect(self.proto)
        self.answers = Answers()
        self._taken = 0

    def send(self, data: bytes, *, read_size: int | None = None) -> None:
        self.transport.receive(data, read_size)

    async def wait(self, n: int = 1, timeout: float = 10.0) -> list[Answer]:
        """The next `n` answers (waiting for them)."""

        def arrived() -> bool:
            self.answers.feed(self.transport.take())
            return len(self.answers.done) >= self._taken + n

        await eventually_async(arrived, timeout=timeout, what=f"{n} answer(s)")
        got = self.answers.done[self._taken : self._taken + n]
        self._taken += n
        return got

    async def one(self, data: bytes, **kw: int) -> Answer:
        self.send(data, **kw)
        return (await self.wait(1))[0]


def run(scenario: Callable[[ServerContext], Awaitable[None]], **limits: object) -> None:
    """Run `scenario(ctx)` in a fresh loop over a real SharedKvIndex (servers.py)."""
    run_in_context(scenario, tokens={TOKEN_A: "alpha", TOKEN_B: "bravo"}, **limits)


def test_healthz_needs_no_credentials() -> None:
    async def scenario(ctx: ServerContext) -> None:
        c = Conn(ctx)
        a = await c.one(request("GET", "/healthz", token=None))
        assert a.status == 200
        assert a.json() == {"status": "ok"}
        assert not c.transport.closing

    run(scenario)


def test_kv_routes_need_credentials() -> None:
    async def scenario(ctx: ServerContext) -> None:
        c = Conn(ctx)
        a = await c.one(request("GET", "/kv/k", token=None))
        assert a.status == 401
        a = await c.one(request("GET", "/kv/k", token="not-a-token"))
        assert a.status == 401

    run(scenario)


@pytest.mark.parametrize("read_size", [1, 5, 64, None])
def test_put_get_delete_in_any_read_size(read_size: int | None) -> None:
    value = bytes(range(256)) * 10

    async def scenario(ctx: ServerContext) -> None:
        c = Conn(ctx)
        a = await c.one(request("PUT", "/kv/k1", value), read_size=read_size or 0)
        assert a.status == 201
        assert a.headers["x-kv-outcome"] == "created"
        assert ctx.store.stats(None).unique_blocks == 1
        a = await c.one(request("GET", "/kv/k1"), read_size=read_size or 0)
        assert (a.status, a.body) == (200, value)
        assert a.headers["content-type"] == "application/octet-stream"
        a = await c.one(request("DELETE", "/kv/k1"), read_size=read_size or 0)
        assert a.status == 204
        a = await c.one(request("GET", "/kv/k1"), read_size=read_size or 0)
        assert a.status == 404

    run(scenario)


def test_pipelined_requests_are_answered_in_order() -> None:
    async def scenario(ctx: ServerContext) -> None:
        c = Conn(ctx)
        pipeline = [
            request("PUT", "/kv/a", b"alpha"),
            request("PUT", "/kv/a", b"alpha"),
            request("GET", "/kv/a"),
            request("GET", "/kv/missing"),
            request("DELETE", "/kv/a"),
            request("GET", "/kv/a"),
        ]
        c.send(b"".join(pipeline))
        got = await c.wait(len(pipeline))
        assert [a.status for a in got] == [201, 200, 200, 404, 204, 404]
        assert got[1].headers["x-kv-outcome"] == "duplicate"
        assert got[2].body == b"alpha"

    run(scenario)


def test_head_answers_the_size_without_the_body() -> None:
    async def scenario(ctx: ServerContext) -> None:
        c = Conn(ctx)
        assert (await c.one(request("PUT", "/kv/a", b"alpha"))).status == 201
        c.send(request("HEAD", "/kv/a"))
        # httptools cannot be told a response answers a HEAD: read the head by hand.
        await eventually_async(lambda: c.transport.written.endswith(b"\r\n\r\n"))
        head = c.transport.take().decode()
        assert head.startswith("HTTP/1.1 200 ")
        assert "\r\ncontent-length: 5\r\n" in head.lower()
        c.send(request("GET", "/kv/a"))  # and nothing of the body came before this answer
        await eventually_async(lambda: c.transport.written.endswith(b"alpha"))
        assert c.transport.take().startswith(b"HTTP/1.1 200 ")

    run(scenario)


def test_tenants_do_not_see_each_others_keys() -> None:
    async def scenario(ctx: ServerContext) -> None:
        a, b = Conn(ctx), Conn(ctx)
        assert (await a.one(request("PUT", "/kv/name", b"alpha's", token=TOKEN_A))).status == 201
        assert (await b.one(request("GET", "/kv/name", token=TOKEN_B))).status == 404

    run(scenario)


def test_a_large_body_read_in_pieces_lands_whole() -> None:
    value = bytes(range(256)) * 8192  # 2 MiB: read straight into its own buffer

    async def scenario(ctx: ServerContext) -> None:
        c = Conn(ctx)
        a = await c.one(request("PUT", "/kv/big", value), read_size=65536)
        assert a.status == 201
        a = await c.one(request("GET", "/kv/big"))
        assert a.body == value

    run(scenario)


def test_a_body_over_the_block_limit_is_refused_from_the_head_and_the_connection_closes() -> None:
    async def scenario(ctx: ServerContext) -> None:
        c = Conn(ctx)
        head = request("PUT", "/kv/big", b"x" * 2048)[:-2048]  # the head alone
        a = await c.one(head)
        assert a.status == 413
        assert a.headers.get("connection") == "close"
        # Lingering: the write side is shut and the rest of the input is dropped.
        await eventually_async(lambda: c.transport.eof_written or c.transport.closing)
        assert ctx.store.stats(None).unique_blocks == 0

    run(scenario, max_block_bytes=1024)


def test_garbage_is_a_400_and_the_connection_closes() -> None:
    async def scenario(ctx: ServerContext) -> None:
        c = Conn(ctx)
        c.send(b"NOT HTTP AT ALL\r\n\r\n")
        await eventually_async(
            lambda: c.transport.eof_written or c.transport.closing, what="closed"
        )
        assert c.transport.written.startswith(b"HTTP/1.1 400 ")

    run(scenario)


def test_connection_close_is_honoured() -> None:
    async def scenario(ctx: ServerContext) -> None:
        c = Conn(ctx)
        a = await c.one(request("GET", "/healthz", token=None, headers={"Connection": "close"}))
        assert a.status == 200
        await eventually_async(
            lambda: c.transport.eof_written or c.transport.closing, what="closed"
        )

    run(scenario)


def test_connection_lost_releases_the_slot_and_the_live_set() -> None:
    async def scenario(ctx: ServerContext) -> None:
        c = Conn(ctx)
        assert (await c.one(request("GET", "/kv/k"))).status == 404
        assert c.proto in ctx.live
        assert ctx.open_connections["http"] == 1
        c.transport.close()
        await eventually_async(lambda: c.proto not in ctx.live, what="the connection left")
        assert ctx.open_connections["http"] == 0

    run(scenario)
