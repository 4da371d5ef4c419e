"""Test-only: a race in LMCache 0.5.6's v1 native-client base class, closed for the tests.

`ConnectorClientBase` (lmcache/v1/storage_backend/native_clients/connector_client_base.py),
the base of v1 `resp://`'s `RESPClient`, submits an operation to the C++ client and only
then registers the future its completion will resolve (`batch_exists_sync`: `future_id =
self._client.submit_batch_exists(keys)`, then `self._register_future_sync(...)`). The
completions are drained on LMCache's event-loop thread (`_on_ready`), and a completion
that arrives before its future is registered is dropped (`entry is None: continue`). The
synchronous callers run on other threads: vLLM's lookup (`RemoteBackend.batched_contains`
-> `batch_exists_sync`, on LMCache's lookup-server thread) then waits on `fut.result()`
forever. That thread is stuck for good: every later lookup of that vLLM waits for the
scheduler's lookup RPC to give up (`lookup_timeout_ms`, 3 s) and misses. It happened in
about one `make e2e` lookup in five here, with our server up and with it down (a dead
server's error completion comes back at once), and it does not depend on the server: a
faster one makes it likelier. It is not CPU-specific: **a GPU deployment of `resp://` has
it too.** LMCache's MP adapter does this right (`NativeConnectorL2Adapter`,
lmcache/v1/distributed/l2_adapters/native_connector_l2_adapter.py: "Register pending op
BEFORE submit to avoid race with demux thread").

The fix below does what that adapter does: one lock held from a submit to the
registration of its future, and by the drain. (The asynchronous methods submit and
register on the event-loop thread itself, which also drains, so they never raced; they
take the lock the same way.) tests/e2e/test_lmcache_client_race.py shows the race with
LMCache's code and its absence with this fix, by forcing the order of the two threads.
"""

from __future__ import annotations

import threading
from typing import Any

from lmcache.v1.storage_backend.native_clients.connector_client_base import ConnectorClientBase

SUBMITS = ("submit_batch_get", "submit_batch_set", "submit_batch_exists")


class _LockedSubmits:
    """The native client, its submits taking the lock that the future's registration
    releases (`_register_future_*` below); everything else passed through."""

    def __init__(self, client: Any, lock: threading.Lock) -> None:
        self._client, self._lock = client, lock

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if name not in SUBMITS:
            return attr

        def submit(*args: Any) -> Any:
            self._lock.acquire()
            try:
                return attr(*args)
            except BaseException:
                self._lock.release()
                raise

        return submit


_stock_init = ConnectorClientBase.__init__
_stock_on_ready = ConnectorClientBase._on_ready
_stock_register_sync = ConnectorClientBase._register_future_sync
_stock_register_async = ConnectorClientBase._register_future_async


def _init(self: Any, native_client: Any, loop: Any = None) -> None:
    _stock_init(self, native_client, loop)
    self._submit_lock = threading.Lock()
    self._client = _LockedSubmits(self._client, self._submit_lock)


def _on_ready(self: Any) -> None:
    with self._submit_lock:
        _stock_on_ready(self)


def _register_sync(self: Any, *args: Any) -> Any:
    try:
        return _stock_register_sync(self, *args)
    finally:
        self._submit_lock.release()


def _register_async(self: Any, *args: Any) -> Any:
    try:
        return _stock_register_async(self, *args)
    finally:
        self._submit_lock.release()


FIXED = {
    "__init__": _init,
    "_on_ready": _on_ready,
    "_register_future_sync": _register_sync,
    "_register_future_async": _register_async,
}
STOCK = {name: getattr(ConnectorClientBase, name) for name in FIXED}


def install(fixed: bool = True) -> None:
    """The fix on every `ConnectorClientBase` made from now on (`fixed=False`: LMCache's
    code again, for clients made after that)."""
    for name, method in (FIXED if fixed else STOCK).items():
        setattr(ConnectorClientBase, name, method)
