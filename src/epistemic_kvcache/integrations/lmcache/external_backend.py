"""`EpistemicGraphExternalBackend`: LMCache v1 storage plugin (Path A) over the client.

LMCache 0.5.6 loads it from the engine YAML (`docs/lmcache.md`, `deploy/lmcache/`):

    storage_plugins: ["epistemic_graph"]          # older name: external_backends
    extra_config:
      storage_plugin.epistemic_graph.module_path: >-
        epistemic_kvcache.integrations.lmcache.external_backend
      storage_plugin.epistemic_graph.class_name: EpistemicGraphExternalBackend
      storage_plugin.epistemic_graph.base_url: http://127.0.0.1:9130   # optional

How it works:
- Blocks are stored as the MemoryObj's raw bytes under `CacheEngineKey.to_string()`:
  no header and no second metadata key, so the bytes are identical to what the MP-mode
  adapters store and deduplicate against them, and any client can read them back.
- The shape needed to rebuild a MemoryObj comes from the engine's `LMCacheMetadata`
  (the full-chunk shape, as LMCache's remote connectors do); a shorter block is the
  last, partial chunk of a prompt and is reshaped to its token count. A block whose
  size fits neither is a miss.
- Reads go straight from the socket into a MemoryObj allocated from LMCache's local CPU
  backend (`get_into`); writes run on a small thread pool and report per key.
- Every transport failure is a miss / a failed store (the client degrades), never an
  exception into LMCache's engine. Lookups (`contains`, `batched_contains`) wait at most
  the client's lookup timeout (1 s), loads and stores its transfer timeout (2 s); after
  one timeout the client's circuit breaker answers at once until the server is back.
- `remove` / `batched_remove` delete on the server (LMCache's `clear` and eviction).
- The constructor checks the token and that the server answers (`check_on_start`), so a
  broken deployment fails LMCache's start once and clearly; `close()` is bounded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StorageBackendInterface

from epistemic_kvcache.client.backend import EpistemicGraphKVBackend
from epistemic_kvcache.client.config import KvCacheConfig, url_from_addr
from epistemic_kvcache.errors import ConfigurationError
from epistemic_kvcache.integrations.lmcache._runtime import (
    DEFAULT_CLOSE_GRACE_S,
    QuietLog,
    WorkPool,
    open_client,
)

if TYPE_CHECKING:
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

log = logging.getLogger(__name__)

PLUGIN_NAME = "epistemic_graph"
_PARAM_PREFIXES = (f"storage_plugin.{PLUGIN_NAME}.", f"external_backend.{PLUGIN_NAME}.")
_KNOWN_PARAMS = frozenset(
    {
        "module_path",
        "class_name",
        "base_url",
        "addr",
        "token",
        "token_file",
        "timeout_s",
        "num_workers",
        "max_connections",
        "ca_file",
        "client_cert",
        "client_key",
        "verify_tls",
        "lookup_timeout_s",
        "breaker_max_backoff_s",
        "check_on_start",
    }
)
_TRUE = (True, "true", "True", "1", 1)
_FALSE = (False, "false", "False", "0", 0)


def plugin_params(extra_config: dict[str, Any] | None) -> dict[str, Any]:
    """Our settings from LMCache's `extra_config` (`storage_plugin.epistemic_graph.*`)."""
    out: dict[str, Any] = {}
    for key, value in (extra_config or {}).items():
        for prefix in _PARAM_PREFIXES:
            if isinstance(key, str) and key.startswith(prefix):
                name = key[len(prefix) :]
                if name not in _KNOWN_PARAMS:
                    raise ConfigurationError(
                        f"invalid extra_config key {key!r}: unknown setting {name!r} "
                        f"(known: {', '.join(sorted(_KNOWN_PARAMS))})"
                    )
                out[name] = value
    return out


def check_on_start(params: dict[str, Any]) -> bool:
    """The `check_on_start` plugin parameter (default true)."""
    value = params.get("check_on_start", True)
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigurationError(f"invalid check_on_start: expected true or false (got {value!r})")


def config_from_params(params: dict[str, Any]) -> tuple[KvCacheConfig, int]:
    """`KvCacheConfig.from_env` overridden by plugin params; also the worker count."""
    if params.get("verify_tls", True) not in _TRUE:
        raise ConfigurationError(
            "invalid verify_tls: TLS verification cannot be disabled; use http:// on "
            "loopback or trust the server's CA (ca_file / SSL_CERT_FILE)"
        )
    overrides: dict[str, Any] = {}
    if params.get("base_url") and params.get("addr"):
        raise ConfigurationError("invalid settings: give base_url or addr, not both")
    if params.get("base_url"):
        overrides["base_url"] = str(params["base_url"])
    elif params.get("addr"):
        overrides["base_url"] = url_from_addr(str(params["addr"]))
    if params.get("token_file"):
        try:
            with open(str(params["token_file"]), encoding="utf-8") as fh:
                overrides["token"] = fh.read().strip()
        except OSError as exc:
            raise ConfigurationError(f"invalid token_file: {exc}") from exc
    elif params.get("token"):
        overrides["token"] = str(params["token"])
    for name in ("ca_file", "client_cert", "client_key"):
        if params.get(name):
            overrides[name] = str(params[name])
    try:
        num_workers = int(params.get("num_workers", 4))
        if params.get("timeout_s") is not None:
            overrides["read_timeout_s"] = float(params["timeout_s"])
        for name in ("lookup_timeout_s", "breaker_max_backoff_s"):
            if params.get(name) is not None:
                overrides[name] = float(params[name])
        if params.get("max_connections") is not None:
            overrides["max_connections"] = int(params["max_connections"])
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"invalid storage plugin setting: {exc}") from exc
    if num_workers < 1:
        raise ConfigurationError(f"invalid num_workers: expected >= 1 (got {num_workers})")
    overrides.setdefault("max_connections", max(num_workers * 2, 4))
    return KvCacheConfig.from_env(**overrides), num_workers


class EpistemicGraphExternalBackend(StorageBackendInterface):  # type: ignore[misc]
    """LMCache v1 storage backend backed by an epistemic-kvcache server (Path A)."""

    def __init__(
        self,
        config: LMCacheEngineConfig,
        metadata: LMCacheMetadata,
        local_cpu_backend: Any,
        loop: asyncio.AbstractEventLoop | None = None,
        dst_device: str = "cpu",
        **_ignored: Any,
    ) -> None:
        super().__init__(dst_device=dst_device)
        if local_cpu_backend is None:
            raise ConfigurationError(
                "EpistemicGraphExternalBackend needs LMCache's local CPU backend to "
                "allocate memory for reads (local_cpu_backend is None)"
            )
        params = plugin_params(config.extra_config)
        kv_config, num_workers = config_from_params(params)
        self._client = open_client(
            kv_config, what="kv-cache storage plugin", check=check_on_start(params)
        )
        self._local_cpu_backend = local_cpu_backend
        self._loop = loop
        self._pool = WorkPool(num_workers, "kvcache-ext")
        self._quiet = QuietLog(log)
        self._put_lock = threading.Lock()
        self._put_tasks: dict[CacheEngineKey, int] = {}
        self._shapes: list[torch.Size] = list(metadata.get_shapes())
        self._dtypes: list[torch.dtype] = list(metadata.get_dtypes())
        self._fmt = MemoryFormat.KV_MLA_FMT if metadata.use_mla else MemoryFormat.KV_2LTD
        self._full_bytes = sum(
            s.numel() * d.itemsize for s, d in zip(self._shapes, self._dtypes, strict=True)
        )
        chunk = int(metadata.chunk_size) or 1
        self._token_bytes = self._full_bytes // chunk if self._full_bytes % chunk == 0 else 0
        self._closed = False

    def __str__(self) -> str:
        return f"EpistemicGraphExternalBackend({self._client.config.base_url})"

    @property
    def client(self) -> EpistemicGraphKVBackend:
        """The underlying HTTP client (stats, counters)."""
        return self._client

    # -- lookups -------------------------------------------------------------------------
    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        """Whether the server holds `key` (`pin` is a no-op: the server owns eviction)."""
        return self._client.exists(key.to_string())

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        """Number of leading keys the server holds (one batch request)."""
        found = self._client.exists_many([k.to_string() for k in keys])
        hits = 0
        for f in found:
            if not f:
                break
            hits += 1
        return hits

    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        """`batched_contains` without blocking the event loop."""
        return await asyncio.wrap_future(self._pool.submit(lambda: self.batched_contains(keys)))

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        """Whether a store of `key` is in flight."""
        with self._put_lock:
            return key in self._put_tasks

    # -- stores --------------------------------------------------------------------------
    def batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[CacheEngineKey], None] | None = None,
    ) -> list[concurrent.futures.Future[list[bool]]] | None:
        """Store the objects asynchronously (one batch PUT); callback per stored key."""
        keys = list(keys)
        if len(keys) != len(objs):
            raise ValueError("keys and objs differ in length")
        if not keys or self._closed:
            return None
        for obj in objs:
            obj.ref_count_up()
        with self._put_lock:
            for k in keys:
                self._put_tasks[k] = self._put_tasks.get(k, 0) + 1

        def run() -> list[bool]:
            try:
                items = [(k.to_string(), obj.byte_array) for k, obj in zip(keys, objs, strict=True)]
                return [o.stored for o in self._client.put_many(items)]
            except Exception as exc:
                self._quiet.failure(f"kv-cache storage plugin: store of {len(keys)} chunks", exc)
                return [False] * len(keys)
            finally:
                for obj in objs:
                    obj.ref_count_down()
                with self._put_lock:
                    for k in keys:
                        left = self._put_tasks.get(k, 1) - 1
                        if left <= 0:
                            self._put_tasks.pop(k, None)
                        else:
                            self._put_tasks[k] = left

        try:
            future: concurrent.futures.Future[list[bool]] = self._pool.submit(run)
        except RuntimeError:  # closed meanwhile
            run()
            return None
        if on_complete_callback is not None:

            def done(f: concurrent.futures.Future[list[bool]]) -> None:
                for k, ok in zip(keys, f.result(), strict=True):
                    if not ok:
                        continue
                    try:
                        on_complete_callback(k)
                    except Exception:
                        log.exception("on_complete_callback failed for %s", k)

            future.add_done_callback(done)
        return [future]

    async def async_batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[CacheEngineKey], None] | None = None,
    ) -> None:
        """Store and wait for the result without blocking the event loop."""
        futures = self.batched_submit_put_task(keys, objs, transfer_spec, on_complete_callback)
        for f in futures or ():
            await asyncio.wrap_future(f)

    # -- loads ---------------------------------------------------------------------------
    def _allocate(self) -> MemoryObj | None:
        shapes: Any = self._shapes[0] if len(self._shapes) == 1 else self._shapes
        dtypes: Any = self._dtypes[0] if len(self._dtypes) == 1 else self._dtypes
        obj: MemoryObj | None = self._local_cpu_backend.allocate(shapes, dtypes, self._fmt)
        return obj

    def _finish(self, obj: MemoryObj, n: int | None) -> MemoryObj | None:
        """Keep `obj` when `n` bytes make a full or a valid partial chunk."""
        if n is None:
            obj.ref_count_down()
            return None
        if n == self._full_bytes:
            return obj
        shape = list(obj.meta.shape)
        if (
            n > 0
            and self._token_bytes
            and n % self._token_bytes == 0
            and len(self._shapes) == 1
            and len(shape) == 4
        ):
            # The last chunk of a prompt: fewer tokens (dim 2 of [kv, layers, tokens, hidden]).
            shape[2] = n // self._token_bytes
            obj.raw_data = obj.raw_data[:n]
            obj.meta.shape = torch.Size(shape)
            if hasattr(obj, "group_prefix_sum"):
                obj.group_prefix_sum = [0, n]
            return obj
        log.warning("kv-cache block of %d bytes fits no chunk shape; treated as a miss", n)
        obj.ref_count_down()
        return None

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        """Read one chunk into a freshly allocated MemoryObj, or None."""
        obj = self._allocate()
        if obj is None:
            log.warning("kv-cache storage plugin: no CPU memory to load %s", key)
            return None
        n = self._client.get_into(key.to_string(), obj.byte_array, exact=False)
        return self._finish(obj, n)

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """Read many chunks with one batch request."""
        objs: list[MemoryObj] = []
        for _ in keys:
            obj = self._allocate()
            if obj is None:
                break
            objs.append(obj)
        sizes = self._client.get_many_into(
            [k.to_string() for k in keys[: len(objs)]], [o.byte_array for o in objs], exact=False
        )
        out: list[MemoryObj | None] = [self._finish(o, n) for o, n in zip(objs, sizes, strict=True)]
        out.extend([None] * (len(keys) - len(objs)))
        return out

    def get_non_blocking(
        self, key: CacheEngineKey, location: str | None = None
    ) -> concurrent.futures.Future[MemoryObj | None]:
        """`get_blocking` on the plugin's thread pool."""
        return self._pool.submit(lambda: self.get_blocking(key))

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[CacheEngineKey], transfer_spec: Any = None
    ) -> list[MemoryObj]:
        """The leading chunks that loaded (stops at the first miss)."""
        got = await asyncio.wrap_future(self._pool.submit(lambda: self.batched_get_blocking(keys)))
        out: list[MemoryObj] = []
        for i, obj in enumerate(got):
            if obj is None:
                for rest in got[i + 1 :]:
                    if rest is not None:
                        rest.ref_count_down()
                break
            out.append(obj)
        return out

    # -- the rest of the interface -------------------------------------------------------
    def pin(self, key: CacheEngineKey) -> bool:
        """No-op (the server's tiers decide what stays); True like LMCache's RemoteBackend."""
        return True

    def unpin(self, key: CacheEngineKey) -> bool:
        """No-op, see `pin`."""
        return True

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        """Delete `key` on the server; True when it existed."""
        return self._client.delete(key.to_string())

    def batched_remove(self, keys: list[CacheEngineKey], force: bool = True) -> int:
        """Delete the keys on the server; how many existed."""
        return sum(self._client.delete_many([k.to_string() for k in keys]))

    def touch_cache(self) -> None:
        """No-op: the server tracks its own recency."""

    def get_allocator_backend(self) -> Any:
        """LMCache's local CPU backend, which allocates the MemoryObjs we load into."""
        return self._local_cpu_backend

    def close(self, grace_s: float = DEFAULT_CLOSE_GRACE_S) -> None:
        """Bounded: queued work is dropped, work in flight gets `grace_s` to finish, then
        its connections are cut. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(self._client, grace_s)
