"""The RESP listener's protocol factory: one per event loop, and what its connections share.

How it works: `loop.create_server` calls the factory once per accepted connection and
gets a new `RespConnection` (server/resp/connection.py) over the factory's `Shared`
(server/resp/session.py: the read scratch the connections' parsers borrow, the live
connections, the activity counters, the SCAN cursors and the MULTI/EXEC gates). With
several event loops each loop has its own factory; every one after the first is made
with `first`, so that what must be one table for the whole server stays the first
loop's. The first factory logs which twins run (the framer, the inline fast path), once
per server.
"""

from __future__ import annotations

import asyncio

from epistemic_kvcache.proto import resp_framer
from epistemic_kvcache.server.context import ServerContext
from epistemic_kvcache.server.resp import fast
from epistemic_kvcache.server.resp.common import WIRE, log
from epistemic_kvcache.server.resp.connection import RespConnection
from epistemic_kvcache.server.resp.session import Shared


class RespFactory:
    """A protocol factory for `loop.create_server` serving RESP on `ctx`'s store; for
    another event loop of the same server, pass the first loop's factory as `first`
    (its `Shared` holds what the loops share: `Shared.peers`)."""

    def __init__(self, ctx: ServerContext, first: RespFactory | None = None) -> None:
        self.shared: Shared = Shared(ctx, None if first is None else first.shared)
        ctx.slots_for(WIRE)
        if first is None:  # said once per server, not once per event loop
            log.info(
                "RESP framer: %s twin%s",
                resp_framer.IMPLEMENTATION,
                f" ({resp_framer.WHY_PURE})" if resp_framer.WHY_PURE else "",
            )
            log.info(
                "RESP fast path: %s twin%s",
                fast.IMPLEMENTATION,
                f" ({fast.WHY_PURE})" if fast.WHY_PURE else "",
            )

    def __call__(self) -> asyncio.BufferedProtocol:
        return RespConnection(self.shared)


def make_resp_factory(ctx: ServerContext, first: RespFactory | None = None) -> RespFactory:
    """A `RespFactory` (see there)."""
    return RespFactory(ctx, first)
