"""The RESP connection's named state (server/resp/state.py), without sockets: the phase
table whole, what the read callback may do in each state, the reading pause, and a
connection driven through a graceful stop over a recording transport."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from epistemic_kvcache.server.context import ServerContext
from epistemic_kvcache.server.resp import make_resp_factory
from epistemic_kvcache.server.resp.state import (
    TRANSITIONS,
    ConnState,
    Event,
    Phase,
    StateError,
    Task,
)
from helpers import FakeTransport, eventually_async, feed
from servers import run_in_context

TOKEN = "resp-state-token-0123456789"

P, E = Phase, Event
EXPECTED = {
    # the stop: a reply or the idle time makes the close due; shut at a boundary
    (P.OPEN, E.DRAIN): P.DRAINING,
    (P.DRAINING, E.REPLIED): P.CLOSE_DUE,
    (P.DRAINING, E.DRAIN_IDLE): P.CLOSE_DUE,
    (P.CLOSE_DUE, E.SHUT): P.LINGERING,
    # closing from anywhere; nothing after
    (P.OPEN, E.CLOSE): P.CLOSED,
    (P.DRAINING, E.CLOSE): P.CLOSED,
    (P.CLOSE_DUE, E.CLOSE): P.CLOSED,
    (P.LINGERING, E.CLOSE): P.CLOSED,
    # repeats and late timers change nothing
    (P.DRAINING, E.DRAIN): P.DRAINING,
    (P.CLOSE_DUE, E.DRAIN): P.CLOSE_DUE,
    (P.CLOSE_DUE, E.REPLIED): P.CLOSE_DUE,
    (P.CLOSE_DUE, E.DRAIN_IDLE): P.CLOSE_DUE,
    (P.LINGERING, E.DRAIN): P.LINGERING,
    (P.LINGERING, E.DRAIN_IDLE): P.LINGERING,
    **{(P.CLOSED, e): P.CLOSED for e in Event},
}


def _at(phase: Phase) -> ConnState:
    st = ConnState()
    path = {
        P.OPEN: [],
        P.DRAINING: [E.DRAIN],
        P.CLOSE_DUE: [E.DRAIN, E.REPLIED],
        P.LINGERING: [E.DRAIN, E.REPLIED, E.SHUT],
        P.CLOSED: [E.CLOSE],
    }[phase]
    for event in path:
        st.on(event)
    assert st.phase is phase
    return st


@pytest.mark.parametrize(("phase", "event"), list(itertools.product(Phase, Event)))
def test_every_phase_and_event(phase: Phase, event: Event) -> None:
    st = _at(phase)
    if (phase, event) in EXPECTED:
        assert st.on(event) is EXPECTED[phase, event]
        assert st.closing == (st.phase in (P.LINGERING, P.CLOSED))
    else:  # e.g. OPEN + REPLIED (told only while draining), OPEN + SHUT (no close due)
        with pytest.raises(StateError, match=event.value):
            st.on(event)
        assert st.phase is phase


def test_the_table_is_the_one_tested() -> None:
    assert TRANSITIONS == EXPECTED


@pytest.mark.parametrize(
    ("phase", "task", "writable"), list(itertools.product(Phase, Task, (True, False)))
)
def test_fast_only_when_parked_writable_and_open(phase: Phase, task: Task, writable: bool) -> None:
    st = _at(phase)
    st.set_task(task)
    st.set_writable(writable)
    assert st.fast == (phase is P.OPEN and task is Task.PARKED and writable)
    # whichever order the changes come in
    st2 = ConnState()
    st2.set_writable(writable)
    st2.set_task(task)
    for event in {P.OPEN: [], P.DRAINING: [E.DRAIN], P.CLOSED: [E.CLOSE]}.get(phase, []):
        st2.on(event)
    if phase in (P.OPEN, P.DRAINING, P.CLOSED):
        assert st2.fast == st.fast


def test_reading_is_paused_for_either_reason_and_the_transport_told_once() -> None:
    st = ConnState()
    assert st.apply() is None  # reading, as the transport is
    st.backpressure = True
    assert st.want_paused
    assert st.apply() is True
    st.yielding = True
    assert st.apply() is None  # already paused
    st.backpressure = False
    assert st.apply() is None  # still yielding
    st.yielding = False
    assert st.apply() is False
    assert st.apply() is None


async def _logged_in(ctx: ServerContext) -> tuple[Any, FakeTransport, ConnState]:
    """A connection over a recording transport, authenticated, its task parked."""
    proto = make_resp_factory(ctx)()
    transport = FakeTransport().connect(proto)
    st: ConnState = proto._st  # type: ignore[attr-defined]
    feed(proto, b"AUTH " + TOKEN.encode() + b"\r\n")
    await eventually_async(lambda: st.task is Task.PARKED, what="parked")
    assert transport.take() == b"+OK\r\n"
    return proto, transport, st


def test_a_connection_through_a_graceful_stop() -> None:
    """Phases as a connection lives them: OPEN while serving; DRAINING at the stop;
    CLOSE_DUE after its next reply; LINGERING once it shut its write side at the
    boundary (after that reply, the last thing written); input then is dropped."""

    async def scenario(ctx: ServerContext) -> None:
        proto, transport, st = await _logged_in(ctx)
        assert (st.phase, st.fast) == (P.OPEN, True)
        proto.begin_drain()
        assert (st.phase, st.fast) == (P.DRAINING, False)
        feed(proto, b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n")
        await eventually_async(lambda: st.phase is P.LINGERING, what="lingering")
        assert transport.take() == b"+OK\r\n"
        assert transport.events[-1] == "write_eof"
        assert proto.drained
        feed(proto, b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n")  # after the end: dropped
        await asyncio.sleep(0)
        assert transport.take() == b""
        assert ctx.store.get_nowait("alpha", "k") == b"v"

    run_in_context(scenario, tokens={TOKEN: "alpha"})


def test_an_idle_connection_closes_after_the_drain_idle_time() -> None:
    async def scenario(ctx: ServerContext) -> None:
        proto, transport, st = await _logged_in(ctx)
        proto.begin_drain()
        await eventually_async(lambda: st.phase is P.LINGERING, what="closed when idle")
        assert transport.events[-1] == "write_eof"
        assert transport.take() == b""

    run_in_context(scenario, tokens={TOKEN: "alpha"})


def test_inside_multi_the_close_waits_for_exec() -> None:
    async def scenario(ctx: ServerContext) -> None:
        proto, transport, st = await _logged_in(ctx)
        feed(proto, b"MULTI\r\n")
        await eventually_async(lambda: transport.written == b"+OK\r\n", what="MULTI")
        transport.take()
        proto.begin_drain()
        feed(proto, b"SET k v\r\n")
        await eventually_async(lambda: transport.written == b"+QUEUED\r\n", what="queued")
        assert st.phase is P.CLOSE_DUE  # due, but not inside MULTI
        transport.take()
        feed(proto, b"EXEC\r\n")
        await eventually_async(lambda: st.phase is P.LINGERING, what="closed after EXEC")
        assert transport.take() == b"*1\r\n+OK\r\n"

    run_in_context(scenario, tokens={TOKEN: "alpha"})
