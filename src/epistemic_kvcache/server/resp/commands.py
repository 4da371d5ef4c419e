"""The RESP command handlers of the connection, strings and the keyspace, registered in
the command table (`dispatch.COMMANDS`); the others are in commands_keys.py (the expiry
questions, SETNX, GETSET, GETDEL, KEYS), commands_admin.py (introspection),
commands_info.py (INFO, CONFIG) and commands_txn.py (transactions).

Each handler receives the client's `Session` (server/resp/session.py) and the command's
arguments, and returns a reply value (`proto.resp.serialize` encodes it) or raises
`Reply` with an error. Handlers registered with `blocking_command` run on the store's
thread pool (store calls); those registered with `command` run on the event loop and
must not block.
"""

from __future__ import annotations

import functools
from typing import Final

from epistemic_kvcache.buffers import received_block
from epistemic_kvcache.proto.glob import Glob
from epistemic_kvcache.proto.resp import (
    Buffer,
    Command,
    ErrorReply,
    SimpleString,
)
from epistemic_kvcache.server.budget import BatchTooLarge, Busy
from epistemic_kvcache.server.resp.common import (
    HELLO_NOAUTH,
    OK,
    REDIS_COMPAT_VERSION,
    SYNTAX_ERROR,
    Frames,
    Reply,
    busy_reply,
    push,
    text,
    to_glob,
    to_int,
    to_key,
    unknown_subcommand,
    valid_client_name,
    wrong_args,
)
from epistemic_kvcache.server.resp.registry import blocking_command, command
from epistemic_kvcache.server.resp.session import Session
from epistemic_kvcache.store.api import PutCond, SharedKvBackend

EPOCH_CHANNEL: Final = b"kvcache:epochs"
"""Pub/sub channel of epoch bumps: messages `<scope> <epoch>`, per tenant."""
MAX_CHANNELS: Final = 1024
"""Channels one connection may subscribe to (only EPOCH_CHANNEL carries messages)."""
SCAN_MAX_COUNT: Final = 10000
SCAN_DEFAULT_COUNT: Final = 10
SCAN_MATCH_BUDGET: Final = 50_000_000
"""Glob work (`Glob.cost` units, ~3 ns each) one SCAN call may spend on MATCH; past it
the call returns early with a cursor (SCAN may return fewer keys than COUNT)."""
MEMORY_USAGE_OVERHEAD: Final = 96
"""Bytes `MEMORY USAGE` adds to key and value for the index entry (an estimate)."""

_TTL_UNSUPPORTED: Final = ErrorReply(
    "ERR SET with EX/PX/EXAT/PXAT is not supported: entries never expire, they are "
    "evicted by the cache tiers or removed with DEL"
)


def hello_map(s: Session) -> dict[str, object]:
    return {
        "server": "epistemic-kvcache",
        "version": REDIS_COMPAT_VERSION,
        "proto": s.protocol_version,
        "id": s.client_id,
        "mode": "standalone",
        "role": "master",
        "modules": [],
    }


# -- connection commands --------------------------------------------------------------------


@command("ping", -1, ("fast", "stale"), (0, 0, 0), "connection", "Ping the server.")
async def _ping(s: Session, cmd: Command) -> object:
    if len(cmd) > 2:
        return wrong_args("ping")
    if s.channels and s.protocol_version == 2:  # Redis' subscribed-mode PING reply
        return [b"pong", cmd[1] if len(cmd) == 2 else b""]
    return cmd[1] if len(cmd) == 2 else SimpleString("PONG")


@command("echo", 2, ("fast", "stale"), (0, 0, 0), "connection", "Return the argument.")
async def _echo(s: Session, cmd: Command) -> object:
    return cmd[1]


@command(
    "quit", -1, ("fast", "stale"), (0, 0, 0), "connection", "Close the connection.", no_auth=True
)
async def _quit(s: Session, cmd: Command) -> object:
    s.quit_requested = True
    return OK


@command(
    "auth",
    -2,
    ("fast", "stale", "no-auth"),
    (0, 0, 0),
    "connection",
    "Authenticate the connection; its keys live in the credential's namespace.",
    no_auth=True,
)
async def _auth(s: Session, cmd: Command) -> object:
    if len(cmd) > 3:
        return SYNTAX_ERROR
    return s.authenticate(cmd[-1]) or OK


@command(
    "hello",
    -1,
    ("fast", "stale", "no-auth"),
    (0, 0, 0),
    "connection",
    "Handshake: select RESP2/RESP3, optionally authenticate and name the client.",
    no_auth=True,
)
async def _hello(s: Session, cmd: Command) -> object:
    version = s.protocol_version
    password: Buffer | None = None
    setname: str | None = None
    if len(cmd) >= 2:
        version = to_int(
            cmd[1], ErrorReply("ERR Protocol version is not an integer or out of range")
        )
        if version not in (2, 3):
            return ErrorReply("NOPROTO unsupported protocol version")
        i = 2
        while i < len(cmd):
            opt = bytes(cmd[i]).upper()
            if opt == b"AUTH" and i + 2 < len(cmd):
                password = cmd[i + 2]
                i += 3
            elif opt == b"SETNAME" and i + 1 < len(cmd):
                setname = valid_client_name(cmd[i + 1])
                i += 2
            else:
                return ErrorReply(f"ERR Syntax error in HELLO option '{text(cmd[i])}'")
    if password is not None:
        failed = s.authenticate(password)
        if failed is not None:
            return failed
    if s.identity is None:
        return HELLO_NOAUTH
    if setname is not None:
        s.name = setname or None
    s.protocol_version = version
    return hello_map(s)


@command(
    "select",
    2,
    ("fast", "loading", "stale"),
    (0, 0, 0),
    "connection",
    "Select database 0 (the only one).",
)
async def _select(s: Session, cmd: Command) -> object:
    if to_int(cmd[1]) != 0:
        return ErrorReply("ERR DB index is out of range")
    return OK


@command(
    "subscribe",
    -2,
    ("pubsub", "noscript", "loading", "stale"),
    (0, 0, 0),
    "pubsub",
    "Listen for messages on channels (kvcache:epochs: the tenant's epoch bumps).",
)
async def _subscribe(s: Session, cmd: Command) -> object:
    frames: list[Buffer] = []
    for raw in cmd[1:]:
        channel = bytes(raw)
        if channel not in s.channels and len(s.channels) >= MAX_CHANNELS:
            return ErrorReply(f"ERR at most {MAX_CHANNELS} channels per connection")
        s.channels[channel] = None
        frames += push([b"subscribe", channel, len(s.channels)], s.protocol_version)
    s.subscriptions_changed()
    return Frames(frames)


@command(
    "unsubscribe",
    -1,
    ("pubsub", "noscript", "loading", "stale"),
    (0, 0, 0),
    "pubsub",
    "Stop listening on the given channels, or on all of them.",
)
async def _unsubscribe(s: Session, cmd: Command) -> object:
    targets = [bytes(a) for a in cmd[1:]] if len(cmd) > 1 else list(s.channels)
    if not targets:
        return Frames(push([b"unsubscribe", None, 0], s.protocol_version))
    frames: list[Buffer] = []
    for channel in targets:
        s.channels.pop(channel, None)
        frames += push([b"unsubscribe", channel, len(s.channels)], s.protocol_version)
    s.subscriptions_changed()
    return Frames(frames)


@command(
    "reset",
    1,
    ("fast", "stale", "no-auth"),
    (0, 0, 0),
    "connection",
    "Reset the connection: RESP2, no name, unauthenticated.",
    no_auth=True,
)
async def _reset(s: Session, cmd: Command) -> object:
    s.reset()
    return SimpleString("RESET")


# -- key commands ---------------------------------------------------------------------------


@blocking_command("get", 2, ("readonly", "fast"), (1, 1, 1), "string", "Get the value of a key.")
def _get(s: Session, cmd: Command) -> object:
    try:
        return s.call(s.ctx.read_reserved, s.account, s.namespace, to_key(cmd[1]))
    except Busy as exc:
        raise Reply(busy_reply(exc.limit)) from None


@blocking_command(
    "set",
    -3,
    ("write", "denyoom"),
    (1, 1, 1),
    "string",
    "Set a key, replacing what it held (NX: create only, XX: replace only, GET).",
)
def _set(s: Session, cmd: Command) -> object:
    nx = xx = get = keepttl = False
    ttl = False
    i = 3
    while i < len(cmd):
        opt = bytes(cmd[i]).upper()
        if opt == b"NX" and not xx:
            nx = True
        elif opt == b"XX" and not nx:
            xx = True
        elif opt == b"GET":
            get = True
        elif opt == b"KEEPTTL" and not ttl:
            keepttl = True
        elif opt in (b"EX", b"PX", b"EXAT", b"PXAT") and not ttl and not keepttl:
            if i + 1 >= len(cmd):
                return SYNTAX_ERROR
            if to_int(cmd[i + 1]) <= 0:
                return ErrorReply("ERR invalid expire time in 'set' command")
            ttl = True
            i += 1
        else:
            return SYNTAX_ERROR
        i += 1
    if ttl:
        return _TTL_UNSUPPORTED
    store = s.store
    ns = s.namespace
    key = to_key(cmd[1])
    old: object = None
    if get:  # the old value, read just before the write (not atomic with it)
        old = _get(s, [b"get", cmd[1]])
    cond: PutCond = "nx" if nx else "xx" if xx else None
    put = store.put if cond is None else functools.partial(store.put, cond=cond)
    result = s.call(put, ns, key, received_block(cmd[2]))
    if get:
        return old
    return OK if result.applied else None


@blocking_command("mget", -2, ("readonly", "fast"), (1, -1, 1), "string", "Get the values of keys.")
def _mget(s: Session, cmd: Command) -> object:
    keys = [to_key(k) for k in cmd[1:]]
    try:
        return s.call(s.ctx.read_many_reserved, s.account, s.namespace, keys)
    except Busy as exc:
        raise Reply(busy_reply(exc.limit)) from None
    except BatchTooLarge as exc:
        raise Reply(ErrorReply(f"ERR MGET {exc}")) from None


@blocking_command(
    "mset",
    -3,
    ("write", "denyoom"),
    (1, -1, 2),
    "string",
    "Set several keys (each replaced like SET).",
)
def _mset(s: Session, cmd: Command) -> object:
    if len(cmd) % 2 == 0:
        return wrong_args("mset")
    items = [(to_key(cmd[i]), received_block(cmd[i + 1])) for i in range(1, len(cmd), 2)]
    s.call(s.store.put_many, s.namespace, items)
    return OK


@blocking_command(
    "exists", -2, ("readonly", "fast"), (1, -1, 1), "keyspace", "Count how many of the keys exist."
)
def _exists(s: Session, cmd: Command) -> object:
    keys = [to_key(k) for k in cmd[1:]]
    return sum(s.call(s.store.exists_many, s.namespace, keys))


def _delete(s: Session, cmd: Command) -> object:
    keys = [to_key(k) for k in cmd[1:]]
    return sum(s.call(s.store.delete_many, s.namespace, keys))


blocking_command("del", -2, ("write",), (1, -1, 1), "keyspace", "Delete keys.")(_delete)
blocking_command("unlink", -2, ("write", "fast"), (1, -1, 1), "keyspace", "Delete keys.")(_delete)


@blocking_command("strlen", 2, ("readonly", "fast"), (1, 1, 1), "string", "Length of a value.")
def _strlen(s: Session, cmd: Command) -> object:
    size = s.call(s.store.size, s.namespace, to_key(cmd[1]))
    return size or 0


@blocking_command(
    "type", 2, ("readonly", "fast"), (1, 1, 1), "keyspace", "The type of a key: string or none."
)
def _type(s: Session, cmd: Command) -> object:
    exists = s.call(s.store.exists, s.namespace, to_key(cmd[1]))
    return SimpleString("string" if exists else "none")


@blocking_command(
    "memory",
    -2,
    ("readonly",),
    (2, 2, 1),
    "server",
    "MEMORY USAGE key [SAMPLES n]: bytes a key and its value take (estimated).",
)
def _memory(s: Session, cmd: Command) -> object:
    sub = bytes(cmd[1]).upper()
    if sub != b"USAGE":
        return unknown_subcommand(cmd[1], "MEMORY")
    if len(cmd) not in (3, 5):
        return ErrorReply("ERR wrong number of arguments for 'memory|usage' command")
    if len(cmd) == 5:
        if bytes(cmd[3]).upper() != b"SAMPLES":
            return SYNTAX_ERROR
        to_int(cmd[4])
    key = to_key(cmd[2])
    size = s.call(s.store.size, s.namespace, key)
    if size is None:
        return None
    return size + len(bytes(cmd[2])) + MEMORY_USAGE_OVERHEAD


@blocking_command(
    "flushdb",
    -1,
    ("write",),
    (0, 0, 0),
    "server",
    "Delete every key of the caller's tenant (snapshots and branches keep their bytes).",
)
def _flushdb(s: Session, cmd: Command) -> object:
    if len(cmd) > 2 or (len(cmd) == 2 and bytes(cmd[1]).upper() not in (b"ASYNC", b"SYNC")):
        return SYNTAX_ERROR
    s.call(s.store.flush, s.namespace)
    return OK


@blocking_command(
    "dbsize",
    1,
    ("readonly", "fast"),
    (0, 0, 0),
    "server",
    "Number of keys in the caller's namespace.",
)
def _dbsize(s: Session, cmd: Command) -> object:
    return s.call(s.store.count, s.namespace)


@blocking_command(
    "scan",
    -2,
    ("readonly",),
    (0, 0, 0),
    "keyspace",
    "Iterate the caller's keys (cursor, MATCH, COUNT, TYPE).",
)
def _scan(s: Session, cmd: Command) -> object:
    invalid_cursor = ErrorReply("ERR invalid cursor")
    cursor = to_int(cmd[1], invalid_cursor)
    count = SCAN_DEFAULT_COUNT
    match: Glob | None = None
    only_strings = True
    i = 2
    while i < len(cmd):
        opt = bytes(cmd[i]).upper()
        if i + 1 >= len(cmd):
            return SYNTAX_ERROR
        if opt == b"COUNT":
            count = to_int(cmd[i + 1])
            if count < 1:
                return SYNTAX_ERROR
        elif opt == b"MATCH":
            match = to_glob(cmd[i + 1])
        elif opt == b"TYPE":
            only_strings = bytes(cmd[i + 1]).lower() == b"string"
        else:
            return SYNTAX_ERROR
        i += 2
    ns = s.namespace
    if not only_strings:  # every key is a string: no other type matches, so no paging
        return ["0", []]
    after: str | None = None
    if cursor != 0:
        after = s.shared.cursors.position(ns, cursor)
        if after is None:
            return invalid_cursor
    limit = min(count, SCAN_MAX_COUNT)
    keys: list[str] = s.call(_scan_page, s.store, ns, after, limit)
    more = len(keys) == limit
    encoded = [k.encode("utf-8") for k in keys] if only_strings else []
    if match is not None:
        matched: list[bytes] = []
        spent = 0
        for i, k in enumerate(encoded):
            if i and spent >= SCAN_MATCH_BUDGET:  # bounded work per call: resume later
                keys, more = keys[:i], True
                break
            spent += match.cost(len(k))
            if match.match(k):
                matched.append(k)
        encoded = matched
    next_cursor = s.shared.cursors.new(ns, keys[-1]) if more else 0
    return [str(next_cursor), encoded]


def _scan_page(store: SharedKvBackend, ns: str, after: str | None, limit: int) -> list[str]:
    return store.keys(ns, after=after, limit=limit)
