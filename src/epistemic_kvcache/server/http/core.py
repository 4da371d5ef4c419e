"""Handlers of the core `/kv` routes: blocks by key, batches, stats, health and metrics."""

from __future__ import annotations

from typing import Final

from epistemic_kvcache.buffers import received_block
from epistemic_kvcache.errors import InvalidKeyError, StoreError
from epistemic_kvcache.proto.errors import row_for
from epistemic_kvcache.proto.http import (
    BATCH_CONTENT_TYPE,
    JSON_CONTENT_TYPE,
    OCTET_CONTENT_TYPE,
    OUTCOME_ERROR_PREFIX,
    batch_exists_doc,
    batch_put_doc,
    decode_key_list,
    encode_batch_get_response,
    error_body,
)
from epistemic_kvcache.server.http.api import (
    OUTCOME_WORD,
    Request,
    Response,
    large_json,
    put_answer,
    put_condition,
)
from epistemic_kvcache.server.http.engine import EPOCH_SCOPE_HEADER, scoped_put
from epistemic_kvcache.shared import MAX_KEY_BYTES, validate_key
from epistemic_kvcache.store.api import BlockData, PutOutcome

_NOT_FOUND_BODY: Final = error_body("not_found", "no such key")


def not_found() -> Response:
    """The answer to a miss: a fresh `Response` each time, never a shared exception.

    A module-level exception instance raised again and again keeps every raise's
    frames: each `raise` prepends the raising frames to the instance's `__traceback__`,
    so a shared `HttpError(404)` held every missed request's handler frames (and what
    they referenced) for good, ~1.6 KB per miss (issue 22). A miss is normal cache
    traffic: it is answered, not raised."""
    return Response(
        404, [("Content-Type", JSON_CONTENT_TYPE)], [_NOT_FOUND_BODY], len(_NOT_FOUND_BODY)
    )


def batch_header_limit(max_batch_keys: int) -> int:
    """Bytes a batch JSON header may take: every key at its size limit, JSON-escaped 6x."""
    return max_batch_keys * (6 * MAX_KEY_BYTES + 24) + 1024


async def healthz(req: Request) -> Response:
    """Liveness: the process answers (no store call, no credentials)."""
    return Response.json(200, {"status": "ok"})


async def readyz(req: Request) -> Response:
    """Readiness: 200 when the store is writable and recovered, else 503 with why."""
    ready = req.ctx.readiness()
    doc: dict[str, object] = {"status": "ready" if ready.ready else "not_ready"}
    if not ready.ready:
        doc["reason"] = ready.reason or "not ready"
    doc.update(ready.detail)
    return Response.json(200 if ready.ready else 503, doc)


async def metrics(req: Request) -> Response:
    body, ctype = await req.ctx.run(req.ctx.metrics.render)
    return Response(200, [("Content-Type", ctype)], [body], len(body))


async def stats(req: Request) -> Response:
    ns = req.ns
    ctx = req.ctx
    result = await ctx.run(ctx.store.stats, ns)
    doc: dict[str, object] = {"namespace": ns, **result.to_dict()}
    if ns in ctx.metrics_tenants:  # server-wide traffic per event loop: operators only
        doc["loops"] = ctx.loop_view()
    return Response.json(200, doc)


def _batch_keys(req: Request) -> list[str]:
    keys = decode_key_list(req.data, max_keys=req.ctx.limits.max_batch_keys)
    for i, key in enumerate(keys):
        try:
            validate_key(key)
        except InvalidKeyError as exc:
            raise InvalidKeyError(f"keys[{i}]: {exc}") from exc
    return keys


async def batch_exists(req: Request) -> Response:
    keys = _batch_keys(req)
    found = await req.ctx.run(req.ctx.store.exists_many, req.ns, keys)
    return await large_json(req.ctx, 200, batch_exists_doc(found))


async def batch_get(req: Request) -> Response:
    keys = _batch_keys(req)
    ctx = req.ctx
    blocks = await ctx.run(ctx.read_many_reserved, req.account, req.ns, keys)
    parts = encode_batch_get_response(blocks)
    return Response(200, [("Content-Type", BATCH_CONTENT_TYPE)], parts, sum(len(p) for p in parts))


async def batch_put(req: Request) -> Response:
    # raises the body's RemoteProtocolError, if any; each block's own receive buffer is
    # handed over to the store
    items = [(key, received_block(block)) for key, block in req.batch.items()]
    ctx = req.ctx  # (the gate and the watched keys: server/writes.py)
    keys = [key for key, _ in items]
    results = await ctx.writes.guard(req.ns, keys, ctx.run(_batch_put, req, items))
    return await large_json(req.ctx, 200, batch_put_doc(results))


def _batch_put(req: Request, items: list[tuple[str, BlockData]]) -> list[str]:
    """Runs on the store pool: one `put_many` for the valid items, per-key errors."""
    store, ns = req.ctx.store, req.ns
    max_block = min(req.ctx.limits.max_block_bytes, store.max_block_bytes)
    results: list[str] = [""] * len(items)
    valid: list[int] = []
    for i, (key, view) in enumerate(items):
        try:
            validate_key(key)
        except InvalidKeyError:
            results[i] = OUTCOME_ERROR_PREFIX + "bad_key"
            continue
        if len(view) > max_block:
            results[i] = OUTCOME_ERROR_PREFIX + "block_too_large"
            continue
        valid.append(i)
    existed = store.exists_many(ns, [items[i][0] for i in valid])
    try:
        done = store.put_many(ns, [items[i] for i in valid])
    except StoreError:
        # put_many stops at its first failure: redo one by one for per-key answers.
        # Items it stored already read as duplicates now; `existed` tells them apart.
        for i, was in zip(valid, existed, strict=True):
            try:
                outcome = store.put(ns, *items[i]).outcome
            except StoreError as exc:
                results[i] = OUTCOME_ERROR_PREFIX + row_for(exc).code
                continue
            if outcome is PutOutcome.DUPLICATE and not was:
                outcome = PutOutcome.NEW
            results[i] = OUTCOME_WORD[outcome]
    else:
        for i, res in zip(valid, done, strict=True):
            results[i] = OUTCOME_WORD[res.outcome]
    return results


async def key_exists(req: Request) -> Response:
    key = req.key
    assert key is not None
    found = await req.ctx.run(req.ctx.store.exists, req.ns, key)
    # `key` names the field; `hash` is the same value, kept for clients written against
    # the first version of this route (docs/http-api.md)
    return Response.json(200, {"key": key, "exists": found, "hash": key})


async def key_get(req: Request) -> Response:
    """GET and HEAD of `/kv/<key>` (HEAD reads only the size)."""
    ctx, key = req.ctx, req.key
    assert key is not None
    if req.method == "HEAD":
        size = await ctx.run(ctx.store.size, req.ns, key)
        if size is None:
            return not_found()
        return Response(200, [("Content-Type", OCTET_CONTENT_TYPE)], [], size)
    data = await ctx.get(req.ns, key, req.account)
    if data is None:
        return not_found()
    return Response.octets(data)


async def key_delete(req: Request) -> Response:
    ctx, key = req.ctx, req.key
    assert key is not None
    deleted = await ctx.writes.guard(req.ns, (key,), ctx.run(ctx.store.delete, req.ns, key), bool)
    if deleted:
        return Response.empty(204)
    return not_found()


async def key_put(req: Request) -> Response:
    if EPOCH_SCOPE_HEADER in req.headers:
        return await scoped_put(req)
    assert req.key is not None
    cond = put_condition(req)
    ctx, ns, key = req.ctx, req.ns, req.key
    # a refused conditional (or first-write-wins) PUT wrote nothing: its watchers stay
    put = ctx.put(ns, key, req.block, cond)
    result = await ctx.writes.guard(ns, (key,), put, lambda r: r.applied)
    return put_answer(result, conditional=cond is not None)
