"""The RESP command handlers, registered in the command table (`dispatch.COMMANDS`).

Each handler receives the client's `Session` (server/resp/session.py) and the command's
arguments, and returns a reply value (`proto.resp.serialize` encodes it) or raises
`Reply` with an error. Handlers registered with `blocking_command` run on the store's
thread pool (store calls); those registered with `command` run on the event loop and
must not block.
"""

from __future__ import annotations

import functools
import os
import resource
import sys
import time
from typing import Final

from epistemic_kvcache.buffers import received_block
from epistemic_kvcache.proto import resp_framer
from epistemic_kvcache.proto.glob import Glob
from epistemic_kvcache.proto.resp import (
    Buffer,
    Command,
    ErrorReply,
    SimpleString,
    Verbatim,
)
from epistemic_kvcache.server.budget import BatchTooLarge, Busy
from epistemic_kvcache.server.context import ServerContext
from epistemic_kvcache.server.resp import fast
from epistemic_kvcache.server.resp.commands_admin import info_sections
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
from epistemic_kvcache.store import core as store_core
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


# -- server commands ------------------------------------------------------------------------

_INFO_DEFAULT: Final = (
    "server",
    "clients",
    "memory",
    "persistence",
    "stats",
    "replication",
    "cpu",
    "kvcache",
    "keyspace",
    "loops",
)


def loop_info(ctx: ServerContext) -> list[tuple[str, object]]:
    """INFO `loops` (operators): how many event loops serve, then one line per loop:
    `loop0:connections=3,requests=120,busy=0.041,cpu_seconds=1.250`."""
    rows = ctx.loop_view()
    out: list[tuple[str, object]] = [("event_loops", len(rows))]
    for row in rows:
        fields = ",".join(f"{k}={v}" for k, v in row.items() if k != "loop")
        out.append((f"loop{row['loop']}", fields))
    return out


def maxmemory(s: Session) -> int:
    """Bytes the RAM tiers may hold (hot + warm capacity): what `maxmemory` means here."""
    tiers = s.store.stats(None).tiers
    return sum(t.capacity_bytes for name, t in tiers.items() if name in ("hot", "warm"))


@blocking_command(
    "info",
    -1,
    ("loading", "stale"),
    (0, 0, 0),
    "server",
    "Server information and the caller's namespace stats.",
)
def _info(s: Session, cmd: Command) -> object:
    wanted = {bytes(a).decode("ascii", "replace").lower() for a in cmd[1:]}
    if wanted & {"all", "everything"}:
        wanted = {*_INFO_DEFAULT, "commandstats"}
    elif not wanted or "default" in wanted:
        wanted = set(_INFO_DEFAULT)
    ns = s.namespace
    stats = s.call(s.store.stats, ns)
    nkeys = s.call(s.store.count, ns)
    ctx, shared = s.ctx, s.shared
    ready = ctx.readiness()
    activity = shared.activity_total(ns)
    sections: list[tuple[str, list[tuple[str, object]]]] = [
        (
            "server",
            [
                ("redis_version", REDIS_COMPAT_VERSION),
                ("redis_mode", "standalone"),
                ("server_name", "epistemic-kvcache"),
                ("kvcache_version", shared.version),
                ("kvcache_resp_framer", resp_framer.IMPLEMENTATION),
                ("kvcache_store_core", store_core.IMPLEMENTATION),
                ("kvcache_fast_path", fast.IMPLEMENTATION),
                ("arch_bits", 64),
                ("uptime_in_seconds", int(time.monotonic() - shared.started)),
                ("resp_protocols", "2,3"),
                ("ready", int(ready.ready)),
                ("ready_reason", (ready.reason or "ok").replace("\r", " ").replace("\n", " ")),
            ],
        ),
        (
            "clients",
            [
                # this tenant's own connections only: the server-wide count would tell one
                # tenant about the others' traffic
                ("connected_clients", ctx.slots_for("resp").connections_of(ns)),
                ("blocked_clients", 0),
                ("maxclients", ctx.limits.max_connections),
            ],
        ),
        ("memory", _memory_section(s, stats.resident_bytes)),
        (
            "persistence",
            [
                ("loading", 0),
                ("aof_enabled", int(shared.durable)),
                ("rdb_changes_since_last_save", 0),
            ],
        ),
        (
            "stats",
            [
                ("total_connections_received", activity.connections),
                ("total_commands_processed", activity.commands),
                ("keyspace_hits", stats.get_hits),
                ("keyspace_misses", stats.get_misses),
                ("evicted_keys", stats.evictions),
                ("expired_keys", 0),
            ],
        ),
    ]
    kv: list[tuple[str, object]] = []
    for field, value in stats.to_dict().items():
        if field == "tiers":
            for tier, tstats in value.items():
                kv.extend((f"tier_{tier}_{k}", v) for k, v in tstats.items())
        elif field != "extra":
            kv.append((field, value))
    sections += info_sections(s)
    sections.append(("kvcache", kv))
    sections.append(("keyspace", [("db0", f"keys={nkeys},expires=0,avg_ttl=0")]))
    if ns in ctx.metrics_tenants:  # server-wide traffic: operators only
        sections.append(("loops", loop_info(ctx)))
    lines: list[str] = []
    for title, fields in sections:
        if title not in wanted:
            continue
        if lines:
            lines.append("")
        lines.append(f"# {'CPU' if title == 'cpu' else title.capitalize()}")
        lines.extend(f"{k}:{v}" for k, v in fields)
    out = "\r\n".join(lines) + ("\r\n" if lines else "")
    return Verbatim(out) if s.protocol_version == 3 else out.encode("utf-8")


def process_rss_bytes() -> int:
    """This process's resident memory now (Linux `/proc/self/statm`; elsewhere the peak
    from `getrusage`): what Redis reports as `used_memory`/`used_memory_rss`."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS: bytes, Linux: KiB


def _human(n: int) -> str:
    """Redis's `*_human` form: `1.50M`."""
    value = float(n)
    for unit in ("B", "K", "M", "G", "T"):
        if value < 1024 or unit == "T":
            return f"{value:.2f}{unit}" if unit != "B" else f"{n}B"
        value /= 1024
    raise AssertionError("unreachable")


def _memory_section(s: Session, tenant_resident: int) -> list[tuple[str, object]]:
    """`INFO memory`: the process's memory, as Redis reports its own (monitoring alerts on
    `used_memory` against `maxmemory`); the caller's stored bytes in RAM have their own
    field, `tenant_resident_bytes`."""
    rss = process_rss_bytes()
    limit = s.call(maxmemory, s)
    return [
        ("used_memory", rss),
        ("used_memory_human", _human(rss)),
        ("used_memory_rss", rss),
        ("used_memory_rss_human", _human(rss)),
        ("used_memory_peak", max(rss, _peak_rss_bytes())),
        ("used_memory_peak_human", _human(max(rss, _peak_rss_bytes()))),
        ("tenant_resident_bytes", tenant_resident),
        ("maxmemory", limit),
        ("maxmemory_human", _human(limit)),
        ("maxmemory_policy", "allkeys-lru"),
        ("mem_allocator", "libc"),
    ]


def _config_table(s: Session) -> dict[str, str]:
    limits = s.limits
    durable = s.shared.durable
    return {
        "save": "",
        "appendonly": "yes" if durable else "no",
        "appendfsync": "always" if durable else "no",
        "databases": "1",
        "maxclients": str(limits.max_connections),
        "proto-max-bulk-len": str(limits.max_block_bytes),
        "timeout": str(int(limits.idle_timeout_s)),
        "maxmemory": str(maxmemory(s)),
        "maxmemory-policy": "allkeys-lru",
    }


def _settings_table(s: Session) -> dict[str, str]:
    """Every setting of this server as `<name>` -> value and `<name>.source` -> where it
    came from (default, flag --x, env NAME, file PATH); operators only (the tenants of
    `metrics_tenants`, as for `/metrics`): paths and limits are not a tenant's business.
    Secrets show as `(hidden)`."""
    if s.namespace not in s.ctx.metrics_tenants:
        return {}
    out: dict[str, str] = {}
    for name, value, source in s.ctx.settings:
        out[name] = value
        out[f"{name}.source"] = source
    return out


@blocking_command(
    "config",
    -2,
    ("admin", "noscript", "loading", "stale"),
    (0, 0, 0),
    "server",
    "CONFIG GET: the Redis settings clients look at; for operators every setting and its source.",
)
def _config(s: Session, cmd: Command) -> object:
    if bytes(cmd[1]).upper() != b"GET":
        return unknown_subcommand(cmd[1], "CONFIG")
    if len(cmd) < 3:
        return ErrorReply("ERR wrong number of arguments for 'config|get' command")
    globs = [to_glob(bytes(pattern).lower()) for pattern in cmd[2:]]
    table = s.call(_config_table, s) | _settings_table(s)
    out: dict[str, str] = {}
    for glob in globs:
        for name, value in table.items():
            if glob.match(name.encode()):
                out[name] = value
    return out
