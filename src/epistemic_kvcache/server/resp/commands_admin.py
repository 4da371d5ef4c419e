"""Introspection commands (docs/resp.md): CLIENT, TIME, OBJECT, COMMAND, and `<command>
HELP` for every command with subcommands (INFO and CONFIG are commands_info.py's). A
tenant sees and kills only its own connections; counters are its own.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Final

from epistemic_kvcache.proto.resp import Buffer, Command, ErrorReply, SimpleString
from epistemic_kvcache.server.resp.common import (
    OK,
    SYNTAX_ERROR,
    text,
    to_int,
    to_key,
    unknown_subcommand,
    valid_client_name,
)
from epistemic_kvcache.server.resp.refusals import ProbeAnswer
from epistemic_kvcache.server.resp.registry import (
    COMMANDS,
    BlockingHandler,
    CommandSpec,
    Handler,
    blocking_command,
    command,
)
from epistemic_kvcache.server.resp.session import LiveConnection, Session

LFU_MAX: Final = 255
"""OBJECT FREQ's ceiling, as Redis' LFU counter."""


# -- CLIENT ---------------------------------------------------------------------------------


def _own_connections(s: Session) -> list[LiveConnection]:
    tenant = s.namespace
    own = [
        c
        for c in s.shared.all_live()
        if c.session.identity is not None and c.session.identity.tenant == tenant
    ]
    return sorted(own, key=lambda c: c.session.created)


def _client_line(c: Session, now: float) -> str:
    flags = ("x" if c.multi is not None else "") + ("P" if c.channels else "")
    fields = [
        ("id", c.client_id),
        ("addr", c.addr),
        ("laddr", c.laddr),
        ("fd", -1),
        ("name", c.name or ""),
        ("age", int(now - c.created)),
        ("idle", int(now - c.last_command)),
        ("flags", flags or "N"),
        ("db", 0),
        ("sub", len(c.channels)),
        ("psub", 0),
        ("ssub", 0),
        ("multi", len(c.multi) if c.multi is not None else -1),
        ("cmd", c.last_route),
        ("user", c.identity.tenant if c.identity is not None else ""),
        ("resp", c.protocol_version),
        ("lib-name", c.lib_name or ""),
        ("lib-ver", c.lib_version or ""),
        ("io-thread", c.shared.ctx.loop.index),  # (Redis 8: its I/O thread; ours: event loop)
    ]
    return " ".join(f"{k}={v}" for k, v in fields)


def _client_list(s: Session, cmd: Command) -> object:
    if len(cmd) > 2:
        if bytes(cmd[2]).upper() == b"TYPE" and len(cmd) == 4:
            kind = bytes(cmd[3]).lower()
            if kind not in (b"normal", b"pubsub", b"master", b"replica", b"slave"):
                return ErrorReply(f"ERR Unknown client type '{text(cmd[3])}'")
            conns = [
                c
                for c in _own_connections(s)
                if (kind == b"pubsub") == bool(c.session.channels)
                and kind in (b"normal", b"pubsub")
            ]
        elif bytes(cmd[2]).upper() == b"ID" and len(cmd) > 3:
            ids = {to_int(a, ErrorReply("ERR Invalid client ID")) for a in cmd[3:]}
            conns = [c for c in _own_connections(s) if c.session.client_id in ids]
        else:
            return SYNTAX_ERROR
    else:
        conns = _own_connections(s)
    now = time.monotonic()
    return "".join(_client_line(c.session, now) + "\n" for c in conns).encode()


def _client_kill(s: Session, cmd: Command) -> object:
    own = _own_connections(s)
    if len(cmd) == 3:  # the old form: CLIENT KILL addr:port
        addr = bytes(cmd[2]).decode("utf-8", "replace")
        for c in own:
            if c.session.addr == addr:
                _kill(s, c)
                return OK
        return ErrorReply("ERR No such client")
    if len(cmd) % 2 != 0:
        return SYNTAX_ERROR
    skipme = True
    filters: list[tuple[bytes, object]] = []
    for i in range(2, len(cmd), 2):
        opt, raw = bytes(cmd[i]).upper(), cmd[i + 1]
        value = bytes(raw).decode("utf-8", "replace")
        if opt == b"ID":
            filters.append((opt, to_int(raw, ErrorReply("ERR client-id should be greater than 0"))))
        elif opt in (b"ADDR", b"LADDR", b"USER"):
            filters.append((opt, value))
        elif opt == b"TYPE":
            if value.lower() not in ("normal", "pubsub", "master", "replica", "slave"):
                return ErrorReply(f"ERR Unknown client type '{text(raw)}'")
            filters.append((opt, value.lower()))
        elif opt == b"MAXAGE":
            filters.append((opt, to_int(raw)))
        elif opt == b"SKIPME":
            if value.lower() not in ("yes", "no"):
                return SYNTAX_ERROR
            skipme = value.lower() == "yes"
        else:
            return SYNTAX_ERROR
    now = time.monotonic()
    killed = 0
    for c in own:
        if skipme and c.session is s:
            continue
        if all(_kill_filter(c.session, opt, want, now) for opt, want in filters):
            _kill(s, c)
            killed += 1
    return killed


def _kill_filter(c: Session, opt: bytes, want: object, now: float) -> bool:
    if opt == b"ID":
        return c.client_id == want
    if opt == b"ADDR":
        return c.addr == want
    if opt == b"LADDR":
        return c.laddr == want
    if opt == b"USER":
        return c.identity is not None and c.identity.tenant == want
    if opt == b"TYPE":
        return want in ("normal", "pubsub") and (want == "pubsub") == bool(c.channels)
    return isinstance(want, int) and now - c.created >= want  # MAXAGE


def _kill(s: Session, c: LiveConnection) -> None:
    if c.session is s:
        s.quit_requested = True  # answered first, then closed (as Redis does)
    else:
        c.kill()


@command(
    "client",
    -2,
    ("stale",),
    (0, 0, 0),
    "connection",
    "CLIENT SETNAME | GETNAME | ID | SETINFO | INFO | LIST | KILL (own tenant only).",
)
async def _client(s: Session, cmd: Command) -> object:
    sub = bytes(cmd[1]).upper()
    s.last_route = "client"  # the command in progress, as Redis lists it
    if sub == b"SETNAME" and len(cmd) == 3:
        s.name = valid_client_name(cmd[2]) or None
        return OK
    if sub == b"GETNAME" and len(cmd) == 2:
        return s.name
    if sub == b"ID" and len(cmd) == 2:
        return s.client_id
    if sub == b"INFO" and len(cmd) == 2:
        return (_client_line(s, time.monotonic()) + "\n").encode()
    if sub == b"LIST":
        return _client_list(s, cmd)
    if sub == b"KILL" and len(cmd) >= 3:
        return _client_kill(s, cmd)
    if sub == b"SETINFO" and len(cmd) == 4:
        attr = bytes(cmd[2]).upper()
        value = valid_client_name(cmd[3]) if cmd[3] else ""
        if attr == b"LIB-NAME":
            s.lib_name = value or None
        elif attr == b"LIB-VER":
            s.lib_version = value or None
        else:
            return ErrorReply(f"ERR Unrecognized option '{text(cmd[2])}'")
        return OK
    if sub == b"MAINT_NOTIFICATIONS":  # redis-py 8's probe on connect (RESP3)
        return ProbeAnswer(unknown_subcommand(cmd[1], "CLIENT"))
    if sub in (b"SETNAME", b"GETNAME", b"ID", b"SETINFO", b"INFO", b"KILL"):
        return ErrorReply(
            f"ERR wrong number of arguments for 'client|{sub.decode().lower()}' command"
        )
    return unknown_subcommand(cmd[1], "CLIENT")


@command(
    "time",
    1,
    ("random", "loading", "stale", "fast"),
    (0, 0, 0),
    "server",
    "The server's clock: Unix seconds and microseconds.",
)
async def _time(s: Session, cmd: Command) -> object:
    micros = time.time_ns() // 1000
    return [b"%d" % (micros // 1_000_000), b"%d" % (micros % 1_000_000)]


# -- OBJECT ---------------------------------------------------------------------------------


@blocking_command(
    "object",
    -2,
    ("readonly",),
    (2, 2, 1),
    "keyspace",
    "OBJECT FREQ | ENCODING | IDLETIME | REFCOUNT key.",
)
def _object(s: Session, cmd: Command) -> object:
    sub = bytes(cmd[1]).upper()
    if sub not in (b"FREQ", b"ENCODING", b"IDLETIME", b"REFCOUNT"):
        return unknown_subcommand(cmd[1], "OBJECT")
    if len(cmd) != 3:
        return ErrorReply(
            f"ERR wrong number of arguments for 'object|{sub.decode().lower()}' command"
        )
    hits = s.call(s.store.key_hits, s.namespace, to_key(cmd[2]))
    if hits is None:
        return None
    if sub == b"FREQ":
        return min(hits, LFU_MAX)  # reads of the key's block
    if sub == b"ENCODING":
        return b"raw"
    if sub == b"IDLETIME":
        return 0  # access time is not tracked per key (docs/resp.md)
    return 1


# -- COMMAND --------------------------------------------------------------------------------


def _command_info(spec: CommandSpec) -> list[object]:
    return [
        spec.name,
        spec.arity,
        {SimpleString(f) for f in spec.flags},
        spec.first_key,
        spec.last_key,
        spec.step,
        set(),
        [],
        [],
        [],
    ]


def _command_docs(spec: CommandSpec) -> dict[str, object]:
    return {"summary": spec.summary, "since": "1.0.0", "group": spec.group}


def _lookup_specs(names: Sequence[Buffer]) -> list[CommandSpec | None]:
    return [COMMANDS.get(bytes(n).lower()) for n in names]


@command(
    "command",
    -1,
    ("loading", "stale"),
    (0, 0, 0),
    "server",
    "COMMAND, COMMAND COUNT | LIST | INFO | DOCS.",
)
async def _command_cmd(s: Session, cmd: Command) -> object:
    if len(cmd) == 1:
        return [_command_info(spec) for spec in COMMANDS.values()]
    sub = bytes(cmd[1]).upper()
    if sub == b"COUNT" and len(cmd) == 2:
        return len(COMMANDS)
    if sub == b"LIST" and len(cmd) == 2:
        return [spec.name for spec in COMMANDS.values()]
    if sub == b"INFO":
        specs = _lookup_specs(cmd[2:]) if len(cmd) > 2 else list(COMMANDS.values())
        return [_command_info(spec) if spec is not None else None for spec in specs]
    if sub == b"DOCS":
        specs = _lookup_specs(cmd[2:]) if len(cmd) > 2 else list(COMMANDS.values())
        return {spec.name: _command_docs(spec) for spec in specs if spec is not None}
    if sub in (b"COUNT", b"LIST"):
        return ErrorReply(
            f"ERR wrong number of arguments for 'command|{sub.decode().lower()}' command"
        )
    return unknown_subcommand(cmd[1], "COMMAND")


# -- HELP -----------------------------------------------------------------------------------

HELP: Final[dict[str, list[tuple[str, str]]]] = {
    "client": [
        ("ID", "Return the ID of the current connection."),
        ("INFO", "Return information about the current client connection."),
        ("LIST [TYPE normal|pubsub] [ID id ...]", "Return this tenant's connections."),
        ("KILL <ip:port>", "Kill this tenant's connection by address."),
        (
            "KILL <option> <value> [<option> <value> [...]]",
            "Kill this tenant's connections by ID, ADDR, LADDR, USER, TYPE, MAXAGE "
            "(SKIPME yes|no, default yes).",
        ),
        ("GETNAME", "Return the name of the current connection."),
        ("SETNAME <name>", "Assign the name <name> to the current connection."),
        ("SETINFO <LIB-NAME|LIB-VER> <value>", "Set client library name or version."),
    ],
    "object": [
        ("ENCODING <key>", "Return the value's representation: always raw."),
        ("FREQ <key>", "Return the reads counted for the key's block (at most 255)."),
        ("IDLETIME <key>", "Return 0: access time is not tracked per key."),
        ("REFCOUNT <key>", "Return 1."),
    ],
    "command": [
        ("(no subcommand)", "Return details about all commands."),
        ("COUNT", "Return the total number of commands in this server."),
        ("LIST", "Return a list of all commands in this server."),
        ("INFO [<command-name> ...]", "Return details about the given commands."),
        ("DOCS [<command-name> ...]", "Return documentation about the given commands."),
    ],
    "config": [
        ("GET <pattern> [<pattern> ...]", "Return the settings matching the glob patterns."),
    ],
    "memory": [
        ("USAGE <key> [SAMPLES <count>]", "Return bytes used by <key> and its value."),
    ],
}
"""`<command> HELP` for every command with subcommands (what each answers here)."""


def _help_lines(name: str) -> list[SimpleString]:
    lines = [
        SimpleString(f"{name.upper()} <subcommand> [<arg> [value] [opt] ...]. Subcommands are:")
    ]
    for usage, what in HELP[name] + [("HELP", "Print this help.")]:
        lines += [SimpleString(usage), SimpleString(f"    {what}")]
    return lines


def _is_help(cmd: Command) -> bool:
    return len(cmd) == 2 and bytes(cmd[1]).upper() == b"HELP"


def install_help() -> None:
    """Make `<command> HELP` answer for each command in `HELP` (after registration)."""
    for name in HELP:
        spec = COMMANDS[name.encode()]
        lines = _help_lines(name)
        if spec.blocking_handler is not None:
            COMMANDS[name.encode()] = dataclasses.replace(
                spec, blocking_handler=_blocking_help(spec.blocking_handler, lines)
            )
        elif spec.handler is not None:
            COMMANDS[name.encode()] = dataclasses.replace(
                spec, handler=_loop_help(spec.handler, lines)
            )


def _blocking_help(handler: BlockingHandler, lines: list[SimpleString]) -> BlockingHandler:
    def with_help(s: Session, cmd: Command) -> object:
        return lines if _is_help(cmd) else handler(s, cmd)

    return with_help


def _loop_help(handler: Handler, lines: list[SimpleString]) -> Handler:
    async def with_help(s: Session, cmd: Command) -> object:
        return lines if _is_help(cmd) else await handler(s, cmd)

    return with_help
