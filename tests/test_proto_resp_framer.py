"""The RESP framer against a byte-at-a-time reference (differential, Hypothesis).

`Reference` below is the simplest framer that can be written: one byte at a time, one
state per position in the grammar, every limit checked as soon as a byte crosses it. It
is the specification; `RespParser` (proto/resp_parser.py) is the fast framer, fed the
same bytes the way a connection feeds it: reads of 1-400 bytes through `get_buffer` /
`buffer_updated` (so large bulks land in their preallocated buffers), with the owner
taking a random number of complete commands between reads, sometimes putting the last
one back (`unread`). Both must frame the same commands, refuse the same ones, and fail
with the same error after the same commands, on well-formed and malformed input alike.
A compiled twin of the framer would be held to the same test.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epistemic_kvcache.errors import RemoteProtocolError
from epistemic_kvcache.proto.resp import NEED_DATA, RefusedCommand, RespParser, split_inline

Framed = tuple[bytes, ...] | tuple[str, str]
"""A framed command as compared: its arguments, or ("refused", reason)."""


def _int(raw: bytes) -> int | None:
    """Strict signed 64-bit decimal, as Redis' string2ll."""
    body = raw[1:] if raw.startswith(b"-") else raw
    if not body or any(c < 0x30 or c > 0x39 for c in body) or len(body) > 19:
        return None
    if len(body) > 1 and body[0] == 0x30:
        return None
    value = int(raw)
    return value if -(2**63) <= value < 2**63 else None


@dataclass
class Limits:
    max_inline: int
    max_args: int
    max_bulk: int
    unauth_args: int
    unauth_bulk: int
    big_from: int
    authenticated: bool

    def reserve(self, length: int) -> bool | str:
        """Deterministic refusals, so both framers get the same answers."""
        if length % 5 == 0:
            return f"no room for {length}"
        return length % 7 != 0


@dataclass
class Reference:
    """Byte-at-a-time RESP request framer: the specification of `RespParser`."""

    lim: Limits
    out: list[Framed] = field(default_factory=list)
    error: str | None = None
    state: str = "start"
    line: bytearray = field(default_factory=bytearray)
    args: list[bytes] = field(default_factory=list)
    left: int = 0
    want: int = 0
    refused: str | None = None

    def feed(self, data: bytes) -> None:
        for b in data:
            if self.error is not None:
                return
            try:
                self._byte(b)
            except RemoteProtocolError as exc:
                self.error = str(exc)

    def _too_long(self, what: str) -> None:
        """A header line with no CRLF yet, longer (its last CR aside) than allowed."""
        n = 1 + len(self.line) - (self.line[-1:] == b"\r")
        if n > self.lim.max_inline:
            raise RemoteProtocolError(f"Protocol error: too big {what} count string")

    def _byte(self, b: int) -> None:
        lim = self.lim
        perr = RemoteProtocolError
        if self.state == "start":
            if b == 0x2A:
                self.state, self.line = "count", bytearray()
            elif b != 0x0A:  # a bare LF is an empty inline request
                self.state, self.line = "inline", bytearray([b])
                if len(self.line) > lim.max_inline:
                    raise perr("Protocol error: too big inline request")
        elif self.state == "inline":
            if b != 0x0A:
                self.line.append(b)
                if len(self.line) > lim.max_inline:
                    raise perr("Protocol error: too big inline request")
                return
            self.state = "start"
            text = self.line[:-1] if self.line.endswith(b"\r") else self.line
            args = split_inline(text)
            if args:
                if not lim.authenticated and (
                    len(args) > lim.unauth_args or any(len(a) > lim.unauth_bulk for a in args)
                ):
                    raise perr("Protocol error: unauthenticated inline request")
                self.out.append(tuple(args))
        elif self.state in ("count", "length"):
            what = "mbulk" if self.state == "count" else "bulk"
            if not (b == 0x0A and self.line.endswith(b"\r")):
                self.line.append(b)
                self._too_long(what)
                return
            value = _int(bytes(self.line[:-1]))
            if self.state == "count":
                self._count(value)
            else:
                self._length(value)
        elif self.state == "dollar":
            if b != 0x24:
                shown = chr(b) if 0x20 <= b < 0x7F else f"\\x{b:02x}"
                raise perr(f"Protocol error: expected '$', got '{shown}'")
            self.state, self.line = "length", bytearray()
            self._too_long("bulk")
        elif self.state == "body":
            self.line.append(b)
            if len(self.line) == self.want + 2:
                if not self.line.endswith(b"\r\n"):
                    raise perr("Protocol error: expected '\\r\\n' after bulk data")
                if self.refused is None:
                    self.args.append(bytes(self.line[:-2]))
                self._arg_done()

    def _count(self, count: int | None) -> None:
        lim = self.lim
        if count is None or count < -1 or count > lim.max_args:
            raise RemoteProtocolError("Protocol error: invalid multibulk length")
        if not lim.authenticated and count > lim.unauth_args:
            raise RemoteProtocolError("Protocol error: unauthenticated multibulk length")
        if count <= 0:
            self.state = "start"
            return
        self.state, self.left, self.args, self.refused = "dollar", count, [], None

    def _length(self, length: int | None) -> None:
        lim = self.lim
        if length is None or length < 0 or length > lim.max_bulk:
            raise RemoteProtocolError("Protocol error: invalid bulk length")
        if not lim.authenticated and length > lim.unauth_bulk:
            raise RemoteProtocolError("Protocol error: unauthenticated bulk length")
        if length >= lim.big_from and self.refused is None:
            answer = lim.reserve(length)
            if answer is not True:
                self.refused = answer if isinstance(answer, str) else ""
        self.state, self.want, self.line = "body", length, bytearray()

    def _arg_done(self) -> None:
        self.left -= 1
        if self.left:
            self.state = "dollar"
            return
        self.state = "start"
        if self.refused is not None:
            self.out.append(("refused", self.refused))
        else:
            self.out.append(tuple(self.args))


def _as_framed(cmd: list[bytes | bytearray | memoryview]) -> Framed:
    if isinstance(cmd, RefusedCommand):
        return ("refused", cmd.reason)
    return tuple(bytes(a) for a in cmd)


def _take(p: RespParser, out: list[Framed], n: int, unread_last: bool) -> str | None:
    """Take up to `n` commands into `out`; the error text once the input is broken."""
    taken: list[list[bytes | bytearray | memoryview]] = []
    try:
        for _ in range(n):
            cmd = p.next_command()
            if cmd is NEED_DATA:
                break
            taken.append(cmd)
    except RemoteProtocolError as exc:
        out.extend(_as_framed(c) for c in taken)
        return str(exc)
    if unread_last and taken:
        p.unread([taken.pop()])
    out.extend(_as_framed(c) for c in taken)
    return None


def run_fast(data: bytes, lim: Limits, plan: list[tuple[int, int, bool]], max_ready: int | None):
    p = RespParser(
        max_inline_bytes=lim.max_inline,
        max_multibulk_len=lim.max_args,
        max_bulk_bytes=lim.max_bulk,
        unauthenticated_max_multibulk_len=lim.unauth_args,
        unauthenticated_max_bulk_bytes=lim.unauth_bulk,
        large_bulk_threshold=lim.big_from,
        read_buffer_bytes=512,
        authenticated=lim.authenticated,
        reserve=lim.reserve,
        max_ready=max_ready,
    )
    out: list[Framed] = []
    pos = 0
    step = 0
    while pos < len(data):
        size, answer, unread_last = plan[step % len(plan)]
        step += 1
        buf = p.get_buffer(-1)
        n = min(len(buf), size, len(data) - pos)
        buf[:n] = data[pos : pos + n]
        p.buffer_updated(n)
        pos += n
        error = _take(p, out, answer, unread_last)
        if error is not None:
            return out, error
    return out, _take(p, out, 1 << 30, False)


_COMMAND = st.lists(st.binary(max_size=40), min_size=0, max_size=5).map(
    lambda args: b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)
)
_PIECE = st.one_of(
    _COMMAND,
    _COMMAND,
    _COMMAND,
    st.sampled_from(
        [b"PING\r\n", b"SET k 'v w'\n", b"\n", b"\r\n", b'GET "a\\x41"\r\n', b'X "open\r\n']
    ),
    st.sampled_from(
        [b"*-1\r\n", b"*0\r\n", b"*01\r\n", b"*1\r\n#3\r\n", b"$", b"*2\r\n$1\r\nab", b"\r"]
    ),
    st.binary(max_size=12),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pieces=st.lists(_PIECE, max_size=12),
    lim=st.builds(
        Limits,
        max_inline=st.integers(3, 40),
        max_args=st.integers(1, 6),
        max_bulk=st.integers(1, 60),
        unauth_args=st.integers(1, 6),
        unauth_bulk=st.integers(1, 60),
        big_from=st.integers(1, 45),
        authenticated=st.booleans(),
    ),
    plan=st.lists(
        st.tuples(st.integers(1, 400), st.integers(0, 4), st.booleans()), min_size=1, max_size=8
    ),
    max_ready=st.one_of(st.none(), st.integers(1, 3)),
)
def test_fast_framer_agrees_with_the_byte_at_a_time_reference(
    pieces: list[bytes],
    lim: Limits,
    plan: list[tuple[int, int, bool]],
    max_ready: int | None,
) -> None:
    data = b"".join(pieces)
    ref = Reference(lim)
    ref.feed(data)
    out, error = run_fast(data, lim, plan, max_ready)
    assert out == ref.out
    assert error == ref.error


def test_reference_agrees_on_a_hand_picked_error() -> None:
    """The reference's own sanity: a bad bulk header after one good command."""
    lim = Limits(64, 10, 100, 10, 100, 32, True)
    data = b"*1\r\n$4\r\nPING\r\n*1\r\n$x\r\n"
    ref = Reference(lim)
    ref.feed(data)
    assert ref.out == [(b"PING",)]
    assert ref.error == "Protocol error: invalid bulk length"
    assert run_fast(data, lim, [(3, 1, False)], None) == (ref.out, ref.error)
