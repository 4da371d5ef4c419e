"""A RESP connection's memory: what it holds in its tenant's account, and when it stops reading.

How it works
------------
Sans-IO: the connection (server/resp/connection.py) tells `Accounting` when its parser
took a read, wrote replies or ran dry, and does what the answers call for (close,
pause or resume reading). The connection's `Account` (server/budget.py) holds, under
its tenant (or the unauthenticated pseudo-tenant): "bulk", the large bulks the parser
preallocates (`reserve`, the parser's hook, asked before each is allocated); "input",
the parser's other buffered bytes (small arguments with their overhead, framed
commands, the unparsed tail); "reply", cold-read buffers reserved by handlers;
"output", replies queued in the transport. Growing "bulk" or "input" can be refused:
the command being framed is then dropped (`refuse_partial`) and answered
`-ERR server busy` (or the tenant's own busy error). Limits per connection:
`resp_max_query_buffer_bytes` of "input" and `client_output_buffer_limit_bytes` of
"output"; a client over either is disconnected, as Redis does.

Back-pressure: reading pauses while a complete command waits and more than
`READ_HIGH_WATER` bytes are buffered (before AUTH: more than
`resp_unauthenticated_max_buffer_bytes`), and resumes once half of that is left.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from epistemic_kvcache.server.budget import Account
from epistemic_kvcache.server.oplog import RefusalLog
from epistemic_kvcache.server.resp.common import WIRE
from epistemic_kvcache.shared import ServerLimits

if TYPE_CHECKING:
    from epistemic_kvcache.proto.resp_parser import RespParser

READ_HIGH_WATER: Final = 4 * 1024 * 1024
"""Bytes of not-yet-executed commands above which reading pauses."""


class RefusalNote:
    """Notes in the refusal log why a connection (of `peer`) was refused something: the
    `note` a connection gives its `Accounting` (it holds no reference back to the
    connection, so the two make no reference cycle)."""

    __slots__ = ("peer", "refusals")

    def __init__(self, refusals: RefusalLog) -> None:
        self.refusals = refusals
        self.peer = "?"

    def __call__(self, why: str) -> None:
        self.refusals.note(WIRE, self.peer, why)


class Accounting:
    """One RESP connection's memory account over its parser (see the module docstring)."""

    __slots__ = ("account", "holds_input", "limits", "note", "output_held")

    def __init__(self, account: Account, limits: ServerLimits, note: Callable[[str], None]) -> None:
        self.account = account
        self.limits = limits
        self.note = note
        """Records why something was refused (the listener's refusal log, for this peer)."""
        self.holds_input = False
        """Whether "input" may be non-zero in the account (so the fast path can skip it)."""
        self.output_held = False
        """Whether "output" may be non-zero in the account (so a write can skip it)."""

    def reserve(self, nbytes: int) -> bool | str:
        """The parser's `reserve` hook: hold `nbytes` of a large bulk under "bulk"."""
        refused = self.account.take("bulk", nbytes)
        if refused is None:
            return True
        self.note(f"{nbytes}-byte bulk over the {refused} limit")
        return refused

    def count_input(self, parser: RespParser) -> int | None:
        """Count what `parser` buffers under "input". Returns the bytes buffered when they
        pass `resp_max_query_buffer_bytes` (the caller disconnects), else None; over the
        budget, the command being framed is refused instead."""
        pending = parser.pending_bytes
        if pending > self.limits.resp_max_query_buffer_bytes:
            self.note(f"{pending} bytes of commands buffered (resp_max_query_buffer_bytes)")
            return pending
        refused = self.account.set("input", pending)
        if refused is not None:
            if parser.refuse_partial(refused):
                pending = parser.pending_bytes
            self.account.set("input", pending, force=True)
        self.holds_input = pending > 0
        return None

    def clear_input(self) -> None:
        """The parser buffers nothing: "input" is zero again."""
        if self.holds_input:
            self.account.set("input", 0, force=True)
            self.holds_input = False

    def count_output(self, transport: object) -> int | None:
        """Count what `transport` holds back under "output". Returns the bytes queued
        when they pass `client_output_buffer_limit_bytes` (the caller disconnects)."""
        queued = self.account.track_output(transport, self.limits.client_output_buffer_limit_bytes)
        self.output_held = self.account.holding("output") > 0
        return queued

    def settle(self, parser: RespParser) -> None:
        """Release what the connection holds beyond what `parser` still buffers.

        Call only while none of its commands runs and none waits in the queue: every
        bulk taken out of the parser is then done with."""
        account = self.account
        if account.holding("bulk") > parser.held_bytes:
            account.set("bulk", parser.held_bytes)
        pending = parser.pending_bytes
        account.set("input", pending, force=True)
        self.holds_input = pending > 0

    def over_high_water(self, parser: RespParser, *, authenticated: bool) -> bool:
        """Whether reading should pause: too much buffered (before AUTH, any command)."""
        if not authenticated:
            return parser.buffered_bytes > self.limits.resp_unauthenticated_max_buffer_bytes
        return parser.peek() is not None and parser.buffered_bytes > READ_HIGH_WATER

    def below_low_water(self, parser: RespParser, *, authenticated: bool) -> bool:
        """Whether paused reading may resume: at most half the high-water mark buffered."""
        if not authenticated:
            return parser.buffered_bytes <= self.limits.resp_unauthenticated_max_buffer_bytes // 2
        return parser.buffered_bytes <= READ_HIGH_WATER // 2
