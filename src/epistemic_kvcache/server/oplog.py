"""What the operator sees in the log: failed logins, an optional access log, JSON lines.

- `AuthFailureLog`: every failed authentication is logged at WARNING with the wire, the
  peer address and the reason (never the credential), at most `burst` lines per
  `window_s`; the rest are counted and summarised in one line when the window ends,
  so a password-guessing flood cannot flood the log. Clients get a generic answer.
- `RefusalLog`: the same for connections refused or closed at a limit (slots, memory
  shares, query and output buffers), on the logger `epistemic_kvcache.limits`.
- `AccessLog`: with `--access-log`, one INFO line per answered request on the logger
  `epistemic_kvcache.access`: wire, peer, tenant, request, status, bytes and duration.
- `JsonFormatter`: `--log-format json` writes each record as one JSON object per line
  (`ts`, `level`, `logger`, `msg`, and the fields a record carries in `extra`).
- `TextFormatter`: the text format (the default). Log lines carry what clients sent
  (tenant names from JWT claims, keys, request targets, command names, reasons quoting
  them): a CR or LF among them would write a forged record into the log. Every
  control character (and line or paragraph separator) of a message is written as an
  escape (`\\r`, `\\n`, `\\t`, `\\x1b`, `\\u2028`), so one record is one line; traceback
  lines are indented, so a line that starts at column 0 is always a record's first.
  `AccessLog` and the rate-limited logs also escape their fields themselves, for
  embedders who install their own formatter. JSON escapes them by construction.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any, Final

AUTH_LOG: Final = logging.getLogger("epistemic_kvcache.auth")
ACCESS_LOG: Final = logging.getLogger("epistemic_kvcache.access")
LIMIT_LOG: Final = logging.getLogger("epistemic_kvcache.limits")

_STD_ATTRS: Final = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}

UNSAFE_TEXT: Final = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
"""Characters that end, rewrite or hide a log line: C0 and C1 controls (CR, LF, NEL,
ESC...), DEL, and the Unicode line and paragraph separators."""
_NAMED: Final = {"\r": "\\r", "\n": "\\n", "\t": "\\t"}


def _escaped(match: re.Match[str]) -> str:
    c = match.group()
    named = _NAMED.get(c)
    if named is not None:
        return named
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def escape_text(text: str) -> str:
    """`text` with every control character or line separator written as an escape
    (`\\r`, `\\n`, `\\t`, `\\xNN`, `\\uNNNN`): safe to put in one line of a text log.
    Printable text, backslashes included, is kept as it is (so escaping is idempotent)."""
    if UNSAFE_TEXT.search(text) is None:
        return text
    return UNSAFE_TEXT.sub(_escaped, text)


def _field(value: str | None) -> str:
    return "-" if value is None else escape_text(value)


class RateLimitedLog:
    """WARNING lines about what clients do wrong, at most `burst` per `window_s`; the
    rest are counted and summarised in one line when the window ends, so a flood of
    bad clients cannot flood the log. Thread-safe: every event loop of a server shares
    one (a lock around the count)."""

    def __init__(
        self,
        logger: logging.Logger,
        event: str,
        one: str,
        many: str,
        burst: int = 20,
        window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self._clock = clock  # tests pass a fake clock they advance
        self.event = event
        self.one = one
        self.what = many
        self.burst = burst
        self.window_s = window_s
        self.total = 0
        self._window_start = 0.0
        self._in_window = 0
        self._suppressed = 0
        self._lock = threading.Lock()

    def note(self, wire: str, peer: str, reason: str) -> None:
        """Log (or count) one occurrence. `peer`: the client's `host:port`."""
        with self._lock:
            self._note(wire, peer, reason)

    def _note(self, wire: str, peer: str, reason: str) -> None:
        self.total += 1
        now = self._clock()
        if now - self._window_start >= self.window_s:
            if self._suppressed:
                self.logger.warning(
                    "%d more %s not logged in the last %.0fs",
                    self._suppressed,
                    self.what,
                    now - self._window_start,
                    extra={"event": self.event + "_suppressed", "count": self._suppressed},
                )
            self._window_start = now
            self._in_window = 0
            self._suppressed = 0
        if self._in_window >= self.burst:
            self._suppressed += 1
            return
        self._in_window += 1
        self.logger.warning(
            "%s wire=%s peer=%s reason=%s",
            self.one,
            wire,
            escape_text(peer),
            escape_text(reason),
            extra={"event": self.event, "wire": wire, "peer": peer, "reason": reason},
        )


class AuthFailureLog(RateLimitedLog):
    """Failed authentications: wire, peer address and port, and reason (never the
    credential). Counted per wire in `by_wire` (`kvcache_auth_failures_total`): a bad
    credential on either wire, an HTTP request without one, and a RESP command refused
    with NOAUTH."""

    def __init__(
        self,
        burst: int = 20,
        window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            AUTH_LOG,
            "auth_failed",
            "authentication failed",
            "failed authentications",
            burst,
            window_s,
            clock,
        )
        self.by_wire: dict[str, int] = {}
        """Failures per wire since start (never reset)."""

    def failed(self, wire: str, peer: str, reason: str) -> None:
        with self._lock:
            self.by_wire[wire] = self.by_wire.get(wire, 0) + 1
            self._note(wire, peer, reason)


def peer_address(transport: object) -> str:
    """`host:port` of a transport's peer, as the auth-failure lines name it (`?` when
    unknown, e.g. a unix socket)."""
    get = getattr(transport, "get_extra_info", None)
    name = get("peername") if get is not None else None
    if isinstance(name, tuple) and len(name) >= 2:
        return f"{name[0]}:{name[1]}"
    return "?"


class RefusalLog(RateLimitedLog):
    """Connections refused or closed for a limit (slots, memory shares, buffers)."""

    def __init__(self, burst: int = 20, window_s: float = 10.0) -> None:
        super().__init__(
            LIMIT_LOG, "refused", "client refused at a limit", "refusals", burst, window_s
        )


class AccessLog:
    """One line per answered request when enabled (`--access-log`)."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled

    def record(
        self,
        wire: str,
        peer: str,
        tenant: str | None,
        request: str,
        status: str,
        bytes_in: int,
        bytes_out: int,
        seconds: float,
    ) -> None:
        ACCESS_LOG.info(
            "%s %s %s %r %s in=%d out=%d %.3fms",
            wire,
            _field(peer),
            _field(tenant),
            request,
            status,
            bytes_in,
            bytes_out,
            seconds * 1000,
            extra={
                "event": "access",
                "wire": wire,
                "peer": peer,
                "tenant": tenant,
                "request": request,
                "status": status,
                "bytes_in": bytes_in,
                "bytes_out": bytes_out,
                "duration_ms": round(seconds * 1000, 3),
            },
        )


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (RFC 3339, UTC), level, logger, msg, extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for name, value in vars(record).items():
            if name not in _STD_ATTRS and not name.startswith("_"):
                doc[name] = (
                    value if isinstance(value, str | int | float | bool | None) else str(value)
                )
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """The text log format: one record, one line, whatever its values hold.

    The message (template and values) has its control characters escaped
    (`escape_text`); a traceback or stack keeps its line breaks but every line of it is
    indented and escaped, so no text in it can pass for a record of its own."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        safe = escape_text(message)
        if safe is not message:
            record = logging.makeLogRecord(vars(record))
            record.msg, record.args = safe, None
        return super().format(record)

    def formatException(self, ei: Any) -> str:
        return _indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _indented(super().formatStack(stack_info))


def _indented(text: str) -> str:
    return "\n".join("    " + escape_text(line) for line in text.split("\n"))


__all__ = [
    "ACCESS_LOG",
    "AUTH_LOG",
    "LIMIT_LOG",
    "UNSAFE_TEXT",
    "AccessLog",
    "AuthFailureLog",
    "JsonFormatter",
    "RateLimitedLog",
    "RefusalLog",
    "TextFormatter",
    "escape_text",
    "peer_address",
]
