"""Where compiled bundles are cached, and how the compiler picks that place.

The compiler needs only `get(key) -> bytes | None` and `put(key, bytes) -> bool` — the
seam of `EpistemicGraphKVBackend`, so bundles share the KV server with KV blocks.
`resolve_context_compiler_cache()` applies the chain:

1. an explicit override from `set_context_compiler_cache(backend)` (`None` clears it);
2. with `MODEL_CONTEXT_COMPILER_CACHE_ENABLED=true` and `EPISTEMIC_GRAPH_KVCACHE_URL` or
   `_ADDR` set, `EpistemicGraphKVBackend.from_env()`, built lazily on first use and
   rebuilt when those variables change;
3. a process-wide `TTLBundleCache` (bounded LRU whose entries expire).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from epistemic_kvcache.errors import ConfigurationError

log = logging.getLogger(__name__)

ENV_ENABLED = "MODEL_CONTEXT_COMPILER_CACHE_ENABLED"
ENV_URL = "EPISTEMIC_GRAPH_KVCACHE_URL"
ENV_ADDR = "EPISTEMIC_GRAPH_KVCACHE_ADDR"
_CLIENT_ENV = (
    ENV_URL,
    ENV_ADDR,
    "EPISTEMIC_GRAPH_KVCACHE_TOKEN",
    "EPISTEMIC_GRAPH_KVCACHE_CLIENT_CERT",
    "EPISTEMIC_GRAPH_KVCACHE_CLIENT_KEY",
)

DEFAULT_TTL_S = 900.0
"""Fifteen minutes: long enough to span a conversation's turns, short enough that a
process never serves a bundle compiled against long-gone evidence."""
DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
"""A bundle of a few thousand tokens is tens of KiB; 64 MiB holds thousands of them."""


@runtime_checkable
class BundleCacheBackend(Protocol):
    """The duck-typed cache seam (what `EpistemicGraphKVBackend` offers)."""

    def get(self, key: str) -> bytes | None:
        """The stored bytes, or `None` on a miss."""
        ...

    def put(self, key: str, value: bytes) -> object:
        """Store; truthy when the backend accepted the bytes (the client returns a
        `PutOutcome`)."""
        ...


class NullBundleCache:
    """A cache that never holds anything: pass it to compile without caching."""

    def get(self, key: str) -> bytes | None:
        """Always a miss."""
        return None

    def put(self, key: str, value: bytes) -> bool:
        """Stores nothing."""
        return False


class TTLBundleCache:
    """In-process, thread-safe LRU bounded by entries and bytes, entries expire after
    `ttl_s`."""

    def __init__(
        self,
        *,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries < 1:
            raise ValueError(f"invalid max_entries: expected >= 1 (got {max_entries})")
        if max_bytes < 1:
            raise ValueError(f"invalid max_bytes: expected >= 1 (got {max_bytes})")
        if not ttl_s > 0:
            raise ValueError(f"invalid ttl_s: expected > 0 (got {ttl_s})")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes currently held."""
        return self._bytes

    def get(self, key: str) -> bytes | None:
        """The bytes if present and not expired (refreshes recency), else `None`."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            expires, value = entry
            if self._clock() >= expires:
                del self._entries[key]
                self._bytes -= len(value)
                return None
            self._entries.move_to_end(key)
            return value

    def put(self, key: str, value: bytes) -> bool:
        """Store (replacing), evicting least recently used entries to fit; `False` when
        the value alone exceeds `max_bytes`."""
        value = bytes(value)
        if len(value) > self.max_bytes:
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= len(old[1])
            self._entries[key] = (self._clock() + self.ttl_s, value)
            self._bytes += len(value)
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._bytes -= len(dropped)
            return True

    def delete(self, key: str) -> bool:
        """Remove `key`; `True` when it was present."""
        with self._lock:
            old = self._entries.pop(key, None)
            if old is None:
                return False
            self._bytes -= len(old[1])
            return True


_lock = threading.Lock()
_override: BundleCacheBackend | None = None
_remote: tuple[tuple[str | None, ...], BundleCacheBackend] | None = None
_local: TTLBundleCache | None = None


def set_context_compiler_cache(backend: BundleCacheBackend | None) -> None:
    """Make `backend` the cache every compile without an explicit `kv_backend` uses;
    `None` clears the override and the resolution chain applies again."""
    global _override
    with _lock:
        _override = backend


def _enabled() -> bool:
    raw = os.environ.get(ENV_ENABLED, "").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("", "0", "false", "no", "off"):
        return False
    raise ConfigurationError(
        f"invalid {ENV_ENABLED}: expected true/false (got {os.environ[ENV_ENABLED]!r})"
    )


def _build_remote() -> BundleCacheBackend:
    try:
        from epistemic_kvcache.client import EpistemicGraphKVBackend
    except ImportError as exc:
        raise ConfigurationError(
            f"{ENV_ENABLED}=true and {ENV_URL}/{ENV_ADDR} are set, but "
            f"epistemic_kvcache.client.EpistemicGraphKVBackend cannot be imported: {exc}"
        ) from exc
    backend: BundleCacheBackend = EpistemicGraphKVBackend.from_env()
    return backend


def resolve_context_compiler_cache() -> BundleCacheBackend:
    """The bundle cache to use now: override > remote (when enabled) > in-process."""
    global _remote, _local
    with _lock:
        if _override is not None:
            return _override
        env = tuple(os.environ.get(name) or None for name in _CLIENT_ENV)
        if _enabled() and (env[0] or env[1]):
            if _remote is None or _remote[0] != env:
                old = _remote
                _remote = (env, _build_remote())
                if old is not None:
                    _close(old[1])
                log.info("context bundle cache: remote KV server (%s)", env[0] or env[1])
            return _remote[1]
        if _local is None:
            _local = TTLBundleCache()
        return _local


def _close(backend: object) -> None:
    close = getattr(backend, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # a failing close of a replaced client must not break callers
            log.warning("closing the previous bundle cache backend failed", exc_info=True)


def reset_context_compiler_cache() -> None:
    """Forget the override, the remote client (closing it) and the in-process cache."""
    global _override, _remote, _local
    with _lock:
        old = _remote
        _override, _remote, _local = None, None, None
    if old is not None:
        _close(old[1])
