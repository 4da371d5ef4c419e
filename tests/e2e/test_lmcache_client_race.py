"""LMCache 0.5.6's v1 native-client race (tests/e2e/lmcache_client_race.py), shown with
its own `RESPClient` against our server, with the order of the two threads forced.

A lookup (`batch_exists_sync`) is submitted; before its future is registered, the
completion is drained on the client's event loop, as happens when the loop thread runs
first. LMCache's code drops the completion and the lookup never returns; with the fix the
drain cannot run in between, and the lookup returns the server's answer.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmcache_client_race
import pytest
from harness import TOKEN_A, KvServer
from lmcache.v1.storage_backend.native_clients.connector_client_base import ConnectorClientBase
from lmcache.v1.storage_backend.native_clients.resp_client import RESPClient

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def kv(tmp_path: Path) -> Iterator[KvServer]:
    server = KvServer(tmp_path / "kv")
    try:
        with server.resp() as r:
            r.set("present", b"x" * 64)
        yield server
    finally:
        server.stop()


class Drains:
    """The native client, recording which completions the event loop has drained."""

    def __init__(self, client: Any) -> None:
        self._client, self.seen, self.cond = client, set[int](), threading.Condition()

    def drain_completions(self) -> Any:
        items = self._client.drain_completions()
        with self.cond:
            self.seen.update(int(item[0]) for item in items)
            self.cond.notify_all()
        return items

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def lookup_with_drain_first(kv: KvServer, fixed: bool) -> tuple[bool, list[bool] | None]:
    """`batch_exists_sync(["present"])`, its future registered only once the event loop
    has drained its completion (LMCache's code: the loop drains as soon as the server has
    answered), or after 1 s if the loop cannot drain it (the fix holds it back). Returns
    whether the drain came first, and the lookup's answer (None: none 5 s after the
    registration, the server long done)."""
    lmcache_client_race.install(fixed)
    loop = asyncio.new_event_loop()
    client = RESPClient("127.0.0.1", kv.resp_port, 1, loop, "", TOKEN_A)
    drains = Drains(client._client)
    client._client = drains
    threading.Thread(target=loop.run_forever, daemon=True).start()
    register = type(client)._register_future_sync
    registered = threading.Event()
    state: dict[str, bool] = {}

    def register_after_drain(self: Any, op: str, future_id: int, *rest: Any) -> Any:
        with drains.cond:
            state["drained_first"] = drains.cond.wait_for(
                lambda: int(future_id) in drains.seen, timeout=1 if fixed else 30
            )
        try:
            return register(self, op, future_id, *rest)
        finally:
            registered.set()

    answer: list[list[bool]] = []
    client._register_future_sync = register_after_drain.__get__(client)  # type: ignore[method-assign]
    caller = threading.Thread(target=lambda: answer.append(client.batch_exists_sync(["present"])))
    caller.daemon = True  # LMCache's code leaves it waiting forever
    caller.start()
    assert registered.wait(60)
    caller.join(5)
    return state["drained_first"], (answer[0] if answer else None)


def test_lmcache_drops_a_completion_drained_before_registration(kv: KvServer) -> None:
    try:
        ran_between, answer = lookup_with_drain_first(kv, fixed=False)
    finally:
        lmcache_client_race.install(False)
    assert ran_between
    assert answer is None, "LMCache's client no longer loses this completion: drop the fix"


def test_fix_keeps_the_drain_out_until_the_future_is_registered(kv: KvServer) -> None:
    try:
        ran_between, answer = lookup_with_drain_first(kv, fixed=True)
    finally:
        lmcache_client_race.install(False)
    assert not ran_between
    assert answer == [True]
    assert ConnectorClientBase._on_ready is lmcache_client_race.STOCK["_on_ready"]
