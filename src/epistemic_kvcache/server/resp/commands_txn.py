"""Transactions: MULTI, EXEC, DISCARD, and WATCH/UNWATCH (optimistic locking).

The dispatcher (server/resp/dispatch.py) queues the commands that follow MULTI and runs
EXEC itself (`Dispatcher.exec_transaction`): it holds the tenant's gate, and answers nil
(a null array) when a WATCHed key was written since WATCH, on either wire and on any
event loop (server/writes.py `KeyWatches`). EXEC, DISCARD, RESET and a closed connection
forget the watched keys, as UNWATCH does.
"""

from __future__ import annotations

from typing import Final

from epistemic_kvcache.proto.resp import Arg, Command, ErrorReply
from epistemic_kvcache.server.resp.common import OK, to_key
from epistemic_kvcache.server.resp.registry import command
from epistemic_kvcache.server.resp.session import Session

WATCH_IN_MULTI: Final = ErrorReply("ERR WATCH inside MULTI is not allowed")
"""Redis's answer; the transaction stays open and is not aborted."""


@command(
    "multi",
    1,
    ("noscript", "loading", "stale", "fast", "allow_busy"),
    (0, 0, 0),
    "transactions",
    "Start a transaction: the commands that follow are queued until EXEC or DISCARD.",
)
async def _multi(s: Session, cmd: Command) -> object:
    if s.multi is not None:
        return ErrorReply("ERR MULTI calls can not be nested")
    s.begin_multi()
    return OK


@command(
    "exec",
    1,
    ("noscript", "loading", "stale", "skip_slowlog"),
    (0, 0, 0),
    "transactions",
    "Run the commands queued since MULTI, with no other command of the tenant between.",
)
async def _exec(s: Session, cmd: Command) -> object:
    # Inside MULTI the dispatcher runs EXEC itself (Dispatcher.exec_transaction).
    return ErrorReply("ERR EXEC without MULTI")


@command(
    "discard",
    1,
    ("noscript", "loading", "stale", "fast", "allow_busy"),
    (0, 0, 0),
    "transactions",
    "Drop the commands queued since MULTI.",
)
async def _discard(s: Session, cmd: Command) -> object:
    if s.multi is None:
        return ErrorReply("ERR DISCARD without MULTI")
    s.end_multi()
    s.unwatch()
    return OK


@command(
    "watch",
    -2,
    ("noscript", "loading", "stale", "fast", "allow_busy"),
    (1, -1, 1),
    "transactions",
    "Watch keys: EXEC answers nil if one of them is written before it (either wire).",
)
async def _watch(s: Session, cmd: Command) -> object:
    if s.multi is not None:
        return WATCH_IN_MULTI
    return s.watch([to_key(k) for k in cmd[1:]]) or OK


@command(
    "unwatch",
    1,
    ("noscript", "loading", "stale", "fast", "allow_busy"),
    (0, 0, 0),
    "transactions",
    "Forget every watched key.",
)
async def _unwatch(s: Session, cmd: Command) -> object:
    s.unwatch()
    return OK


# -- what a write wrote (the dispatcher marks the watchers of those keys changed) -----------

WRITES: Final = frozenset({"set", "setnx", "getset", "getdel", "mset", "del", "unlink", "flushdb"})
"""The commands that write keys (GETEX and PERSIST write nothing here: there are no TTLs)."""
EVERY_KEY: Final = None
"""`written`'s answer for a write that may have changed any key of the tenant (FLUSHDB)."""


def written(route: str, cmd: Command, reply: object) -> list[Arg] | None:
    """The keys the write `cmd` (route in `WRITES`, answered `reply`) wrote: none when
    the reply says it wrote nothing (a refused SET NX/XX or SETNX, a DEL or GETDEL that
    found no key); `EVERY_KEY` for FLUSHDB. DEL names every key it was given once it
    removed any (Redis marks only the keys it removed)."""
    if isinstance(reply, ErrorReply):
        return []
    if route == "flushdb":
        return EVERY_KEY
    if route == "mset":
        return cmd[1::2]
    if route in ("del", "unlink"):
        return cmd[1:] if reply else []
    if reply is None and route == "getdel":
        return []
    if route == "setnx" and not reply:
        return []
    if route == "set" and reply is None and not any(bytes(a).upper() == b"GET" for a in cmd[3:]):
        return []  # refused (NX, XX, first-write-wins); with GET, nil is the old value
    return cmd[1:2]
