"""The one HTTP route table: every route, its methods, the body each accepts, the handler.

Route templates come from `proto.http` (`match_route` maps a path to one). HEAD is
answered wherever GET is (without a body). A method missing here is a 405 with an
`Allow` header built from the table.
"""

from __future__ import annotations

from typing import Final

from epistemic_kvcache.proto.http import (
    ROUTE_BATCH_EXISTS,
    ROUTE_BATCH_GET,
    ROUTE_BATCH_PUT,
    ROUTE_BRANCH,
    ROUTE_BRANCH_KEY,
    ROUTE_BRANCHES,
    ROUTE_EPOCH,
    ROUTE_EPOCH_BUMP,
    ROUTE_HEALTHZ,
    ROUTE_KEY,
    ROUTE_KEY_EXISTS,
    ROUTE_KEYS,
    ROUTE_METRICS,
    ROUTE_PAGE_IN,
    ROUTE_READYZ,
    ROUTE_SNAPSHOT,
    ROUTE_SNAPSHOT_FORK,
    ROUTE_SNAPSHOT_KEY,
    ROUTE_SNAPSHOTS,
    ROUTE_STATS,
)
from epistemic_kvcache.server.http import core, engine
from epistemic_kvcache.server.http.api import BLOCK, BodyRule, Endpoint, Route
from epistemic_kvcache.shared import ServerLimits


def _batch_put_body(limits: ServerLimits, store_max: int) -> int:
    return limits.max_batch_bytes + 4 + core.batch_header_limit(limits.max_batch_keys)


def _batch_keys_body(limits: ServerLimits, store_max: int) -> int:
    return core.batch_header_limit(limits.max_batch_keys)


def _page_in_body(limits: ServerLimits, store_max: int) -> int:
    return engine.MAX_PAGE_IN_JSON_BYTES


def _snapshot_body(limits: ServerLimits, store_max: int) -> int:
    return engine.MAX_ENGINE_JSON_BYTES


_BATCH_PUT: Final = BodyRule(_batch_put_body, "batch_too_large", "batch")
_BATCH_KEYS: Final = BodyRule(_batch_keys_body, "batch_too_large")
_PAGE_IN: Final = BodyRule(_page_in_body, "body_too_large")
_SNAPSHOT: Final = BodyRule(_snapshot_body, "body_too_large")
_BRANCH_BLOCK: Final = BodyRule(BLOCK.limit, "block_too_large", "bytes")


def _route(
    template: str, *, auth: bool = True, operators_only: bool = False, **methods: Endpoint
) -> Route:
    return Route(template, methods, auth=auth, operators_only=operators_only)


ROUTES: Final[dict[str, Route]] = {
    r.template: r
    for r in (
        _route(ROUTE_HEALTHZ, auth=False, GET=Endpoint(core.healthz)),
        _route(ROUTE_READYZ, auth=False, GET=Endpoint(core.readyz)),
        _route(ROUTE_METRICS, operators_only=True, GET=Endpoint(core.metrics)),
        _route(ROUTE_STATS, GET=Endpoint(core.stats)),
        _route(ROUTE_BATCH_EXISTS, POST=Endpoint(core.batch_exists, _BATCH_KEYS)),
        _route(ROUTE_BATCH_GET, POST=Endpoint(core.batch_get, _BATCH_KEYS)),
        _route(ROUTE_BATCH_PUT, POST=Endpoint(core.batch_put, _BATCH_PUT)),
        _route(
            ROUTE_KEY,
            GET=Endpoint(core.key_get),
            PUT=Endpoint(core.key_put, BLOCK),
            DELETE=Endpoint(core.key_delete),
        ),
        _route(ROUTE_KEY_EXISTS, GET=Endpoint(core.key_exists)),
        _route(
            ROUTE_SNAPSHOTS,
            GET=Endpoint(engine.snapshots),
            POST=Endpoint(engine.snapshots, _SNAPSHOT),
        ),
        _route(ROUTE_SNAPSHOT, GET=Endpoint(engine.snapshot), DELETE=Endpoint(engine.snapshot)),
        _route(ROUTE_SNAPSHOT_KEY, GET=Endpoint(engine.snapshot_key)),
        _route(ROUTE_SNAPSHOT_FORK, POST=Endpoint(engine.snapshot_fork)),
        _route(ROUTE_BRANCHES, GET=Endpoint(engine.branches)),
        _route(ROUTE_BRANCH, GET=Endpoint(engine.branch), DELETE=Endpoint(engine.branch)),
        _route(
            ROUTE_BRANCH_KEY,
            GET=Endpoint(engine.branch_key),
            PUT=Endpoint(engine.branch_key, _BRANCH_BLOCK),
        ),
        _route(ROUTE_EPOCH, GET=Endpoint(engine.epoch)),
        _route(ROUTE_EPOCH_BUMP, POST=Endpoint(engine.epoch_bump)),
        _route(ROUTE_PAGE_IN, POST=Endpoint(engine.page_in, _PAGE_IN)),
        _route(ROUTE_KEYS, GET=Endpoint(engine.list_keys_route)),
    )
}
"""Route template -> `Route`."""
