"""The RESP connection's state, named: its phase of life, its command task, its reading.

How it works
------------
Sans-IO: no asyncio, no transport; `server/resp/connection.py` asks and tells it, and
does the I/O. Three small machines, each changed in one place:

- `Phase`, the connection's life, changed only by `ConnState.on(event)` through the
  `TRANSITIONS` table (as h11 keeps its states in `_state.py`): OPEN serves; DRAINING
  (the server is stopping) serves and waits for a reason to close; CLOSE_DUE closes at
  the next boundary between commands; LINGERING has shut its write side at a boundary
  and drops input; CLOSED writes nothing more. An event a phase does not take is a bug
  and raises `StateError`.
- `Task`, what the connection's command task does: RUNNING commands, PARKED waiting
  for input (the read callback's fast path may answer in its place), or WAITING_PEER
  for the peer to read its replies.
- Reading, paused for either of two reasons (`backpressure`: too much is buffered;
  `yielding`: the last read cost a time slice, skip one loop turn); `want_paused`
  tells whether the transport should be paused, `apply()` records that it was told.

`fast` is derived, kept current by every change that affects it: the read callback
may answer commands itself (task parked, the peer reading its replies, phase OPEN).
"""

from __future__ import annotations

import enum
from typing import Final

__all__ = ["TRANSITIONS", "ConnState", "Event", "Phase", "StateError", "Task"]


class Phase(enum.Enum):
    OPEN = "open"
    """Serving."""
    DRAINING = "draining"
    """The server is stopping: serving, until a reply goes out or the idle time passes."""
    CLOSE_DUE = "close due"
    """Close at the next boundary between commands (none half-received, no MULTI)."""
    LINGERING = "lingering"
    """The write side is shut after the last reply; input is read and dropped."""
    CLOSED = "closed"
    """Closing or closed: nothing is written any more."""


class Event(enum.Enum):
    DRAIN = "drain"
    """The server began its graceful stop."""
    REPLIED = "replied"
    """Replies were written (told only outside OPEN)."""
    DRAIN_IDLE = "drain idle"
    """No command came for the drain's idle time since the stop began."""
    SHUT = "shut"
    """The write side was shut at a boundary."""
    CLOSE = "close"
    """Closed: QUIT, a limit, a protocol error, a revoked credential, the peer gone."""


class Task(enum.Enum):
    RUNNING = "running"
    PARKED = "parked"
    """Waiting for input with nothing queued."""
    WAITING_PEER = "waiting for the peer"
    """Waiting for the peer to read its replies (the budget for more is spent)."""


class StateError(Exception):
    """An event the current phase does not take (a bug in the caller)."""


_P, _E = Phase, Event
TRANSITIONS: Final[dict[tuple[Phase, Event], Phase]] = {
    (_P.OPEN, _E.DRAIN): _P.DRAINING,
    (_P.OPEN, _E.CLOSE): _P.CLOSED,
    (_P.DRAINING, _E.DRAIN): _P.DRAINING,
    (_P.DRAINING, _E.REPLIED): _P.CLOSE_DUE,
    (_P.DRAINING, _E.DRAIN_IDLE): _P.CLOSE_DUE,
    (_P.DRAINING, _E.CLOSE): _P.CLOSED,
    (_P.CLOSE_DUE, _E.DRAIN): _P.CLOSE_DUE,
    (_P.CLOSE_DUE, _E.REPLIED): _P.CLOSE_DUE,
    (_P.CLOSE_DUE, _E.DRAIN_IDLE): _P.CLOSE_DUE,
    (_P.CLOSE_DUE, _E.SHUT): _P.LINGERING,
    (_P.CLOSE_DUE, _E.CLOSE): _P.CLOSED,
    (_P.LINGERING, _E.DRAIN): _P.LINGERING,
    (_P.LINGERING, _E.DRAIN_IDLE): _P.LINGERING,
    (_P.LINGERING, _E.CLOSE): _P.CLOSED,
    **{(_P.CLOSED, e): _P.CLOSED for e in Event},  # late timers and callbacks: nothing
}
"""(phase, event) -> the next phase; a pair not here is a bug (`StateError`)."""

_ENDED: Final = frozenset({Phase.LINGERING, Phase.CLOSED})


class ConnState:
    """One connection's state (see the module docstring). Attributes are read freely;
    change them only through the methods."""

    __slots__ = (
        "backpressure",
        "closing",
        "eof",
        "fast",
        "phase",
        "task",
        "transport_paused",
        "writable",
        "yielding",
    )

    def __init__(self) -> None:
        self.phase = Phase.OPEN
        self.closing = False
        """The phase is LINGERING or CLOSED: nothing more is run or written."""
        self.task = Task.RUNNING
        self.writable = True
        """The transport has not paused writing (the peer reads its replies)."""
        self.eof = False
        """The peer shut its write side."""
        self.backpressure = False
        self.yielding = False
        self.transport_paused = False
        self.fast = False
        """The read callback may answer commands itself (see the module docstring)."""

    # -- the phase --------------------------------------------------------------------------
    def on(self, event: Event) -> Phase:
        """Take `event`; returns the new phase."""
        try:
            phase = TRANSITIONS[self.phase, event]
        except KeyError:
            raise StateError(f"{event.value!r} in phase {self.phase.value!r}") from None
        self.phase = phase
        self.closing = phase in _ENDED
        self._derive()
        return phase

    @property
    def draining(self) -> bool:
        """The server's stop reached this connection (any phase after OPEN)."""
        return self.phase is not Phase.OPEN

    # -- the task ---------------------------------------------------------------------------
    def set_task(self, task: Task) -> None:
        self.task = task
        self._derive()

    # -- writing ----------------------------------------------------------------------------
    def set_writable(self, writable: bool) -> None:
        self.writable = writable
        self._derive()

    # -- reading ----------------------------------------------------------------------------
    @property
    def want_paused(self) -> bool:
        """Whether the transport should not read now."""
        return self.backpressure or self.yielding

    def apply(self) -> bool | None:
        """Record that the transport is told `want_paused`: True (pause) or False (resume)
        when that changes what it was told last, None when nothing is to be done."""
        want = self.backpressure or self.yielding
        if want == self.transport_paused:
            return None
        self.transport_paused = want
        return want

    def _derive(self) -> None:
        self.fast = self.task is Task.PARKED and self.writable and self.phase is Phase.OPEN
