"""`EpistemicGraphKVBackend`: the synchronous HTTP client of the `/kv` API.

How it works:
- One urllib3 connection pool per client (keep-alive, `max_connections` sockets, blocking
  when all are busy); the pool is thread-safe, so one client serves every thread.
- A transport failure (refused, reset, timeout, 5xx/429/408) never raises: reads become
  misses, writes fail (`PutOutcome.FAILED`, False), the failure is counted and logged
  (rate-limited, since an unreachable cache would otherwise log once per prompt chunk).
  A connection reset is retried once only for a request that is safe to repeat
  (`RETRY_ON_RESET`: reads, and PUTs that replace a key's bytes); a snapshot, fork, epoch
  bump, DELETE or conditional PUT is never sent twice, since the first may have been
  applied.
- Error answers are read through the one error table (`proto.errors.client_rule`): each
  JSON error code says whether to raise, degrade, split a batch, or report a write whose
  outcome is unknown (`PutOutcome.UNKNOWN`, `OutcomeUnknownError`).
- Two timeouts: lookups (HEAD, batch exists) wait `lookup_timeout_s` (1 s), transfers
  `read_timeout_s` (2 s) for the next byte. A timeout or a refused connection opens a
  circuit breaker (`client.breaker`): every request is then answered at once without
  the network while a background probe (`GET /healthz`) waits for the server to answer
  again, so a stalled server costs one timeout, not one per prompt chunk.
- 401/403, a TLS peer that fails verification and a malformed request raise: retrying
  cannot fix them and silently missing would hide a broken deployment.
- `get_into` / `get_many_into` read bodies straight from the socket into the caller's
  buffer (`http.client.HTTPResponse.readinto`, no intermediate `bytes`). A block whose
  size differs from the buffer is a miss: a half-filled buffer is never reported loaded.
- Keys travel as one percent-encoded path segment (`proto.http.quote_key`, which encodes a
  letter of keys that collide with route names such as `stats` or `snapshot`, so the
  server reads them as keys; old servers decode them the same way).
"""

from __future__ import annotations

import contextlib
import enum
import http.client
import json
import logging
import math
import socket
import ssl
import struct
import threading
import time
import urllib.parse
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import fields
from typing import Any, Final, Literal, Self

import urllib3
import urllib3.exceptions

from epistemic_kvcache.client.breaker import CircuitBreaker
from epistemic_kvcache.client.config import KvCacheConfig
from epistemic_kvcache.client.stats import ClientCounters, KvCacheStats
from epistemic_kvcache.errors import (
    AuthError,
    ConfigurationError,
    KvCacheError,
    LocalProtocolError,
    OutcomeUnknownError,
    ProtocolError,
    RemoteProtocolError,
)
from epistemic_kvcache.graph import Edge, PageInResult
from epistemic_kvcache.proto.errors import client_rule
from epistemic_kvcache.proto.http import encode_batch_put_request, quote_key
from epistemic_kvcache.shared import (
    DEFAULT_LIMITS,
    RESERVED_SEGMENTS,
    BranchInfo,
    SnapshotInfo,
    validate_key,
)

log = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview

BATCH_CONTENT_TYPE = "application/x-kvcache-batch"
MAX_BATCH_KEYS = DEFAULT_LIMITS.max_batch_keys
"""Server default `max_batch_keys`; larger batches are split."""
MAX_BATCH_PUT_BYTES = DEFAULT_LIMITS.max_batch_bytes
"""Split batch PUT bodies, and batch GETs into caller buffers, at this many block bytes
(the server's default `max_batch_bytes`; a larger batch is refused with 413)."""
_SKIP_CHUNK = 1024 * 1024
_LOG_INTERVAL_S = 10.0
_U32 = struct.Struct(">I")


class PutOutcome(enum.Enum):
    """What one `put` did (the server's `X-Kv-Outcome` / batch result words).

    Truthy exactly when the server holds the given bytes under the key afterwards
    (`NEW`, `DUPLICATE`, `REPLACED`), so `if kv.put(k, b):` reads naturally.
    """

    NEW = "created"
    """The key did not exist; it was created."""
    DUPLICATE = "duplicate"
    """The key already held exactly these bytes; nothing was written."""
    REPLACED = "replaced"
    """The key held other bytes; they were replaced."""
    CONFLICT = "conflict"
    """Refused: the key exists with other bytes and the server keeps the first write
    (a first-write-wins tenant, or an `nx` condition)."""
    MISSING = "missing"
    """Refused: an `xx` condition and the key does not exist."""
    FAILED = "failed"
    """Not stored: unreachable or failing server, block refused (too large, quota)."""
    UNKNOWN = "unknown"
    """The server could not say whether the write was applied (cluster mode: the shared
    cluster did not confirm it, HTTP 503 `outcome_unknown`); read the key back."""

    @property
    def stored(self) -> bool:
        """True when the server holds these bytes under the key."""
        return self in _STORED

    def __bool__(self) -> bool:
        return self in _STORED

    @classmethod
    def from_word(cls, word: object) -> PutOutcome:
        """The outcome named by a server result word; `error:<code>` is UNKNOWN when the
        error table says such a write may have been applied, else (and for words it
        does not know) FAILED."""
        for member in cls:
            if member.value == word:
                return member
        if (
            isinstance(word, str)
            and word.startswith("error:")
            and client_rule(500, word[6:]).action == "unknown"
        ):
            return cls.UNKNOWN
        return cls.FAILED


_STORED = frozenset({PutOutcome.NEW, PutOutcome.DUPLICATE, PutOutcome.REPLACED})


RETRY_ON_RESET: Final[dict[str, bool]] = {
    # reads: repeating them changes nothing
    "GET": True,
    "HEAD": True,
    "stats": True,
    "connection check": True,
    "healthz": True,
    "snapshot probe": True,
    "batch exists": True,
    "batch get": True,
    "snapshot info": True,
    "branch info": True,
    "snapshots": True,
    "branches": True,
    "epoch": True,
    "list keys": True,
    # a plain PUT replaces the key's bytes with the same bytes: applied once or twice,
    # the key holds them (a second application answers "duplicate"); a batch PUT is such
    # PUTs; page-in only promotes blocks to RAM
    "PUT": True,
    "batch put": True,
    "page-in": True,
    # not safe to send twice once the first may have been applied
    "conditional PUT": False,  # another writer may act between the two (NX recreates)
    "epoch-tagged PUT": False,  # a bump between the two tags the retry with a new epoch
    "DELETE": False,  # a key recreated between the two would be deleted again
    "snapshot": False,  # a second snapshot
    "fork": False,  # a second branch
    "epoch bump": False,  # a double bump
    "branch PUT": False,
    "snapshot delete": False,
    "branch delete": False,
}
"""Which requests are sent a second time when the connection is reset (by `what`, the
request's name in logs); a name not listed is not retried. docs/client.md explains it."""


class _TransportFailure(Exception):
    """Internal: a request failed in a way that degrades to a miss. `outcome_unknown`:
    a write may have been applied (the server said so, or the connection broke after
    the request went out and it was not safe to repeat)."""

    def __init__(self, message: str, *, outcome_unknown: bool = False) -> None:
        super().__init__(message)
        self.outcome_unknown = outcome_unknown


class _BatchTooLarge(_TransportFailure):
    """Internal: the server refused a batch answer over its `max_batch_bytes` (413)."""


class KvCacheUnavailableError(KvCacheError):
    """The server could not be reached (or answered 5xx/429/408).

    Raised only by calls whose silent failure would mislead the caller (`epoch_bump`,
    `epoch_get`, `list_keys`, `list_snapshots`, `list_branches`); the data-path calls
    degrade to a miss / False instead. Retrying later may help.
    """


class KvCacheOutcomeUnknownError(KvCacheUnavailableError, OutcomeUnknownError):
    """A request that is not safe to repeat (`snapshot`, `fork`, `epoch_bump`) may or may
    not have been applied: the connection broke after it was sent, or the server said
    it cannot tell (cluster mode, `outcome_unknown`). It was not retried; look before
    repeating it (`list_snapshots`, `list_branches`, `epoch_get`)."""


def _fields_of(doc: object, names: Sequence[str], what: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise RemoteProtocolError(f"{what}: expected a JSON object")
    try:
        return {name: doc[name] for name in names}
    except KeyError as exc:
        raise RemoteProtocolError(f"{what}: answer lacks {exc}") from exc


_SNAPSHOT_FIELDS = tuple(f.name for f in fields(SnapshotInfo))
_BRANCH_FIELDS = tuple(f.name for f in fields(BranchInfo))


def _byte_bounded_chunks(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """[start, stop) ranges of at most `MAX_BATCH_KEYS` items and `MAX_BATCH_PUT_BYTES`
    bytes each (a single larger item gets a range of its own)."""
    ranges: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, n in enumerate(sizes):
        if i > start and (i - start >= MAX_BATCH_KEYS or total + n > MAX_BATCH_PUT_BYTES):
            ranges.append((start, i))
            start, total = i, 0
        total += n
    if start < len(sizes):
        ranges.append((start, len(sizes)))
    return ranges


def _as_byte_view(buffer: Any) -> memoryview:
    """A writable, flat, unsigned-byte view of `buffer` (TypeError otherwise)."""
    mv = memoryview(buffer)
    if mv.readonly:
        raise TypeError("get_into needs a writable buffer")
    if not mv.c_contiguous:
        raise TypeError("get_into needs a C-contiguous buffer")
    # '<B' (ctypes arrays, LMCache's MemoryObj.byte_array), typed or n-dim arrays.
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _as_bytes_view(data: Any) -> memoryview:
    """A flat, unsigned-byte (read-only use) view of `data`."""
    mv = memoryview(data)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _tracked(base: type[Any], live: weakref.WeakSet[Any], aborted: threading.Event) -> type[Any]:
    """`base` (a urllib3 connection class) that records each connected instance in
    `live`, so `abort` can shut their sockets down (and cuts any that connects after)."""

    def connect(self: Any) -> None:
        base.connect(self)
        live.add(self)
        if aborted.is_set():
            _cut(self)

    return type(f"Tracked{base.__name__}", (base,), {"connect": connect})


def _cut(conn: Any) -> None:
    """Shut a connection's socket down: a thread blocked on it wakes with an error."""
    sock = getattr(conn, "sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _pool_wait(timeout: urllib3.Timeout) -> int:
    """Seconds to wait for a free pooled connection: the request's own read timeout."""
    return max(1, math.ceil(timeout.read_timeout or 1))


def _block_view(key: str, data: Any) -> memoryview:
    """The block to store as bytes; TypeError (naming the key) for None and non-buffers."""
    if data is None:
        raise TypeError(
            f"put({key!r}, None): a block must be a bytes-like object; use delete() to remove a key"
        )
    try:
        return _as_bytes_view(data)
    except TypeError as exc:
        raise TypeError(
            f"put({key!r}, ...): a block must be a bytes-like object "
            f"(bytes, bytearray, memoryview, array), not {type(data).__name__}"
        ) from exc


class EpistemicGraphKVBackend:
    """Thread-safe client of one epistemic-kvcache server.

    `get(key) -> bytes | None` and `put(key, data) -> PutOutcome` (truthy when stored)
    are the seam other code plugs into; transport failures are a miss / a falsy outcome,
    never an exception.
    """

    def __init__(self, config: KvCacheConfig | None = None, **overrides: Any) -> None:
        if config is not None and not isinstance(config, KvCacheConfig):
            hint = (
                f"EpistemicGraphKVBackend(base_url={config!r}, token=...)"
                if isinstance(config, str)
                else "EpistemicGraphKVBackend(KvCacheConfig(...)) or keyword settings"
            )
            raise TypeError(
                "EpistemicGraphKVBackend takes a KvCacheConfig or keyword settings, "
                f"not a positional {type(config).__name__}; use {hint}"
            )
        if config is None:
            config = KvCacheConfig(**overrides) if overrides else KvCacheConfig()
        elif overrides:
            config = config.with_overrides(**overrides)
        self.config = config
        self._prefix = config.path_prefix
        headers = {"User-Agent": "epistemic-kvcache-client/0.1", "Accept-Encoding": "identity"}
        if config.token:
            headers["Authorization"] = f"Bearer {config.token}"
        self._headers = headers
        timeout = urllib3.Timeout(connect=config.connect_timeout_s, read=config.read_timeout_s)
        self._transfer_timeout = timeout
        self._lookup_timeout = urllib3.Timeout(
            connect=min(config.connect_timeout_s, config.lookup_timeout_s),
            read=config.lookup_timeout_s,
        )
        self._pool: urllib3.HTTPConnectionPool
        if config.scheme == "https":
            self._pool = urllib3.HTTPSConnectionPool(
                config.host,
                config.port,
                maxsize=config.max_connections,
                block=True,
                timeout=timeout,
                retries=False,
                ssl_context=self._ssl_context(config),
            )
        else:
            self._pool = urllib3.HTTPConnectionPool(
                config.host,
                config.port,
                maxsize=config.max_connections,
                block=True,
                timeout=timeout,
                retries=False,
            )
        self._live: weakref.WeakSet[Any] = weakref.WeakSet()
        self._aborted = threading.Event()
        self._pool.ConnectionCls = _tracked(self._pool.ConnectionCls, self._live, self._aborted)
        self._lock = threading.Lock()
        self._counts = {f.name: 0 for f in fields(ClientCounters)}
        self._last_log: dict[str, float] = {}
        self._closed = False
        self._breaker: CircuitBreaker | None = None
        if config.breaker_max_backoff_s > 0:
            self._breaker = CircuitBreaker(
                self._probe,
                backoff_s=min(0.5, config.breaker_max_backoff_s),
                max_backoff_s=config.breaker_max_backoff_s,
                name=f"kv-cache {config.base_url}",
            )

    @staticmethod
    def _ssl_context(config: KvCacheConfig) -> ssl.SSLContext:
        """Verification always on; trust roots and client identity from the config."""
        try:
            if config.ca_file or config.ca_dir:
                ctx = ssl.create_default_context(cafile=config.ca_file, capath=config.ca_dir)
            else:
                ctx = ssl.create_default_context()
            if config.client_cert:
                ctx.load_cert_chain(config.client_cert, config.client_key)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigurationError(f"invalid TLS settings: {exc}") from exc
        ctx.check_hostname = True
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    # -- construction / lifetime ------------------------------------------------------
    @classmethod
    def from_env(cls, **overrides: Any) -> EpistemicGraphKVBackend:
        """A client configured by `KvCacheConfig.from_env(**overrides)`."""
        return cls(KvCacheConfig.from_env(**overrides))

    def close(self) -> None:
        """Close every idle pooled connection and stop the breaker's probe. Idempotent.

        Returns within about `lookup_timeout_s` (a probe in flight); requests still
        running in other threads end within their own timeouts."""
        self._closed = True
        if self._breaker is not None:
            self._breaker.shutdown(self.config.lookup_timeout_s + 1.0)
        self._pool.close()

    def abort(self) -> None:
        """Close, and cut every connection a request is using right now: requests in
        other threads fail at once (a miss / FAILED) instead of waiting for their
        timeouts. For shutting down under a stalled server. Idempotent."""
        self._closed = True
        self._aborted.set()  # connections made from now on are cut as they connect
        self._pool.close()  # no new connections for retries
        for conn in list(self._live):
            _cut(conn)
        self.close()

    @property
    def breaker(self) -> CircuitBreaker | None:
        """The circuit breaker (None when `breaker_max_backoff_s` is 0)."""
        return self._breaker

    def check_connection(self) -> None:
        """Make one authenticated request (`GET /kv/stats`, lookup timeout): return when
        the server answers and accepts the token.

        Raises `KvCacheUnavailableError` (unreachable, stalled, 5xx), `AuthError` (401:
        token missing or wrong), `ForbiddenError` (403) or `ConfigurationError` (TLS).
        Used by the LMCache plugins at start-up, so a wrong deployment fails once, clearly.
        """
        try:
            resp = self._request(
                "GET", f"{self._prefix}/kv/stats", what="connection check", lookup=True
            )
        except _TransportFailure as exc:
            raise KvCacheUnavailableError(
                f"kv-cache server at {self.config.base_url} is not answering: {exc}"
            ) from exc
        resp.release_conn()
        if resp.status == 404:
            raise LocalProtocolError(
                f"{self.config.base_url} answered 404 for /kv/stats: not an epistemic-kvcache "
                "server, or the wrong URL path prefix",
                status_hint=404,
            )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EpistemicGraphKVBackend({self.config.base_url!r})"

    # -- counters / logging -----------------------------------------------------------
    def counters(self) -> ClientCounters:
        """A snapshot of this client's counters."""
        with self._lock:
            return ClientCounters(**self._counts)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def _degraded(self, kind: str, what: str, detail: object) -> None:
        """Log a degraded operation: WARNING at most every 10 s per kind, else DEBUG."""
        now = time.monotonic()
        with self._lock:
            last = self._last_log.get(kind, -_LOG_INTERVAL_S)
            loud = now - last >= _LOG_INTERVAL_S
            if loud:
                self._last_log[kind] = now
        level = logging.WARNING if loud else logging.DEBUG
        log.log(
            level, "kv-cache %s at %s degraded to a miss: %s", what, self.config.base_url, detail
        )

    # -- request plumbing -------------------------------------------------------------
    def _key_path(self, key: str, suffix: str = "") -> str:
        return f"{self._prefix}/kv/{quote_key(key)}{suffix}"

    def _probe(self) -> bool:
        """The breaker's probe: does the server answer `GET /healthz` at all?"""
        if self._closed:
            return False
        try:
            resp = self._pool.urlopen(
                "GET",
                f"{self._prefix}/healthz",
                headers=self._headers,
                retries=False,
                redirect=False,
                timeout=self._lookup_timeout,
                pool_timeout=_pool_wait(self._lookup_timeout),
                assert_same_host=False,
            )
        except (urllib3.exceptions.HTTPError, OSError):
            return False
        resp.release_conn()
        return True  # any answer, even an error status: the server is there

    def _trip(self, what: str, exc: object) -> None:
        """The server did not answer (timeout, refused, reset): count, log, open."""
        self._count(transport_errors=1)
        self._degraded("transport", what, exc)
        self._open_breaker(f"{what}: {exc}")

    def _open_breaker(self, detail: str) -> None:
        if self._breaker is not None:
            before = self._breaker.trips
            self._breaker.record_failure(detail)
            if self._breaker.trips != before:
                self._count(breaker_trips=1)

    def _request(
        self,
        method: str,
        path: str,
        *,
        body: Buffer | list[Buffer] | None = None,
        headers: dict[str, str] | None = None,
        preload: bool = True,
        what: str,
        lookup: bool = False,
        accept: tuple[int, ...] = (),
    ) -> urllib3.BaseHTTPResponse:
        """Send one request (`lookup`: with the short lookup timeout; `accept`: error
        statuses the caller handles itself).

        Raises `_TransportFailure` (counted) or auth/config errors; fails at once while
        the circuit breaker is open.
        """
        if self._closed:
            raise _TransportFailure("client closed")
        breaker = self._breaker
        if breaker is not None and not breaker.allow():
            self._count(fast_failures=1)
            raise _TransportFailure(
                f"server not answering for {breaker.open_for_s():.1f} s ({breaker.reason})"
            )
        timeout = self._lookup_timeout if lookup else self._transfer_timeout
        all_headers = self._headers if not headers else {**self._headers, **headers}
        sent = 0
        payload: Any = body
        if isinstance(body, bytes):
            sent = len(body)
        elif isinstance(body, list):
            payload = [_as_bytes_view(b) for b in body]
            sent = sum(v.nbytes for v in payload)
        elif body is not None:  # any object with the buffer protocol
            payload = _as_bytes_view(body)
            sent = payload.nbytes
        for attempt in (0, 1):
            try:
                resp = self._pool.urlopen(
                    method,
                    path,
                    body=payload,
                    headers=all_headers,
                    retries=False,
                    redirect=False,
                    preload_content=preload,
                    decode_content=False,
                    timeout=timeout,
                    pool_timeout=_pool_wait(timeout),
                    assert_same_host=False,
                )
            except urllib3.exceptions.SSLError as exc:
                cause = exc.__context__ or exc
                if isinstance(
                    cause, ssl.SSLCertVerificationError
                ) or "CERTIFICATE_VERIFY_FAILED" in str(exc):
                    raise ConfigurationError(
                        f"TLS verification of {self.config.base_url} failed: {exc}; "
                        "check the server certificate and the client's trust roots "
                        "(SSL_CERT_FILE / SSL_CERT_DIR)"
                    ) from exc
                self._count(requests=1)
                self._trip(what, exc)
                raise _TransportFailure(str(exc)) from exc
            except urllib3.exceptions.ProtocolError as exc:
                # Reset / disconnected after the request went out (a kept-alive socket the
                # server closed, or a server that died mid-request): the request may have
                # been applied, so only one that is safe to repeat is sent again. (A read
                # timeout is not retried: it is a ReadTimeoutError, not this.)
                retry = RETRY_ON_RESET.get(what, False)
                if attempt == 0 and retry and not self._closed:
                    continue
                self._count(requests=1)
                self._trip(what, exc)
                raise _TransportFailure(str(exc), outcome_unknown=not retry) from exc
            except urllib3.exceptions.EmptyPoolError as exc:
                # Every pooled connection busy for the whole timeout: our own overload
                # (or requests stuck on a stall that has tripped the breaker already).
                self._count(requests=1, transport_errors=1)
                self._degraded("pool", what, f"no free connection: {exc}")
                raise _TransportFailure(str(exc)) from exc
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                self._count(requests=1)
                self._trip(what, exc)
                raise _TransportFailure(str(exc)) from exc
            self._count(requests=1, bytes_sent=sent)
            if breaker is not None:
                breaker.record_success()
            if resp.status not in accept:
                self._check_status(resp, what)
            return resp
        raise AssertionError("unreachable")  # pragma: no cover

    def _check_status(self, resp: urllib3.BaseHTTPResponse, what: str) -> None:
        """Act on an error answer as the error table says (`proto.errors.client_rule`)."""
        status = resp.status
        if status < 400 or status == 404:
            return
        code, detail = self._error_doc(resp)
        rule = client_rule(status, code)
        text = f"kv-cache {what}: HTTP {status} ({detail})"
        if rule.action == "split" and what == "batch get":
            raise _BatchTooLarge(detail)  # the caller splits the batch
        if rule.action in ("degrade", "unknown"):
            self._count(server_errors=1)
            self._degraded("server", what, f"HTTP {status} {detail}")
            raise _TransportFailure(text, outcome_unknown=rule.applied == "unknown")
        if rule.action in ("refused", "split"):
            # Block too large, no room, quota: the write fails, the caller carries on.
            self._degraded("refused", what, f"HTTP {status} {detail}")
            raise _TransportFailure(text)
        exc = rule.exc
        if issubclass(exc, ProtocolError):  # the server says our request was malformed
            raise LocalProtocolError(text, status_hint=status)
        if exc is AuthError:
            raise AuthError(f"{text}; check the token")
        raise exc(text)

    @staticmethod
    def _error_doc(resp: urllib3.BaseHTTPResponse) -> tuple[str | None, str]:
        """The answer's JSON error code (None when it has none) and a short detail."""
        try:
            data = resp.data if resp.data is not None else b""
        except (urllib3.exceptions.HTTPError, OSError):
            data = b""
        finally:
            resp.release_conn()
        try:
            doc = json.loads(data)
        except ValueError:
            return None, data[:200].decode("utf-8", "replace")
        if isinstance(doc, dict):
            code = doc.get("error")
            detail = f"{code or ''}: {doc.get('message', '')}"
            return (code if isinstance(code, str) else None), detail
        return None, str(doc)[:200]

    @staticmethod
    def _discard(resp: urllib3.BaseHTTPResponse) -> None:
        """Drop a connection whose body we will not read (do not reuse it)."""
        try:
            resp.close()
        finally:
            resp.release_conn()

    @staticmethod
    def _raw(resp: urllib3.BaseHTTPResponse) -> http.client.HTTPResponse:
        fp = getattr(resp, "_fp", None)
        if not isinstance(fp, http.client.HTTPResponse):  # pragma: no cover - urllib3 internals
            raise _TransportFailure("unexpected urllib3 response object")
        return fp

    def _read_exact(self, raw: http.client.HTTPResponse, mv: memoryview) -> None:
        """Fill `mv` completely from the body or raise `_TransportFailure` (which opens
        the breaker: the server stopped sending mid-body)."""
        got = 0
        total = mv.nbytes
        try:
            while got < total:
                n = raw.readinto(mv[got:])
                if not n:
                    raise _TransportFailure(f"body ended after {got} of {total} bytes")
                got += n
        except (OSError, http.client.HTTPException) as exc:
            self._open_breaker(f"reading a body: {exc}")
            raise _TransportFailure(str(exc)) from exc
        except _TransportFailure as exc:
            self._open_breaker(f"reading a body: {exc}")
            raise

    def _skip(self, raw: http.client.HTTPResponse, n: int) -> None:
        scratch = memoryview(bytearray(min(n, _SKIP_CHUNK)))
        while n > 0:
            chunk = scratch[: min(n, len(scratch))]
            self._read_exact(raw, chunk)
            n -= len(chunk)

    # -- single-key operations --------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        """The block stored under `key`, or None (absent, or the server unreachable)."""
        validate_key(key)
        if key in RESERVED_SEGMENTS:
            return self.get_many([key])[0]
        try:
            resp = self._request("GET", self._key_path(key), what="GET")
        except _TransportFailure:
            self._count(misses=1)
            return None
        data = resp.data
        resp.release_conn()
        if resp.status == 404:
            self._count(misses=1)
            return None
        self._count(hits=1, bytes_received=len(data))
        return bytes(data)

    def get_into(self, key: str, buffer: Any, *, exact: bool = True) -> int | None:
        """Read the block straight into `buffer`; return its length, or None on a miss.

        With `exact` (the default) a block whose size differs from `len(buffer)` is a miss
        and the buffer's contents are unspecified. With `exact=False` any block that fits
        is accepted and its length returned.
        """
        validate_key(key)
        mv = _as_byte_view(buffer)
        if key in RESERVED_SEGMENTS:
            return self.get_many_into([key], [mv], exact=exact)[0]
        try:
            resp = self._request("GET", self._key_path(key), preload=False, what="GET")
        except _TransportFailure:
            self._count(misses=1)
            return None
        if resp.status == 404:
            resp.drain_conn()
            resp.release_conn()
            self._count(misses=1)
            return None
        try:
            size = int(resp.headers.get("Content-Length", "-1"))
        except ValueError:
            size = -1
        if size < 0 or size > mv.nbytes or (exact and size != mv.nbytes):
            self._discard(resp)
            self._count(misses=1, size_mismatches=1)
            log.debug("kv-cache GET %r: block is %d bytes, buffer %d", key, size, mv.nbytes)
            return None
        try:
            self._read_exact(self._raw(resp), mv[:size])
        except _TransportFailure as exc:
            self._discard(resp)
            self._count(misses=1, transport_errors=1)
            self._degraded("transport", "GET", exc)
            return None
        resp.release_conn()
        self._count(hits=1, bytes_received=size)
        return size

    def put(
        self,
        key: str,
        data: Any,
        *,
        epoch_scope: str | None = None,
        cond: Literal["nx", "xx"] | None = None,
    ) -> PutOutcome:
        """Store `data` (any bytes-like object) under `key`; what happened as a
        `PutOutcome`, truthy when the server holds these bytes under the key.

        `NEW` (created), `DUPLICATE` (it held exactly these bytes: nothing written),
        `REPLACED` (it held other bytes), `CONFLICT` (refused: the key exists and `cond`
        is "nx", or the tenant keeps first writes), `MISSING` (refused: `cond` "xx" and
        no such key), `FAILED` (unreachable, refused block). `cond`: "nx" creates only
        (`If-None-Match: *`), "xx" replaces only (`If-Match: *`). `None` and other
        non-buffers raise `TypeError`. With `epoch_scope` the entry is tagged with the
        scope's current epoch and reads miss once `epoch_bump(scope)` ran (header
        `X-Kv-Epoch-Scope`; needs a server with the engine routes).
        """
        validate_key(key)
        view = _block_view(key, data)
        headers = {"Content-Type": "application/octet-stream"}
        if cond == "nx":
            headers["If-None-Match"] = "*"
        elif cond == "xx":
            headers["If-Match"] = "*"
        elif cond is not None:
            raise ValueError(f"invalid cond: expected 'nx', 'xx' or None (got {cond!r})")
        path = self._key_path(key)
        if epoch_scope is not None:
            headers["X-Kv-Epoch-Scope"] = self._scope_header(epoch_scope)
            path = f"{self._prefix}/kv/{quote_key(key)}"
        elif key in RESERVED_SEGMENTS and cond is None:
            return self.put_many([(key, view)])[0]
        what = "PUT"
        if epoch_scope is not None:
            what = "epoch-tagged PUT"
        elif cond is not None:
            what = "conditional PUT"
        try:
            resp = self._request(
                "PUT", path, body=view, headers=headers, what=what, accept=(409, 412)
            )
        except _TransportFailure as exc:
            self._count(puts_failed=1)
            return PutOutcome.UNKNOWN if exc.outcome_unknown else PutOutcome.FAILED
        resp.release_conn()
        outcome = self._put_outcome(resp, cond)
        self._count(**({"puts_ok": 1} if outcome.stored else {"puts_failed": 1}))
        return outcome

    @staticmethod
    def _put_outcome(resp: urllib3.BaseHTTPResponse, cond: str | None) -> PutOutcome:
        word = resp.headers.get("X-Kv-Outcome")
        if word is not None:
            return PutOutcome.from_word(word.strip().lower())
        if resp.status == 201:
            return PutOutcome.NEW
        if resp.status == 409 or (resp.status == 412 and cond == "nx"):
            return PutOutcome.CONFLICT
        if resp.status == 412:
            return PutOutcome.MISSING
        if resp.status in (200, 204):  # a server that does not say: it holds the bytes
            return PutOutcome.DUPLICATE
        return PutOutcome.FAILED

    def exists(self, key: str) -> bool:
        """Whether `key` is stored (False when the server is unreachable)."""
        validate_key(key)
        if key in RESERVED_SEGMENTS:
            return self.exists_many([key])[0]
        try:
            resp = self._request("HEAD", self._key_path(key), what="HEAD", lookup=True)
        except _TransportFailure:
            return False
        resp.release_conn()
        return resp.status == 200

    def size(self, key: str) -> int | None:
        """The block's length without reading it, or None."""
        validate_key(key)
        try:
            resp = self._request("HEAD", self._key_path(key), what="HEAD", lookup=True)
        except _TransportFailure:
            return None
        resp.release_conn()
        if resp.status != 200:
            return None
        try:
            return int(resp.headers.get("Content-Length", ""))
        except ValueError:
            return None

    def delete(self, key: str) -> bool:
        """Remove `key`. False when it was absent or the server is unreachable."""
        validate_key(key)
        try:
            resp = self._request("DELETE", self._key_path(key), what="DELETE")
        except _TransportFailure:
            return False
        resp.release_conn()
        return resp.status in (200, 204)

    def stats(self) -> KvCacheStats | None:
        """The caller's namespace stats, or None when the server is unreachable."""
        try:
            resp = self._request("GET", f"{self._prefix}/kv/stats", what="stats")
        except _TransportFailure:
            return None
        data = resp.data
        resp.release_conn()
        if resp.status != 200:
            return None
        try:
            doc = json.loads(data)
        except ValueError as exc:
            raise RemoteProtocolError(f"/kv/stats: not JSON ({exc})") from exc
        if not isinstance(doc, dict):
            raise RemoteProtocolError("/kv/stats: expected a JSON object")
        return KvCacheStats.from_json(doc)

    def health(self) -> bool:
        """True when `GET /healthz` answers 200."""
        try:
            resp = self._request("GET", f"{self._prefix}/healthz", what="healthz", lookup=True)
        except (_TransportFailure, AuthError):
            return False
        resp.release_conn()
        return resp.status == 200

    def supports_fork(self) -> bool:
        """Whether the server offers snapshots and branches (never raises).

        Probes `GET /kv/snapshot`: a server with the engine routes answers a JSON
        `{"snapshots": [...]}`; an older one answers 404 (or the bytes of a key named
        `snapshot`), and an unreachable one nothing: all of those are False.
        """
        try:
            resp = self._request("GET", f"{self._prefix}/kv/snapshot", what="snapshot probe")
        except (_TransportFailure, KvCacheError):
            return False
        data = resp.data
        resp.release_conn()
        if resp.status != 200 or "json" not in resp.headers.get("Content-Type", ""):
            return False
        try:
            doc = json.loads(data)
        except ValueError:
            return False
        return isinstance(doc, dict) and isinstance(doc.get("snapshots"), list)

    # -- batch operations -------------------------------------------------------------
    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """`exists` for each key, in order, in as few round trips as the server allows."""
        for k in keys:
            validate_key(k)
        out: list[bool] = []
        for start in range(0, len(keys), MAX_BATCH_KEYS):
            chunk = list(keys[start : start + MAX_BATCH_KEYS])
            out.extend(self._exists_batch(chunk))
        return out

    def _exists_batch(self, keys: list[str]) -> list[bool]:
        body = json.dumps({"keys": keys}).encode()
        try:
            resp = self._request(
                "POST",
                f"{self._prefix}/kv/batch/exists",
                body=body,
                headers={"Content-Type": "application/json"},
                what="batch exists",
                lookup=True,
            )
        except _TransportFailure:
            return [False] * len(keys)
        data = resp.data
        resp.release_conn()
        try:
            flags = json.loads(data)["exists"]
        except (ValueError, KeyError, TypeError) as exc:
            raise RemoteProtocolError(f"batch exists: bad answer ({exc})") from exc
        if not isinstance(flags, list) or len(flags) != len(keys):
            raise RemoteProtocolError("batch exists: answer does not match the request")
        return [bool(f) for f in flags]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """`get` for each key, in order (batch route)."""
        for k in keys:
            validate_key(k)
        out: list[bytes | None] = []
        for start in range(0, len(keys), MAX_BATCH_KEYS):
            out.extend(self._get_splitting(list(keys[start : start + MAX_BATCH_KEYS])))
        return out

    def _get_splitting(self, keys: list[str]) -> list[bytes | None]:
        """A batch GET; when the hits add up past the server's batch limit, halves."""
        try:
            return self._batch_get(keys, None, exact=True, raise_too_large=True)
        except _BatchTooLarge:
            if len(keys) == 1:
                return [self.get(keys[0])]
            mid = len(keys) // 2
            return self._get_splitting(keys[:mid]) + self._get_splitting(keys[mid:])

    def get_many_into(
        self, keys: Sequence[str], buffers: Sequence[Any], *, exact: bool = True
    ) -> list[int | None]:
        """`get_into` for each (key, buffer) pair in one batch request per 1024 keys."""
        if len(keys) != len(buffers):
            raise ValueError("keys and buffers differ in length")
        for k in keys:
            validate_key(k)
        views = [_as_byte_view(b) for b in buffers]
        out: list[int | None] = []
        for start, stop in _byte_bounded_chunks([v.nbytes for v in views]):
            res = self._batch_get(list(keys[start:stop]), views[start:stop], exact=exact)
            out.extend(r if isinstance(r, int) or r is None else None for r in res)
        return out

    def _batch_get(
        self,
        keys: list[str],
        views: list[memoryview] | None,
        *,
        exact: bool,
        raise_too_large: bool = False,
    ) -> list[Any]:
        """Batch GET. With `views`, fills them and returns sizes; else returns bytes."""
        n = len(keys)
        body = json.dumps({"keys": keys}).encode()
        try:
            resp = self._request(
                "POST",
                f"{self._prefix}/kv/batch/get",
                body=body,
                headers={"Content-Type": "application/json"},
                preload=False,
                what="batch get",
            )
        except _BatchTooLarge as exc:
            if raise_too_large:
                raise
            self._degraded("refused", "batch get", f"HTTP 413 {exc}")
            self._count(misses=n)
            return [None] * n
        except _TransportFailure:
            self._count(misses=n)
            return [None] * n
        results: list[Any] = [None] * n
        hits = misses = mismatches = received = 0
        try:
            raw = self._raw(resp)
            head = bytearray(4)
            self._read_exact(raw, memoryview(head))
            (hlen,) = _U32.unpack(head)
            if hlen > 16 * 1024 * 1024:
                raise RemoteProtocolError(f"batch get: header of {hlen} bytes")
            hbuf = bytearray(hlen)
            self._read_exact(raw, memoryview(hbuf))
            try:
                sizes = json.loads(hbuf)["sizes"]
            except (ValueError, KeyError, TypeError) as exc:
                raise RemoteProtocolError(f"batch get: bad header ({exc})") from exc
            if not isinstance(sizes, list) or len(sizes) != n:
                raise RemoteProtocolError("batch get: header does not match the request")
            for i, size in enumerate(sizes):
                if not isinstance(size, int) or size < 0:
                    misses += 1
                    continue
                if views is None:
                    block = bytearray(size)
                    self._read_exact(raw, memoryview(block))
                    results[i] = bytes(block)
                    hits += 1
                    received += size
                    continue
                mv = views[i]
                if size > mv.nbytes or (exact and size != mv.nbytes):
                    self._skip(raw, size)
                    misses += 1
                    mismatches += 1
                    continue
                self._read_exact(raw, mv[:size])
                results[i] = size
                hits += 1
                received += size
        except _TransportFailure as exc:
            # Blocks already read are complete and stay hits; the rest are misses.
            self._discard(resp)
            self._count(
                transport_errors=1,
                hits=hits,
                misses=n - hits,
                size_mismatches=mismatches,
                bytes_received=received,
            )
            self._degraded("transport", "batch get", exc)
            return results
        except RemoteProtocolError:
            self._discard(resp)
            raise
        resp.release_conn()
        self._count(hits=hits, misses=misses, size_mismatches=mismatches, bytes_received=received)
        return results

    def put_many(self, items: Iterable[tuple[str, Buffer]]) -> list[PutOutcome]:
        """`put` for each (key, data) pair, in order (batch route, split by size/count)."""
        pending: list[tuple[str, memoryview]] = []
        for key, data in items:
            validate_key(key)
            pending.append((key, _block_view(key, data)))
        out: list[PutOutcome] = []
        batch: list[tuple[str, memoryview]] = []
        batch_bytes = 0
        for key, mv in pending:
            if batch and (
                len(batch) >= MAX_BATCH_KEYS or batch_bytes + mv.nbytes > MAX_BATCH_PUT_BYTES
            ):
                out.extend(self._put_batch(batch))
                batch, batch_bytes = [], 0
            batch.append((key, mv))
            batch_bytes += mv.nbytes
        if batch:
            out.extend(self._put_batch(batch))
        return out

    def _put_batch(self, batch: list[tuple[str, memoryview]]) -> list[PutOutcome]:
        parts = encode_batch_put_request([k for k, _ in batch], [mv for _, mv in batch])
        length = sum(memoryview(p).nbytes for p in parts)
        try:
            resp = self._request(
                "POST",
                f"{self._prefix}/kv/batch/put",
                body=parts,
                headers={"Content-Type": BATCH_CONTENT_TYPE, "Content-Length": str(length)},
                what="batch put",
            )
        except _TransportFailure as exc:
            self._count(puts_failed=len(batch))
            outcome = PutOutcome.UNKNOWN if exc.outcome_unknown else PutOutcome.FAILED
            return [outcome] * len(batch)
        data = resp.data
        resp.release_conn()
        try:
            results = json.loads(data)["results"]
        except (ValueError, KeyError, TypeError) as exc:
            raise RemoteProtocolError(f"batch put: bad answer ({exc})") from exc
        if not isinstance(results, list) or len(results) != len(batch):
            raise RemoteProtocolError("batch put: answer does not match the request")
        outcomes = [PutOutcome.from_word(r) for r in results]
        failed = [r for r, o in zip(results, outcomes, strict=True) if o is PutOutcome.FAILED]
        if failed:
            self._degraded("refused", "batch put", f"{len(failed)} keys refused: {failed[:3]}")
        stored = sum(1 for o in outcomes if o.stored)
        self._count(puts_ok=stored, puts_failed=len(outcomes) - stored)
        return outcomes

    def delete_many(self, keys: Sequence[str]) -> list[bool]:
        """`delete` for each key, in order: True where the key existed and was removed.

        One request per key over the pooled keep-alive connections (the server has no
        batch delete route); stops touching the network once the breaker opens."""
        for k in keys:
            validate_key(k)
        return [self.delete(k) for k in keys]

    # -- engine features: snapshots, branches, epochs, paging (docs/engine-features.md) --
    @staticmethod
    def _scope_header(scope: str) -> str:
        raw = scope.encode("utf-8")
        if not 0 < len(raw) <= 1024 or any(c in raw for c in b"\r\n\x00"):
            raise ValueError(f"invalid epoch scope {scope!r}: 1..1024 bytes, no CR/LF/NUL")
        return raw.decode("latin-1")  # http.client re-encodes latin-1: the UTF-8 bytes go out

    def _call(self, method: str, path: str, *, doc: object = None, what: str) -> tuple[int, Any]:
        """A JSON request: `(status, parsed body)`; the body is None for 204 and 404.

        Raises `_TransportFailure` (counted) and the errors of `_check_status`.
        """
        body: bytes | None = None
        headers: dict[str, str] | None = None
        if doc is not None:
            body = json.dumps(doc, separators=(",", ":")).encode("utf-8")
            headers = {"Content-Type": "application/json"}
        resp = self._request(method, path, body=body, headers=headers, what=what)
        data = resp.data
        resp.release_conn()
        if resp.status in (204, 404):
            return resp.status, None
        try:
            return resp.status, json.loads(data)
        except ValueError as exc:
            raise RemoteProtocolError(f"{what}: answer is not JSON ({exc})") from exc

    def _call_or_raise(
        self, method: str, path: str, *, doc: object = None, what: str
    ) -> tuple[int, Any]:
        try:
            return self._call(method, path, doc=doc, what=what)
        except _TransportFailure as exc:
            raise self._unavailable(what, exc) from exc

    def _unavailable(self, what: str, exc: _TransportFailure) -> KvCacheUnavailableError:
        if exc.outcome_unknown:
            return KvCacheOutcomeUnknownError(
                f"kv-cache {what} at {self.config.base_url}: the outcome is unknown (it may "
                f"or may not have been applied; not retried): {exc}"
            )
        return KvCacheUnavailableError(f"kv-cache {what} at {self.config.base_url} failed: {exc}")

    def _id_path(self, kind: str, ident: str, suffix: str = "") -> str:
        if not ident:
            raise ValueError(f"empty {kind} id")
        return f"{self._prefix}/kv/{kind}/{urllib.parse.quote(ident, safe='')}{suffix}"

    def snapshot(
        self,
        keys: Sequence[str] | None = None,
        prefix: str | None = None,
        ttl_s: float | None = None,
    ) -> SnapshotInfo | None:
        """Snapshot `keys` (absent ones skipped) or every key with `prefix` (neither: the
        whole namespace); no bytes are copied. None when the server is unreachable or has
        no snapshot routes: fall back to plain copies."""
        if keys is not None and prefix is not None:
            raise ValueError("give keys or prefix, not both")
        doc: dict[str, Any] = {}
        if keys is not None:
            for k in keys:
                validate_key(k)
            doc["keys"] = list(keys)
        if prefix is not None:
            doc["prefix"] = prefix
        if ttl_s is not None:
            doc["ttl_s"] = ttl_s
        try:
            status, answer = self._call(
                "POST", f"{self._prefix}/kv/snapshot", doc=doc, what="snapshot"
            )
        except _TransportFailure as exc:
            if exc.outcome_unknown:
                raise self._unavailable("snapshot", exc) from exc
            return None
        except LocalProtocolError as exc:
            if exc.status_hint in (404, 405):  # a server without the route
                return None
            raise
        if status == 404:
            return None
        return SnapshotInfo(**_fields_of(answer, _SNAPSHOT_FIELDS, "snapshot"))

    def _record(self, kind: str, rid: str, fields: tuple[str, ...]) -> dict[str, Any] | None:
        """GET a snapshot/branch record's fields; None if absent or unreachable."""
        try:
            status, answer = self._call("GET", self._id_path(kind, rid), what=f"{kind} info")
        except _TransportFailure:
            return None
        if status == 404:
            return None
        return _fields_of(answer, fields, f"{kind} info")

    def _records(self, kind: str, fields: tuple[str, ...]) -> list[dict[str, Any]]:
        """The caller's snapshot/branch records (raises when unreachable)."""
        plural = "branches" if kind == "branch" else f"{kind}s"
        _, answer = self._call_or_raise("GET", f"{self._prefix}/kv/{kind}", what=plural)
        items = _fields_of(answer, (plural,), plural)[plural]
        if not isinstance(items, list):
            raise RemoteProtocolError(f"{plural}: {plural!r} is not a list")
        return [_fields_of(d, fields, plural) for d in items]

    def _delete_record(self, kind: str, rid: str) -> bool:
        try:
            status, _ = self._call("DELETE", self._id_path(kind, rid), what=f"{kind} delete")
        except _TransportFailure:
            return False
        return status == 204

    def snapshot_info(self, snapshot_id: str) -> SnapshotInfo | None:
        """The snapshot, or None (absent, expired, or the server unreachable)."""
        rec = self._record("snapshot", snapshot_id, _SNAPSHOT_FIELDS)
        return SnapshotInfo(**rec) if rec is not None else None

    def list_snapshots(self) -> list[SnapshotInfo]:
        """Live snapshots of the caller's namespace, oldest first."""
        return [SnapshotInfo(**d) for d in self._records("snapshot", _SNAPSHOT_FIELDS)]

    def delete_snapshot(self, snapshot_id: str) -> bool:
        """Release the snapshot (and its branches). False if absent or unreachable."""
        return self._delete_record("snapshot", snapshot_id)

    def snapshot_get(self, snapshot_id: str, key: str) -> bytes | None:
        """`key` as of the snapshot, or None."""
        validate_key(key)
        return self._read(self._id_path("snapshot", snapshot_id, "/" + quote_key(key)))

    def fork(self, snapshot_id: str) -> BranchInfo | None:
        """Make a copy-on-write branch of a snapshot (zero bytes copied).

        None when the snapshot does not exist, or the server is unreachable or has no
        snapshot routes."""
        try:
            status, answer = self._call(
                "POST", self._id_path("snapshot", snapshot_id, "/fork"), what="fork"
            )
        except _TransportFailure as exc:
            if exc.outcome_unknown:
                raise self._unavailable("fork", exc) from exc
            return None
        except LocalProtocolError as exc:
            if exc.status_hint in (404, 405):
                return None
            raise
        if status == 404:
            return None
        return BranchInfo(**_fields_of(answer, _BRANCH_FIELDS, "fork"))

    def branch_info(self, branch_id: str) -> BranchInfo | None:
        """The branch (with its private and shared bytes), or None."""
        rec = self._record("branch", branch_id, _BRANCH_FIELDS)
        return BranchInfo(**rec) if rec is not None else None

    def list_branches(self) -> list[BranchInfo]:
        """Branches of the caller's namespace, oldest first."""
        return [BranchInfo(**d) for d in self._records("branch", _BRANCH_FIELDS)]

    def delete_branch(self, branch_id: str) -> bool:
        """Release the branch's overlay. False if absent or unreachable."""
        return self._delete_record("branch", branch_id)

    def branch_get(self, branch_id: str, key: str) -> bytes | None:
        """`key` in the branch: its overlay's block, else the snapshot's; or None."""
        validate_key(key)
        return self._read(self._id_path("branch", branch_id, "/" + quote_key(key)))

    def branch_put(self, branch_id: str, key: str, data: Any) -> bool:
        """Write `key` into the branch overlay only. False when the branch does not exist
        or the server is unreachable."""
        validate_key(key)
        try:
            resp = self._request(
                "PUT",
                self._id_path("branch", branch_id, "/" + quote_key(key)),
                body=data,
                headers={"Content-Type": "application/octet-stream"},
                what="branch PUT",
            )
        except _TransportFailure:
            self._count(puts_failed=1)
            return False
        resp.release_conn()
        ok = resp.status in (200, 201)
        self._count(**({"puts_ok": 1} if ok else {"puts_failed": 1}))
        return ok

    def _read(self, path: str) -> bytes | None:
        try:
            resp = self._request("GET", path, what="GET")
        except _TransportFailure:
            self._count(misses=1)
            return None
        data = resp.data
        resp.release_conn()
        if resp.status != 200:
            self._count(misses=1)
            return None
        self._count(hits=1, bytes_received=len(data))
        return bytes(data)

    def epoch_bump(self, scope: str) -> int:
        """Make every entry written with `epoch_scope=scope` stale; returns the new epoch.

        Raises `KvCacheUnavailableError` when the bump could not be made."""
        self._scope_header(scope)
        path = f"{self._prefix}/kv/epoch/{urllib.parse.quote(scope, safe='')}/bump"
        status, answer = self._call_or_raise("POST", path, what="epoch bump")
        if status == 404:
            raise LocalProtocolError("epoch bump: the server has no epoch routes", status_hint=404)
        epoch = _fields_of(answer, ("epoch",), "epoch bump")["epoch"]
        if not isinstance(epoch, int):
            raise RemoteProtocolError("epoch bump: 'epoch' is not an integer")
        return epoch

    def epoch_get(self, scope: str) -> int:
        """The current epoch of `scope` (0 if never bumped)."""
        self._scope_header(scope)
        path = f"{self._prefix}/kv/epoch/{urllib.parse.quote(scope, safe='')}"
        status, answer = self._call_or_raise("GET", path, what="epoch")
        if status == 404:
            raise LocalProtocolError("epoch: the server has no epoch routes", status_hint=404)
        epoch = _fields_of(answer, ("epoch",), "epoch")["epoch"]
        if not isinstance(epoch, int):
            raise RemoteProtocolError("epoch: 'epoch' is not an integer")
        return epoch

    def page_in_ranked(
        self,
        edges: Iterable[Edge],
        node_keys: Mapping[str, Sequence[str]],
        budget_bytes: int,
        *,
        damping: float = 0.85,
    ) -> PageInResult | None:
        """Rank the graph's nodes by PageRank and promote their blocks into the server's
        hot tier, most central first, within `budget_bytes`. Nodes are strings. None when
        the server is unreachable (paging is advisory)."""
        doc = {
            "edges": [list(e) for e in edges],
            "node_keys": {node: list(keys) for node, keys in node_keys.items()},
            "budget_bytes": budget_bytes,
            "damping": damping,
        }
        try:
            status, answer = self._call(
                "POST", f"{self._prefix}/kv/page-in", doc=doc, what="page-in"
            )
        except _TransportFailure:
            return None
        if status == 404 or not isinstance(answer, dict):
            return None
        try:
            return PageInResult.from_dict(answer)
        except (KeyError, TypeError, ValueError) as exc:
            raise RemoteProtocolError(f"page-in: bad answer ({exc})") from exc

    def list_keys(
        self, prefix: str = "", *, after: str | None = None, limit: int | None = None
    ) -> list[str]:
        """Keys of the caller's namespace starting with `prefix`, sorted, strictly after
        `after`; all of them, or the first `limit`. Raises `KvCacheUnavailableError`."""
        out: list[str] = []
        cursor = after
        while limit is None or len(out) < limit:
            page = 1000 if limit is None else min(1000, limit - len(out))
            query: dict[str, str] = {"prefix": prefix, "limit": str(page)}
            if cursor is not None:
                query["after"] = cursor
            qs = urllib.parse.urlencode(query, quote_via=urllib.parse.quote)
            path = f"{self._prefix}/kv/keys?{qs}"
            status, answer = self._call_or_raise("GET", path, what="list keys")
            if status == 404:
                raise LocalProtocolError(
                    "list keys: the server has no /kv/keys route", status_hint=404
                )
            got = _fields_of(answer, ("keys", "next_after"), "list keys")
            keys, cursor = got["keys"], got["next_after"]
            if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                raise RemoteProtocolError("list keys: 'keys' is not a list of strings")
            out.extend(keys)
            if cursor is None:
                break
            if not isinstance(cursor, str):
                raise RemoteProtocolError("list keys: 'next_after' is not a string")
        return out
