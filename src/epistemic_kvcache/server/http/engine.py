"""HTTP handlers of the engine features (docs/engine-features.md, docs/http-api.md).

Snapshots, branches, epochs, graph-aware paging and key listing, plus `PUT /kv/<key>`
with an `X-Kv-Epoch-Scope` header. They are rows of the one route table
(server/http/routes.py) like the core routes. Every store call runs on the store's
thread pool (`ServerContext.run`), and so does parsing and validating a JSON body and
encoding a large JSON answer (the event loop never parses or builds megabytes); a
page-in graph is bounded in bytes, JSON values, edges, nodes and keys before any
ranking work starts. Everything is scoped to the caller's verified namespace.
`NotFoundError` (no such snapshot/branch) becomes `404 not_found` through the error
table. Epoch bumps are published through `ServerContext.notify_epoch` (RESP pub/sub),
and scopes read or written here are watched (`watch_epoch`) for bumps made by other
processes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Mapping
from typing import Any
from urllib.parse import parse_qs

from epistemic_kvcache.errors import InvalidKeyError, RemoteProtocolError
from epistemic_kvcache.graph import PageRankConvergenceError, page_in_ranked
from epistemic_kvcache.proto.http import EPOCH_SCOPE_HEADER as _SCOPE_HEADER
from epistemic_kvcache.proto.http import (
    OCTET_CONTENT_TYPE,
    decode_key_segment,
    request_path,
    route_id_segment,
)
from epistemic_kvcache.server.http.api import (
    HttpError,
    Request,
    Response,
    bad_request,
    large_json,
    load_json,
    put_answer,
    put_condition,
)
from epistemic_kvcache.shared import MAX_SCOPE_BYTES, BranchInfo, SnapshotInfo, validate_key
from epistemic_kvcache.store.api import SharedKvBackend

EPOCH_SCOPE_HEADER = _SCOPE_HEADER.lower().encode("ascii")  # parsed heads: lower-case bytes
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


def _check_fields(doc: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(doc) - allowed)
    if unknown:
        raise bad_request(f"unknown field(s) {unknown}; allowed: {sorted(allowed)}")


def _segment(raw: bytes, what: str) -> str:
    try:
        return decode_key_segment(raw)
    except RemoteProtocolError as exc:
        raise bad_request(f"invalid {what}: {exc}") from exc


def _key(key: object, where: str) -> str:
    if not isinstance(key, str):
        raise bad_request(f"{where}: keys are strings")
    try:
        validate_key(key)
    except InvalidKeyError as exc:
        raise HttpError(400, "bad_key", f"{where}: {exc}") from exc
    return key


def _scope(raw: str) -> str:
    n = len(raw.encode("utf-8"))
    if not 0 < n <= MAX_SCOPE_BYTES or "\x00" in raw:
        raise bad_request(f"invalid epoch scope: expected 1..{MAX_SCOPE_BYTES} bytes without NUL")
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


# -- handlers (rows of server/http/routes.py) ---------------------------------------------


def _id(req: Request) -> str:
    return _segment(route_id_segment(request_path(req.target)), "id")


async def snapshots(req: Request) -> Response:
    if req.method == "POST":
        return await _snapshot_create(req)
    infos = await req.ctx.run(req.ctx.store.snapshot_list, req.ns)
    return await large_json(req.ctx, 200, {"snapshots": [i.to_dict() for i in infos]})


async def branches(req: Request) -> Response:
    found = await req.ctx.run(req.ctx.store.branch_list, req.ns)
    return await large_json(req.ctx, 200, {"branches": [b.to_dict() for b in found]})


async def snapshot(req: Request) -> Response:
    store = req.ctx.store
    return await _record(req, "snapshot", store.snapshot_delete, store.snapshot_info)


async def _record(
    req: Request,
    kind: str,
    delete: Callable[[str, str], bool],
    info: Callable[[str, str], SnapshotInfo | BranchInfo | None],
) -> Response:
    """GET (the record) or DELETE (204) of `/kv/<kind>/<id>`; 404 when absent."""
    ident = _id(req)
    if req.method == "DELETE":
        if await req.ctx.run(delete, req.ns, ident):
            return Response.empty(204)
        raise HttpError(404, "not_found", f"no such {kind}")
    found = await req.ctx.run(info, req.ns, ident)
    if found is None:
        raise HttpError(404, "not_found", f"no such {kind}")
    return Response.json(200, found.to_dict())


async def snapshot_key(req: Request) -> Response:
    assert req.key is not None
    data = await req.ctx.run(req.ctx.store.snapshot_get, req.ns, _id(req), req.key)
    if data is None:
        raise HttpError(404, "not_found", "no such key in the snapshot (or no such snapshot)")
    return Response.octets(data)


async def snapshot_fork(req: Request) -> Response:
    branch = await req.ctx.run(req.ctx.store.branch_create, req.ns, _id(req))
    return Response.json(201, branch.to_dict())


async def branch(req: Request) -> Response:
    store = req.ctx.store
    return await _record(req, "branch", store.branch_delete, store.branch_info)


async def epoch(req: Request) -> Response:
    ctx, ns = req.ctx, req.ns
    scope = _scope(_id(req))
    current = await ctx.run(ctx.store.epoch_get, ns, scope)
    ctx.watch_epoch(ns, scope, current)
    return Response.json(200, {"scope": scope, "epoch": current})


async def epoch_bump(req: Request) -> Response:
    ctx, ns = req.ctx, req.ns
    scope = _scope(_id(req))
    # entries of the scope's older epochs read as absent from now on: any key may change
    bumped = await ctx.writes.guard(ns, None, ctx.run(ctx.store.epoch_bump, ns, scope))
    ctx.notify_epoch(ns, scope, bumped)  # RESP pub/sub `kvcache:epochs`
    return Response.json(200, {"scope": scope, "epoch": bumped})


async def scoped_put(req: Request) -> Response:
    """`PUT /kv/<key>` with `X-Kv-Epoch-Scope`: the entry is tagged with the scope's epoch."""
    ctx = req.ctx
    raw = req.headers[EPOCH_SCOPE_HEADER]
    try:
        scope = _scope(raw.decode("utf-8").strip())
    except UnicodeDecodeError as exc:
        raise bad_request("X-Kv-Epoch-Scope must be UTF-8") from exc
    assert req.key is not None
    cond = put_condition(req)
    put = functools.partial(ctx.store.put, req.ns, req.key, req.block, epoch_scope=scope, cond=cond)
    result = await ctx.writes.guard(req.ns, (req.key,), ctx.run(put), lambda r: r.applied)
    ctx.watch_epoch(req.ns, scope)  # publish bumps other processes make to this scope
    return put_answer(result, {"epoch_scope": scope}, conditional=cond is not None)


async def branch_key(req: Request) -> Response:
    ctx, branch_id = req.ctx, _id(req)
    store, ns, key = ctx.store, req.ns, req.key
    assert key is not None
    if req.method == "PUT":
        return put_answer(await ctx.run(store.branch_put, ns, branch_id, key, req.block))
    missing = "no such key in the branch (or no such branch)"
    if req.method == "HEAD":
        size = await ctx.run(store.branch_size, ns, branch_id, key)
        if size is None:
            raise HttpError(404, "not_found", missing)
        return Response(200, [("Content-Type", OCTET_CONTENT_TYPE)], [], size)
    data = await ctx.run(store.branch_get, ns, branch_id, key)
    if data is None:
        raise HttpError(404, "not_found", missing)
    return Response.octets(data)


async def _snapshot_create(req: Request) -> Response:
    ctx = req.ctx
    keys, prefix, ttl = await ctx.run(_parse_snapshot_create, req.plain)
    create = functools.partial(
        ctx.store.snapshot_create, req.ns, keys=keys, prefix=prefix, ttl_s=ttl
    )
    info = await ctx.run(create)
    return Response.json(201, info.to_dict())


def _parse_snapshot_create(
    body: bytearray | memoryview | None,
) -> tuple[list[str] | None, str | None, float | None]:
    """Parse and check a snapshot request (blocking: runs on the pool)."""
    doc = load_json(body, empty_ok=True)
    _check_fields(doc, {"keys", "prefix", "ttl_s"})
    keys_doc, prefix, ttl = doc.get("keys"), doc.get("prefix"), doc.get("ttl_s")
    if keys_doc is not None and prefix is not None:
        raise bad_request("give either 'keys' or 'prefix', not both")
    keys: list[str] | None = None
    if keys_doc is not None:
        if not isinstance(keys_doc, list):
            raise bad_request("'keys' must be a list of strings")
        keys = [_key(k, f"keys[{i}]") for i, k in enumerate(keys_doc)]
    if prefix is not None and not isinstance(prefix, str):
        raise bad_request("'prefix' must be a string")
    if ttl is not None and (
        isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 < ttl < math.inf
    ):
        raise bad_request("'ttl_s' must be a positive number of seconds (or null)")
    return keys, prefix, float(ttl) if ttl is not None else None


_PageIn = tuple[
    list[tuple[Hashable, Hashable] | tuple[Hashable, Hashable, float]],
    dict[Hashable, list[str]],
    int,
    float,
]


async def page_in(req: Request) -> Response:
    ctx = req.ctx
    edges, node_keys, budget, damping = await ctx.run(_parse_page_in, req.plain)
    run = functools.partial(
        page_in_ranked, ctx.store, req.ns, edges, node_keys, budget, damping=damping
    )
    try:
        result = await ctx.run(run)
    except PageRankConvergenceError as exc:
        raise bad_request(str(exc)) from exc
    return await large_json(ctx, 200, await ctx.run(result.to_dict))


def _parse_page_in(body: bytearray | memoryview | None) -> _PageIn:
    """Parse and check a page-in request within the caps (blocking: runs on the pool)."""
    if body:
        raw = body if isinstance(body, bytearray) else bytes(body)
        values = raw.count(b",") + raw.count(b"[") + raw.count(b"{")
        if values > _MAX_PAGE_IN_VALUES:
            raise bad_request(
                f"graph too large: at most {MAX_PAGE_IN_EDGES} edges, {MAX_PAGE_IN_NODES} "
                f"nodes and {MAX_PAGE_IN_KEYS} keys"
            )
    doc = load_json(body, empty_ok=False)
    _check_fields(doc, {"edges", "node_keys", "budget_bytes", "damping"})
    edges_doc, node_keys_doc = doc.get("edges", []), doc.get("node_keys")
    budget, damping = doc.get("budget_bytes"), doc.get("damping", 0.85)
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise bad_request("'budget_bytes' must be an integer >= 0")
    if isinstance(damping, bool) or not isinstance(damping, int | float):
        raise bad_request("'damping' must be a number")
    if not 0.0 <= damping <= 0.99:
        raise bad_request("'damping' must be in [0, 0.99]")
    if not isinstance(node_keys_doc, dict):
        raise bad_request("'node_keys' must be an object {node: [key, ...]}")
    if not isinstance(edges_doc, list):
        raise bad_request("'edges' must be a list of [src, dst] or [src, dst, weight]")
    if len(edges_doc) > MAX_PAGE_IN_EDGES:
        raise bad_request(f"too many edges: {len(edges_doc)} (at most {MAX_PAGE_IN_EDGES})")
    if len(node_keys_doc) > MAX_PAGE_IN_NODES:
        raise bad_request(f"too many nodes: {len(node_keys_doc)} (at most {MAX_PAGE_IN_NODES})")
    node_keys: dict[Hashable, list[str]] = {}
    total_keys = 0
    for node, keys in node_keys_doc.items():
        if not isinstance(keys, list):
            raise bad_request(f"node_keys[{node!r}] must be a list of keys")
        total_keys += len(keys)
        if total_keys > MAX_PAGE_IN_KEYS:
            raise bad_request(f"too many keys in node_keys (at most {MAX_PAGE_IN_KEYS})")
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
            raise bad_request(
                f"edges[{i}] must be [src, dst] or [src, dst, weight] with string nodes"
            )
        nodes.add(e[0])
        nodes.add(e[1])
        if len(nodes) > MAX_PAGE_IN_NODES:
            raise bad_request(f"too many nodes (at most {MAX_PAGE_IN_NODES}, edges included)")
        if len(e) == 3:
            w = e[2]
            if isinstance(w, bool) or not isinstance(w, int | float) or not 0 < w < math.inf:
                raise bad_request(f"edges[{i}]: the weight must be a positive number")
            edges.append((e[0], e[1], float(w)))
        else:
            edges.append((e[0], e[1]))
    return edges, node_keys, budget, float(damping)


async def list_keys_route(req: Request) -> Response:
    ctx = req.ctx
    _, _, query = req.target.partition(b"?")
    try:
        params = parse_qs(
            query.decode("ascii"), keep_blank_values=True, strict_parsing=False, errors="strict"
        )
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad_request(f"invalid query string ({exc})") from exc
    unknown = sorted(set(params) - {"prefix", "after", "limit"})
    if unknown:
        raise bad_request(f"unknown query parameter(s) {unknown}; allowed: after, limit, prefix")
    for name, values in params.items():
        if len(values) > 1:
            raise bad_request(f"query parameter {name!r} given twice")
    prefix = params.get("prefix", [""])[0]
    after = params.get("after", [None])[0] or None
    raw_limit = params.get("limit", [str(DEFAULT_LIST_KEYS)])[0]
    try:
        limit = int(raw_limit)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIST_KEYS:
        raise bad_request(f"'limit' must be an integer in 1..{MAX_LIST_KEYS} (got {raw_limit!r})")
    if len(prefix.encode("utf-8")) > 1024:
        raise bad_request("'prefix' is longer than a key can be")
    keys, next_after = await ctx.run(list_keys, ctx.store, req.ns, prefix, after, limit)
    return await large_json(ctx, 200, {"keys": keys, "next_after": next_after})
