"""The RESP connection and dispatcher (server/resp/connection.py, dispatch.py) driven
directly: bytes in through the protocol's read callbacks, bytes out of a recording
transport (`helpers.FakeTransport`), a real `SharedKvIndex` behind it. No socket, no
client library: what a read of N bytes makes the server write, exactly.

The tests stay at the connection's outer edge (`make_resp_factory`, `connection_made`,
`get_buffer`/`buffer_updated`, `pause_writing`, the transport) so they hold whatever the
parser's inner surface becomes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from epistemic_kvcache.server.context import ServerContext
from epistemic_kvcache.server.resp import make_resp_factory
from epistemic_kvcache.server.resp.listener import RespFactory
from helpers import FakeTransport, eventually_async
from servers import run_in_context

TOKEN_A = "resp-dispatch-token-alpha"
TOKEN_B = "resp-dispatch-token-bravo"


def cmd(*args: str | bytes) -> bytes:
    """One command as a RESP array of bulk strings."""
    out = [f"*{len(args)}\r\n".encode()]
    for a in args:
        raw = a.encode() if isinstance(a, str) else a
        out.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    return b"".join(out)


class Conn:
    """One RESP connection over a FakeTransport, inside the running loop."""

    def __init__(self, ctx: ServerContext, factory: RespFactory | None = None) -> None:
        self.factory = make_resp_factory(ctx) if factory is None else factory
        self.proto = self.factory()
        self.transport = FakeTransport().connect(self.proto)

    def send(self, data: bytes, *, read_size: int | None = None) -> None:
        self.transport.receive(data, read_size)

    async def reply(self, expected: bytes, timeout: float = 10.0) -> bytes:
        """Wait until `expected` has been written (exactly that, nothing else) and take it."""
        await eventually_async(
            lambda: len(self.transport.written) >= len(expected), timeout=timeout, what=expected
        )
        got = self.transport.take()
        assert got == expected
        return got

    async def login(self, token: str = TOKEN_A) -> None:
        self.send(cmd("AUTH", token))
        await self.reply(b"+OK\r\n")


def run(scenario: Callable[[ServerContext], Awaitable[None]], **limits: object) -> None:
    """Run `scenario(ctx)` in a fresh loop over a real SharedKvIndex (servers.py)."""
    run_in_context(scenario, tokens={TOKEN_A: "alpha", TOKEN_B: "bravo"}, **limits)


def test_commands_before_auth_are_refused_and_auth_lets_them_through() -> None:
    async def scenario(ctx: ServerContext) -> None:
        c = Conn(ctx)
        c.send(cmd("GET", "k"))
        await c.reply(b"-NOAUTH Authentication required.\r\n")
        c.send(cmd("AUTH", "wrong-token"))
        got = await eventually_async(lambda: c.transport.take(), what="an AUTH error")
        assert got.startswith(b"-WRONGPASS")
        assert got.endswith(b"\r\n")
        await c.login()
        c.send(cmd("GET", "k"))
        await c.reply(b"$-1\r\n")

    run(scenario)


def test_set_then_get_round_trips_through_the_store() -> None:
    async def scenario(ctx: ServerContext) -> None:
        c = Conn(ctx)
        await c.login()
        c.send(cmd("SET", "k1", b"\x00value\r\n"))
        await c.reply(b"+OK\r\n")
        c.send(cmd("GET", "k1"))
        await c.reply(b"$8\r\n\x00value\r\n\r\n")
        c.send(cmd("EXISTS", "k1", "nope"))
        await c.reply(b":1\r\n")
        assert ctx.store.stats(None).unique_blocks == 1

    run(scenario)


def test_tenants_do_not_see_each_others_keys() -> None:
    async def scenario(ctx: ServerContext) -> None:
        a, b = Conn(ctx), Conn(ctx)
        await a.login(TOKEN_A)
        await b.login(TOKEN_B)
        a.send(cmd("SET", "shared-name", "alpha's"))
        await a.reply(b"+OK\r\n")
        b.send(cmd("GET", "shared-name"))
        await b.reply(b"$-1\r\n")

    run(scenario)


@pytest.mark.parametrize("read_size", [1, 2, 3, 7, 64, 10_000])
def test_pipelined_commands_in_any_read_size_are_answered_in_order(read_size: int) -> None:
    pipeline = [cmd("SET", f"k{i}", f"v{i}" * (i + 1)) for i in range(20)]
    pipeline += [cmd("GET", f"k{i}") for i in range(20)]
    pipeline += [cmd("GET", "missing"), cmd("PING"), cmd("DEL", "k0", "k1", "missing")]
    expected = b"+OK\r\n" * 20
    for i in range(20):
        value = f"v{i}".encode() * (i + 1)
        expected += b"$%d\r\n%s\r\n" % (len(value), value)
    expected += b"$-1\r\n+PONG\r\n:2\r\n"

    async def scenario(ctx: ServerContext) -> None:
        c = Conn(ctx)
        await c.login()
        c.send(b"".join(pipeline), read_size=read_size)
        await c.reply(expected)

    run(scenario)


def test_a_large_set_read_in_pieces_lands_whole() -> None:
    value = bytes(range(256)) * 4096  # 1 MiB: read straight into its final buffer

    async def scenario(ctx: ServerContext) -> None:
        c = Conn(ctx)
        await c.login()
        c.send(cmd("SET", "big", value), read_size=65536)
        await c.reply(b"+OK\r\n")
        c.send(cmd("STRLEN", "big"))
        await c.reply(b":%d\r\n" % len(value))
        c.send(cmd("GET", "big"))
        await c.reply(b"$%d\r\n%s\r\n" % (len(value), value))

    run(scenario)


def test_unknown_command_names_itself_and_the_connection_lives_on() -> None:
    async def scenario(ctx: ServerContext) -> None:
        c = Conn(ctx)
        await c.login()
        c.send(cmd("NOSUCHCMD", "a", "b") + cmd("PING"))
        await c.reply(
            b"-ERR unknown command 'NOSUCHCMD', with args beginning with: 'a' 'b' \r\n+PONG\r\n"
        )
        assert not c.transport.closing

    run(scenario)


def test_a_protocol_error_is_answered_then_the_connection_closes() -> None:
    async def scenario(ctx: ServerContext) -> None:
        c = Conn(ctx)
        await c.login()
        c.send(b"*1\r\n$x\r\n")
        await eventually_async(lambda: c.transport.closing, what="the connection closed")
        assert c.transport.written.startswith(b"-ERR Protocol error")

    run(scenario)


def test_quit_answers_ok_and_closes() -> None:
    async def scenario(ctx: ServerContext) -> None:
        c = Conn(ctx)
        await c.login()
        c.send(cmd("QUIT"))
        await c.reply(b"+OK\r\n")
        await eventually_async(lambda: c.transport.closing, what="the connection closed")

    run(scenario)


HIGH_WATER = FakeTransport().high_water


def test_a_peer_that_does_not_read_is_not_served_once_its_tenant_budget_is_spent() -> None:
    """The tenant's share of buffered bytes (`max_tenant_inflight_bytes`) is held by
    replies the peer has not read: nothing more is run for it until it reads."""

    async def scenario(ctx: ServerContext) -> None:
        c = Conn(ctx)
        await c.login()
        c.send(cmd("SET", "k", "v"))
        await c.reply(b"+OK\r\n")
        c.transport.fill(HIGH_WATER + 1)  # pause_writing, and the share is spent
        # Neither the inline fast path (GET) nor the task (PING, ECHO) answers while
        # the peer does not read.
        c.send(cmd("GET", "k") + cmd("PING") + cmd("ECHO", "x"))
        for _ in range(20):  # give the task every chance to (wrongly) answer
            await asyncio.sleep(0)
        assert c.transport.written == b""
        c.transport.drain()  # resume_writing
        await c.reply(b"$1\r\nv\r\n+PONG\r\n$1\r\nx\r\n")

    run(scenario, max_tenant_inflight_bytes=HIGH_WATER)


def test_a_peer_that_does_not_read_yet_is_served_while_its_replies_fit_the_budget() -> None:
    """As Redis does: a client may write a whole pipeline before it reads its replies
    (redis-py's pipeline does); while the replies fit its tenant's share they are
    produced, paused writing or not."""

    async def scenario(ctx: ServerContext) -> None:
        c = Conn(ctx)
        await c.login()
        c.send(cmd("SET", "k", "v"))
        await c.reply(b"+OK\r\n")
        c.transport.fill(HIGH_WATER + 1)  # pause_writing
        c.send(cmd("GET", "k") + cmd("PING") + cmd("SET", "k2", "v2") + cmd("ECHO", "x"))
        await c.reply(b"$1\r\nv\r\n+PONG\r\n+OK\r\n$1\r\nx\r\n")
        assert ctx.store.get_nowait("alpha", "k2") == b"v2"

    run(scenario)


@pytest.mark.parametrize("read_size", [None, 5])
def test_the_inline_commands_wait_while_the_peer_does_not_read(read_size: int | None) -> None:
    """GET/SET/EXISTS/STRLEN, which the read callback answers inline when it can, are
    not answered (nor SETs applied) while writing is paused with the tenant's budget
    spent; all are once it resumes."""

    async def scenario(ctx: ServerContext) -> None:
        c = Conn(ctx)
        await c.login()
        c.send(cmd("SET", "k", "v"))
        await c.reply(b"+OK\r\n")
        c.transport.fill(HIGH_WATER + 1)  # pause_writing, the share spent
        c.send(
            cmd("GET", "k")
            + cmd("SET", "k2", "v2")
            + cmd("EXISTS", "k", "k2")
            + cmd("STRLEN", "k"),
            read_size=read_size,
        )
        for _ in range(20):
            await asyncio.sleep(0)
        assert c.transport.written == b""
        assert ctx.store.get_nowait("alpha", "k2") is None  # not run either
        c.transport.drain()  # resume_writing
        await c.reply(b"$1\r\nv\r\n+OK\r\n:2\r\n:1\r\n")

    run(scenario, max_tenant_inflight_bytes=HIGH_WATER)


def test_connection_lost_releases_the_slot_and_the_live_set() -> None:
    async def scenario(ctx: ServerContext) -> None:
        c = Conn(ctx)
        await c.login()
        assert c.proto in ctx.live
        assert ctx.open_connections["resp"] == 1
        c.transport.close()
        await eventually_async(lambda: c.proto not in ctx.live, what="the connection left")
        assert ctx.open_connections["resp"] == 0

    run(scenario)


def test_client_list_names_the_last_command_answered_on_the_fast_path() -> None:
    """GET/SET/EXISTS/STRLEN answered inline (`run_fast`) are the connection's last
    command for CLIENT LIST's `cmd=` too, as when the task answers them."""

    async def scenario(ctx: ServerContext) -> None:
        c = Conn(ctx)
        await c.login()
        c.send(cmd("SET", "k", "v"))
        await c.reply(b"+OK\r\n")
        c.send(cmd("EXISTS", "k"))
        await c.reply(b":1\r\n")
        other = Conn(ctx, c.factory)  # (a second connection of the same listener)
        await other.login()
        other.send(cmd("CLIENT", "LIST"))
        got = await eventually_async(lambda: other.transport.take(), what="CLIENT LIST")
        lines = [line for line in got.split(b"\n") if b"id=" in line]
        mine = [line for line in lines if b" cmd=client " not in line]
        assert len(mine) == 1
        assert b" cmd=exists " in mine[0]

    run(scenario)
