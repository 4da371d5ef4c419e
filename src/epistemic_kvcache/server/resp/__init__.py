"""The Redis (RESP2/RESP3) listener (docs/resp.md).

- `listener`: the protocol factory, one per event loop; `connection`: the asyncio
  protocol (framing, the command task, flow control), over `state` (its phase, task and
  reading, named), `accounting` (its memory, back-pressure) and `deadlines` (its clocks).
- `dispatch`: the command table, checks, batching on the thread pool, fast paths.
- `commands`, `commands_keys`, `commands_admin`, `commands_info`, `commands_txn`: the
  command handlers, each given a narrow `Session`; `refusals`: the commands not served,
  each with why.
- `session`: what a handler sees (the client's session, the listener's shared state).
"""

from epistemic_kvcache.server.resp import (  # noqa: F401  (they register commands)
    commands_info,
    commands_keys,
    commands_txn,
)
from epistemic_kvcache.server.resp.commands import EPOCH_CHANNEL
from epistemic_kvcache.server.resp.commands_admin import install_help
from epistemic_kvcache.server.resp.common import REDIS_COMPAT_VERSION
from epistemic_kvcache.server.resp.connection import RespConnection
from epistemic_kvcache.server.resp.listener import RespFactory, make_resp_factory
from epistemic_kvcache.server.resp.registry import COMMANDS, CommandSpec

install_help()

__all__ = [
    "COMMANDS",
    "EPOCH_CHANNEL",
    "REDIS_COMPAT_VERSION",
    "CommandSpec",
    "RespConnection",
    "RespFactory",
    "make_resp_factory",
]
