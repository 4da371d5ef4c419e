"""The Redis (RESP2/RESP3) listener: asyncio glue between sockets, `RespParser` and the store.

How it works
------------
One `RespConnection` (an `asyncio.BufferedProtocol`) per client. The event loop reads
straight into the parser's buffers (`get_buffer`/`buffer_updated`: a large SET payload
lands in its final preallocated `bytearray`). A per-connection task pulls commands from
the parser in order, runs each one (store calls go to the thread pool via `ctx.run`),
and writes the reply before taking the next, so pipelined replies keep request order.

Fast path: while that task is parked waiting for input (nothing queued, nothing in
flight), `buffer_updated` itself answers the plain `GET key` / `SET key value` commands
that RAM answers at once (`ServerContext.get_nowait` / `put_nowait`: hot hits, misses,
small PUTs on the memory backend), and writes their replies, without waking the task.
The first command it cannot answer that way is left to the task, in order. A plain SET
on the durable backend runs in the task: it is queued for the group committer inline
and awaited as a future (consecutive pipelined SETs are queued together, so they share
one commit).

Back-pressure, both ways:
- Reads: when a complete command is waiting and the parser holds more than
  `_READ_HIGH_WATER` bytes (or `_MAX_QUEUED_COMMANDS` commands), reading is paused until
  the task has drained below half of that. Reading always resumes when the parser needs
  data, so a single large command can never deadlock.
- Writes: `pause_writing` blocks the task before its next command, so a client that does
  not read its replies stops being served (and then stops being read).

Memory: a large bulk's array is allocated as soon as its `$len` header is parsed, so
the parser first reserves its size from the server-wide in-flight budget
(`ServerContext.reserve_body`). A refused bulk is read and dropped and its command
answered `-ERR server busy, retry`. The connection gives its reservations back whenever
no command of it is running (what the parser still holds stays reserved), and all of
them when it closes.

Timeouts: a connection not authenticated `auth_timeout_s` after it opened (or after
RESET) is closed; a connection with no traffic for `idle_timeout_s` is closed; a command whose
first byte arrived more than `request_timeout_s` ago and is still incomplete (slowloris)
is cut off. Malformed input gets `-ERR Protocol error: ...` and the connection closes
after the replies to the commands before it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import re
import secrets
import socket
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Final, TypeVar, cast

from epistemic_kvcache.errors import (
    AuthError,
    BlockTooLargeError,
    CapacityError,
    DiskFullError,
    InvalidKeyError,
    RemoteProtocolError,
    StorageIOError,
    StoreError,
)
from epistemic_kvcache.proto.glob import Glob
from epistemic_kvcache.proto.resp import (
    NEED_DATA,
    Buffer,
    Command,
    ErrorReply,
    Event,
    RefusedCommand,
    RespParser,
    SimpleString,
    Verbatim,
    serialize,
)
from epistemic_kvcache.server.context import Identity, ServerContext
from epistemic_kvcache.shared import MAX_KEY_BYTES
from epistemic_kvcache.store.api import PutCond, PutResult, SharedKvBackend
from epistemic_kvcache.store.engine import WOULD_BLOCK

log = logging.getLogger(__name__)
T = TypeVar("T")

WIRE: Final = "resp"
REDIS_COMPAT_VERSION: Final = "7.0.0"
"""The Redis version we answer in INFO/HELLO: the command set we implement is 7.0's."""
_READ_HIGH_WATER: Final = 4 * 1024 * 1024
"""Bytes of not-yet-executed commands above which reading pauses."""
_MAX_QUEUED_COMMANDS: Final = 4096
"""Framed-but-not-executed commands above which reading pauses (pipelines)."""
_MAX_BATCH_COMMANDS: Final = 64
"""Pipelined store commands run in one thread-pool job, at most this many..."""
_MAX_BATCH_ARG_BYTES: Final = 1024 * 1024
"""...while their arguments total less than this..."""
_MAX_BATCH_REPLY_BYTES: Final = 4 * 1024 * 1024
"""...and the job stops early once its replies reach this (the rest runs next)."""
_SCAN_CURSORS: Final = 16384
"""SCAN cursors remembered server-wide (oldest forgotten first)."""
_SCAN_MAX_COUNT: Final = 10000
_SCAN_DEFAULT_COUNT: Final = 10
_SCAN_MATCH_BUDGET: Final = 50_000_000
"""Glob work (`Glob.cost` units, ~3 ns each) one SCAN call may spend on MATCH; past it
the call returns early with a cursor (SCAN may return fewer keys than COUNT)."""
EPOCH_CHANNEL: Final = b"kvcache:epochs"
"""Pub/sub channel of epoch bumps: messages `<scope> <epoch>`, per tenant."""
_MAX_CHANNELS: Final = 1024
"""Channels one connection may subscribe to (only EPOCH_CHANNEL carries messages)."""
_PUBSUB_OUTPUT_LIMIT: Final = 8 * 1024 * 1024
"""A subscriber whose unread messages exceed this is disconnected (Redis' soft pubsub
client-output-buffer-limit is 8 MiB)."""
_SUBSCRIBED_MODE_COMMANDS: Final = frozenset(
    {"subscribe", "unsubscribe", "psubscribe", "punsubscribe", "ping", "quit", "reset"}
)

_MAX_PIPELINED_SETS: Final = 64
"""Plain SETs queued for one group commit before their replies are awaited."""
_SMALL_REPLY: Final = 16 * 1024
"""Bulk replies shorter than this are sent as one buffer (head + bytes + CRLF)."""
_FAST_NAMES: Final = {b"get": "get", b"GET": "get", b"set": "set", b"SET": "set"}

OK: Final = SimpleString("OK")
NOAUTH: Final = ErrorReply("NOAUTH Authentication required.")
WRONGPASS: Final = ErrorReply("WRONGPASS invalid username-password pair or user is disabled.")
NOT_AN_INTEGER: Final = ErrorReply("ERR value is not an integer or out of range")
SYNTAX_ERROR: Final = ErrorReply("ERR syntax error")
INTERNAL_ERROR: Final = ErrorReply("ERR internal error")
BUSY: Final = ErrorReply("ERR server busy, retry")
DISK_FULL: Final = ErrorReply("ERR disk full, nothing was stored")
STORAGE_IO_ERROR: Final = ErrorReply("ERR storage I/O error, nothing was stored")
_HELLO_NOAUTH: Final = ErrorReply(
    "NOAUTH HELLO must be called with the client already authenticated, otherwise the "
    "HELLO <proto> AUTH <user> <pass> option can be used to authenticate the client and "
    "select the RESP protocol version at the same time"
)
_TTL_UNSUPPORTED: Final = ErrorReply(
    "ERR SET with EX/PX/EXAT/PXAT is not supported: entries never expire, they are "
    "evicted by the cache tiers or removed with DEL"
)


class _Reply(Exception):
    """Raised inside a handler to answer with an error reply."""

    def __init__(self, reply: ErrorReply) -> None:
        super().__init__(reply)
        self.reply = reply


def _text(arg: Buffer, limit: int = 128) -> str:
    """Client bytes for an error message: truncated, CR/LF-free."""
    s = bytes(arg[:limit]).decode("utf-8", "backslashreplace")
    return s.replace("\r", " ").replace("\n", " ")


def _int(arg: Buffer, error: ErrorReply = NOT_AN_INTEGER) -> int:
    raw = bytes(arg)
    if re.fullmatch(rb"-?(?:0|[1-9][0-9]{0,18})", raw) is None:
        raise _Reply(error)
    value = int(raw)
    if not -(2**63) <= value < 2**63:
        raise _Reply(error)
    return value


def _key(arg: Buffer) -> str:
    try:
        return bytes(arg).decode("utf-8")
    except UnicodeDecodeError:
        raise _Reply(ErrorReply("ERR invalid key: not valid UTF-8")) from None


class _Frames:
    """A reply already serialized (several frames, or push frames)."""

    __slots__ = ("buffers",)

    def __init__(self, buffers: list[Buffer]) -> None:
        self.buffers = buffers


def _push(items: list[object], protocol: int) -> list[Buffer]:
    """A pub/sub frame: a RESP3 push (`>`) or, in RESP2, a plain array."""
    out = serialize(items, protocol)
    if protocol == 3:
        out[0] = b">" + bytes(out[0])[1:]
    return out


def _command_bytes(cmd: Command) -> int:
    return sum(len(a) for a in cmd)


def _reply_bytes(reply: object) -> int:
    """Approximate payload size of a reply (bulk strings, and arrays of them)."""
    if isinstance(reply, bytes | bytearray | memoryview):
        return len(reply)
    if isinstance(reply, list):
        return sum(len(r) for r in reply if isinstance(r, bytes | bytearray | memoryview))
    return 0


def _wrong_args(name: str) -> ErrorReply:
    return ErrorReply(f"ERR wrong number of arguments for '{name}' command")


def _unknown_subcommand(sub: Buffer, cmd: str) -> ErrorReply:
    return ErrorReply(f"ERR unknown subcommand '{_text(sub)}'. Try {cmd} HELP.")


# -- command table ----------------------------------------------------------------------

Handler = Callable[["RespConnection", Command], Awaitable[object]]
"""Runs on the event loop (connection state, no store access)."""
BlockingHandler = Callable[["RespConnection", Command], object]
"""Runs on the thread pool (store access); consecutive ones are batched in one job."""


@dataclass(frozen=True, slots=True)
class CommandSpec:
    """One command: Redis arity (negative = at least), flags, key positions, handler."""

    name: str
    arity: int
    flags: tuple[str, ...]
    first_key: int
    last_key: int
    step: int
    group: str
    summary: str
    handler: Handler | None
    blocking_handler: BlockingHandler | None = None
    no_auth: bool = False


COMMANDS: dict[bytes, CommandSpec] = {}


def _command(
    name: str,
    arity: int,
    flags: tuple[str, ...],
    keys: tuple[int, int, int],
    group: str,
    summary: str,
    *,
    no_auth: bool = False,
) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        COMMANDS[name.encode()] = CommandSpec(
            name, arity, flags, *keys, group, summary, fn, no_auth=no_auth
        )
        return fn

    return register


def _blocking_command(
    name: str,
    arity: int,
    flags: tuple[str, ...],
    keys: tuple[int, int, int],
    group: str,
    summary: str,
) -> Callable[[BlockingHandler], BlockingHandler]:
    def register(fn: BlockingHandler) -> BlockingHandler:
        COMMANDS[name.encode()] = CommandSpec(
            name, arity, flags, *keys, group, summary, None, blocking_handler=fn
        )
        return fn

    return register


# -- shared per-listener state ----------------------------------------------------------


class _Listener:
    """What all connections of one RESP listener share."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.started = time.monotonic()
        self._next_id = 0
        self._cursors: OrderedDict[int, tuple[str, str]] = OrderedDict()
        self._cursors_lock = threading.Lock()  # SCAN runs on the thread pool
        try:
            self.version = metadata.version("epistemic-kvcache")
        except metadata.PackageNotFoundError:
            self.version = "0"
        self.durable = _is_durable(ctx.store)

    def next_client_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def new_cursor(self, tenant: str, after: str) -> int:
        with self._cursors_lock:
            cursor = 0
            while cursor == 0 or cursor in self._cursors:
                cursor = secrets.randbits(63)
            self._cursors[cursor] = (tenant, after)
            while len(self._cursors) > _SCAN_CURSORS:
                self._cursors.popitem(last=False)
            return cursor

    def cursor_position(self, tenant: str, cursor: int) -> str | None:
        with self._cursors_lock:
            entry = self._cursors.get(cursor)
            if entry is None or entry[0] != tenant:
                return None
            self._cursors.move_to_end(cursor)
            return entry[1]


def _is_durable(store: SharedKvBackend) -> bool:
    """Whether acknowledged writes are on disk (drives CONFIG GET appendonly/INFO)."""
    from epistemic_kvcache.store import SharedKvIndex

    return not isinstance(store, SharedKvIndex)


def make_resp_factory(ctx: ServerContext) -> Callable[[], asyncio.BufferedProtocol]:
    """A protocol factory for `loop.create_server` serving RESP on `ctx`'s store."""
    listener = _Listener(ctx)

    def factory() -> asyncio.BufferedProtocol:
        return RespConnection(listener)

    return factory


# -- the connection -----------------------------------------------------------------------


class RespConnection(asyncio.BufferedProtocol):
    """One RESP client connection. Create through `make_resp_factory`."""

    def __init__(self, listener: _Listener) -> None:
        self._listener = listener
        self._ctx = ctx = listener.ctx
        limits = ctx.limits
        self._parser = RespParser(
            max_multibulk_len=limits.resp_max_args,
            max_bulk_bytes=max(limits.max_block_bytes, MAX_KEY_BYTES),
            unauthenticated_max_multibulk_len=limits.resp_unauthenticated_max_args,
            unauthenticated_max_bulk_bytes=limits.resp_unauthenticated_max_bulk_bytes,
            reserve=self._reserve,
        )
        self._reserved = 0
        """Bytes of the in-flight budget this connection holds (see `_settle`)."""
        self.client_id = listener.next_client_id()
        self.identity: Identity | None = None
        self.protocol_version = 2
        self.name: str | None = None
        self.lib_name: str | None = None
        self.lib_version: str | None = None

        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._task: asyncio.Task[None] | None = None
        self._wakeup = asyncio.Event()
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._counted = False
        self._closing = False
        self._eof = False
        self._quit = False
        self._reading_paused = False
        self._busy = False
        self._parked = False
        """The command task waits for input with nothing queued: the fast path may run."""
        self._last_activity = self._loop.time()
        self._partial_since: float | None = None
        self._seen_parsed = 0
        self._timer: asyncio.TimerHandle | None = None
        self._auth_timer: asyncio.TimerHandle | None = None
        self._pending: deque[Command] = deque()
        """Framed commands a batch job left undone; they run before the parser's next."""
        self.channels: dict[bytes, None] = {}
        """Subscribed pub/sub channels, in subscription order."""
        self._sub_tenant: str | None = None

    # -- asyncio callbacks ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport = cast(asyncio.Transport, transport)
        open_now = self._ctx.open_connections.get(WIRE, 0)
        if open_now >= self._ctx.limits.max_connections:
            self._closing = True
            transport.write(b"-ERR max number of clients reached\r\n")
            transport.close()
            return
        self._ctx.open_connections[WIRE] = open_now + 1
        self._counted = True
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._task = self._loop.create_task(self._serve())
        self._arm_timer(self._timeout_check_delay())
        self.arm_auth_deadline()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._parser.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        parser = self._parser
        parser.buffer_updated(nbytes)
        now = self._loop.time()
        self._last_activity = now
        if parser.has_partial:
            if self._partial_since is None or parser.commands_parsed != self._seen_parsed:
                self._partial_since = now
                self._seen_parsed = parser.commands_parsed
        else:
            self._partial_since = None
        if (
            self._parked
            and parser.has_ready
            and self.identity is not None
            and not self.channels
            and not self._closing
        ):
            self._run_inline()
            self._settle()
            if not parser.has_ready and not parser.has_error:
                return  # all answered here: the task stays parked
        self._wakeup.set()
        if (
            not self._reading_paused
            and parser.has_ready
            and (
                parser.buffered_bytes > _READ_HIGH_WATER
                or parser.ready_count > _MAX_QUEUED_COMMANDS
            )
            and self._transport is not None
        ):
            self._reading_paused = True
            self._transport.pause_reading()

    def eof_received(self) -> bool:
        self._eof = True
        self._wakeup.set()
        return True  # keep the write side open until the queued replies are sent

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        if self._reserved:
            self._ctx.release_body(self._reserved)
            self._reserved = 0
        self.channels.clear()
        self.sync_subscription()
        if self._counted:
            self._counted = False
            self._ctx.open_connections[WIRE] -= 1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._auth_timer is not None:
            self._auth_timer.cancel()
            self._auth_timer = None
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._can_write.set()
        self._wakeup.set()

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._last_activity = self._loop.time()
        self._can_write.set()

    # -- the command loop -------------------------------------------------------------------
    def _next_command(self) -> Event:
        if self._pending:
            return self._pending.popleft()
        return self._parser.next_event()

    async def _serve(self) -> None:
        try:
            while not self._closing:
                try:
                    event = self._next_command()
                except RemoteProtocolError as exc:
                    self._observe("protocol_error", "error", 0.0)
                    self._write(serialize(ErrorReply(f"ERR {exc}"), self.protocol_version))
                    self._close()
                    return
                if event is NEED_DATA:
                    self._settle()
                    self._resume_reading(force=True)
                    if self._eof:
                        self._close()
                        return
                    self._wakeup.clear()
                    self._parked = True
                    try:
                        await self._wakeup.wait()
                    finally:
                        self._parked = False
                    continue
                self._resume_reading(force=False)
                if not self._can_write.is_set():
                    await self._can_write.wait()
                    if self._closing:
                        return
                replies = await self._execute(event)
                if self._closing:
                    return
                if not self._pending:
                    self._settle()
                buffers: list[Buffer] = []
                for reply in replies:
                    if isinstance(reply, _Frames):
                        buffers += reply.buffers
                    else:
                        buffers += serialize(reply, self.protocol_version)
                self._write(buffers)
                if self._quit:
                    self._close()
                    return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("RESP connection %d failed", self.client_id)
            self._close(abort=True)

    def _check(self, cmd: Command) -> tuple[str, CommandSpec | None, ErrorReply | None]:
        """The command's metrics route, its spec, and an error reply if it may not run."""
        if isinstance(cmd, RefusedCommand):
            return "busy", None, BUSY
        spec = COMMANDS.get(bytes(cmd[0]).lower())
        if spec is None:
            return "unknown", None, NOAUTH if self.identity is None else self._unknown_command(cmd)
        if self.identity is None and not spec.no_auth:
            return spec.name, spec, NOAUTH
        if (spec.arity > 0 and len(cmd) != spec.arity) or len(cmd) < -spec.arity:
            return spec.name, spec, _wrong_args(spec.name)
        if (
            self.channels
            and self.protocol_version == 2
            and spec.name not in _SUBSCRIBED_MODE_COMMANDS
        ):
            return (
                spec.name,
                spec,
                ErrorReply(
                    f"ERR Can't execute '{spec.name}': only (P|S)SUBSCRIBE / "
                    "(P|S)UNSUBSCRIBE / PING / QUIT / RESET are allowed in this context"
                ),
            )
        return spec.name, spec, None

    async def _execute(self, cmd: Command) -> list[object]:
        """Run `cmd`, and the store commands framed right behind it in the same job."""
        started = time.perf_counter()
        route, spec, error = self._check(cmd)
        if error is not None or spec is None:
            self._observe(route, "error", time.perf_counter() - started)
            return [error]
        if route == "get" and len(cmd) == 2:
            try:
                fast = self._get_nowait(cmd[1])
            except _Reply as exc:
                fast = exc.reply
            if fast is not WOULD_BLOCK:
                status = "error" if isinstance(fast, ErrorReply) else "ok"
                self._observe(route, status, time.perf_counter() - started)
                return [fast]
        elif route == "set" and len(cmd) == 3:
            replies = await self._plain_sets(cmd, started)
            if replies is not None:
                return replies
        if spec.blocking_handler is not None:
            batch = [(route, spec.blocking_handler, cmd)]
            size = _command_bytes(cmd)
            while len(batch) < _MAX_BATCH_COMMANDS and size < _MAX_BATCH_ARG_BYTES:
                following = self._pending[0] if self._pending else self._parser.peek()
                if following is None:
                    break
                route2, spec2, error2 = self._check(following)
                if error2 is not None or spec2 is None or spec2.blocking_handler is None:
                    break
                self._next_command()  # consume what was peeked
                batch.append((route2, spec2.blocking_handler, following))
                size += _command_bytes(following)
            self._busy = True
            try:
                results = await self._ctx.run(self._run_batch, batch)
            finally:
                self._busy = False
                self._last_activity = self._loop.time()
            for (route_i, _, _), (reply_i, seconds) in zip(batch, results, strict=False):
                status = "error" if isinstance(reply_i, ErrorReply) else "ok"
                self._observe(route_i, status, seconds)
            # Commands the job left undone (replies grew too big) run next, in order.
            self._pending.extendleft(item[2] for item in reversed(batch[len(results) :]))
            return [reply_i for reply_i, _ in results]
        handler = spec.handler
        if handler is None:  # every spec has exactly one of the two handlers
            raise RuntimeError(f"command {spec.name!r} has no handler")
        reply: object
        self._busy = True
        try:
            reply = await handler(self, cmd)
        except _Reply as exc:
            reply = exc.reply
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("RESP %s failed", route)
            reply = INTERNAL_ERROR
        finally:
            self._busy = False
            self._last_activity = self._loop.time()
        status = "error" if isinstance(reply, ErrorReply) else "ok"
        self._observe(route, status, time.perf_counter() - started)
        return [reply]

    # -- the fast path ------------------------------------------------------------------
    def _run_inline(self) -> None:
        """Answer framed plain GET/SET commands that RAM answers at once (task parked).

        Stops at the first command it cannot answer without blocking; the task runs it.
        """
        parser = self._parser
        inline_puts = self._ctx.inline_puts
        while parser.has_ready and self._can_write.is_set() and not self._closing:
            cmd = parser.peek()
            if cmd is None or not 2 <= len(cmd) <= 3:
                return
            name = cmd[0]
            kind = _FAST_NAMES.get(name) if isinstance(name, bytes) else None
            if kind is None:
                kind = _FAST_NAMES.get(bytes(name).lower())
                if kind is None:
                    return
            started = time.perf_counter()
            reply: object
            try:
                if kind == "get" and len(cmd) == 2:
                    reply = self._get_nowait(cmd[1])
                elif kind == "set" and len(cmd) == 3 and inline_puts:
                    result = self._ctx.put_nowait(self.namespace, _key(cmd[1]), cmd[2])
                    if result is WOULD_BLOCK:
                        return
                    if not isinstance(result, PutResult):  # inline_puts: never a future
                        raise RuntimeError("put_nowait returned a future on an inline store")
                    reply = OK
                else:
                    return
            except _Reply as exc:
                reply = exc.reply
            except StoreError as exc:
                reply = self._store_error_reply(exc, kind)
            if reply is WOULD_BLOCK:
                return
            parser.next_event()  # consume what was peeked
            self._write(self._encode(reply))
            status = "error" if isinstance(reply, ErrorReply) else "ok"
            self._observe(kind, status, time.perf_counter() - started)

    def _get_nowait(self, arg: Buffer) -> object:
        """A plain GET's reply if RAM answers it, else `WOULD_BLOCK`."""
        try:
            return self._ctx.get_nowait(self.namespace, _key(arg))
        except StoreError as exc:
            raise _Reply(self._store_error_reply(exc, "get")) from None

    def _encode(self, reply: object) -> list[Buffer]:
        """`serialize`, with the replies of GET and SET written without its machinery."""
        if isinstance(reply, bytes | bytearray):
            n = len(reply)
            if n < _SMALL_REPLY:
                return [b"".join((b"$%d\r\n" % n, reply, b"\r\n"))]
            return [b"$%d\r\n" % n, reply, b"\r\n"]
        if reply is OK:
            return [b"+OK\r\n"]
        if reply is None:
            return [b"$-1\r\n" if self.protocol_version == 2 else b"_\r\n"]
        return serialize(reply, self.protocol_version)

    def _plain_set_ok(self, cmd: Command | None) -> bool:
        """Whether `cmd` is a `SET key value` this connection may run now."""
        if cmd is None or len(cmd) != 3 or self.identity is None or self.channels:
            return False
        return bytes(cmd[0]).lower() == b"set"

    async def _plain_sets(self, cmd: Command, started: float) -> list[object] | None:
        """Run `SET key value` and the plain SETs pipelined right behind it.

        Each is started inline (`put_nowait`); durable ones are all queued before the
        first is awaited, so they share a group commit. None when the first cannot start
        inline (the caller runs it on the thread pool).
        """
        ns = self.namespace
        ctx = self._ctx
        begun: list[tuple[object, float]] = []
        current: Command | None = cmd
        while current is not None:
            t0 = started if not begun else time.perf_counter()
            outcome: object
            try:
                outcome = ctx.put_nowait(ns, _key(current[1]), current[2])
            except _Reply as exc:
                outcome = exc.reply
            except StoreError as exc:
                outcome = self._store_error_reply(exc, "set")
            if outcome is WOULD_BLOCK:
                break
            if begun:
                self._next_command()  # consume what was peeked
            begun.append((outcome, t0))
            if len(begun) >= _MAX_PIPELINED_SETS:
                break
            following = self._pending[0] if self._pending else self._parser.peek()
            current = following if self._plain_set_ok(following) else None
        if not begun:
            return None
        replies: list[object] = []
        self._busy = True
        try:
            for outcome, t0 in begun:
                reply = outcome
                if isinstance(outcome, concurrent.futures.Future):
                    try:
                        await asyncio.wrap_future(outcome)
                        reply = OK
                    except StoreError as exc:
                        reply = self._store_error_reply(exc, "set")
                elif isinstance(outcome, PutResult):
                    reply = OK
                replies.append(reply)
                status = "error" if isinstance(reply, ErrorReply) else "ok"
                self._observe("set", status, time.perf_counter() - t0)
        finally:
            self._busy = False
            self._last_activity = self._loop.time()
        return replies

    def _run_batch(
        self, batch: list[tuple[str, BlockingHandler, Command]]
    ) -> list[tuple[object, float]]:
        """Thread-pool job: run store commands in order until their replies grow big."""
        out: list[tuple[object, float]] = []
        reply_bytes = 0
        for route, handler, cmd in batch:
            started = time.perf_counter()
            reply: object
            try:
                reply = handler(self, cmd)
            except _Reply as exc:
                reply = exc.reply
            except Exception:
                log.exception("RESP %s failed", route)
                reply = INTERNAL_ERROR
            out.append((reply, time.perf_counter() - started))
            reply_bytes += _reply_bytes(reply)
            if reply_bytes >= _MAX_BATCH_REPLY_BYTES:
                break
        return out

    @staticmethod
    def _unknown_command(cmd: Command) -> ErrorReply:
        args = ""
        for arg in cmd[1:]:
            if len(args) >= 128:
                break
            args += f"'{_text(arg, 128 - len(args))}' "
        return ErrorReply(
            f"ERR unknown command '{_text(cmd[0])}', with args beginning with: {args}"
        )

    def _observe(self, route: str, status: str, seconds: float) -> None:
        try:
            self._ctx.metrics.observe_request(
                wire=WIRE, route=route, status=status, seconds=seconds
            )
        except Exception:  # metrics must never break serving
            log.exception("metrics.observe_request failed")

    # -- the in-flight memory budget ------------------------------------------------------
    def _reserve(self, nbytes: int) -> bool:
        """The parser's `reserve` hook: take `nbytes` from the server-wide budget."""
        if not self._ctx.reserve_body(nbytes):
            log.info(
                "RESP connection %d: %d-byte bulk refused (server busy)", self.client_id, nbytes
            )
            return False
        self._reserved += nbytes
        return True

    def _settle(self) -> None:
        """Release what this connection reserved beyond what its parser still holds.

        Call only while none of its commands runs and none waits in `_pending`: every
        bulk taken out of the parser is then done with."""
        excess = self._reserved - self._parser.held_bytes
        if excess > 0:
            self._ctx.release_body(excess)
            self._reserved -= excess

    # -- I/O helpers ------------------------------------------------------------------------
    def _write(self, buffers: list[Buffer]) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if len(buffers) == 1:
            transport.write(buffers[0])
        else:
            transport.writelines(buffers)

    def _close(self, *, abort: bool = False) -> None:
        self._closing = True
        transport = self._transport
        if transport is not None and not transport.is_closing():
            if abort:
                transport.abort()
            else:
                transport.close()

    def _resume_reading(self, *, force: bool) -> None:
        if not self._reading_paused or self._transport is None:
            return
        parser = self._parser
        if force or (
            parser.buffered_bytes <= _READ_HIGH_WATER // 2
            and parser.ready_count <= _MAX_QUEUED_COMMANDS // 2
        ):
            self._reading_paused = False
            self._partial_since = None  # the wait was ours, not the client's
            self._transport.resume_reading()

    def arm_auth_deadline(self) -> None:
        """Close the connection unless it authenticates within `auth_timeout_s`."""
        if self._auth_timer is not None:
            self._auth_timer.cancel()
        self._auth_timer = self._loop.call_later(
            self._ctx.limits.auth_timeout_s, self._on_auth_timeout
        )

    def _on_auth_timeout(self) -> None:
        self._auth_timer = None
        if self._closing or self.identity is not None:
            return
        log.info("RESP connection %d not authenticated in time, closing", self.client_id)
        self._close(abort=True)

    def _timeout_check_delay(self) -> float:
        limits = self._ctx.limits
        return max(0.05, min(limits.idle_timeout_s, limits.request_timeout_s))

    def _arm_timer(self, delay: float) -> None:
        self._timer = self._loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self._closing:
            return
        limits = self._ctx.limits
        now = self._loop.time()
        if self._busy or self.channels:  # a subscriber waits for messages, it is not idle
            self._last_activity = now
        idle_deadline = self._last_activity + limits.idle_timeout_s
        deadline = idle_deadline
        if self._partial_since is not None and not self._reading_paused:
            deadline = min(deadline, self._partial_since + limits.request_timeout_s)
        if now >= deadline:
            log.info("RESP connection %d timed out", self.client_id)
            self._close(abort=True)
            return
        self._arm_timer(max(0.05, deadline - now))

    # -- store access -----------------------------------------------------------------------
    @property
    def namespace(self) -> str:
        identity = self.identity
        if identity is None:  # handlers run only once authenticated
            raise _Reply(NOAUTH)
        return identity.tenant

    @staticmethod
    def _call(fn: Callable[..., T], *args: object) -> T:
        """Call the store (on the thread pool), mapping its errors to RESP errors."""
        try:
            return fn(*args)
        except StoreError as exc:
            name = getattr(fn, "__name__", repr(fn))
            raise _Reply(RespConnection._store_error_reply(exc, name)) from None

    @staticmethod
    def _store_error_reply(exc: StoreError, what: str) -> ErrorReply:
        """The RESP error for a store failure. Disk and internal failures get generic
        text (their messages name server paths and OS errors); the detail is logged."""
        if isinstance(exc, InvalidKeyError):
            return ErrorReply(f"ERR {_text(str(exc).encode(), 400)}")
        if isinstance(exc, BlockTooLargeError):
            return ErrorReply(f"ERR block too large: {exc}")
        if isinstance(exc, CapacityError):
            return ErrorReply(f"ERR no room in the cache: {exc}")
        if isinstance(exc, DiskFullError):
            log.error("store call %s failed: %s", what, exc)
            return DISK_FULL
        if isinstance(exc, StorageIOError):
            log.error("store call %s failed: %s", what, exc)
            return STORAGE_IO_ERROR
        log.error("store call %s failed", what, exc_info=exc)
        return INTERNAL_ERROR

    def _authenticate(self, password: Buffer) -> ErrorReply | None:
        """Verify a credential and switch identity; an error reply on failure."""
        try:
            credential = bytes(password).decode("utf-8")
            identity = self._ctx.auth.authenticate(credential)
        except (UnicodeDecodeError, AuthError):
            return WRONGPASS
        self.identity = identity
        self._parser.authenticated = True
        if self._auth_timer is not None:
            self._auth_timer.cancel()
            self._auth_timer = None
        self.sync_subscription()
        return None

    # -- pub/sub ----------------------------------------------------------------------------
    def sync_subscription(self) -> None:
        """Listen to the current tenant's epoch bumps iff subscribed to EPOCH_CHANNEL."""
        want = None
        if self.identity is not None and EPOCH_CHANNEL in self.channels:
            want = self.identity.tenant
        if want == self._sub_tenant:
            return
        if self._sub_tenant is not None:
            self._ctx.epochs.unsubscribe(self._sub_tenant, self.deliver_epoch)
        if want is not None:
            self._ctx.epochs.subscribe(want, self.deliver_epoch)
        self._sub_tenant = want

    def deliver_epoch(self, scope: str, epoch: int) -> None:
        """Send one `message` frame on EPOCH_CHANNEL (on the event loop)."""
        transport = self._transport
        if transport is None or transport.is_closing() or self._closing:
            return
        if transport.get_write_buffer_size() > _PUBSUB_OUTPUT_LIMIT:
            log.warning("RESP subscriber %d does not read its messages: closed", self.client_id)
            self._close(abort=True)
            return
        payload = f"{scope} {epoch}".encode()
        self._write(_push([b"message", EPOCH_CHANNEL, payload], self.protocol_version))

    def _hello_map(self) -> dict[str, object]:
        return {
            "server": "epistemic-kvcache",
            "version": REDIS_COMPAT_VERSION,
            "proto": self.protocol_version,
            "id": self.client_id,
            "mode": "standalone",
            "role": "master",
            "modules": [],
        }


# The handlers below are module-level functions registered in COMMANDS.


def _valid_client_name(raw: Buffer) -> str:
    data = bytes(raw)
    if any(b < 0x21 or b > 0x7E for b in data):
        raise _Reply(
            ErrorReply("ERR Client names cannot contain spaces, newlines or special characters.")
        )
    return data.decode("ascii")


# -- connection commands --------------------------------------------------------------------


@_command("ping", -1, ("fast", "stale"), (0, 0, 0), "connection", "Ping the server.", no_auth=True)
async def _ping(c: RespConnection, cmd: Command) -> object:
    if len(cmd) > 2:
        return _wrong_args("ping")
    if c.channels and c.protocol_version == 2:  # Redis' subscribed-mode PING reply
        return [b"pong", cmd[1] if len(cmd) == 2 else b""]
    return cmd[1] if len(cmd) == 2 else SimpleString("PONG")


@_command("echo", 2, ("fast", "stale"), (0, 0, 0), "connection", "Return the argument.")
async def _echo(c: RespConnection, cmd: Command) -> object:
    return cmd[1]


@_command(
    "quit", -1, ("fast", "stale"), (0, 0, 0), "connection", "Close the connection.", no_auth=True
)
async def _quit(c: RespConnection, cmd: Command) -> object:
    c._quit = True
    return OK


@_command(
    "auth",
    -2,
    ("fast", "stale", "no-auth"),
    (0, 0, 0),
    "connection",
    "Authenticate the connection; its keys live in the credential's namespace.",
    no_auth=True,
)
async def _auth(c: RespConnection, cmd: Command) -> object:
    if len(cmd) > 3:
        return SYNTAX_ERROR
    return c._authenticate(cmd[-1]) or OK


@_command(
    "hello",
    -1,
    ("fast", "stale", "no-auth"),
    (0, 0, 0),
    "connection",
    "Handshake: select RESP2/RESP3, optionally authenticate and name the client.",
    no_auth=True,
)
async def _hello(c: RespConnection, cmd: Command) -> object:
    version = c.protocol_version
    password: Buffer | None = None
    setname: str | None = None
    if len(cmd) >= 2:
        version = _int(cmd[1], ErrorReply("ERR Protocol version is not an integer or out of range"))
        i = 2
        while i < len(cmd):
            opt = bytes(cmd[i]).upper()
            if opt == b"AUTH" and i + 2 < len(cmd):
                password = cmd[i + 2]
                i += 3
            elif opt == b"SETNAME" and i + 1 < len(cmd):
                setname = _valid_client_name(cmd[i + 1])
                i += 2
            else:
                return ErrorReply(f"ERR Syntax error in HELLO option '{_text(cmd[i])}'")
        if version not in (2, 3):
            return ErrorReply("NOPROTO unsupported protocol version")
    if password is not None:
        failed = c._authenticate(password)
        if failed is not None:
            return failed
    if c.identity is None:
        return _HELLO_NOAUTH
    if setname is not None:
        c.name = setname or None
    c.protocol_version = version
    return c._hello_map()


@_command(
    "select",
    2,
    ("fast", "loading", "stale"),
    (0, 0, 0),
    "connection",
    "Select database 0 (the only one).",
)
async def _select(c: RespConnection, cmd: Command) -> object:
    if _int(cmd[1]) != 0:
        return ErrorReply("ERR DB index is out of range")
    return OK


@_command(
    "subscribe",
    -2,
    ("pubsub", "noscript", "loading", "stale"),
    (0, 0, 0),
    "pubsub",
    "Listen for messages on channels (kvcache:epochs: the tenant's epoch bumps).",
)
async def _subscribe(c: RespConnection, cmd: Command) -> object:
    frames: list[Buffer] = []
    for raw in cmd[1:]:
        channel = bytes(raw)
        if channel not in c.channels and len(c.channels) >= _MAX_CHANNELS:
            return ErrorReply(f"ERR at most {_MAX_CHANNELS} channels per connection")
        c.channels[channel] = None
        frames += _push([b"subscribe", channel, len(c.channels)], c.protocol_version)
    c.sync_subscription()
    return _Frames(frames)


@_command(
    "unsubscribe",
    -1,
    ("pubsub", "noscript", "loading", "stale"),
    (0, 0, 0),
    "pubsub",
    "Stop listening on the given channels, or on all of them.",
)
async def _unsubscribe(c: RespConnection, cmd: Command) -> object:
    targets = [bytes(a) for a in cmd[1:]] if len(cmd) > 1 else list(c.channels)
    if not targets:
        return _Frames(_push([b"unsubscribe", None, 0], c.protocol_version))
    frames: list[Buffer] = []
    for channel in targets:
        c.channels.pop(channel, None)
        frames += _push([b"unsubscribe", channel, len(c.channels)], c.protocol_version)
    c.sync_subscription()
    return _Frames(frames)


@_command(
    "reset",
    1,
    ("fast", "stale", "no-auth"),
    (0, 0, 0),
    "connection",
    "Reset the connection: RESP2, no name, unauthenticated.",
    no_auth=True,
)
async def _reset(c: RespConnection, cmd: Command) -> object:
    c.channels.clear()
    c.sync_subscription()
    c.protocol_version = 2
    c.name = None
    c.identity = None
    c._parser.authenticated = False
    c.arm_auth_deadline()
    return SimpleString("RESET")


@_command(
    "client", -2, ("stale",), (0, 0, 0), "connection", "CLIENT SETNAME | GETNAME | ID | SETINFO."
)
async def _client(c: RespConnection, cmd: Command) -> object:
    sub = bytes(cmd[1]).upper()
    if sub == b"SETNAME" and len(cmd) == 3:
        c.name = _valid_client_name(cmd[2]) or None
        return OK
    if sub == b"GETNAME" and len(cmd) == 2:
        return c.name
    if sub == b"ID" and len(cmd) == 2:
        return c.client_id
    if sub == b"SETINFO" and len(cmd) == 4:
        attr = bytes(cmd[2]).upper()
        value = _valid_client_name(cmd[3]) if cmd[3] else ""
        if attr == b"LIB-NAME":
            c.lib_name = value or None
        elif attr == b"LIB-VER":
            c.lib_version = value or None
        else:
            return ErrorReply(f"ERR Unrecognized option '{_text(cmd[2])}'")
        return OK
    if sub in (b"SETNAME", b"GETNAME", b"ID", b"SETINFO"):
        return ErrorReply(
            f"ERR wrong number of arguments for 'client|{sub.decode().lower()}' command"
        )
    return _unknown_subcommand(cmd[1], "CLIENT")


# -- key commands ---------------------------------------------------------------------------


@_blocking_command("get", 2, ("readonly", "fast"), (1, 1, 1), "string", "Get the value of a key.")
def _get(c: RespConnection, cmd: Command) -> object:
    return c._call(c._ctx.store.get, c.namespace, _key(cmd[1]))


@_blocking_command(
    "set",
    -3,
    ("write", "denyoom"),
    (1, 1, 1),
    "string",
    "Set a key (first write wins: an existing key keeps its bytes).",
)
def _set(c: RespConnection, cmd: Command) -> object:
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
            if _int(cmd[i + 1]) <= 0:
                return ErrorReply("ERR invalid expire time in 'set' command")
            ttl = True
            i += 1
        else:
            return SYNTAX_ERROR
        i += 1
    if ttl:
        return _TTL_UNSUPPORTED
    store = c._ctx.store
    ns = c.namespace
    key = _key(cmd[1])
    old: Buffer | None = None
    if get:
        old = c._call(store.get, ns, key)
    ok_reply: object = old if get else OK
    cond: PutCond = "nx" if nx else "xx" if xx else None
    put = store.put if cond is None else functools.partial(store.put, cond=cond)
    result = c._call(put, ns, key, cmd[2])
    if not result.applied:
        return old if get else None
    return ok_reply


@_blocking_command(
    "mget", -2, ("readonly", "fast"), (1, -1, 1), "string", "Get the values of keys."
)
def _mget(c: RespConnection, cmd: Command) -> object:
    keys = [_key(k) for k in cmd[1:]]
    return c._call(c._ctx.store.get_many, c.namespace, keys)


@_blocking_command(
    "mset",
    -3,
    ("write", "denyoom"),
    (1, -1, 2),
    "string",
    "Set several keys (first write wins per key).",
)
def _mset(c: RespConnection, cmd: Command) -> object:
    if len(cmd) % 2 == 0:
        return _wrong_args("mset")
    items = [(_key(cmd[i]), cmd[i + 1]) for i in range(1, len(cmd), 2)]
    c._call(c._ctx.store.put_many, c.namespace, items)
    return OK


@_blocking_command(
    "exists", -2, ("readonly", "fast"), (1, -1, 1), "keyspace", "Count how many of the keys exist."
)
def _exists(c: RespConnection, cmd: Command) -> object:
    keys = [_key(k) for k in cmd[1:]]
    return sum(c._call(c._ctx.store.exists_many, c.namespace, keys))


def _delete(c: RespConnection, cmd: Command) -> object:
    keys = [_key(k) for k in cmd[1:]]
    return sum(c._call(c._ctx.store.delete_many, c.namespace, keys))


_blocking_command("del", -2, ("write",), (1, -1, 1), "keyspace", "Delete keys.")(_delete)
_blocking_command("unlink", -2, ("write", "fast"), (1, -1, 1), "keyspace", "Delete keys.")(_delete)


@_blocking_command("strlen", 2, ("readonly", "fast"), (1, 1, 1), "string", "Length of a value.")
def _strlen(c: RespConnection, cmd: Command) -> object:
    size = c._call(c._ctx.store.size, c.namespace, _key(cmd[1]))
    return size or 0


@_blocking_command(
    "dbsize",
    1,
    ("readonly", "fast"),
    (0, 0, 0),
    "server",
    "Number of keys in the caller's namespace.",
)
def _dbsize(c: RespConnection, cmd: Command) -> object:
    return c._call(c._ctx.store.count, c.namespace)


@_blocking_command(
    "scan",
    -2,
    ("readonly",),
    (0, 0, 0),
    "keyspace",
    "Iterate the caller's keys (cursor, MATCH, COUNT, TYPE).",
)
def _scan(c: RespConnection, cmd: Command) -> object:
    invalid_cursor = ErrorReply("ERR invalid cursor")
    cursor = _int(cmd[1], invalid_cursor)
    count = _SCAN_DEFAULT_COUNT
    match: Glob | None = None
    only_strings = True
    i = 2
    while i < len(cmd):
        opt = bytes(cmd[i]).upper()
        if i + 1 >= len(cmd):
            return SYNTAX_ERROR
        if opt == b"COUNT":
            count = _int(cmd[i + 1])
            if count < 1:
                return SYNTAX_ERROR
        elif opt == b"MATCH":
            match = _glob(cmd[i + 1])
        elif opt == b"TYPE":
            only_strings = bytes(cmd[i + 1]).lower() == b"string"
        else:
            return SYNTAX_ERROR
        i += 2
    ns = c.namespace
    after: str | None = None
    if cursor != 0:
        after = c._listener.cursor_position(ns, cursor)
        if after is None:
            return invalid_cursor
    limit = min(count, _SCAN_MAX_COUNT)
    keys: list[str] = c._call(_scan_page, c._ctx.store, ns, after, limit)
    more = len(keys) == limit
    encoded = [k.encode("utf-8") for k in keys] if only_strings else []
    if match is not None:
        matched: list[bytes] = []
        spent = 0
        for i, k in enumerate(encoded):
            if i and spent >= _SCAN_MATCH_BUDGET:  # bounded work per call: resume later
                keys, more = keys[:i], True
                break
            spent += match.cost(len(k))
            if match.match(k):
                matched.append(k)
        encoded = matched
    next_cursor = c._listener.new_cursor(ns, keys[-1]) if more else 0
    return [str(next_cursor), encoded]


def _glob(pattern: Buffer) -> Glob:
    try:
        return Glob(bytes(pattern))
    except RemoteProtocolError as exc:
        raise _Reply(ErrorReply(f"ERR {exc}")) from None


def _scan_page(store: SharedKvBackend, ns: str, after: str | None, limit: int) -> list[str]:
    return store.keys(ns, after=after, limit=limit)


# -- server commands ------------------------------------------------------------------------

_INFO_DEFAULT: Final = ("server", "clients", "persistence", "stats", "kvcache", "keyspace")


@_blocking_command(
    "info",
    -1,
    ("loading", "stale"),
    (0, 0, 0),
    "server",
    "Server information and the caller's namespace stats.",
)
def _info(c: RespConnection, cmd: Command) -> object:
    wanted = {bytes(a).decode("ascii", "replace").lower() for a in cmd[1:]}
    if not wanted or wanted & {"all", "default", "everything"}:
        wanted = set(_INFO_DEFAULT)
    stats = c._call(c._ctx.store.stats, c.namespace)
    nkeys = c._call(c._ctx.store.count, c.namespace)
    ctx, lst = c._ctx, c._listener
    sections: list[tuple[str, list[tuple[str, object]]]] = [
        (
            "server",
            [
                ("redis_version", REDIS_COMPAT_VERSION),
                ("redis_mode", "standalone"),
                ("server_name", "epistemic-kvcache"),
                ("kvcache_version", lst.version),
                ("arch_bits", 64),
                ("uptime_in_seconds", int(time.monotonic() - lst.started)),
                ("resp_protocols", "2,3"),
            ],
        ),
        (
            "clients",
            [
                # the server-wide connection count would tell one tenant about the
                # others' traffic, so INFO reports only the limit
                ("maxclients", ctx.limits.max_connections),
            ],
        ),
        (
            "persistence",
            [
                ("loading", 0),
                ("aof_enabled", int(lst.durable)),
                ("rdb_changes_since_last_save", 0),
            ],
        ),
        (
            "stats",
            [
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
    sections.append(("kvcache", kv))
    sections.append(("keyspace", [("db0", f"keys={nkeys},expires=0,avg_ttl=0")]))
    lines: list[str] = []
    for title, fields in sections:
        if title not in wanted:
            continue
        if lines:
            lines.append("")
        lines.append(f"# {title.capitalize()}")
        lines.extend(f"{k}:{v}" for k, v in fields)
    text = "\r\n".join(lines) + ("\r\n" if lines else "")
    return Verbatim(text) if c.protocol_version == 3 else text.encode("utf-8")


def _config_table(c: RespConnection) -> dict[str, str]:
    limits = c._ctx.limits
    durable = c._listener.durable
    return {
        "save": "",
        "appendonly": "yes" if durable else "no",
        "appendfsync": "always" if durable else "no",
        "databases": "1",
        "maxclients": str(limits.max_connections),
        "proto-max-bulk-len": str(limits.max_block_bytes),
        "timeout": str(int(limits.idle_timeout_s)),
        "maxmemory": "0",
        "maxmemory-policy": "allkeys-lru",
    }


@_command(
    "config",
    -2,
    ("admin", "noscript", "loading", "stale"),
    (0, 0, 0),
    "server",
    "CONFIG GET: the Redis settings clients look at, answered truthfully.",
)
async def _config(c: RespConnection, cmd: Command) -> object:
    if bytes(cmd[1]).upper() != b"GET":
        return _unknown_subcommand(cmd[1], "CONFIG")
    if len(cmd) < 3:
        return ErrorReply("ERR wrong number of arguments for 'config|get' command")
    table = _config_table(c)
    out: dict[str, str] = {}
    for pattern in cmd[2:]:
        glob = _glob(bytes(pattern).lower())
        for name, value in table.items():
            if glob.match(name.encode()):
                out[name] = value
    return out


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


@_command(
    "command",
    -1,
    ("loading", "stale"),
    (0, 0, 0),
    "server",
    "COMMAND, COMMAND COUNT | LIST | INFO | DOCS.",
)
async def _command_cmd(c: RespConnection, cmd: Command) -> object:
    if len(cmd) == 1:
        return [_command_info(s) for s in COMMANDS.values()]
    sub = bytes(cmd[1]).upper()
    if sub == b"COUNT" and len(cmd) == 2:
        return len(COMMANDS)
    if sub == b"LIST" and len(cmd) == 2:
        return [s.name for s in COMMANDS.values()]
    if sub == b"INFO":
        specs = _lookup_specs(cmd[2:]) if len(cmd) > 2 else list(COMMANDS.values())
        return [_command_info(s) if s is not None else None for s in specs]
    if sub == b"DOCS":
        specs = _lookup_specs(cmd[2:]) if len(cmd) > 2 else list(COMMANDS.values())
        return {s.name: _command_docs(s) for s in specs if s is not None}
    return _unknown_subcommand(cmd[1], "COMMAND")
