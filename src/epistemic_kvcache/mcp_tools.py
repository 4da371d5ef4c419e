"""`epistemic-kvcache mcp`: the store as MCP tools, with the caller's rights only.

How it works
- Three tools, each an `action` plus its arguments: `graph_kvcache` (stats, exists,
  list, delete), `graph_fork` (snapshot, fork, branch, list, delete) and
  `graph_kv_checkpoint` (create, restore, list). `KvCacheTools` holds their logic over
  our HTTP client (`EpistemicGraphKVBackend`); `build_server` registers each method
  with the official MCP SDK (`mcp.server.mcpserver.MCPServer`): the method's signature
  (less `self`) is the tool's input schema and its docstring the tool's description,
  so a tool's parameters are written once.
- This process holds no credentials of its own. Over stdio it serves one caller, the
  process that started it, with the token in that caller's environment
  (`EPISTEMIC_GRAPH_KVCACHE_TOKEN`). Over streamable HTTP every request must carry
  `Authorization: Bearer <token>`; the SDK's bearer middleware asks `KvCacheTokenVerifier`,
  which checks the token against the kvcache server itself (`GET /kv/stats`), and the
  tools then talk to the server with exactly that token. So a tool can never do more
  than its caller's token allows: tenant isolation, quotas and auth stay the server's.
- The tenant is what the server says the token belongs to (`/kv/stats` namespace); the
  checkpoint tool binds checkpoints to it, so no caller can name another tenant.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import inspect
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Literal

from epistemic_kvcache.checkpoints import (
    RECORD_PREFIX,
    CheckpointError,
    CheckpointKey,
    CheckpointRecord,
    KVCheckpointStore,
)
from epistemic_kvcache.client.backend import EpistemicGraphKVBackend, KvCacheUnavailableError
from epistemic_kvcache.client.config import KvCacheConfig
from epistemic_kvcache.errors import AuthError, ConfigurationError, ForbiddenError, KvCacheError
from epistemic_kvcache.install import require_extra

log = logging.getLogger(__name__)

MAX_LIST = 1000
"""Most keys / checkpoints one tool call lists (pass `after` to page on)."""
MAX_INLINE_BLOB_BYTES = 4 * 1024 * 1024
"""Checkpoint blobs travel base64 in tool results only up to this size; larger ones are
read from the server directly (the result names the key)."""
TOKEN_CACHE_S = 30.0
"""A verified token is trusted this long before it is checked with the server again."""
MAX_CLIENTS = 64
"""HTTP mode: pooled clients kept (one per recent caller token)."""


KvAction = Literal["stats", "exists", "list", "delete"]
ForkAction = Literal["snapshot", "fork", "branch", "list", "delete"]
CheckpointAction = Literal["create", "restore", "list"]
"""Each tool's actions: its input schema's `action` enum (the tool still refuses others)."""


class ToolFailure(KvCacheError):
    """A tool call that cannot be done as asked; the message goes back to the caller."""


def _jsonable(obj: Any) -> Any:
    return obj.to_dict() if hasattr(obj, "to_dict") else obj


class KvCacheTools:
    """The three tools' logic over one client (the caller's token)."""

    def __init__(self, client: EpistemicGraphKVBackend) -> None:
        self.client = client
        self._tenant: str | None = None

    def tenant(self) -> str:
        """The namespace the server gives this client's token."""
        if self._tenant is None:
            stats = self.client.stats()
            if stats is None:
                raise ToolFailure("the kvcache server is unreachable")
            self._tenant = stats.namespace
        return self._tenant

    # -- graph_kvcache ----------------------------------------------------------------
    def graph_kvcache(
        self,
        action: KvAction,
        key: str | None = None,
        prefix: str = "",
        after: str | None = None,
        limit: int = 100,
    ) -> dict[str, Any]:
        """Inspect the caller's namespace of the KV-cache store.

        action: `stats` (the namespace's counters and tier occupancy), `exists` (is `key`
        stored, and its size), `list` (keys starting with `prefix`, sorted, at most
        `limit`, after `after`; `next_after` pages on), `delete` (remove `key`).
        """
        if action == "stats":
            stats = self.client.stats()
            if stats is None:
                raise ToolFailure("the kvcache server is unreachable")
            return dict(stats.raw)
        if action == "list":
            n = max(1, min(int(limit), MAX_LIST))
            keys = self.client.list_keys(prefix, after=after, limit=n + 1)
            more = len(keys) > n
            keys = keys[:n]
            return {"keys": keys, "next_after": keys[-1] if more else None}
        if key is None:
            raise ToolFailure(f"action {action!r} needs a key")
        if action == "exists":
            size = self.client.size(key)
            return {"key": key, "exists": size is not None, "size": size}
        if action == "delete":
            return {"key": key, "deleted": self.client.delete(key)}
        raise ToolFailure(f"unknown action {action!r}: stats, exists, list or delete")

    # -- graph_fork -------------------------------------------------------------------
    def graph_fork(
        self,
        action: ForkAction,
        snapshot_id: str | None = None,
        branch_id: str | None = None,
        keys: list[str] | None = None,
        prefix: str | None = None,
        ttl_s: float | None = None,
    ) -> dict[str, Any]:
        """Snapshots and copy-on-write branches of the caller's namespace (no bytes copied).

        action: `snapshot` (of `keys`, or of every key with `prefix`, or of the whole
        namespace; optional `ttl_s`), `fork` (a new branch over `snapshot_id`), `branch`
        (the branch `branch_id`, or every branch), `list` (snapshots and branches),
        `delete` (the branch `branch_id`, or the snapshot `snapshot_id`).
        """
        c = self.client
        if action == "snapshot":
            info = c.snapshot(keys=keys, prefix=prefix, ttl_s=ttl_s)
            if info is None:
                raise ToolFailure("snapshot failed (server unreachable or without snapshots)")
            return {"snapshot": info.to_dict()}
        if action == "fork":
            if snapshot_id is None:
                raise ToolFailure("fork needs snapshot_id")
            branch = c.fork(snapshot_id)
            if branch is None:
                raise ToolFailure(f"no snapshot {snapshot_id!r} to fork")
            return {"branch": branch.to_dict()}
        if action == "branch":
            if branch_id is None:
                return {"branches": [b.to_dict() for b in c.list_branches()]}
            found = c.branch_info(branch_id)
            if found is None:
                raise ToolFailure(f"no branch {branch_id!r}")
            return {"branch": found.to_dict()}
        if action == "list":
            return {
                "snapshots": [s.to_dict() for s in c.list_snapshots()],
                "branches": [b.to_dict() for b in c.list_branches()],
            }
        if action == "delete":
            if branch_id is not None:
                return {"branch_id": branch_id, "deleted": c.delete_branch(branch_id)}
            if snapshot_id is not None:
                return {"snapshot_id": snapshot_id, "deleted": c.delete_snapshot(snapshot_id)}
            raise ToolFailure("delete needs snapshot_id or branch_id")
        raise ToolFailure(f"unknown action {action!r}: snapshot, fork, branch, list or delete")

    # -- graph_kv_checkpoint ----------------------------------------------------------
    def graph_kv_checkpoint(
        self,
        action: CheckpointAction,
        checkpoint_id: str | None = None,
        model: str | None = None,
        quantization: str = "none",
        engine: str = "vllm",
        engine_version: str = "",
        prefix_digest: str | None = None,
        policy_version: str = "1",
        blob_base64: str | None = None,
        metadata: dict[str, Any] | None = None,
        conversation_id: str | None = None,
        allow_cold_start: bool = False,
        include_blob: bool = False,
    ) -> dict[str, Any]:
        """KV checkpoints bound to the caller's tenant and a policy version.

        action: `create` (store `blob_base64` under the id derived from model,
        quantization, engine, engine_version, prefix_digest, the caller's tenant and
        policy_version; returns the id), `restore` (load `checkpoint_id` for
        `conversation_id` under `policy_version`: refused for another tenant or policy
        unless `allow_cold_start`; `include_blob` returns the bytes up to 4 MiB), `list`
        (the tenant's checkpoints).
        """
        store = KVCheckpointStore(self.client)
        tenant = self.tenant()
        try:
            if action == "create":
                if model is None or prefix_digest is None or blob_base64 is None:
                    raise ToolFailure("create needs model, prefix_digest and blob_base64")
                try:
                    blob = base64.b64decode(blob_base64, validate=True)
                except (binascii.Error, ValueError) as exc:
                    raise ToolFailure(f"blob_base64 is not base64 ({exc})") from None
                key = CheckpointKey(
                    model, quantization, engine, engine_version, prefix_digest, tenant,
                    policy_version,
                )  # fmt: skip
                record = store.create_checkpoint(key, blob, metadata)
                return {"checkpoint": _record_dict(record)}
            if action == "restore":
                if checkpoint_id is None:
                    raise ToolFailure("restore needs checkpoint_id")
                restored = store.restore_conversation(
                    checkpoint_id,
                    conversation_id or uuid.uuid4().hex,
                    tenant,
                    policy_version,
                    allow_cold_start=allow_cold_start,
                )
                out: dict[str, Any] = {
                    "conversation_id": restored.conversation_id,
                    "cold_start": restored.cold_start,
                    "reason": restored.reason,
                    "provenance_key": restored.provenance_key,
                }
                if restored.checkpoint is not None:
                    rec = restored.checkpoint.record
                    out["checkpoint"] = _record_dict(rec)
                    out["blob_key"] = rec.blob_key
                    if include_blob:
                        if rec.blob_size > MAX_INLINE_BLOB_BYTES:
                            raise ToolFailure(
                                f"blob of {rec.blob_size} bytes is over the inline limit "
                                f"({MAX_INLINE_BLOB_BYTES}); GET {rec.blob_key} from the server"
                            )
                        out["blob_base64"] = base64.b64encode(restored.checkpoint.blob).decode()
                return out
            if action == "list":
                return {"checkpoints": self._list_checkpoints(tenant)}
        except CheckpointError as exc:
            raise ToolFailure(f"{type(exc).__name__}: {exc}") from None
        raise ToolFailure(f"unknown action {action!r}: create, restore or list")

    def _list_checkpoints(self, tenant: str) -> list[dict[str, Any]]:
        keys = self.client.list_keys(RECORD_PREFIX, limit=MAX_LIST)
        out = []
        for key, data in zip(keys, self.client.get_many(keys), strict=True):
            if data is None:
                continue
            try:
                record = CheckpointRecord.from_json(data, key[len(RECORD_PREFIX) :])
            except CheckpointError:
                out.append({"id": key[len(RECORD_PREFIX) :], "error": "corrupt record"})
                continue
            if record.key.tenant == tenant:
                out.append(_record_dict(record))
        return out


def _record_dict(record: CheckpointRecord) -> dict[str, Any]:
    k = record.key
    return {
        "id": record.id,
        "model": k.model,
        "quantization": k.quantization,
        "engine": k.engine,
        "engine_version": k.engine_version,
        "prefix_digest": k.prefix_digest,
        "tenant": k.tenant,
        "policy_version": k.policy_version,
        "blob_digest": record.blob_digest,
        "blob_size": record.blob_size,
        "created_at": record.created_at,
        "metadata": record.metadata,
    }


# -- clients per caller ----------------------------------------------------------------


class ClientPool:
    """HTTP mode: one client per caller token (LRU, closed on eviction); token checks
    cached for `TOKEN_CACHE_S`."""

    def __init__(self, base: KvCacheConfig, max_clients: int = MAX_CLIENTS) -> None:
        self.base = base.with_overrides(token=None)
        self.max_clients = max_clients
        self._clients: OrderedDict[str, EpistemicGraphKVBackend] = OrderedDict()
        self._verified: dict[str, tuple[float, str]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _id(token: str) -> str:
        return hashlib.sha256(token.encode()).hexdigest()

    def client(self, token: str) -> EpistemicGraphKVBackend:
        tid = self._id(token)
        with self._lock:
            c = self._clients.get(tid)
            if c is not None:
                self._clients.move_to_end(tid)
                return c
            c = EpistemicGraphKVBackend(self.base.with_overrides(token=token))
            self._clients[tid] = c
            while len(self._clients) > self.max_clients:
                _, old = self._clients.popitem(last=False)
                old.close()
            return c

    def verify(self, token: str) -> str | None:
        """The tenant of `token` per the kvcache server, or None if it refuses the token."""
        tid = self._id(token)
        now = time.monotonic()
        hit = self._verified.get(tid)
        if hit is not None and now - hit[0] < TOKEN_CACHE_S:
            return hit[1]
        try:
            stats = self.client(token).stats()
        except (AuthError, ForbiddenError):
            return None
        if stats is None:
            return None
        with self._lock:
            self._verified[tid] = (now, stats.namespace)
            if len(self._verified) > 4 * self.max_clients:
                self._verified.pop(next(iter(self._verified)))
        return stats.namespace

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()


# -- the MCP server ----------------------------------------------------------------------


def build_server(
    tools_for_caller: Callable[[], KvCacheTools],
    *,
    http_auth: tuple[ClientPool, str, str] | None = None,
) -> Any:
    """An `MCPServer` with the three tools. `tools_for_caller` gives the tools bound to the
    current caller's token. `http_auth`: (pool, kvcache base URL, this server's URL) turns
    on bearer authentication for streamable HTTP."""
    import anyio.to_thread
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
    from mcp.types import ToolAnnotations

    from epistemic_kvcache._version import __version__

    kwargs: dict[str, Any] = {}
    if http_auth is not None:
        from mcp.server.auth.provider import AccessToken
        from mcp.server.auth.settings import AuthSettings
        from pydantic import AnyHttpUrl

        pool, kv_url, self_url = http_auth

        class KvCacheTokenVerifier:
            """Accepts exactly the tokens the kvcache server accepts."""

            async def verify_token(self, token: str) -> AccessToken | None:
                tenant = await anyio.to_thread.run_sync(pool.verify, token)
                if tenant is None:
                    return None
                return AccessToken(token=token, client_id=tenant, scopes=[], subject=tenant)

        kwargs["token_verifier"] = KvCacheTokenVerifier()
        kwargs["auth"] = AuthSettings(
            issuer_url=AnyHttpUrl(kv_url),
            resource_server_url=AnyHttpUrl(self_url),
            validate_token_resource=False,
        )

    server = MCPServer(
        name="epistemic-kvcache",
        version=__version__,
        instructions=(
            "Inspect and manage an epistemic-kvcache store with the caller's own token: "
            "graph_kvcache (stats, exists, list, delete keys), graph_fork (snapshots and "
            "copy-on-write branches), graph_kv_checkpoint (tenant-bound KV checkpoints)."
        ),
        **kwargs,
    )

    def register(method: Callable[..., dict[str, Any]], annotations: ToolAnnotations) -> None:
        """Publish a `KvCacheTools` method as a tool: its signature less `self` is the
        tool's input schema, its docstring the description; a call runs the method on a
        worker thread with the caller's tools."""
        sig = inspect.signature(method, eval_str=True)
        params = list(sig.parameters.values())[1:]

        async def tool(**args: Any) -> dict[str, Any]:
            tools = tools_for_caller()

            def run() -> dict[str, Any]:
                try:
                    return method(tools, **args)
                except (ToolFailure, ValueError, KvCacheError) as exc:
                    raise ToolError(str(exc)) from None

            result: dict[str, Any] = await anyio.to_thread.run_sync(run)
            return result

        tool.__name__ = tool.__qualname__ = method.__name__
        tool.__doc__ = method.__doc__
        tool.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        tool.__annotations__ = {p.name: p.annotation for p in params}
        tool.__annotations__["return"] = sig.return_annotation
        server.tool(annotations=annotations)(tool)

    register(
        KvCacheTools.graph_kvcache, ToolAnnotations(destructive_hint=True, idempotent_hint=True)
    )
    register(KvCacheTools.graph_fork, ToolAnnotations(destructive_hint=True))
    register(KvCacheTools.graph_kv_checkpoint, ToolAnnotations(destructive_hint=False))

    return server


# -- the subcommand ---------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `epistemic-kvcache mcp`."""
    parser.add_argument(
        "--transport",
        choices=("stdio", "http"),
        default="stdio",
        help="stdio (one caller: the token in EPISTEMIC_GRAPH_KVCACHE_TOKEN) or streamable "
        "HTTP (each request's own Authorization: Bearer token); default stdio",
    )
    parser.add_argument(
        "--listen",
        default="127.0.0.1:9140",
        metavar="HOST:PORT",
        help="HTTP transport: listen address (default 127.0.0.1:9140)",
    )
    parser.add_argument(
        "--public-url",
        default=None,
        metavar="URL",
        help="HTTP transport: this server's URL as clients reach it (default http://<listen>/mcp)",
    )
    parser.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="HOST[:PORT]",
        help="HTTP transport: also accept this Host header (repeatable; DNS-rebinding guard)",
    )


def _check_server(client: EpistemicGraphKVBackend, *, with_token: bool) -> None:
    """At start: the kv-cache server answers (and, `with_token`, accepts the token), so a
    wrong URL or token fails now, once, instead of in every tool call."""
    url = client.config.base_url
    if not with_token:
        if not client.health():
            raise KvCacheUnavailableError(
                f"kv-cache server at {url} is not answering /healthz "
                "(set EPISTEMIC_GRAPH_KVCACHE_URL)"
            )
        return
    try:
        client.check_connection()
    except ForbiddenError as exc:
        raise ConfigurationError(
            f"invalid EPISTEMIC_GRAPH_KVCACHE_TOKEN: the server at {url} accepts it but "
            f"forbids this tenant's /kv requests ({exc})"
        ) from None
    except AuthError:
        raise ConfigurationError(
            f"invalid EPISTEMIC_GRAPH_KVCACHE_TOKEN: the server at {url} refused it "
            "(401: not a token it knows)"
        ) from None


def run(args: argparse.Namespace) -> int:
    """Serve the tools until stdin closes (stdio) or SIGINT/SIGTERM (HTTP)."""
    require_extra("mcp", "mcp")
    base = KvCacheConfig.from_env()
    if args.transport == "stdio":
        if base.token is None:
            raise ConfigurationError(
                "missing EPISTEMIC_GRAPH_KVCACHE_TOKEN: the stdio transport acts with the "
                "caller's token; set it in the environment of this process"
            )
        client = EpistemicGraphKVBackend(base)
        try:
            _check_server(client, with_token=True)
        except BaseException:
            client.close()
            raise
        tools = KvCacheTools(client)
        server = build_server(lambda: tools)
        logging.getLogger("epistemic_kvcache").info("mcp: stdio, kvcache server %s", base.base_url)
        try:
            server.run("stdio")
        finally:
            client.close()
        return 0
    return _run_http(args, base)


def _run_http(args: argparse.Namespace, base: KvCacheConfig) -> int:
    from mcp.server.auth.middleware.auth_context import get_access_token
    from mcp.server.transport_security import TransportSecuritySettings

    from epistemic_kvcache.config import parse_address

    try:
        addr = parse_address(args.listen)
    except Exception as exc:
        raise ConfigurationError(
            f"invalid --listen: expected host:port (got {args.listen!r})"
        ) from exc
    if not addr.is_loopback:
        log.warning("mcp: listening on %s without TLS: put a TLS proxy in front", addr)
    public = args.public_url or f"http://{addr}/mcp"
    with EpistemicGraphKVBackend(base.with_overrides(token=None)) as probe:
        _check_server(probe, with_token=False)  # each caller brings its own token later
    pool = ClientPool(base)

    def tools_for_caller() -> KvCacheTools:
        access = get_access_token()
        if access is None:  # the bearer middleware admits no request without one
            raise ToolFailure("no caller token")
        return KvCacheTools(pool.client(access.token))

    server = build_server(tools_for_caller, http_auth=(pool, base.base_url, public))
    hosts = [str(addr), f"localhost:{addr.port}", f"127.0.0.1:{addr.port}", *args.allow_host]
    security = TransportSecuritySettings(
        enable_dns_rebinding_protection=True, allowed_hosts=hosts, allowed_origins=[]
    )
    logging.getLogger("epistemic_kvcache").info(
        "mcp: listening http=%s (streamable HTTP at /mcp), kvcache server %s",
        addr,
        base.base_url,
    )
    try:
        server.run(
            "streamable-http",
            host=addr.host,
            port=addr.port,
            transport_security=security,
            stateless_http=True,
            json_response=True,
        )
    finally:
        pool.close()
    return 0
