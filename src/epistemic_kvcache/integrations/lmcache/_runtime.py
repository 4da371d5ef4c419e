"""What both LMCache plugins share: the start-up check, a bounded worker pool, quiet logs.

- `open_client` builds the client and, unless told not to, makes one authenticated
  request, so a missing or wrong token, a wrong URL or a server that is not there fails
  LMCache's start with one clear `ConfigurationError` instead of a traceback per batch.
- `WorkPool` is a thread pool whose `shutdown` is bounded: queued work is cancelled, the
  work in flight gets `grace_s` to finish (none while the client's breaker is open: the
  server is known not to answer), then the client's connections are cut
  (`EpistemicGraphKVBackend.abort`) so every request fails at once, and only then are
  the threads joined. LMCache's buffers stay valid until `shutdown` returns, and no
  thread touches them afterwards.
- `QuietLog` logs a failing batch once per interval per kind (with a traceback only for
  unexpected exceptions), counting the rest: an expired token must not log 125
  tracebacks in 30 s.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from epistemic_kvcache.client.backend import EpistemicGraphKVBackend, KvCacheUnavailableError
from epistemic_kvcache.client.config import KvCacheConfig
from epistemic_kvcache.errors import (
    AuthError,
    ConfigurationError,
    ForbiddenError,
    KvCacheError,
    LocalProtocolError,
)

DEFAULT_CLOSE_GRACE_S = 1.0
"""How long `close()` lets requests in flight finish before cutting their connections."""


def open_client(config: KvCacheConfig, *, what: str, check: bool) -> EpistemicGraphKVBackend:
    """A client for `config`; with `check`, one request proves the URL and token work.

    Raises `ConfigurationError` naming the URL and the fix.
    """
    if not config.token:
        raise ConfigurationError(
            f"{what}: no token for {config.base_url}; set EPISTEMIC_GRAPH_KVCACHE_TOKEN "
            "(or give token_file) to the server's token"
        )
    client = EpistemicGraphKVBackend(config)
    if not check:
        return client
    try:
        client.check_connection()
    except AuthError:
        client.close()
        raise ConfigurationError(
            f"{what}: {config.base_url} refused the token (401); check "
            "EPISTEMIC_GRAPH_KVCACHE_TOKEN / token_file"
        ) from None  # the message says it all: one traceback in LMCache's log, not two
    except ForbiddenError as exc:
        client.close()
        raise ConfigurationError(
            f"{what}: {config.base_url} answered 403 forbidden to this token ({exc})"
        ) from None
    except (KvCacheUnavailableError, LocalProtocolError, ConfigurationError) as exc:
        client.close()
        raise ConfigurationError(
            f"{what}: cannot use the kv-cache server at {config.base_url}: {exc}. "
            "Start the server, fix base_url / addr, or pass check_on_start=false to "
            "start without it (lookups then miss until it answers)"
        ) from None
    return client


class QuietLog:
    """Rate-limited logging of failed batches: one line per kind per `interval_s`."""

    def __init__(self, log: logging.Logger, interval_s: float = 10.0) -> None:
        self._log = log
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def failure(self, what: str, exc: BaseException) -> None:
        """Log `exc` (traceback only for unexpected exceptions), at most once per kind."""
        kind = type(exc).__name__
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -self._interval_s) < self._interval_s:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return
            self._last[kind] = now
            more = self._suppressed.pop(kind, 0)
        extra = f" ({more} more like it since the last message)" if more else ""
        expected = isinstance(exc, KvCacheError)
        self._log.error("%s failed: %s: %s%s", what, kind, exc, extra, exc_info=not expected)


class WorkPool:
    """A thread pool with in-flight tracking and a bounded `shutdown`."""

    def __init__(self, workers: int, name: str) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix=name
        )
        self._cond = threading.Condition()
        self._inflight = 0
        self._closed = False

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run `fn` on the pool. RuntimeError once shut down."""

        def run() -> Any:
            with self._cond:
                self._inflight += 1
            try:
                return fn()
            finally:
                with self._cond:
                    self._inflight -= 1
                    self._cond.notify_all()

        if self._closed:
            raise RuntimeError("closed")
        return self._executor.submit(run)

    @property
    def closed(self) -> bool:
        return self._closed

    def shutdown(self, client: EpistemicGraphKVBackend, grace_s: float) -> None:
        """Cancel queued work, give running work `grace_s`, then abort the client's
        connections and join the threads. Idempotent."""
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)
        if client.breaker is not None and client.breaker.is_open:
            grace_s = 0.0  # the server is known not to answer: nothing will finish
        deadline = time.monotonic() + grace_s
        with self._cond:
            while self._inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        client.abort()
        self._executor.shutdown(wait=True)
