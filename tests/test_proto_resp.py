"""Sans-IO tests of the RESP parser and serializer (no sockets).

Every framing case is fed whole, one byte at a time, and through the BufferedProtocol
pair (`get_buffer` / `buffer_updated`) with a tiny large-bulk threshold so the
preallocated-buffer path runs too.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis._parsers.encoders import Encoder
from redis.connection import PythonRespSerializer

from epistemic_kvcache.errors import LocalProtocolError, RemoteProtocolError
from epistemic_kvcache.proto.resp import (
    FIRST_READ_AFTER_BIG,
    NEED_DATA,
    NULL_ARRAY,
    ErrorReply,
    RefusedCommand,
    RespParser,
    SimpleString,
    Verbatim,
    command_size,
    pack_command,
    serialize,
    split_inline,
)

Feeder = Callable[[RespParser, bytes], None]


def feed_whole(p: RespParser, data: bytes) -> None:
    p.receive_data(data)


def feed_bytewise(p: RespParser, data: bytes) -> None:
    for i in range(len(data)):
        p.receive_data(data[i : i + 1])


def _feed_reads(p: RespParser, data: bytes, rng: random.Random, longest: int) -> None:
    """Like asyncio.BufferedProtocol: write into get_buffer(), then buffer_updated()."""
    pos = 0
    while pos < len(data):
        buf = p.get_buffer(-1)
        n = min(len(buf), len(data) - pos, rng.randint(1, longest))
        buf[:n] = data[pos : pos + n]
        p.buffer_updated(n)
        pos += n


def feed_buffered(p: RespParser, data: bytes, rng: random.Random | None = None) -> None:
    """Reads of 1..7 bytes."""
    _feed_reads(p, data, rng or random.Random(0), 7)


def feed_reads(p: RespParser, data: bytes, rng: random.Random | None = None) -> None:
    """Like a socket with reads of 1..300 bytes: a command's header and the start of its
    large bulk often share a read (framed straight from the scratch buffer)."""
    _feed_reads(p, data, rng or random.Random(1), 300)


def feed_greedy(p: RespParser, data: bytes) -> None:
    """Like a socket with everything already queued: each read fills what is lent (a
    large bulk's rest with its CRLF, the short first read after a large bulk)."""
    pos = 0
    while pos < len(data):
        buf = p.get_buffer(-1)
        n = min(len(buf), len(data) - pos)
        buf[:n] = data[pos : pos + n]
        p.buffer_updated(n)
        pos += n


FEEDERS: list[tuple[str, Feeder, int]] = [
    ("whole", feed_whole, 32 * 1024),
    ("bytewise", feed_bytewise, 32 * 1024),
    ("buffered-big", feed_buffered, 4),
    ("bytewise-big", feed_bytewise, 4),
    ("reads", feed_reads, 32 * 1024),
    ("reads-big", feed_reads, 4),
    ("greedy", feed_greedy, 32 * 1024),
    ("greedy-big", feed_greedy, 4),
]


def drain(p: RespParser) -> tuple[list[list[bytes]], str | None]:
    """All commands, then the protocol error message if any."""
    out: list[list[bytes]] = []
    while True:
        try:
            ev = p.next_event()
        except RemoteProtocolError as exc:
            return out, str(exc)
        if ev is NEED_DATA:
            return out, None
        out.append([bytes(a) for a in ev])


GOOD: list[tuple[bytes, list[list[bytes]]]] = [
    (b"*1\r\n$4\r\nPING\r\n", [[b"PING"]]),
    (
        b"*3\r\n$3\r\nSET\r\n$3\r\nkey\r\n$5\r\nvalue\r\n",
        [[b"SET", b"key", b"value"]],
    ),
    (b"*2\r\n$3\r\nGET\r\n$0\r\n\r\n", [[b"GET", b""]]),
    (b"*2\r\n$4\r\nECHO\r\n$4\r\n\r\n\r\n\r\n", [[b"ECHO", b"\r\n\r\n"]]),
    (b"*1\r\n$4\r\nPING\r\n*1\r\n$4\r\nPING\r\n", [[b"PING"], [b"PING"]]),
    (b"*0\r\n*-1\r\n*1\r\n$1\r\nx\r\n", [[b"x"]]),  # empty requests are ignored (Redis)
    (b"PING\r\n", [[b"PING"]]),
    (b"PING\n", [[b"PING"]]),
    (b"set  k   v\r\n", [[b"set", b"k", b"v"]]),
    (b"\r\n\n  \r\nPING\r\n", [[b"PING"]]),
    (b"SET \"a b\" 'c d'\r\n", [[b"SET", b"a b", b"c d"]]),
    (b'ECHO "\\x41\\n\\"q\\""\r\n', [[b"ECHO", b'A\n"q"']]),
    (b"ECHO 'it\\'s'\r\n", [[b"ECHO", b"it's"]]),
    (b'ECHO ""\r\n', [[b"ECHO", b""]]),
    (
        b"*2\r\n$3\r\nGET\r\n$40\r\n" + b"k" * 40 + b"\r\nPING\r\n",
        [[b"GET", b"k" * 40], [b"PING"]],
    ),
    (b"*2\r\n$3\r\nSET\r\n$3\r\n\x00\xff\x80\r\n", [[b"SET", b"\x00\xff\x80"]]),
]

BAD: list[tuple[bytes, list[list[bytes]], str]] = [
    # Redis tests/unit/protocol.tcl and networking.c wording.
    (b"*3000000000\r\n", [], "Protocol error: invalid multibulk length"),
    (b"*-10\r\n", [], "Protocol error: invalid multibulk length"),
    (b"*abc\r\n", [], "Protocol error: invalid multibulk length"),
    (b"*01\r\n", [], "Protocol error: invalid multibulk length"),
    (b"*\r\n", [], "Protocol error: invalid multibulk length"),
    (b"*1\r\n$-10\r\n", [], "Protocol error: invalid bulk length"),
    (b"*1\r\n$2000000000\r\n", [], "Protocol error: invalid bulk length"),
    (b"*1\r\n$blabla\r\n", [], "Protocol error: invalid bulk length"),
    (b"*1\r\n$99999999999999999999\r\n", [], "Protocol error: invalid bulk length"),
    (b"*1\r\nfoo\r\n", [], "Protocol error: expected '$', got 'f'"),
    (
        b"*3\r\n$3\r\nSET\r\n$1\r\nx\r\nfooz\r\n",
        [],
        "Protocol error: expected '$', got 'f'",
    ),
    (b"*1\r\n\x00\r\n", [], "Protocol error: expected '$', got '\\x00'"),
    (b"*1\r\n$3\r\nabcde\r\n", [], "Protocol error: expected '\\r\\n' after bulk data"),
    (
        b"PING\r\n*1\r\n$-1\r\n",
        [[b"PING"]],
        "Protocol error: invalid bulk length",
    ),
    (
        b'set """test-key""" test-value\r\nping\r\n',
        [],
        "Protocol error: unbalanced quotes in request",
    ),
    (b'ECHO "abc\r\n', [], "Protocol error: unbalanced quotes in request"),
    (b"ECHO 'abc\r\n", [], "Protocol error: unbalanced quotes in request"),
]


@pytest.mark.parametrize(("name", "feed", "threshold"), FEEDERS, ids=[f[0] for f in FEEDERS])
@pytest.mark.parametrize(("data", "expected"), GOOD)
def test_good_input(
    name: str,
    feed: Feeder,
    threshold: int,
    data: bytes,
    expected: list[list[bytes]],
) -> None:
    p = RespParser(authenticated=True, large_bulk_threshold=threshold)
    feed(p, data)
    assert drain(p) == (expected, None)
    assert p.buffered_bytes == 0
    assert not p.has_partial


@pytest.mark.parametrize(("name", "feed", "threshold"), FEEDERS, ids=[f[0] for f in FEEDERS])
@pytest.mark.parametrize(("data", "before", "message"), BAD)
def test_bad_input(
    name: str,
    feed: Feeder,
    threshold: int,
    data: bytes,
    before: list[list[bytes]],
    message: str,
) -> None:
    p = RespParser(authenticated=True, large_bulk_threshold=threshold)
    feed(p, data)
    assert drain(p) == (before, message)
    # The error sticks.
    with pytest.raises(RemoteProtocolError, match="Protocol error"):
        p.next_event()


def test_partial_command_waits() -> None:
    p = RespParser(authenticated=True)
    data = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$5\r\nvalue\r\n"
    for cut in range(len(data)):
        q = RespParser(authenticated=True)
        q.receive_data(data[:cut])
        assert q.next_event() is NEED_DATA
        assert q.has_partial == (cut > 0)
    p.receive_data(data)
    assert p.next_event() == [b"SET", b"k", b"value"]


@pytest.mark.parametrize(
    ("kwargs", "data", "message"),
    [
        ({"max_multibulk_len": 3}, b"*4\r\n", "invalid multibulk length"),
        ({"max_bulk_bytes": 10}, b"*1\r\n$11\r\n", "invalid bulk length"),
        ({"max_inline_bytes": 16}, b"A" * 17, "too big inline request"),
        ({"max_inline_bytes": 16}, b"A" * 17 + b"\r\n", "too big inline request"),
        ({"max_inline_bytes": 16}, b"*" + b"1" * 17, "too big mbulk count string"),
        ({"max_inline_bytes": 16}, b"*1\r\n$" + b"1" * 17, "too big bulk count string"),
    ],
)
def test_configured_limits(kwargs: dict[str, int], data: bytes, message: str) -> None:
    p = RespParser(authenticated=True, **kwargs)
    p.receive_data(data)
    with pytest.raises(RemoteProtocolError, match=message):
        p.next_event()


def test_limits_just_inside_are_accepted() -> None:
    p = RespParser(authenticated=True, max_multibulk_len=3, max_bulk_bytes=10)
    p.receive_data(b"*3\r\n$10\r\n0123456789\r\n$0\r\n\r\n$1\r\nx\r\n")
    assert p.next_event() == [b"0123456789", b"", b"x"]


def test_invalid_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="max_bulk_bytes"):
        RespParser(max_bulk_bytes=0)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"*11\r\n", "Protocol error: unauthenticated multibulk length"),
        (b"*1\r\n$16385\r\n", "Protocol error: unauthenticated bulk length"),
        (b"A B C D E F G H I J K\r\n", "Protocol error: unauthenticated inline request"),
        (b"AUTH " + b"x" * 16385 + b"\r\n", "Protocol error: unauthenticated inline request"),
    ],
)
def test_unauthenticated_limits(data: bytes, message: str) -> None:
    p = RespParser()  # unauthenticated, Redis' defaults
    p.receive_data(data)
    with pytest.raises(RemoteProtocolError) as info:
        p.next_event()
    assert str(info.value) == message


def test_unauthenticated_parses_one_command_ahead_then_relaxes() -> None:
    """Limits for a command are the ones in force after the previous command ran."""
    p = RespParser(unauthenticated_max_multibulk_len=2, unauthenticated_max_bulk_bytes=4)
    big = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$10\r\n0123456789\r\n"
    p.receive_data(b"*2\r\n$4\r\nAUTH\r\n$3\r\ntok\r\n" + big)
    assert p.peek() is not None
    assert p.next_event() == [b"AUTH", b"tok"]
    p.authenticated = True  # AUTH succeeded
    assert p.next_event() == [b"SET", b"k", b"0123456789"]

    q = RespParser(unauthenticated_max_multibulk_len=2, unauthenticated_max_bulk_bytes=4)
    q.receive_data(b"*2\r\n$4\r\nAUTH\r\n$3\r\nbad\r\n" + big)
    assert q.next_event() == [b"AUTH", b"bad"]
    with pytest.raises(RemoteProtocolError, match="unauthenticated multibulk length"):
        q.next_event()


def test_large_bulk_is_read_into_one_preallocated_buffer() -> None:
    size = 1 << 20
    payload = bytes(range(256)) * (size // 256)
    p = RespParser(authenticated=True)
    p.receive_data(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\n" % size + payload[:100])
    first = p.get_buffer(65536)
    # The buffer lent to the socket is the unfilled tail of the final argument and room
    # for the CRLF after it.
    assert len(first) == size - 100 + 2
    views: list[memoryview] = []
    pos = 100
    while pos < size:
        buf = p.get_buffer(65536)
        views.append(buf)
        n = min(len(buf), 100_000, size - pos)
        buf[:n] = payload[pos : pos + n]
        p.buffer_updated(n)
        pos += n
    assert all(v.obj is first.obj for v in views)
    assert p.next_event() is NEED_DATA  # CRLF still missing
    assert p.buffered_bytes == size + 4
    p.receive_data(b"\r\n")
    cmd = p.next_event()
    assert isinstance(cmd, list)
    arg = cmd[2]
    assert arg == payload
    # no copy: the argument is the buffer we read into (a view over an mmap when large)
    owner = arg.obj if isinstance(arg, memoryview) else arg
    assert owner is first.obj
    assert p.buffered_bytes == 0


def test_large_bulk_starting_in_a_read_goes_straight_into_its_buffer() -> None:
    size = 256 << 10
    payload = bytes(range(256)) * (size // 256)
    head = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\n" % size
    wire = head + payload + b"\r\n*1\r\n$4\r\nPING\r\n"
    p = RespParser(authenticated=True)
    scratch = p.get_buffer(-1)
    first = min(len(scratch), 40_000)  # the head and the start of the payload
    scratch[:first] = wire[:first]
    p.buffer_updated(first)
    started = first - len(head)
    assert p.buffered_bytes == started + len(b"SETk")  # nothing left in the receive buffer
    lent = p.get_buffer(65536)
    assert len(lent) == size - started + 2  # the rest is read in place, and its CRLF
    lent[:] = wire[first : first + len(lent)]
    p.buffer_updated(len(lent))
    p.receive_data(wire[first + len(lent) :])
    cmd = p.next_event()
    assert isinstance(cmd, list)
    assert [bytes(a) for a in cmd[:2]] == [b"SET", b"k"]
    assert cmd[2] == payload
    assert isinstance(cmd[2], memoryview)
    assert cmd[2].obj is lent.obj  # one buffer, filled by both reads
    assert p.next_event() == [b"PING"]
    assert p.next_event() is NEED_DATA


def test_a_large_bulk_is_not_started_beyond_max_ready() -> None:
    p = RespParser(authenticated=True, large_bulk_threshold=64, max_ready=1)
    body = b"v" * 100
    wire = b"*2\r\n$3\r\nGET\r\n$1\r\na\r\n*3\r\n$3\r\nSET\r\n$1\r\nb\r\n$100\r\n" + body + b"\r\n"
    buf = p.get_buffer(-1)
    buf[: len(wire)] = wire
    p.buffer_updated(len(wire))
    assert p.peek() == [b"GET", b"a"]
    assert p.held_bytes == 0  # the SET's bulk is not allocated while the queue is full
    assert p.next_event() == [b"GET", b"a"]
    cmd = p.next_event()  # framed now, from the receive buffer
    assert isinstance(cmd, list)
    assert [bytes(a) for a in cmd] == [b"SET", b"b", body]


def test_after_a_large_bulk_the_next_read_asks_for_a_header_first() -> None:
    """Large SETs back to back: the read after one asks for a header's worth, so the next
    bulk goes into its own buffer in place instead of being copied out of the scratch
    buffer; a read that fills it (more than large bulks follow) gets the whole scratch
    buffer again."""
    size = 64 << 10
    p = RespParser(authenticated=True)
    full = len(p.get_buffer(-1))
    assert full > FIRST_READ_AFTER_BIG
    one = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\n" % size + b"v" * size + b"\r\n"
    feed_greedy(p, one)
    assert len(p.get_buffer(-1)) == FIRST_READ_AFTER_BIG
    scratch = p.get_buffer(-1)
    head = b"*3\r\n$3\r\nSET\r\n$1\r\nj\r\n$%d\r\n" % size
    scratch[: len(head) + 10] = head + b"w" * 10
    p.buffer_updated(len(head) + 10)  # less than asked: still between large bulks
    lent = p.get_buffer(-1)
    assert len(lent) == size - 10 + 2  # in place, with its CRLF
    lent[:] = b"w" * (size - 10) + b"\r\n"
    p.buffer_updated(len(lent))
    small = b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n" * 400
    scratch = p.get_buffer(-1)
    assert len(scratch) == FIRST_READ_AFTER_BIG
    scratch[:] = small[: len(scratch)]
    p.buffer_updated(len(scratch))  # it filled: whole reads again
    assert len(p.get_buffer(-1)) == full
    cmds, error = drain(p)
    assert error is None
    assert [bytes(c[2]) for c in cmds[:2]] == [b"v" * size, b"w" * size]


@pytest.mark.parametrize(
    ("room", "then", "expected", "error"),
    [
        (b"\r\n", b"*1\r\n$4\r\nPING\r\n", [[b"SET", b"k", b"v" * 40], [b"PING"]], None),
        (b"\r", b"\n*1\r\n$4\r\nPING\r\n", [[b"SET", b"k", b"v" * 40], [b"PING"]], None),
        (b"XY", b"*1\r\n$4\r\nPING\r\n", [], "Protocol error: expected '\\r\\n' after bulk data"),
    ],
    ids=["crlf", "half", "garbage"],
)
def test_what_lands_in_a_large_bulks_room_is_parsed_in_order(
    room: bytes, then: bytes, expected: list[list[bytes]], error: str | None
) -> None:
    p = RespParser(authenticated=True, large_bulk_threshold=32)
    p.receive_data(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$40\r\n")
    lent = p.get_buffer(-1)
    assert len(lent) == 42
    got = b"v" * 40 + room
    lent[: len(got)] = got
    p.buffer_updated(len(got))
    feed_greedy(p, then)
    cmds, message = drain(p)
    assert [[bytes(a) for a in c] for c in cmds] == expected
    assert message == error
    assert p.held_bytes == 0


def test_refusing_a_command_mid_large_bulk_lets_its_buffer_go() -> None:
    size = 64 << 10
    p = RespParser(authenticated=True)
    p.receive_data(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\n" % size + b"v" * 100)
    assert p.held_bytes == size
    assert p.refuse_partial("over the query buffer limit")
    assert p.held_bytes == 0  # at once, not when the connection closes
    feed_greedy(p, b"v" * (size - 100) + b"\r\n*1\r\n$4\r\nPING\r\n")
    refused = p.next_event()
    assert isinstance(refused, RefusedCommand)
    assert refused.reason == "over the query buffer limit"
    assert p.next_event() == [b"PING"]
    assert (p.held_bytes, p.buffered_bytes) == (0, 0)


def test_a_full_read_of_small_commands_ends_the_short_reads() -> None:
    p = RespParser(authenticated=True, large_bulk_threshold=32)
    feed_greedy(p, b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$40\r\n" + b"v" * 40 + b"\r\n")
    assert p.next_event() == [b"SET", b"k", b"v" * 40]
    scratch = p.get_buffer(-1)
    assert len(scratch) == FIRST_READ_AFTER_BIG
    small = b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n" * 400
    scratch[:] = small[: len(scratch)]
    p.buffer_updated(len(scratch))
    assert p.next_event() == [b"GET", b"k"]
    assert len(p.get_buffer(-1)) > FIRST_READ_AFTER_BIG


def test_small_command_then_a_large_bulk_in_the_same_read() -> None:
    p = RespParser(authenticated=True, large_bulk_threshold=64)
    body = b"v" * 100
    wire = b"*2\r\n$3\r\nGET\r\n$1\r\na\r\n*3\r\n$3\r\nSET\r\n$1\r\nb\r\n$100\r\n" + body[:10]
    buf = p.get_buffer(-1)
    buf[: len(wire)] = wire
    p.buffer_updated(len(wire))
    taken = p.next_event()
    assert taken == [b"GET", b"a"]
    p.unread([taken])  # handed back: it comes first
    rest = p.get_buffer(-1)
    assert len(rest) == 92  # the large bulk's buffer, 10 bytes already in, and its CRLF
    rest[:] = body[10:] + b"\r\n"
    p.buffer_updated(92)  # the CRLF came in the payload's read: the command is complete
    assert p.next_event() == [b"GET", b"a"]
    cmd = p.next_event()
    assert isinstance(cmd, list)
    assert [bytes(a) for a in cmd] == [b"SET", b"b", body]


class Budget:
    """A `reserve` hook over a fixed budget; `release` gives bytes back."""

    def __init__(self, total: int) -> None:
        self.left = total
        self.asked: list[int] = []

    def reserve(self, n: int) -> bool:
        self.asked.append(n)
        if n > self.left:
            return False
        self.left -= n
        return True


@pytest.mark.parametrize(("name", "feed", "threshold"), FEEDERS, ids=[f[0] for f in FEEDERS])
def test_refused_bulk_is_skipped_and_its_command_refused(
    name: str, feed: Feeder, threshold: int
) -> None:
    budget = Budget(45)
    p = RespParser(authenticated=True, large_bulk_threshold=threshold, reserve=budget.reserve)
    data = (
        b"*3\r\n$3\r\nSET\r\n$1\r\na\r\n$30\r\n" + b"x" * 30 + b"\r\n"
        b"*4\r\n$4\r\nMSET\r\n$1\r\nb\r\n$20\r\n" + b"y" * 20 + b"\r\n$1\r\nc\r\n"
        b"*2\r\n$4\r\nECHO\r\n$5\r\nhello\r\n"
    )
    feed(p, data)
    cmds: list[list[bytes]] = []
    while (ev := p.next_event()) is not NEED_DATA:
        cmds.append(ev)
    if threshold > 30:  # no large bulks: nothing is reserved, nothing refused
        assert budget.asked == []
        assert cmds[1] == [b"MSET", b"b", b"y" * 20, b"c"]
        return
    # Bulks of >= 4 bytes are reserved: 30 + 4 (MSET) fit the budget of 45, 20 more do
    # not, so that command is dropped whole; ECHO's 4 + 5 fit again.
    assert cmds[0] == [b"SET", b"a", b"x" * 30]
    assert isinstance(cmds[1], RefusedCommand)
    assert cmds[1] == []
    assert cmds[2] == [b"ECHO", b"hello"]
    assert budget.asked == [30, 4, 20, 4, 5]
    assert budget.left == 2
    assert p.held_bytes == 0


def test_held_bytes_follow_preallocated_bulks_until_returned() -> None:
    budget = Budget(1000)
    p = RespParser(authenticated=True, large_bulk_threshold=8, reserve=budget.reserve)
    p.receive_data(b"*3\r\n$4\r\nMSET\r\n$10\r\n0123456789\r\n$100\r\n" + b"z" * 50)
    assert p.held_bytes == 110  # one finished argument, one being filled
    p.receive_data(b"z" * 50 + b"\r\n*2\r\n$4\r\nECHO\r\n$9\r\n123456789\r\n")
    assert p.held_bytes == 119
    assert p.next_event() == [b"MSET", b"0123456789", b"z" * 100]
    assert p.held_bytes == 9
    assert p.next_event() == [b"ECHO", b"123456789"]
    assert p.held_bytes == 0
    assert budget.left == 1000 - 119  # the owner releases; the parser only reserves
    # A protocol error drops the partial command's buffers from held_bytes too.
    p.receive_data(b"*2\r\n$4\r\nECHO\r\n$20\r\n" + b"q" * 20 + b"XX")
    with pytest.raises(RemoteProtocolError, match="after bulk data"):
        p.next_event()
    assert p.held_bytes == 0


def test_refused_bulk_still_checks_its_framing() -> None:
    p = RespParser(authenticated=True, large_bulk_threshold=4, reserve=lambda n: False)
    p.receive_data(b"*2\r\n$4\r\nECHO\r\n$6\r\nabcdefXX")
    with pytest.raises(RemoteProtocolError, match="after bulk data"):
        p.next_event()


def test_get_buffer_grows_scratch_for_large_hints() -> None:
    p = RespParser(authenticated=True, read_buffer_bytes=16)
    assert len(p.get_buffer(-1)) == 16
    assert len(p.get_buffer(1000)) == 1000
    p.buffer_updated(0)
    assert p.next_event() is NEED_DATA


def test_buffered_bytes_counts_ready_and_partial() -> None:
    p = RespParser(authenticated=True)
    p.receive_data(b"*2\r\n$4\r\nECHO\r\n$3\r\nabc\r\n*2\r\n$4\r\nECHO\r\n$5\r\nab")
    assert p.peek() is not None
    assert p.has_partial
    assert p.buffered_bytes == 7 + 4 + 2  # ready command + partial args + unparsed "ab"
    p.next_event()
    assert p.peek() is None


def test_split_inline_matches_sdssplitargs() -> None:
    assert split_inline(b"") == []
    assert split_inline(b"   ") == []
    assert split_inline(b'a "b\\tc" \'d\\\\e\' "\\x4g"') == [b"a", b"b\tc", b"d\\\\e", b"x4g"]
    with pytest.raises(RemoteProtocolError):
        split_inline(b'"abc"def')


# -- Hypothesis ------------------------------------------------------------------------

args_strategy = st.lists(
    st.one_of(st.binary(max_size=200), st.text(max_size=50), st.integers()),
    min_size=1,
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(
    commands=st.lists(args_strategy, min_size=1, max_size=5),
    threshold=st.sampled_from([1, 16, 64, 32 * 1024]),
    seed=st.integers(0, 2**32),
)
def test_roundtrip_redis_py_serializer(
    commands: list[list[bytes | str | int]], threshold: int, seed: int
) -> None:
    """What redis-py sends, split anywhere, parses back to the same arguments."""
    enc = Encoder("utf-8", "strict", False)
    ser = PythonRespSerializer(64, enc.encode)
    wire = b""
    expected = []
    for cmd in commands:
        # redis-py splits a first str argument on spaces; start with a fixed name.
        full: list[bytes | str | int] = [b"CMD", *cmd]
        wire += b"".join(bytes(c) for c in ser.pack(*full))
        expected.append([enc.encode(a) for a in full])
    rng = random.Random(seed)
    p = RespParser(authenticated=True, large_bulk_threshold=threshold)
    feed_buffered(p, wire, rng)
    assert drain(p) == (expected, None)


@settings(max_examples=100, deadline=None)
@given(cmd=args_strategy)
def test_roundtrip_pack_command(cmd: list[bytes | str | int]) -> None:
    p = RespParser(authenticated=True, large_bulk_threshold=8)
    for buf in pack_command(*cmd, cutoff=8):
        p.receive_data(buf)
    expected = [
        a.encode() if isinstance(a, str) else (b"%d" % a if isinstance(a, int) else a) for a in cmd
    ]
    assert drain(p) == ([expected], None)


_fuzz_bytes = st.one_of(
    st.binary(max_size=300),
    st.lists(
        st.sampled_from(
            [b"*", b"$", b"\r\n", b"\n", b"1", b"2", b"-1", b"0", b"9", b"x", b'"', b"'", b"\\"]
        ),
        max_size=60,
    ).map(b"".join),
)


@settings(max_examples=500, deadline=None)
@given(data=_fuzz_bytes, authenticated=st.booleans(), bytewise=st.booleans())
def test_fuzz_parses_or_raises_protocol_error(
    data: bytes, authenticated: bool, bytewise: bool
) -> None:
    """Any input: commands, NEED_DATA, or RemoteProtocolError; nothing else."""
    p = RespParser(authenticated=authenticated, large_bulk_threshold=4, max_inline_bytes=64)
    if bytewise:
        feed_bytewise(p, data)
    else:
        feed_buffered(p, data)
    for _ in range(len(data) + 2):
        try:
            ev = p.next_event()
        except RemoteProtocolError as exc:
            message = str(exc)
            break
        if ev is NEED_DATA:
            return
        assert isinstance(ev, list)
        assert ev
        assert all(isinstance(a, bytes | bytearray) for a in ev)
    else:
        pytest.fail("parser produced more commands than input bytes")
    assert message.startswith("Protocol error: ")


# -- serializer ------------------------------------------------------------------------

SERIALIZE: list[tuple[object, bytes, bytes]] = [
    (SimpleString("OK"), b"+OK\r\n", b"+OK\r\n"),
    (ErrorReply("ERR bad"), b"-ERR bad\r\n", b"-ERR bad\r\n"),
    (42, b":42\r\n", b":42\r\n"),
    (-1, b":-1\r\n", b":-1\r\n"),
    (2**70, b"$22\r\n1180591620717411303424\r\n", b"(1180591620717411303424\r\n"),
    (b"ab", b"$2\r\nab\r\n", b"$2\r\nab\r\n"),
    ("é", b"$2\r\n\xc3\xa9\r\n", b"$2\r\n\xc3\xa9\r\n"),
    (b"", b"$0\r\n\r\n", b"$0\r\n\r\n"),
    (None, b"$-1\r\n", b"_\r\n"),
    (NULL_ARRAY, b"*-1\r\n", b"_\r\n"),
    (True, b":1\r\n", b"#t\r\n"),
    (False, b":0\r\n", b"#f\r\n"),
    (1.5, b"$3\r\n1.5\r\n", b",1.5\r\n"),
    (float("inf"), b"$3\r\ninf\r\n", b",inf\r\n"),
    (float("-inf"), b"$4\r\n-inf\r\n", b",-inf\r\n"),
    (float("nan"), b"$3\r\nnan\r\n", b",nan\r\n"),
    ([], b"*0\r\n", b"*0\r\n"),
    ([b"a", None, 1], b"*3\r\n$1\r\na\r\n$-1\r\n:1\r\n", b"*3\r\n$1\r\na\r\n_\r\n:1\r\n"),
    ({"k": 1}, b"*2\r\n$1\r\nk\r\n:1\r\n", b"%1\r\n$1\r\nk\r\n:1\r\n"),
    ({b"m"}, b"*1\r\n$1\r\nm\r\n", b"~1\r\n$1\r\nm\r\n"),
    (Verbatim("a:b"), b"$3\r\na:b\r\n", b"=7\r\ntxt:a:b\r\n"),
    ([[1], [[]]], b"*2\r\n*1\r\n:1\r\n*1\r\n*0\r\n", b"*2\r\n*1\r\n:1\r\n*1\r\n*0\r\n"),
]


@pytest.mark.parametrize(("value", "resp2", "resp3"), SERIALIZE)
def test_serialize(value: object, resp2: bytes, resp3: bytes) -> None:
    assert b"".join(serialize(value, 2)) == resp2
    assert b"".join(serialize(value, 3)) == resp3


def test_serialize_keeps_big_payload_as_its_own_buffer() -> None:
    payload = memoryview(bytearray(b"x" * 100))
    out = serialize([b"small", payload, b"tail"], 2, cutoff=50)
    assert len(out) == 3
    assert out[1] is payload  # not copied
    assert b"".join(bytes(b) for b in out) == (
        b"*3\r\n$5\r\nsmall\r\n$100\r\n" + b"x" * 100 + b"\r\n$4\r\ntail\r\n"
    )


@pytest.mark.parametrize(
    "value",
    [SimpleString("a\r\nb"), ErrorReply("ERR \n"), object(), [1, object()]],
)
def test_serialize_refuses_what_resp_cannot_carry(value: object) -> None:
    with pytest.raises(LocalProtocolError):
        serialize(value, 2)


def test_serialize_refuses_unknown_protocol() -> None:
    with pytest.raises(LocalProtocolError):
        serialize(1, 4)


@given(st.lists(st.binary(max_size=300), min_size=1, max_size=12))
def test_command_size_is_the_multibulk_encoding(args: list[bytes]) -> None:
    """The access log's `in=` for RESP: the command's bytes as a client sends them."""
    wire = sum(len(b) for b in pack_command(*args))
    assert command_size(args) == wire
    assert command_size([memoryview(a) for a in args]) == wire
    assert command_size(RefusedCommand("too big")) == 0
