"""`EpistemicGraphKVBackend`: the synchronous HTTP client of the `/kv` API.

How it works:
- One urllib3 connection pool per client (keep-alive, `max_connections` sockets, blocking
  when all are busy); the pool is thread-safe, so one client serves every thread.
- A transport failure (refused, reset, timeout, 5xx/429/408) never raises: reads become
  misses, writes return False, the failure is counted and logged (rate-limited, since an
  unreachable cache would otherwise log once per prompt chunk). A reset on a kept-alive
  socket is retried once, because the server may have closed it while idle.
- 401/403, a TLS peer that fails verification and a malformed request raise: retrying
  cannot fix them and silently missing would hide a broken deployment.
- `get_into` / `get_many_into` read bodies straight from the socket into the caller's
  buffer (`http.client.HTTPResponse.readinto`, no intermediate `bytes`). A block whose
  size differs from the buffer is a miss: a half-filled buffer is never reported loaded.
- Keys travel as one percent-encoded path segment (`quote(key, safe="")`). Keys that
  collide with route names (`stats`, `batch`, ...) go through the batch routes instead.
"""

from __future__ import annotations

import http.client
import json
import logging
import ssl
import struct
import threading
import time
import urllib.parse
from collections.abc import Iterable, Sequence
from dataclasses import fields
from typing import Any, Self

import urllib3
import urllib3.exceptions

from epistemic_kvcache.client.config import KvCacheConfig
from epistemic_kvcache.client.stats import ClientCounters, KvCacheStats
from epistemic_kvcache.errors import (
    AuthError,
    ConfigurationError,
    ForbiddenError,
    InvalidKeyError,
    LocalProtocolError,
    RemoteProtocolError,
)
from epistemic_kvcache.store.api import validate_key

log = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview

BATCH_CONTENT_TYPE = "application/x-kvcache-batch"
MAX_BATCH_KEYS = 1024
"""Server default `max_batch_keys`; larger batches are split."""
MAX_BATCH_PUT_BYTES = 256 * 1024 * 1024
"""Split batch PUT bodies at this size (server default `max_batch_bytes` is 1 GiB)."""
RESERVED_SEGMENTS = frozenset({"stats", "batch", "snapshot", "branch"})
"""`/kv/<segment>` route names; such keys are sent through the batch routes."""
_SKIP_CHUNK = 1024 * 1024
_LOG_INTERVAL_S = 10.0
_U32 = struct.Struct(">I")


class _TransportFailure(Exception):
    """Internal: a request failed in a way that degrades to a miss."""


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


class EpistemicGraphKVBackend:
    """Thread-safe client of one epistemic-kvcache server.

    `get(key) -> bytes | None` and `put(key, data) -> bool` are the seam other code plugs
    into; transport failures are a miss / False, never an exception.
    """

    def __init__(self, config: KvCacheConfig | None = None, **overrides: Any) -> None:
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
        self._lock = threading.Lock()
        self._counts = {f.name: 0 for f in fields(ClientCounters)}
        self._last_log: dict[str, float] = {}
        self._closed = False

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
        """Close every pooled connection. Idempotent."""
        self._closed = True
        self._pool.close()

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
        return f"{self._prefix}/kv/{urllib.parse.quote(key, safe='')}{suffix}"

    def _request(
        self,
        method: str,
        path: str,
        *,
        body: Buffer | list[Buffer] | None = None,
        headers: dict[str, str] | None = None,
        preload: bool = True,
        what: str,
    ) -> urllib3.BaseHTTPResponse:
        """Send one request. Raises `_TransportFailure` (counted) or auth/config errors."""
        if self._closed:
            raise _TransportFailure("client closed")
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
                    pool_timeout=max(1, int(self.config.read_timeout_s)),
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
                self._count(requests=1, transport_errors=1)
                self._degraded("transport", what, exc)
                raise _TransportFailure(str(exc)) from exc
            except urllib3.exceptions.ProtocolError as exc:
                # Reset / disconnected: possibly a kept-alive socket the server closed.
                if attempt == 0:
                    continue
                self._count(requests=1, transport_errors=1)
                self._degraded("transport", what, exc)
                raise _TransportFailure(str(exc)) from exc
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                self._count(requests=1, transport_errors=1)
                self._degraded("transport", what, exc)
                raise _TransportFailure(str(exc)) from exc
            self._count(requests=1, bytes_sent=sent)
            self._check_status(resp, what)
            return resp
        raise AssertionError("unreachable")  # pragma: no cover

    def _check_status(self, resp: urllib3.BaseHTTPResponse, what: str) -> None:
        status = resp.status
        if status < 400 or status == 404:
            return
        detail = self._error_text(resp)
        if status == 401:
            raise AuthError(f"kv-cache {what}: 401 unauthorized ({detail}); check the token")
        if status == 403:
            raise ForbiddenError(f"kv-cache {what}: 403 forbidden ({detail})")
        if status >= 500 or status in (408, 429):
            self._count(server_errors=1)
            self._degraded("server", what, f"HTTP {status} {detail}")
            raise _TransportFailure(f"HTTP {status}")
        if status in (411, 413):
            # Block too large or similar: the write fails, the caller carries on.
            self._degraded("refused", what, f"HTTP {status} {detail}")
            raise _TransportFailure(f"HTTP {status}")
        if status == 400 and "bad_key" in detail:
            raise InvalidKeyError(f"kv-cache {what}: server refused the key ({detail})")
        raise LocalProtocolError(f"kv-cache {what}: HTTP {status} ({detail})", status_hint=status)

    @staticmethod
    def _error_text(resp: urllib3.BaseHTTPResponse) -> str:
        try:
            data = resp.data if resp.data is not None else b""
        except (urllib3.exceptions.HTTPError, OSError):
            data = b""
        finally:
            resp.release_conn()
        try:
            doc = json.loads(data)
        except ValueError:
            return data[:200].decode("utf-8", "replace")
        if isinstance(doc, dict):
            return f"{doc.get('error', '')}: {doc.get('message', '')}"
        return str(doc)[:200]

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
        """Fill `mv` completely from the body or raise `_TransportFailure`."""
        got = 0
        total = mv.nbytes
        try:
            while got < total:
                n = raw.readinto(mv[got:])
                if not n:
                    raise _TransportFailure(f"body ended after {got} of {total} bytes")
                got += n
        except (OSError, http.client.HTTPException) as exc:
            raise _TransportFailure(str(exc)) from exc

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

    def put(self, key: str, data: Any) -> bool:
        """Store `data` (any bytes-like object) under `key`. True when the server holds it.

        A key that already existed is True as well (same bytes: a dedup hit; different
        bytes: first write wins, the stored block stays).
        """
        validate_key(key)
        if key in RESERVED_SEGMENTS:
            return self.put_many([(key, data)])[0]
        try:
            resp = self._request(
                "PUT",
                self._key_path(key),
                body=data,
                headers={"Content-Type": "application/octet-stream"},
                what="PUT",
            )
        except _TransportFailure:
            self._count(puts_failed=1)
            return False
        resp.release_conn()
        ok = resp.status in (200, 201, 204)
        self._count(**({"puts_ok": 1} if ok else {"puts_failed": 1}))
        return ok

    def exists(self, key: str) -> bool:
        """Whether `key` is stored (False when the server is unreachable)."""
        validate_key(key)
        if key in RESERVED_SEGMENTS:
            return self.exists_many([key])[0]
        try:
            resp = self._request("HEAD", self._key_path(key), what="HEAD")
        except _TransportFailure:
            return False
        resp.release_conn()
        return resp.status == 200

    def size(self, key: str) -> int | None:
        """The block's length without reading it, or None."""
        validate_key(key)
        if key in RESERVED_SEGMENTS:
            raise InvalidKeyError(f"invalid key {key!r}: a route name, reachable over RESP only")
        try:
            resp = self._request("HEAD", self._key_path(key), what="HEAD")
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
        if key in RESERVED_SEGMENTS:
            raise InvalidKeyError(f"invalid key {key!r}: a route name, reachable over RESP only")
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
            resp = self._request("GET", f"{self._prefix}/healthz", what="healthz")
        except (_TransportFailure, AuthError):
            return False
        resp.release_conn()
        return resp.status == 200

    def supports_fork(self) -> bool:
        """Whether the server offers snapshots and branches (never raises).

        Asks `GET /healthz` for its `features` list and looks for `"snapshots"`; a server
        that does not advertise it (or cannot be reached) does not support forking.
        """
        try:
            resp = self._request("GET", f"{self._prefix}/healthz", what="healthz")
        except (_TransportFailure, AuthError, LocalProtocolError, InvalidKeyError):
            return False
        data = resp.data
        resp.release_conn()
        if resp.status != 200:
            return False
        try:
            doc = json.loads(data)
        except ValueError:
            return False
        features = doc.get("features") if isinstance(doc, dict) else None
        return isinstance(features, list) and "snapshots" in features

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
            chunk = list(keys[start : start + MAX_BATCH_KEYS])
            out.extend(self._batch_get(chunk, None, exact=True))
        return out

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
        for start in range(0, len(keys), MAX_BATCH_KEYS):
            chunk = list(keys[start : start + MAX_BATCH_KEYS])
            res = self._batch_get(chunk, views[start : start + MAX_BATCH_KEYS], exact=exact)
            out.extend(r if isinstance(r, int) or r is None else None for r in res)
        return out

    def _batch_get(
        self, keys: list[str], views: list[memoryview] | None, *, exact: bool
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

    def put_many(self, items: Iterable[tuple[str, Buffer]]) -> list[bool]:
        """`put` for each (key, data) pair, in order (batch route, split by size/count)."""
        pending: list[tuple[str, memoryview]] = []
        for key, data in items:
            validate_key(key)
            pending.append((key, _as_bytes_view(data)))
        out: list[bool] = []
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

    def _put_batch(self, batch: list[tuple[str, memoryview]]) -> list[bool]:
        header = json.dumps(
            {"keys": [k for k, _ in batch], "sizes": [mv.nbytes for _, mv in batch]}
        ).encode()
        parts: list[Buffer] = [_U32.pack(len(header)), header, *(mv for _, mv in batch)]
        length = sum(memoryview(p).nbytes for p in parts)
        try:
            resp = self._request(
                "POST",
                f"{self._prefix}/kv/batch/put",
                body=parts,
                headers={"Content-Type": BATCH_CONTENT_TYPE, "Content-Length": str(length)},
                what="batch put",
            )
        except _TransportFailure:
            self._count(puts_failed=len(batch))
            return [False] * len(batch)
        data = resp.data
        resp.release_conn()
        try:
            results = json.loads(data)["results"]
        except (ValueError, KeyError, TypeError) as exc:
            raise RemoteProtocolError(f"batch put: bad answer ({exc})") from exc
        if not isinstance(results, list) or len(results) != len(batch):
            raise RemoteProtocolError("batch put: answer does not match the request")
        ok = [r in ("created", "duplicate", "conflict") for r in results]
        failed = [r for r in results if r not in ("created", "duplicate", "conflict")]
        if failed:
            self._degraded("refused", "batch put", f"{len(failed)} keys refused: {failed[:3]}")
        self._count(puts_ok=sum(ok), puts_failed=len(ok) - sum(ok))
        return ok

    def delete_many(self, keys: Sequence[str]) -> list[bool]:
        """`delete` for each key (one request each: there is no batch delete route)."""
        return [self.delete(k) for k in keys]
