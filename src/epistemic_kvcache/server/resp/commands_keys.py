"""Key commands a cache user reaches for beyond GET/SET (docs/resp.md): TTL/PTTL and the
other expiry questions answered truthfully (entries never expire), SETNX, GETSET, GETDEL,
a bounded KEYS. (The commands refused on purpose, each with why: server/resp/refusals.py.)

GETSET and GETDEL read a key and then write it: the dispatcher runs them holding the
tenant alone (`dispatch._HOLDS_TENANT`, as EXEC does), so no other RESP command of the
tenant lands between the read and the write.
"""

from __future__ import annotations

import functools
from typing import Final

from epistemic_kvcache.buffers import received_block
from epistemic_kvcache.proto.resp import Command, ErrorReply
from epistemic_kvcache.server.budget import Busy
from epistemic_kvcache.server.resp.common import SYNTAX_ERROR, Reply, busy_reply, to_glob, to_key
from epistemic_kvcache.server.resp.registry import blocking_command
from epistemic_kvcache.server.resp.session import Session

KEYS_MAX: Final = 10_000
"""Keys KEYS may look at: past it (the tenant holds more) KEYS refuses and names SCAN."""
KEYS_MATCH_BUDGET: Final = 50_000_000
"""Glob work (`Glob.cost` units) one KEYS may spend; past it KEYS refuses and names SCAN."""


def _exists(s: Session, key: str) -> bool:
    return s.call(s.store.exists, s.namespace, key)


def _ttl(s: Session, cmd: Command) -> object:
    return -1 if _exists(s, to_key(cmd[1])) else -2


for _name, _summary in (
    ("ttl", "Seconds to live: -1 for an existing key (entries never expire), -2 if absent."),
    ("pttl", "Milliseconds to live: -1 for an existing key, -2 if absent."),
    ("expiretime", "Expiry as a Unix time: -1 for an existing key (none), -2 if absent."),
    ("pexpiretime", "Expiry in Unix ms: -1 for an existing key (none), -2 if absent."),
):
    blocking_command(_name, 2, ("readonly", "fast"), (1, 1, 1), "keyspace", _summary)(_ttl)


@blocking_command(
    "persist", 2, ("write", "fast"), (1, 1, 1), "keyspace", "Remove a TTL: always 0 (none)."
)
def _persist(s: Session, cmd: Command) -> object:
    _exists(s, to_key(cmd[1]))  # the key is validated like any other
    return 0


def _read(s: Session, key: str) -> object:
    try:
        return s.call(s.ctx.read_reserved, s.account, s.namespace, key)
    except Busy as exc:
        raise Reply(busy_reply(exc.limit)) from None


@blocking_command(
    "setnx", 3, ("write", "denyoom", "fast"), (1, 1, 1), "string", "Set a key only if absent."
)
def _setnx(s: Session, cmd: Command) -> object:
    # the store decides create-only atomically (the same PUT as SET NX)
    put = functools.partial(s.store.put, cond="nx")
    result = s.call(put, s.namespace, to_key(cmd[1]), received_block(cmd[2]))
    return 1 if result.applied else 0


@blocking_command(
    "getset",
    3,
    ("write", "denyoom", "fast"),
    (1, 1, 1),
    "string",
    "Set a key and return the value it held (the tenant held alone between the two).",
)
def _getset(s: Session, cmd: Command) -> object:
    key = to_key(cmd[1])
    old = _read(s, key)
    s.call(s.store.put, s.namespace, key, received_block(cmd[2]))
    return old


@blocking_command(
    "getdel",
    2,
    ("write", "fast"),
    (1, 1, 1),
    "string",
    "Delete a key and return its value (the tenant held alone between the two).",
)
def _getdel(s: Session, cmd: Command) -> object:
    key = to_key(cmd[1])
    old = _read(s, key)
    if old is not None:
        s.call(s.store.delete, s.namespace, key)
    return old


_NO_EXPIRY: Final = ErrorReply(
    "ERR GETEX with EX/PX/EXAT/PXAT is not supported: entries never expire here; the "
    "cache tiers evict them and DEL removes them"
)


@blocking_command(
    "getex",
    -2,
    ("write", "fast"),
    (1, 1, 1),
    "string",
    "GETEX key [PERSIST]: GET (entries never expire; EX/PX/EXAT/PXAT are refused).",
)
def _getex(s: Session, cmd: Command) -> object:
    if len(cmd) > 2:
        opt = bytes(cmd[2]).upper()
        if opt in (b"EX", b"PX", b"EXAT", b"PXAT") and len(cmd) == 4:
            return _NO_EXPIRY
        if opt != b"PERSIST" or len(cmd) != 3:
            return SYNTAX_ERROR
    return _read(s, to_key(cmd[1]))


@blocking_command(
    "keys",
    2,
    ("readonly",),
    (0, 0, 0),
    "keyspace",
    f"Keys matching a glob, for tenants of at most {KEYS_MAX} keys (else use SCAN).",
)
def _keys(s: Session, cmd: Command) -> object:
    glob = to_glob(cmd[1])
    ns = s.namespace
    keys: list[str] = s.call(functools.partial(s.store.keys, limit=KEYS_MAX + 1), ns)
    if len(keys) > KEYS_MAX:
        return _keys_refused(f"this tenant holds more than {KEYS_MAX} keys")
    out: list[bytes] = []
    spent = 0
    for key in keys:
        raw = key.encode("utf-8")
        spent += glob.cost(len(raw))
        if spent > KEYS_MATCH_BUDGET:
            return _keys_refused("the pattern is too costly to match against every key")
        if glob.match(raw):
            out.append(raw)
    return out


def _keys_refused(why: str) -> ErrorReply:
    return ErrorReply(
        f"ERR KEYS refused: {why} (KEYS answers at most {KEYS_MAX} keys in one call); "
        "use SCAN cursor MATCH pattern COUNT n, which pages through any number"
    )
