"""The compiled twin of the RESP framer against the pure one (differential, Hypothesis).

proto/resp_parser.py is the pure-Python reference; proto/_resp_parser_c is the same
source compiled by Cython (setup.py), picked at import by proto/resp_framer.py. Both get
the same random byte stream the way a connection feeds them (reads of random sizes
through `get_buffer` / `buffer_updated`, sometimes `feed`; pipelined commands; the owner
taking a random number of commands between reads, putting some back with `unread`,
refusing a partial command; malformed input; bulks up to the size limit, large ones in
their preallocated buffers) and must hand out the same commands (argument types
included), the same refusals and the same error after the same commands, with the same
accounting (`held_bytes`, `pending_bytes`, `buffered_bytes`, ...) after every step.

Where the compiled twin is not built these tests are skipped; tests/test_twins.py checks
that it is built and selected where it should be (in CI, `KVCACHE_REQUIRE_COMPILED=1`).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epistemic_kvcache.errors import RemoteProtocolError
from epistemic_kvcache.proto import resp_parser
from epistemic_kvcache.proto.resp import NEED_DATA, RefusedCommand
from helpers import compiled_twin

compiled, needs_compiled = compiled_twin("epistemic_kvcache.proto._resp_parser_c")


# -- the differential property ------------------------------------------------------------


def _reserve(length: int) -> bool | str:
    """Deterministic refusals, so both twins get the same answers."""
    if length % 5 == 0:
        return f"no room for {length}"
    return length % 7 != 0


def _figures(p: Any) -> tuple[object, ...]:
    return (
        p.held_bytes,
        p.pending_bytes,
        p.buffered_bytes,
        p.has_partial,
        p.has_error,
        p.commands_parsed,
        p.authenticated,
    )


def _shown(cmd: Any) -> tuple[object, ...]:
    if isinstance(cmd, RefusedCommand):
        return ("refused", cmd.reason)
    return tuple((type(a).__name__, bytes(a)) for a in cmd)


Step = tuple[int, int, int, int]
"""(read size, commands taken, what else: 0 nothing, 1 unread the last, 2 refuse the
partial command, 3 feed() instead of get_buffer, 4 authenticate, how big a sizehint)."""


def _drive(cls: type[Any], data: bytes, limits: dict[str, Any], plan: list[Step]) -> list[object]:
    """Feed `data` per `plan`; the trace of everything the owner can see."""
    p = cls(reserve=_reserve, **limits)
    trace: list[object] = []
    pos = 0
    step = 0
    while True:
        size, answer, extra, hint = plan[step % len(plan)]
        step += 1
        if extra == 4:
            p.authenticated = True
        if pos < len(data):
            if extra == 3:
                n = min(size, len(data) - pos)
                p.feed(data[pos : pos + n])
            else:
                buf = p.get_buffer(hint)
                n = min(len(buf), size, len(data) - pos)
                trace.append(("lent", len(buf)))
                buf[:n] = data[pos : pos + n]
                p.buffer_updated(n)
            pos += n
        taken: list[Any] = []
        want = answer if pos < len(data) else 1 << 30
        try:
            while len(taken) < want and (cmd := p.next_command()) is not NEED_DATA:
                taken.append(cmd)
        except RemoteProtocolError as exc:
            trace.extend(_shown(c) for c in taken)
            trace.append(("error", str(exc)))
            trace.append(_figures(p))
            return trace
        if extra == 1 and taken and pos < len(data):  # (at the end: take them all)
            p.unread([taken.pop()])
        trace.extend(_shown(c) for c in taken)
        if extra == 2:
            trace.append(("refuse_partial", p.refuse_partial("owner said no")))
        trace.append(_figures(p))
        if pos >= len(data) and not taken and p.peek() is None:
            p.close()
            trace.append(_figures(p))
            return trace


def _command(args: list[bytes]) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


_SMALL = st.lists(st.binary(max_size=40), max_size=5).map(_command)
_FAST = st.sampled_from(
    [
        _command([b"GET", b"k"]),
        _command([b"SET", b"k", b"v" * 100]),
        _command([b"EXISTS", b"a", b"b"]),
        b"PING\r\n",
        b"SET k 'v w'\n",
        b"\n",
    ]
)
_BAD = st.sampled_from(
    [
        b"*-1\r\n",
        b"*0\r\n",
        b"*01\r\n",
        b"*1\r\n#3\r\n",
        b"$",
        b"*2\r\n$1\r\nab",
        b"\r",
        b"*1\r\n$-2\r\n",
        b"*99999999999999999999\r\n",
        b"*1\r\n$3\r\nabcX\n",
        b'X "open\r\n',
    ]
)
_BIG = st.tuples(st.integers(0, 3000), st.binary(min_size=1, max_size=1)).map(
    lambda t: _command([b"SET", b"big", t[1] * t[0]])
)
_PIPELINE = st.lists(st.one_of(_SMALL, _FAST), min_size=2, max_size=8).map(b"".join)
_PIECE = st.one_of(_SMALL, _PIPELINE, _PIPELINE, _FAST, _BAD, _BIG, st.binary(max_size=16))


@needs_compiled
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pieces=st.lists(_PIECE, max_size=14),
    limits=st.fixed_dictionaries(
        {
            "max_inline_bytes": st.one_of(st.integers(3, 64), st.just(64 * 1024)),
            "max_multibulk_len": st.one_of(st.integers(1, 8), st.just(1024)),
            "max_bulk_bytes": st.integers(1, 4000),
            "unauthenticated_max_multibulk_len": st.one_of(st.integers(1, 8), st.just(10)),
            "unauthenticated_max_bulk_bytes": st.integers(1, 4000),
            "large_bulk_threshold": st.integers(1, 2000),
            "read_buffer_bytes": st.integers(16, 1024),
            "authenticated": st.booleans(),
            "max_ready": st.one_of(st.none(), st.integers(1, 3)),
        }
    ),
    plan=st.lists(
        st.tuples(
            st.integers(1, 5000), st.integers(0, 4), st.integers(0, 6), st.integers(-1, 3000)
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_the_twins_frame_the_same(
    pieces: list[bytes], limits: dict[str, Any], plan: list[Step]
) -> None:
    data = b"".join(pieces)
    pure_trace = _drive(resp_parser.RespParser, data, limits, plan)
    compiled_trace = _drive(compiled.RespParser, data, limits, plan)
    assert compiled_trace == pure_trace


@needs_compiled
@pytest.mark.parametrize("size", [32 * 1024 - 1, 32 * 1024, 256 * 1024, 4 * 1024 * 1024])
def test_the_twins_agree_on_huge_bulks_up_to_the_limit(size: int) -> None:
    """Default limits, bulks around the large-bulk threshold and up to `max_bulk_bytes`
    (read in place), one over it (refused with Redis' words), in 64 KiB reads."""
    value = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    data = _command([b"SET", b"k", value]) + _command([b"GET", b"k"])
    over = _command([b"SET", b"k", value + b"!"])
    limits = {"authenticated": True, "max_bulk_bytes": size}
    plan: list[Step] = [(64 * 1024, 2, 0, -1)]
    for stream in (data, data + over):
        pure_trace = _drive(resp_parser.RespParser, stream, limits, plan)
        assert _drive(compiled.RespParser, stream, limits, plan) == pure_trace
    assert ("error", "Protocol error: invalid bulk length") in pure_trace


@needs_compiled
def test_the_twins_share_events_and_refusals() -> None:
    """What callers compare by identity or class is one object for both twins."""
    assert compiled.RespParser is not resp_parser.RespParser
    p = compiled.RespParser(authenticated=True, large_bulk_threshold=4, reserve=lambda n: "full")
    assert p.next_command() is NEED_DATA
    p.feed(_command([b"SET", b"k", b"0123456789"]))
    cmd = p.next_command()
    assert isinstance(cmd, RefusedCommand)
    assert cmd.reason == "full"
