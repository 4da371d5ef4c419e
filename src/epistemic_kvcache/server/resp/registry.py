"""The RESP command table: `COMMANDS` (name -> `CommandSpec`) and the decorators that fill it.

The handlers register themselves (server/resp/commands*.py) with `command` (runs on the
event loop) or `blocking_command` (runs on the store's thread pool); the dispatcher
(server/resp/dispatch.py) looks commands up here. The commands refused on purpose are not
in it (COMMAND lists what works): server/resp/refusals.py.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from epistemic_kvcache.proto.resp import Command

if TYPE_CHECKING:
    from epistemic_kvcache.server.resp.session import Session

Handler = Callable[["Session", Command], Awaitable[object]]
"""Runs on the event loop (session state, no store access)."""
BlockingHandler = Callable[["Session", Command], object]
"""Runs on the thread pool (store access); consecutive ones are batched in one job."""
H = TypeVar("H", Handler, BlockingHandler)


@dataclass(frozen=True, slots=True)
class CommandSpec:
    """One command: Redis arity (negative = at least), flags, key positions, handler."""

    name: str
    arity: int
    flags: tuple[str, ...]
    first_key: int
    last_key: int
    step: int
    group: str
    summary: str
    handler: Handler | None
    blocking_handler: BlockingHandler | None = None
    no_auth: bool = False


COMMANDS: dict[bytes, CommandSpec] = {}


def command(
    name: str,
    arity: int,
    flags: tuple[str, ...],
    keys: tuple[int, int, int],
    group: str,
    summary: str,
    *,
    no_auth: bool = False,
) -> Callable[[Handler], Handler]:
    """Register an event-loop handler."""
    return _registrar(
        lambda fn: CommandSpec(name, arity, flags, *keys, group, summary, fn, no_auth=no_auth)
    )


def blocking_command(
    name: str,
    arity: int,
    flags: tuple[str, ...],
    keys: tuple[int, int, int],
    group: str,
    summary: str,
) -> Callable[[BlockingHandler], BlockingHandler]:
    """Register a thread-pool handler."""
    return _registrar(
        lambda fn: CommandSpec(name, arity, flags, *keys, group, summary, None, blocking_handler=fn)
    )


def _registrar(spec_of: Callable[[H], CommandSpec]) -> Callable[[H], H]:
    """A decorator that enters the function it decorates in `COMMANDS` as `spec_of(fn)`."""

    def register(fn: H) -> H:
        spec = spec_of(fn)
        COMMANDS[spec.name.encode()] = spec
        return fn

    return register
