"""`EpistemicGraphKVBackend`: the synchronous HTTP client of the `/kv` API.

The client is three layers, one class each (each inherits the one before):
- `client.transport.HttpTransport`: the urllib3 pool, timeouts, retry-on-reset rules,
  the error table, the circuit breaker and the counters (its docstring says how a
  failure degrades to a miss);
- `client.engine_ops.EngineOps`: snapshots, branches, epochs, paging, key listing;
- this module: the data path, single keys and batches.

How the data path works:
- A transport failure never raises: reads become misses, writes fail
  (`PutOutcome.FAILED`, or `UNKNOWN` when the write may have been applied).
- `get_into` / `get_many_into` read bodies straight from the socket into the caller's
  buffer (no intermediate `bytes`). A block whose size differs from the buffer is a
  miss: a half-filled buffer is never reported loaded.
- Batches follow the server's default limits (`shared.DEFAULT_LIMITS`): split at
  `MAX_BATCH_KEYS` keys and `MAX_BATCH_PUT_BYTES` block bytes; a batch GET the server
  refuses as too large (413) is halved. The batch bodies are framed and parsed by
  `proto.http`, the module the server uses for them too.
- Keys travel as one percent-encoded path segment (`proto.http.quote_key`, which encodes a
  letter of keys that collide with route names such as `stats` or `snapshot`, so the
  server reads them as keys; old servers decode them the same way).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any, Literal, Self

import urllib3

from epistemic_kvcache.client.config import KvCacheConfig
from epistemic_kvcache.client.engine_ops import EngineOps
from epistemic_kvcache.client.outcome import (
    KvCacheOutcomeUnknownError,
    KvCacheUnavailableError,
    PutOutcome,
)
from epistemic_kvcache.client.stats import KvCacheStats
from epistemic_kvcache.client.transport import (
    RETRY_ON_RESET,
    _as_byte_view,
    _as_bytes_view,
    _BatchTooLarge,
    _TransportFailure,
    log,
)
from epistemic_kvcache.errors import (
    AuthError,
    KvCacheError,
    LocalProtocolError,
    RemoteProtocolError,
)
from epistemic_kvcache.proto.http import (
    BATCH_CONTENT_TYPE,
    BATCH_LENGTH_BYTES,
    EPOCH_SCOPE_HEADER,
    JSON_CONTENT_TYPE,
    OCTET_CONTENT_TYPE,
    OUTCOME_HEADER,
    ROUTE_BATCH_EXISTS,
    ROUTE_BATCH_GET,
    ROUTE_BATCH_PUT,
    ROUTE_HEALTHZ,
    ROUTE_SNAPSHOTS,
    ROUTE_STATS,
    batch_header_length,
    decode_batch_exists_response,
    decode_batch_get_header,
    decode_batch_put_response,
    encode_batch_put_request,
    encode_key_list,
    quote_key,
)
from epistemic_kvcache.shared import DEFAULT_LIMITS, RESERVED_SEGMENTS, validate_key

__all__ = [
    "BATCH_CONTENT_TYPE",
    "MAX_BATCH_KEYS",
    "MAX_BATCH_PUT_BYTES",
    "RETRY_ON_RESET",
    "EpistemicGraphKVBackend",
    "KvCacheOutcomeUnknownError",
    "KvCacheUnavailableError",
    "PutOutcome",
]

Buffer = bytes | bytearray | memoryview

MAX_BATCH_KEYS = DEFAULT_LIMITS.max_batch_keys
"""Server default `max_batch_keys`; larger batches are split."""
MAX_BATCH_PUT_BYTES = DEFAULT_LIMITS.max_batch_bytes
"""Split batch PUT bodies, and batch GETs into caller buffers, at this many block bytes
(the server's default `max_batch_bytes`; a larger batch is refused with 413)."""


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


class EpistemicGraphKVBackend(EngineOps):
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
        super().__init__(config)

    # -- construction / lifetime ------------------------------------------------------
    @classmethod
    def from_env(cls, **overrides: Any) -> EpistemicGraphKVBackend:
        """A client configured by `KvCacheConfig.from_env(**overrides)`."""
        return cls(KvCacheConfig.from_env(**overrides))

    def check_connection(self) -> None:
        """Make one authenticated request (`GET /kv/stats`, lookup timeout): return when
        the server answers and accepts the token.

        Raises `KvCacheUnavailableError` (unreachable, stalled, 5xx), `AuthError` (401:
        token missing or wrong), `ForbiddenError` (403) or `ConfigurationError` (TLS).
        Used by the LMCache plugins at start-up, so a wrong deployment fails once, clearly.
        """
        try:
            resp = self._request(
                "GET", f"{self._prefix}{ROUTE_STATS}", what="connection check", lookup=True
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
        headers = {"Content-Type": OCTET_CONTENT_TYPE}
        if cond == "nx":
            headers["If-None-Match"] = "*"
        elif cond == "xx":
            headers["If-Match"] = "*"
        elif cond is not None:
            raise ValueError(f"invalid cond: expected 'nx', 'xx' or None (got {cond!r})")
        path = self._key_path(key)
        if epoch_scope is not None:
            headers[EPOCH_SCOPE_HEADER] = self._scope_header(epoch_scope)
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
        word = resp.headers.get(OUTCOME_HEADER)
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
            resp = self._request("GET", f"{self._prefix}{ROUTE_STATS}", what="stats")
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
            resp = self._request(
                "GET", f"{self._prefix}{ROUTE_HEALTHZ}", what="healthz", lookup=True
            )
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
            resp = self._request("GET", f"{self._prefix}{ROUTE_SNAPSHOTS}", what="snapshot probe")
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

    def _post_keys(
        self, route: str, what: str, keys: list[str], **kwargs: Any
    ) -> urllib3.BaseHTTPResponse:
        """`POST` the JSON key list to a batch `route` (exists, get)."""
        return self._request(
            "POST",
            f"{self._prefix}{route}",
            body=encode_key_list(keys),
            headers={"Content-Type": JSON_CONTENT_TYPE},
            what=what,
            **kwargs,
        )

    def _exists_batch(self, keys: list[str]) -> list[bool]:
        try:
            resp = self._post_keys(ROUTE_BATCH_EXISTS, "batch exists", keys, lookup=True)
        except _TransportFailure:
            return [False] * len(keys)
        data = resp.data
        resp.release_conn()
        return decode_batch_exists_response(data, len(keys))

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
        try:
            resp = self._post_keys(ROUTE_BATCH_GET, "batch get", keys, preload=False)
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
            head = bytearray(BATCH_LENGTH_BYTES)
            self._read_exact(raw, memoryview(head))
            hbuf = bytearray(batch_header_length(head))
            self._read_exact(raw, memoryview(hbuf))
            for i, size in enumerate(decode_batch_get_header(hbuf, n)):
                if size < 0:
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
                f"{self._prefix}{ROUTE_BATCH_PUT}",
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
        results = decode_batch_put_response(data, len(batch))
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
