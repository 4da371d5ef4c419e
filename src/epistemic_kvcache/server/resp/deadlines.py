"""When a RESP connection is due to be closed for silence or slowness.

How it works
------------
Sans-IO: the connection (server/resp/connection.py) tells `Deadlines` what happened
and when (the event loop's clock), and one timer of its own asks `due` every
`check_delay` or sooner. Three clocks run:

- idle: no traffic for `idle_timeout_s` (a subscriber: `subscriber_idle_timeout_s`);
  a command the store is still working on counts as traffic;
- a partial command: a command whose first byte arrived more than `request_timeout_s`
  ago and is still incomplete (slowloris). Its clock starts when a read leaves a
  command half-received and starts again whenever a command completes meanwhile (the
  client makes progress); it does not run while reading is paused by the server's own
  back-pressure, and resuming reading restarts it;
- a stall: replies not read for `request_timeout_s` (writing paused that long).

The earliest of the three is the deadline; `due` says which one it is, for the log.
"""

from __future__ import annotations

from epistemic_kvcache.shared import ServerLimits

MIN_CHECK_S = 0.05
"""The timer never fires more often than this."""


def check_delay(limits: ServerLimits) -> float:
    """How often the connection's timer asks `due` when nothing is close."""
    return max(MIN_CHECK_S, min(limits.idle_timeout_s, limits.request_timeout_s))


class Deadlines:
    """One RESP connection's clocks (see the module docstring); times are `loop.time()`."""

    __slots__ = ("last_activity", "partial_since", "seen_parsed", "write_paused_since")

    def __init__(self, now: float) -> None:
        self.last_activity = now
        """The last read, reply read by the peer, or command run."""
        self.partial_since: float | None = None
        """Since when a command is half-received (None: none is)."""
        self.seen_parsed = 0
        """The parser's command count when `partial_since` was set."""
        self.write_paused_since: float | None = None
        """Since when the peer has not read its replies (None: it reads them)."""

    def read(self, now: float, *, has_partial: bool, commands_parsed: int) -> None:
        """A read left bytes in the parser: traffic now; a half-received command's clock
        starts, or starts again when commands completed since it was set."""
        self.last_activity = now
        if not has_partial:
            self.partial_since = None
        elif self.partial_since is None or commands_parsed != self.seen_parsed:
            self.partial_since = now
            self.seen_parsed = commands_parsed

    def due(
        self,
        now: float,
        limits: ServerLimits,
        *,
        busy: bool,
        subscribed: bool,
        backpressure: bool,
    ) -> tuple[float, str]:
        """The earliest deadline and why: "idle", "command not completed in time" or
        "replies not read in time". `busy`: a command of the connection is running (it
        counts as traffic); `backpressure`: reading is paused by the server (the partial
        command's clock stops)."""
        if busy:
            self.last_activity = now
        idle = limits.subscriber_idle_timeout_s if subscribed else limits.idle_timeout_s
        deadline, why = self.last_activity + idle, "idle"
        if self.partial_since is not None and not backpressure:
            partial_deadline = self.partial_since + limits.request_timeout_s
            if partial_deadline < deadline:
                deadline, why = partial_deadline, "command not completed in time"
        if self.write_paused_since is not None:
            stall_deadline = self.write_paused_since + limits.request_timeout_s
            if stall_deadline < deadline:
                deadline, why = stall_deadline, "replies not read in time"
        return deadline, why
