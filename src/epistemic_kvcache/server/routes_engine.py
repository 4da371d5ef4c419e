"""HTTP handlers of the engine features (docs/engine-features.md, docs/http-api.md).

Snapshots, branches, epochs, graph-aware paging and key listing, plus `PUT /kv/<key>`
with an `X-Kv-Epoch-Scope` header. `server/http.py` owns the connection, parsing,
authentication and admission; once a request routed here is complete it hands over an
`EngineRequest` and sends back the `EngineResponse`. Every store call runs on the
store's thread pool (`ServerContext.run`), and so does parsing and validating a JSON
body (the event loop never parses megabytes); a page-in graph is bounded in bytes, JSON
values, edges, nodes and keys before any ranking work starts. Everything is scoped to
the caller's verified namespace. `NotFoundError` (no such snapshot/branch) becomes
`404 not_found`, a malformed request `400 bad_request`; other store errors propagate to
http.py's mapping. Epoch bumps are published through `ServerContext.notify_epoch` (RESP
pub/sub), and scopes read or written here are watched (`watch_epoch`) for bumps made by
other processes.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

from epistemic_kvcache.errors import InvalidKeyError, NotFoundError, RemoteProtocolError
from epistemic_kvcache.graph import PageRankConvergenceError, page_in_ranked
from epistemic_kvcache.proto.http import (
    ENGINE_ROUTES,
    JSON_CONTENT_TYPE,
    OCTET_CONTENT_TYPE,
    ROUTE_BRANCH,
    ROUTE_BRANCH_KEY,
    ROUTE_BRANCHES,
    ROUTE_EPOCH,
    ROUTE_EPOCH_BUMP,
    ROUTE_KEY,
    ROUTE_KEYS,
    ROUTE_PAGE_IN,
    ROUTE_SNAPSHOT,
    ROUTE_SNAPSHOT_FORK,
    ROUTE_SNAPSHOT_KEY,
    ROUTE_SNAPSHOTS,
    decode_key_segment,
    error_body,
    request_path,
    route_id_segment,
)
from epistemic_kvcache.server.context import ServerContext
from epistemic_kvcache.shared import MAX_SCOPE_BYTES, validate_key
from epistemic_kvcache.store.api import Buffer, PutOutcome, PutResult, SharedKvBackend

EPOCH_SCOPE_HEADER = b"x-kv-epoch-scope"
"""`PUT /kv/<key>` with this header tags the entry with the scope's current epoch."""
MAX_ENGINE_JSON_BYTES = 64 * 1024 * 1024
"""Snapshot key lists: 64 MiB holds ~1M keys of LMCache's ~60 bytes."""
MAX_PAGE_IN_JSON_BYTES = 16 * 1024 * 1024
"""A page-in graph: 200,000 edges of 30-byte node names take ~14 MiB."""
MAX_PAGE_IN_EDGES = 200_000
MAX_PAGE_IN_NODES = 200_000
"""Distinct nodes, in `node_keys` and in `edges` together."""
MAX_PAGE_IN_KEYS = 400_000
"""Keys in `node_keys`, all nodes together."""
_MAX_PAGE_IN_VALUES = 4 * MAX_PAGE_IN_EDGES + 2 * MAX_PAGE_IN_NODES + MAX_PAGE_IN_KEYS + 64
"""Upper bound of the JSON values (counted as `,` `[` `{`) a page-in body within the
caps above can hold; checked before parsing, which bounds the parser's work (json holds
the GIL while it runs: ~0.2 s for this many values at worst)."""
MAX_LIST_KEYS = 10_000
"""Largest `limit` of `GET /kv/keys`."""
DEFAULT_LIST_KEYS = 1000

_OUTCOME_WORD = {
    PutOutcome.NEW: "created",
    PutOutcome.DUPLICATE: "duplicate",
    PutOutcome.REPLACED: "replaced",
    PutOutcome.CONFLICT: "conflict",
    PutOutcome.MISSING: "missing",
}


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A complete, authenticated, admitted request for an engine route."""

    method: str
    route: str
    target: bytes
    """The raw request target (path and query, still percent-encoded)."""
    ns: str
    key: str | None
    """The decoded `{key}` segment, for routes that have one."""
    headers: Mapping[bytes, bytes]
    body: bytearray | memoryview | None
    """The request body: a memoryview over an mmap for a large single-key PUT."""


@dataclass(slots=True)
class EngineResponse:
    """Status, headers, body buffers and Content-Length (None: no body, e.g. 204)."""

    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)
    parts: list[Buffer] = field(default_factory=list)
    length: int | None = 0


class _Refusal(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def wants_engine(route: str | None, method: str, headers: Mapping[bytes, bytes]) -> bool:
    """Whether `handle` answers this request (an engine route, or a scoped key PUT)."""
    if route in ENGINE_ROUTES:
        return True
    return route == ROUTE_KEY and method == "PUT" and EPOCH_SCOPE_HEADER in headers


def body_limit(route: str, method: str, max_block_bytes: int) -> tuple[int, str | None] | None:
    """(max body bytes, 413 code) for an engine route, None for other routes.

    A code of None means the route takes no body (what arrives is discarded)."""
    if route == ROUTE_BRANCH_KEY and method == "PUT":
        return max_block_bytes, "block_too_large"
    if route == ROUTE_PAGE_IN and method == "POST":
        return MAX_PAGE_IN_JSON_BYTES, "body_too_large"
    if route == ROUTE_SNAPSHOTS and method == "POST":
        return MAX_ENGINE_JSON_BYTES, "body_too_large"
    if route in ENGINE_ROUTES:
        return max_block_bytes, None
    return None


# -- helpers --------------------------------------------------------------------------------


def _json(status: int, doc: object, headers: Sequence[tuple[str, str]] = ()) -> EngineResponse:
    body = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    return EngineResponse(
        status, [("Content-Type", JSON_CONTENT_TYPE), *headers], [body], len(body)
    )


def _error(status: int, code: str, message: str) -> EngineResponse:
    body = error_body(code, message)
    return EngineResponse(status, [("Content-Type", JSON_CONTENT_TYPE)], [body], len(body))


def _bytes(data: Buffer) -> EngineResponse:
    return EngineResponse(200, [("Content-Type", OCTET_CONTENT_TYPE)], [data], len(data))


def _put_answer(result: PutResult, extra: Mapping[str, object] | None = None) -> EngineResponse:
    word = _OUTCOME_WORD[result.outcome]
    doc = {"outcome": word, "digest": result.digest.hex(), "size": result.size, **(extra or {})}
    headers = [("X-Kv-Digest", result.digest.hex()), ("X-Kv-Outcome", word)]
    return _json(201 if result.created else 200, doc, headers)


def _bad(message: str) -> _Refusal:
    return _Refusal(400, "bad_request", message)


def _load_json(body: bytearray | memoryview | None, *, empty_ok: bool) -> dict[str, Any]:
    if not body:
        if empty_ok:
            return {}
        raise _bad("this route needs a JSON object body")
    try:
        doc = json.loads(bytes(body))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(f"invalid JSON body ({exc})") from exc
    if not isinstance(doc, dict):
        raise _bad("the body must be a JSON object")
    return doc


def _check_fields(doc: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(doc) - allowed)
    if unknown:
        raise _bad(f"unknown field(s) {unknown}; allowed: {sorted(allowed)}")


def _segment(raw: bytes, what: str) -> str:
    try:
        return decode_key_segment(raw)
    except RemoteProtocolError as exc:
        raise _bad(f"invalid {what}: {exc}") from exc


def _key(key: object, where: str) -> str:
    if not isinstance(key, str):
        raise _bad(f"{where}: keys are strings")
    try:
        validate_key(key)
    except InvalidKeyError as exc:
        raise _Refusal(400, "bad_key", f"{where}: {exc}") from exc
    return key


def _scope(raw: str) -> str:
    n = len(raw.encode("utf-8"))
    if not 0 < n <= MAX_SCOPE_BYTES or "\x00" in raw:
        raise _bad(f"invalid epoch scope: expected 1..{MAX_SCOPE_BYTES} bytes without NUL")
    return raw


# -- listing --------------------------------------------------------------------------------


def list_keys(
    store: SharedKvBackend, ns: str, prefix: str, after: str | None, limit: int
) -> tuple[list[str], str | None]:
    """Keys of `ns` starting with `prefix`, sorted, strictly after `after`, at most `limit`.

    Returns `(keys, next_after)`; `next_after` is the cursor for the next page, None
    when the listing is complete. Blocking: run on the store pool.
    """
    out: list[str] = []
    cursor = after
    if prefix and (cursor is None or cursor < prefix):
        # `keys()` lists strictly after its cursor: the prefix itself may be a key.
        if store.exists(ns, prefix):
            out.append(prefix)
        cursor = prefix
    while len(out) < limit:
        want = limit - len(out)
        page = store.keys(ns, after=cursor, limit=want)
        for key in page:
            if not key.startswith(prefix):
                return out, None  # sorted: nothing later has the prefix
            out.append(key)
        if len(page) < want:
            return out, None
        cursor = page[-1]
    return out, (out[-1] if out else None)


# -- dispatch -------------------------------------------------------------------------------


async def handle(ctx: ServerContext, req: EngineRequest) -> EngineResponse:
    """Answer one engine request. Store errors other than `NotFoundError` propagate."""
    try:
        return await _route(ctx, req)
    except _Refusal as exc:
        return _error(exc.status, exc.code, exc.message)
    except NotFoundError as exc:
        return _error(404, "not_found", str(exc) or "not found")


async def _route(ctx: ServerContext, req: EngineRequest) -> EngineResponse:
    store, ns, route, method = ctx.store, req.ns, req.route, req.method
    path = request_path(req.target)
    if route == ROUTE_KEY:  # PUT with X-Kv-Epoch-Scope
        return await _scoped_put(ctx, req)
    if route == ROUTE_SNAPSHOTS:
        if method == "POST":
            return await _snapshot_create(ctx, req)
        infos = await ctx.run(store.snapshot_list, ns)
        return _json(200, {"snapshots": [i.to_dict() for i in infos]})
    if route == ROUTE_BRANCHES:
        branches = await ctx.run(store.branch_list, ns)
        return _json(200, {"branches": [b.to_dict() for b in branches]})
    if route == ROUTE_PAGE_IN:
        return await _page_in(ctx, req)
    if route == ROUTE_KEYS:
        return await _list_keys(ctx, req)
    ident = _segment(route_id_segment(path), "id")
    if route == ROUTE_SNAPSHOT:
        if method == "DELETE":
            if await ctx.run(store.snapshot_delete, ns, ident):
                return EngineResponse(204, length=None)
            return _error(404, "not_found", "no such snapshot")
        snap = await ctx.run(store.snapshot_info, ns, ident)
        if snap is None:
            return _error(404, "not_found", "no such snapshot")
        return _json(200, snap.to_dict())
    if route == ROUTE_SNAPSHOT_KEY:
        assert req.key is not None
        data = await ctx.run(store.snapshot_get, ns, ident, req.key)
        if data is None:
            return _error(404, "not_found", "no such key in the snapshot (or no such snapshot)")
        return _bytes(data)
    if route == ROUTE_SNAPSHOT_FORK:
        branch = await ctx.run(store.branch_create, ns, ident)
        return _json(201, branch.to_dict())
    if route == ROUTE_BRANCH:
        if method == "DELETE":
            if await ctx.run(store.branch_delete, ns, ident):
                return EngineResponse(204, length=None)
            return _error(404, "not_found", "no such branch")
        info = await ctx.run(store.branch_info, ns, ident)
        if info is None:
            return _error(404, "not_found", "no such branch")
        return _json(200, info.to_dict())
    if route == ROUTE_BRANCH_KEY:
        return await _branch_key(ctx, req, ident)
    if route in (ROUTE_EPOCH, ROUTE_EPOCH_BUMP):
        scope = _scope(ident)
        if route == ROUTE_EPOCH_BUMP:
            epoch = await ctx.run(store.epoch_bump, ns, scope)
            ctx.notify_epoch(ns, scope, epoch)  # RESP pub/sub `kvcache:epochs`
        else:
            epoch = await ctx.run(store.epoch_get, ns, scope)
            ctx.watch_epoch(ns, scope, epoch)
        return _json(200, {"scope": scope, "epoch": epoch})
    raise AssertionError(f"unhandled engine route {route}")  # pragma: no cover


async def _scoped_put(ctx: ServerContext, req: EngineRequest) -> EngineResponse:
    raw = req.headers[EPOCH_SCOPE_HEADER]
    try:
        scope = _scope(raw.decode("utf-8").strip())
    except UnicodeDecodeError as exc:
        raise _bad("X-Kv-Epoch-Scope must be UTF-8") from exc
    assert req.key is not None
    assert req.body is not None
    put = functools.partial(ctx.store.put, req.ns, req.key, req.body, epoch_scope=scope)
    result = await ctx.run(put)
    ctx.watch_epoch(req.ns, scope)  # publish bumps other processes make to this scope
    return _put_answer(result, {"epoch_scope": scope})


async def _branch_key(ctx: ServerContext, req: EngineRequest, branch_id: str) -> EngineResponse:
    store, ns, key = ctx.store, req.ns, req.key
    assert key is not None
    if req.method == "PUT":
        assert req.body is not None
        return _put_answer(await ctx.run(store.branch_put, ns, branch_id, key, req.body))
    if req.method == "HEAD":
        size = await ctx.run(store.branch_size, ns, branch_id, key)
        if size is None:
            return _error(404, "not_found", "no such key in the branch (or no such branch)")
        return EngineResponse(200, [("Content-Type", OCTET_CONTENT_TYPE)], [], size)
    data = await ctx.run(store.branch_get, ns, branch_id, key)
    if data is None:
        return _error(404, "not_found", "no such key in the branch (or no such branch)")
    return _bytes(data)


async def _snapshot_create(ctx: ServerContext, req: EngineRequest) -> EngineResponse:
    keys, prefix, ttl = await ctx.run(_parse_snapshot_create, req.body)
    create = functools.partial(
        ctx.store.snapshot_create, req.ns, keys=keys, prefix=prefix, ttl_s=ttl
    )
    info = await ctx.run(create)
    return _json(201, info.to_dict())


def _parse_snapshot_create(
    body: bytearray | memoryview | None,
) -> tuple[list[str] | None, str | None, float | None]:
    """Parse and check a snapshot request (blocking: runs on the pool)."""
    doc = _load_json(body, empty_ok=True)
    _check_fields(doc, {"keys", "prefix", "ttl_s"})
    keys_doc, prefix, ttl = doc.get("keys"), doc.get("prefix"), doc.get("ttl_s")
    if keys_doc is not None and prefix is not None:
        raise _bad("give either 'keys' or 'prefix', not both")
    keys: list[str] | None = None
    if keys_doc is not None:
        if not isinstance(keys_doc, list):
            raise _bad("'keys' must be a list of strings")
        keys = [_key(k, f"keys[{i}]") for i, k in enumerate(keys_doc)]
    if prefix is not None and not isinstance(prefix, str):
        raise _bad("'prefix' must be a string")
    if ttl is not None and (
        isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 < ttl < math.inf
    ):
        raise _bad("'ttl_s' must be a positive number of seconds (or null)")
    return keys, prefix, float(ttl) if ttl is not None else None


_PageIn = tuple[
    list[tuple[Hashable, Hashable] | tuple[Hashable, Hashable, float]],
    dict[Hashable, list[str]],
    int,
    float,
]


async def _page_in(ctx: ServerContext, req: EngineRequest) -> EngineResponse:
    edges, node_keys, budget, damping = await ctx.run(_parse_page_in, req.body)
    run = functools.partial(
        page_in_ranked, ctx.store, req.ns, edges, node_keys, budget, damping=damping
    )
    try:
        result = await ctx.run(run)
    except PageRankConvergenceError as exc:
        raise _bad(str(exc)) from exc
    return _json(200, result.to_dict())


def _parse_page_in(body: bytearray | memoryview | None) -> _PageIn:
    """Parse and check a page-in request within the caps (blocking: runs on the pool)."""
    if body:
        raw = body if isinstance(body, bytearray) else bytes(body)
        values = raw.count(b",") + raw.count(b"[") + raw.count(b"{")
        if values > _MAX_PAGE_IN_VALUES:
            raise _bad(
                f"graph too large: at most {MAX_PAGE_IN_EDGES} edges, {MAX_PAGE_IN_NODES} "
                f"nodes and {MAX_PAGE_IN_KEYS} keys"
            )
    doc = _load_json(body, empty_ok=False)
    _check_fields(doc, {"edges", "node_keys", "budget_bytes", "damping"})
    edges_doc, node_keys_doc = doc.get("edges", []), doc.get("node_keys")
    budget, damping = doc.get("budget_bytes"), doc.get("damping", 0.85)
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise _bad("'budget_bytes' must be an integer >= 0")
    if isinstance(damping, bool) or not isinstance(damping, int | float):
        raise _bad("'damping' must be a number")
    if not 0.0 <= damping <= 0.99:
        raise _bad("'damping' must be in [0, 0.99]")
    if not isinstance(node_keys_doc, dict):
        raise _bad("'node_keys' must be an object {node: [key, ...]}")
    if not isinstance(edges_doc, list):
        raise _bad("'edges' must be a list of [src, dst] or [src, dst, weight]")
    if len(edges_doc) > MAX_PAGE_IN_EDGES:
        raise _bad(f"too many edges: {len(edges_doc)} (at most {MAX_PAGE_IN_EDGES})")
    if len(node_keys_doc) > MAX_PAGE_IN_NODES:
        raise _bad(f"too many nodes: {len(node_keys_doc)} (at most {MAX_PAGE_IN_NODES})")
    node_keys: dict[Hashable, list[str]] = {}
    total_keys = 0
    for node, keys in node_keys_doc.items():
        if not isinstance(keys, list):
            raise _bad(f"node_keys[{node!r}] must be a list of keys")
        total_keys += len(keys)
        if total_keys > MAX_PAGE_IN_KEYS:
            raise _bad(f"too many keys in node_keys (at most {MAX_PAGE_IN_KEYS})")
        node_keys[node] = [_key(k, f"node_keys[{node!r}][{i}]") for i, k in enumerate(keys)]
    nodes: set[str] = set(node_keys_doc)
    edges: list[tuple[Hashable, Hashable] | tuple[Hashable, Hashable, float]] = []
    for i, e in enumerate(edges_doc):
        if (
            not isinstance(e, list)
            or len(e) not in (2, 3)
            or not isinstance(e[0], str)
            or not isinstance(e[1], str)
        ):
            raise _bad(f"edges[{i}] must be [src, dst] or [src, dst, weight] with string nodes")
        nodes.add(e[0])
        nodes.add(e[1])
        if len(nodes) > MAX_PAGE_IN_NODES:
            raise _bad(f"too many nodes (at most {MAX_PAGE_IN_NODES}, edges included)")
        if len(e) == 3:
            w = e[2]
            if isinstance(w, bool) or not isinstance(w, int | float) or not 0 < w < math.inf:
                raise _bad(f"edges[{i}]: the weight must be a positive number")
            edges.append((e[0], e[1], float(w)))
        else:
            edges.append((e[0], e[1]))
    return edges, node_keys, budget, float(damping)


async def _list_keys(ctx: ServerContext, req: EngineRequest) -> EngineResponse:
    _, _, query = req.target.partition(b"?")
    try:
        params = parse_qs(
            query.decode("ascii"), keep_blank_values=True, strict_parsing=False, errors="strict"
        )
    except (UnicodeDecodeError, ValueError) as exc:
        raise _bad(f"invalid query string ({exc})") from exc
    unknown = sorted(set(params) - {"prefix", "after", "limit"})
    if unknown:
        raise _bad(f"unknown query parameter(s) {unknown}; allowed: after, limit, prefix")
    for name, values in params.items():
        if len(values) > 1:
            raise _bad(f"query parameter {name!r} given twice")
    prefix = params.get("prefix", [""])[0]
    after = params.get("after", [None])[0] or None
    raw_limit = params.get("limit", [str(DEFAULT_LIST_KEYS)])[0]
    try:
        limit = int(raw_limit)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIST_KEYS:
        raise _bad(f"'limit' must be an integer in 1..{MAX_LIST_KEYS} (got {raw_limit!r})")
    if len(prefix.encode("utf-8")) > 1024:
        raise _bad("'prefix' is longer than a key can be")
    keys, next_after = await ctx.run(list_keys, ctx.store, req.ns, prefix, after, limit)
    return _json(200, {"keys": keys, "next_after": next_after})
