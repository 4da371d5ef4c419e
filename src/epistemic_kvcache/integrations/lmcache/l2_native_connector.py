"""`EpistemicGraphL2Connector`: LMCache's `native_plugin` L2 client over our HTTP API.

LMCache (MP mode) loads this class through its `native_plugin` factory and wraps it in
`NativeConnectorL2Adapter`; the same protocol is what `ConnectorClientBase` drives in
v1 mode. See `/docs/lmcache.md` and LMCACHE_CONTRACT.md §1.

How it works:
- `submit_batch_*` only enqueue work and return a future id at once (LMCache calls them
  while holding its own lock). A batch is split into up to `num_workers` groups of
  keys, balanced by bytes; a thread pool runs one batch HTTP request per group through
  one pooled, keep-alive `EpistemicGraphKVBackend`.
- GETs read each block straight from the socket into LMCache's memoryview
  (`get_many_into`, exact size: a block whose size differs from the buffer is reported
  not loaded, never half-filled).
- When the last group of a future finishes, its completion
  `(future_id, ok, error, per_key_results)` is queued and a Linux eventfd is bumped.
  LMCache's demux thread polls that fd and calls `drain_completions`, which resets the
  fd first and then takes the queue, so no wake-up is lost.
- Every failure (transport, auth, bad key, bugs) becomes per-key `False` plus error text;
  nothing ever raises into LMCache's demux thread, and failures are logged at most once
  per 10 s per kind.
- `submit_batch_delete` deletes for real (LMCache's MP admin `DELETE /cache/objects` and
  its L2 eviction call it through `NativeConnectorL2Adapter.delete`); per-key results
  say which keys existed.
- Lookups use the client's short lookup timeout (1 s), transfers the transfer timeout
  (2 s); after one timeout the client's circuit breaker answers every request at once
  (a miss / not stored) until a background probe sees the server again.
- The constructor checks the token and that the server answers (one clear
  `ConfigurationError` at LMCache's start); `close()` is bounded: in-flight requests
  get a second to finish, then their connections are cut.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from epistemic_kvcache.client.backend import EpistemicGraphKVBackend
from epistemic_kvcache.client.config import (
    DEFAULT_CONNECT_TIMEOUT_S,
    KvCacheConfig,
    url_from_addr,
)
from epistemic_kvcache.errors import ConfigurationError
from epistemic_kvcache.integrations.lmcache._runtime import (
    DEFAULT_CLOSE_GRACE_S,
    QuietLog,
    WorkPool,
    open_client,
)

log = logging.getLogger(__name__)

Completion = tuple[int, bool, str, list[bool] | None]

DEFAULT_NUM_WORKERS = 8
"""Concurrent HTTP requests per connector (matches LMCache's RESP adapter default)."""


class _Pending:
    """One submitted future: per-key results filled in by its groups."""

    __slots__ = ("errors", "future_id", "lock", "needs_all", "remaining", "results")

    def __init__(self, future_id: int, n_keys: int, n_groups: int, *, needs_all: bool) -> None:
        self.future_id = future_id
        self.needs_all = needs_all
        """True for get/set (ok only if every key loaded/stored); False for exists."""
        self.results = [False] * n_keys
        self.errors: list[str] = []
        self.remaining = n_groups
        self.lock = threading.Lock()


def _groups(sizes: Sequence[int], max_groups: int) -> list[list[int]]:
    """Split key indices into <= max_groups contiguous runs of roughly equal bytes."""
    n = len(sizes)
    if n == 0:
        return []
    k = max(1, min(max_groups, n))
    weights = list(sizes) if sum(sizes) > 0 else [1] * n
    target = sum(weights) / k
    groups: list[list[int]] = [[]]
    acc = 0.0
    for i, weight in enumerate(weights):
        if groups[-1] and acc + weight / 2 > target and len(groups) < k:
            groups.append([])
            acc = 0.0
        groups[-1].append(i)
        acc += weight
    return groups


class EpistemicGraphL2Connector:
    """LMCache native L2 connector (`native_plugin`) for an epistemic-kvcache server.

    `adapter_params` become keyword arguments: `base_url` or `addr` (`host:port`),
    `token` (or `token_file`), `timeout_s` (transfers), `lookup_timeout_s`,
    `breaker_max_backoff_s`, `num_workers`, `max_connections`, `ca_file`,
    `client_cert`, `client_key`, `verify_tls`, `check_on_start`. Anything not given
    comes from the environment (`KvCacheConfig.from_env`), so the token can stay out of
    LMCache's configuration (and its logs). `verify_tls=False` is refused: the design
    allows no switch that disables TLS verification; use `http://` on loopback or trust
    the CA. With `check_on_start` (the default) a missing or rejected token, or a server
    that does not answer, raises `ConfigurationError` here, so LMCache fails to start
    with one clear message.
    """

    def __init__(
        self,
        base_url: str | None = None,
        addr: str | None = None,
        token: str | None = None,
        token_file: str | None = None,
        timeout_s: float | None = None,
        num_workers: int = DEFAULT_NUM_WORKERS,
        max_connections: int | None = None,
        verify_tls: bool = True,
        ca_file: str | None = None,
        client_cert: str | None = None,
        client_key: str | None = None,
        lookup_timeout_s: float | None = None,
        breaker_max_backoff_s: float | None = None,
        check_on_start: bool = True,
        *,
        config: KvCacheConfig | None = None,
    ) -> None:
        if verify_tls is not True:
            raise ConfigurationError(
                f"invalid verify_tls: {verify_tls!r}; TLS verification cannot be disabled. "
                "Use http:// on a loopback address, or give ca_file / SSL_CERT_FILE the CA "
                "that signed the server certificate"
            )
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ConfigurationError(
                f"invalid num_workers: expected a positive integer (got {num_workers!r})"
            )
        if base_url is not None and addr is not None:
            raise ConfigurationError("invalid adapter_params: give base_url or addr, not both")
        if not isinstance(check_on_start, bool):
            raise ConfigurationError(
                f"invalid check_on_start: expected true or false (got {check_on_start!r})"
            )
        if token is not None and token_file is not None:
            raise ConfigurationError("invalid adapter_params: give token or token_file, not both")
        if token_file is not None:
            try:
                with open(token_file, encoding="utf-8") as fh:
                    token = fh.read().strip()
            except OSError as exc:
                raise ConfigurationError(
                    f"invalid token_file: cannot read {token_file!r} ({exc})"
                ) from exc
        overrides: dict[str, Any] = {}
        if base_url is not None:
            overrides["base_url"] = base_url
        elif addr is not None:
            overrides["base_url"] = url_from_addr(addr)
        if token is not None:
            overrides["token"] = token
        if timeout_s is not None:
            if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
                raise ConfigurationError(f"invalid timeout_s: expected seconds (got {timeout_s!r})")
            overrides["read_timeout_s"] = float(timeout_s)
            overrides["connect_timeout_s"] = min(float(timeout_s), DEFAULT_CONNECT_TIMEOUT_S)
        for name, value in (
            ("lookup_timeout_s", lookup_timeout_s),
            ("breaker_max_backoff_s", breaker_max_backoff_s),
        ):
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise ConfigurationError(f"invalid {name}: expected seconds (got {value!r})")
                overrides[name] = float(value)
        if ca_file is not None:
            overrides["ca_file"] = ca_file
        if client_cert is not None:
            overrides["client_cert"] = client_cert
        if client_key is not None:
            overrides["client_key"] = client_key
        overrides["max_connections"] = max(num_workers, max_connections or num_workers)
        if config is None:
            config = KvCacheConfig.from_env(**overrides)
        elif overrides:
            config = config.with_overrides(**overrides)
        self.config = config
        self.num_workers = num_workers
        self._client = open_client(config, what="kv-cache L2 connector", check=check_on_start)
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._pool = WorkPool(num_workers, "kvcache-l2")
        self._quiet = QuietLog(log)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._completions: collections.deque[Completion] = collections.deque()
        self._closed = False

    # -- the native connector interface --------------------------------------------------
    def event_fd(self) -> int:
        """A Linux eventfd that becomes readable when completions are ready."""
        return self._efd

    def submit_batch_get(self, keys: list[str], bufs: list[memoryview]) -> int:
        """Fill each buffer with its key's block; per-key results say which loaded."""
        return self._submit_buffers(keys, bufs, self._do_get)

    def submit_batch_set(self, keys: list[str], bufs: list[memoryview]) -> int:
        """Store each buffer under its key; per-key results say which were stored."""
        return self._submit_buffers(keys, bufs, self._do_set)

    def submit_batch_exists(self, keys: list[str]) -> int:
        """Ask which keys are stored (one batch request)."""
        return self._submit_keys(keys, self._do_exists, groups=1)

    def submit_batch_delete(self, keys: list[str]) -> int:
        """Delete the keys; per-key results say which existed (and are now gone)."""
        return self._submit_keys(keys, self._do_delete, groups=self.num_workers)

    def drain_completions(self) -> list[Completion]:
        """Completions ready so far: `(future_id, ok, error, per_key_results)`."""
        with contextlib.suppress(BlockingIOError, OSError):
            os.eventfd_read(self._efd)
        out: list[Completion] = []
        with self._lock:
            while self._completions:
                out.append(self._completions.popleft())
        return out

    def close(self, grace_s: float = DEFAULT_CLOSE_GRACE_S) -> None:
        """Release everything, bounded: queued batches are dropped, in-flight ones get
        `grace_s` to finish and then have their connections cut. LMCache's buffers are
        not touched after this returns. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(self._client, grace_s)
        os.close(self._efd)

    # -- extras ------------------------------------------------------------------------
    @property
    def client(self) -> EpistemicGraphKVBackend:
        """The underlying HTTP client (stats, counters)."""
        return self._client

    # -- internals ---------------------------------------------------------------------
    def _submit_keys(
        self,
        keys: list[str],
        work: Callable[[list[str], list[memoryview]], list[bool]],
        *,
        groups: int,
    ) -> int:
        fid = next(self._ids)
        keys = list(keys)
        if not keys:
            self._complete(fid, True, "", [])
            return fid
        runs = _groups([1] * len(keys), groups)
        pending = _Pending(fid, len(keys), len(runs), needs_all=False)
        for idx in runs:
            self._spawn(pending, work, idx, [keys[i] for i in idx], [])
        return fid

    def _submit_buffers(
        self,
        keys: list[str],
        bufs: list[memoryview],
        work: Callable[[list[str], list[memoryview]], list[bool]],
    ) -> int:
        fid = next(self._ids)
        keys = list(keys)
        bufs = list(bufs)
        if len(keys) != len(bufs):
            self._complete(fid, False, "keys and buffers differ in length", [False] * len(keys))
            return fid
        if not keys:
            self._complete(fid, True, "", [])
            return fid
        try:
            sizes = [memoryview(b).nbytes for b in bufs]
        except TypeError as exc:
            self._complete(fid, False, f"bad buffer: {exc}", [False] * len(keys))
            return fid
        groups = _groups(sizes, self.num_workers)
        pending = _Pending(fid, len(keys), len(groups), needs_all=True)
        for idx in groups:
            self._spawn(pending, work, idx, [keys[i] for i in idx], [bufs[i] for i in idx])
        return fid

    def _spawn(
        self,
        pending: _Pending,
        work: Callable[[list[str], list[memoryview]], list[bool]],
        idx: list[int],
        keys: list[str],
        bufs: list[memoryview],
    ) -> None:
        def run() -> None:
            try:
                res = work(keys, bufs)
                err = ""
            except Exception as exc:
                self._quiet.failure(f"kv-cache L2 connector: batch of {len(keys)} keys", exc)
                res = [False] * len(keys)
                err = f"{type(exc).__name__}: {exc}"
            self._group_done(pending, idx, res, err)

        try:
            if self._closed:
                raise RuntimeError("connector closed")
            self._pool.submit(run)
        except RuntimeError:  # pool shut down
            self._group_done(pending, idx, [False] * len(idx), "connector closed")

    def _group_done(self, pending: _Pending, idx: list[int], res: list[bool], err: str) -> None:
        with pending.lock:
            for i, ok in zip(idx, res, strict=True):
                pending.results[i] = ok
            if err:
                pending.errors.append(err)
            pending.remaining -= 1
            last = pending.remaining == 0
        if last:
            error = "; ".join(pending.errors)
            ok = not error and (all(pending.results) or not pending.needs_all)
            if not ok and not error:
                missing = pending.results.count(False)
                error = f"{missing} of {len(pending.results)} keys not found or not stored"
            self._complete(pending.future_id, ok, error, pending.results)

    def _complete(self, fid: int, ok: bool, error: str, results: list[bool]) -> None:
        with self._lock:
            self._completions.append((fid, ok, error, results))
            closed = self._closed
        if not closed:
            with contextlib.suppress(OSError):  # fd closed during shutdown
                os.eventfd_write(self._efd, 1)

    def _do_get(self, keys: list[str], bufs: list[memoryview]) -> list[bool]:
        sizes = self._client.get_many_into(keys, bufs, exact=True)
        return [s is not None for s in sizes]

    def _do_set(self, keys: list[str], bufs: list[memoryview]) -> list[bool]:
        return [o.stored for o in self._client.put_many(list(zip(keys, bufs, strict=True)))]

    def _do_exists(self, keys: list[str], _bufs: list[memoryview]) -> list[bool]:
        return self._client.exists_many(keys)

    def _do_delete(self, keys: list[str], _bufs: list[memoryview]) -> list[bool]:
        return self._client.delete_many(keys)
