"""The RESP connection's sans-IO parts without a socket: its clocks (server/resp/deadlines.py)
and its memory account over a real parser (server/resp/accounting.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from epistemic_kvcache.proto.resp import pack_command
from epistemic_kvcache.proto.resp_parser import RespParser
from epistemic_kvcache.server.budget import Account, MemoryBudget
from epistemic_kvcache.server.resp.accounting import READ_HIGH_WATER, Accounting
from epistemic_kvcache.server.resp.deadlines import MIN_CHECK_S, Deadlines, check_delay
from epistemic_kvcache.shared import ServerLimits

LIMITS = ServerLimits(idle_timeout_s=300.0, request_timeout_s=60.0, subscriber_idle_timeout_s=900.0)


def _due(d: Deadlines, now: float, **kw: bool) -> tuple[float, str]:
    flags = {"busy": False, "subscribed": False, "backpressure": False} | kw
    return d.due(now, LIMITS, **flags)


def test_an_idle_connection_is_due_after_the_idle_timeout() -> None:
    d = Deadlines(10.0)
    assert _due(d, 11.0) == (310.0, "idle")
    assert _due(d, 11.0, subscribed=True) == (910.0, "idle")


def test_a_running_command_counts_as_traffic() -> None:
    d = Deadlines(0.0)
    assert _due(d, 500.0, busy=True) == (800.0, "idle")
    assert d.last_activity == 500.0


def test_a_half_received_command_runs_the_slowloris_clock_until_it_completes() -> None:
    d = Deadlines(0.0)
    d.read(5.0, has_partial=True, commands_parsed=0)
    assert _due(d, 6.0) == (65.0, "command not completed in time")
    d.read(20.0, has_partial=True, commands_parsed=0)  # no progress: the clock keeps its start
    assert _due(d, 21.0) == (65.0, "command not completed in time")
    d.read(30.0, has_partial=True, commands_parsed=3)  # commands completed: it starts again
    assert _due(d, 31.0) == (90.0, "command not completed in time")
    d.read(40.0, has_partial=False, commands_parsed=4)
    assert _due(d, 41.0) == (340.0, "idle")


def test_the_slowloris_clock_stops_while_the_server_holds_reading() -> None:
    d = Deadlines(0.0)
    d.read(5.0, has_partial=True, commands_parsed=0)
    assert _due(d, 6.0, backpressure=True) == (305.0, "idle")


def test_replies_not_read_are_due_after_the_request_timeout() -> None:
    d = Deadlines(0.0)
    d.write_paused_since = 100.0
    assert _due(d, 101.0) == (160.0, "replies not read in time")
    d.read(120.0, has_partial=True, commands_parsed=0)
    assert _due(d, 121.0) == (160.0, "replies not read in time")  # the earlier of the two


def test_the_timer_checks_at_most_as_often_as_the_floor() -> None:
    assert check_delay(LIMITS) == 60.0
    assert check_delay(replace(LIMITS, idle_timeout_s=0.001)) == MIN_CHECK_S


def _accounting(limits: ServerLimits, notes: list[str]) -> tuple[Accounting, RespParser]:
    acc = Accounting(Account(MemoryBudget(1 << 30, 1 << 30)), limits, notes.append)
    parser = RespParser(reserve=acc.reserve, large_bulk_threshold=1024, authenticated=True)
    return acc, parser


def test_input_is_counted_and_settled() -> None:
    notes: list[str] = []
    acc, parser = _accounting(LIMITS, notes)
    parser.feed(pack_command(b"SET", b"k", b"v" * 100)[0][:-10])  # one command, cut short
    assert acc.count_input(parser) is None
    assert acc.holds_input
    assert acc.account.holding("input") == parser.pending_bytes > 0
    parser.close()
    acc.settle(parser)
    assert not acc.holds_input
    assert acc.account.holding("input") == 0
    assert notes == []


def test_a_query_buffer_over_its_limit_is_reported_for_a_disconnect() -> None:
    notes: list[str] = []
    acc, parser = _accounting(replace(LIMITS, resp_max_query_buffer_bytes=64), notes)
    parser.feed(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$500\r\n" + b"v" * 400)
    assert acc.count_input(parser) == parser.pending_bytes
    assert notes == [
        f"{parser.pending_bytes} bytes of commands buffered (resp_max_query_buffer_bytes)"
    ]


def test_a_large_bulk_over_the_budget_is_refused_and_noted() -> None:
    notes: list[str] = []
    acc = Accounting(Account(MemoryBudget(4096, 4096)), LIMITS, notes.append)
    assert acc.reserve(1024) is True
    assert acc.account.holding("bulk") == 1024
    refused = acc.reserve(1 << 20)
    assert isinstance(refused, str)
    assert notes == [f"{1 << 20}-byte bulk over the {refused} limit"]


@pytest.mark.parametrize("authenticated", [True, False])
def test_reading_pauses_over_the_high_water_and_resumes_at_half(authenticated: bool) -> None:
    high = READ_HIGH_WATER if authenticated else LIMITS.resp_unauthenticated_max_buffer_bytes
    acc, _ = _accounting(LIMITS, [])
    parser = RespParser(authenticated=authenticated, max_ready=1)
    one = pack_command(b"SET", b"k", b"v")[0]
    parser.feed(one)  # a complete command waits
    assert not acc.over_high_water(parser, authenticated=authenticated)
    parser.feed(b"*1\r\n$" + str(high * 2).encode() + b"\r\n" + b"x" * high)
    assert acc.over_high_water(parser, authenticated=authenticated)
    assert not acc.below_low_water(parser, authenticated=authenticated)
    parser.close()
    assert acc.below_low_water(parser, authenticated=authenticated)
