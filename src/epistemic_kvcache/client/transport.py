"""`HttpTransport`: the client's connection pool, error handling and circuit breaker.

How it works:
- One urllib3 connection pool per client (keep-alive, `max_connections` sockets, blocking
  when all are busy); the pool is thread-safe, so one client serves every thread.
- A transport failure (refused, reset, timeout, 5xx/429/408) never raises out of the
  data-path calls: `_request` raises `_TransportFailure` (counted, and logged
  rate-limited, since an unreachable cache would otherwise log once per prompt chunk),
  which the callers turn into a miss / a failed write.
  A connection reset is retried once only for a request that is safe to repeat
  (`RETRY_ON_RESET`: reads, and PUTs that replace a key's bytes); a snapshot, fork, epoch
  bump, DELETE or conditional PUT is never sent twice, since the first may have been
  applied.
- Error answers are read through the one error table (`proto.errors.client_rule`): each
  JSON error code says whether to raise, degrade, split a batch, or report a write whose
  outcome is unknown.
- Two timeouts: lookups (HEAD, batch exists) wait `lookup_timeout_s` (1 s), transfers
  `read_timeout_s` (2 s) for the next byte. A timeout or a refused connection opens a
  circuit breaker (`client.breaker`): every request is then answered at once without
  the network while a background probe (`GET /healthz`) waits for the server to answer
  again, so a stalled server costs one timeout, not one per prompt chunk.
- 401/403, a TLS peer that fails verification and a malformed request raise: retrying
  cannot fix them and silently missing would hide a broken deployment.
- `_read_exact` reads a body straight from the socket into a caller's buffer
  (`http.client.HTTPResponse.readinto`, no intermediate `bytes`).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import math
import socket
import ssl
import threading
import time
import weakref
from dataclasses import fields
from typing import Any, Final

import urllib3
import urllib3.exceptions

from epistemic_kvcache.client.breaker import CircuitBreaker
from epistemic_kvcache.client.config import KvCacheConfig
from epistemic_kvcache.client.outcome import KvCacheOutcomeUnknownError, KvCacheUnavailableError
from epistemic_kvcache.client.stats import ClientCounters
from epistemic_kvcache.errors import (
    AuthError,
    ConfigurationError,
    LocalProtocolError,
    ProtocolError,
)
from epistemic_kvcache.proto.errors import client_rule
from epistemic_kvcache.proto.http import ROUTE_HEALTHZ, quote_key

log = logging.getLogger("epistemic_kvcache.client.backend")
"""The client's one logger (named as before the split, for operators' log filters)."""

Buffer = bytes | bytearray | memoryview

_SKIP_CHUNK = 1024 * 1024
_LOG_INTERVAL_S = 10.0


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


class HttpTransport:
    """The request plumbing of `EpistemicGraphKVBackend`: pool, timeouts, breaker,
    counters, error table. Subclasses add the operations."""

    def __init__(self, config: KvCacheConfig) -> None:
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
        tls: dict[str, Any] = {}
        pool_cls: type[urllib3.HTTPConnectionPool] = urllib3.HTTPConnectionPool
        if config.scheme == "https":
            pool_cls = urllib3.HTTPSConnectionPool
            tls["ssl_context"] = self._ssl_context(config)
        self._pool: urllib3.HTTPConnectionPool = pool_cls(
            config.host,
            config.port,
            maxsize=config.max_connections,
            block=True,
            timeout=timeout,
            retries=False,
            **tls,
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
                f"{self._prefix}{ROUTE_HEALTHZ}",
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

    def _read(self, path: str) -> bytes | None:
        """GET `path`'s body: bytes on 200, None (a miss, counted) otherwise."""
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

    def _unavailable(self, what: str, exc: _TransportFailure) -> KvCacheUnavailableError:
        if exc.outcome_unknown:
            return KvCacheOutcomeUnknownError(
                f"kv-cache {what} at {self.config.base_url}: the outcome is unknown (it may "
                f"or may not have been applied; not retried): {exc}"
            )
        return KvCacheUnavailableError(f"kv-cache {what} at {self.config.base_url} failed: {exc}")
