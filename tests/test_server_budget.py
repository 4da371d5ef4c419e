"""Shares of shared resources, without sockets: the memory budget and accounts, connection
slots, SCAN cursors, epoch watches, and the one error table."""

from __future__ import annotations

import threading

import pytest

from epistemic_kvcache.errors import (
    AuthError,
    BlockTooLargeError,
    CapacityError,
    ClusterUnavailableError,
    DiskFullError,
    ForbiddenError,
    InvalidKeyError,
    KvCacheError,
    NotFoundError,
    QuotaExceededError,
    RemoteProtocolError,
    StorageIOError,
    StoreClosedError,
    StoreError,
    StoreFaultError,
)
from epistemic_kvcache.proto.errors import (
    ERROR_ROWS,
    INTERNAL,
    exception_for_code,
    http_message,
    resp_text,
    row_for,
)
from epistemic_kvcache.server.budget import (
    UNAUTHENTICATED_GRACE_S,
    Account,
    ConnectionSlots,
    MemoryBudget,
    SlotLimits,
)
from epistemic_kvcache.server.context import EpochNotifier
from epistemic_kvcache.server.resp.session import CursorTable

# -- the memory budget ---------------------------------------------------------------------


def test_budget_refuses_by_the_limit_that_is_reached() -> None:
    budget = MemoryBudget(total=100, per_tenant=60)
    a, b = Account(budget, "a"), Account(budget, "b")
    assert a.take("body", 60) is None
    assert a.take("body", 1) == "tenant"  # a is at its share...
    assert b.take("body", 40) is None  # ...b is not affected
    assert b.take("body", 1) == "server"  # now the server is full
    assert budget.used == 100
    assert budget.refusals == {"server": 1, "tenant": 1}
    a.give_back("body", 30)
    assert b.take("body", 20) is None
    assert budget.used_by("a") == 30
    assert budget.used_by("b") == 60


def test_account_purposes_force_move_and_close() -> None:
    budget = MemoryBudget(total=1000, per_tenant=100)
    acc = Account(budget)  # unauthenticated: only the server-wide limit applies
    assert acc.set("input", 500) is None
    assert budget.used_by(None) == 500
    acc.move_to("t")  # authenticated: everything counts for the tenant now
    assert budget.used_by(None) == 0
    assert budget.used_by("t") == 500
    assert acc.take("reply", 1) == "tenant"  # over its share: refused...
    acc.set("output", 50, force=True)  # ...but bytes that exist are always counted
    assert acc.held == 550
    assert budget.used == 550
    acc.set("input", 0)
    assert acc.held == 50
    acc.close()
    assert budget.used == 0
    assert acc.take("reply", 1) == "server"  # a closed account takes nothing more
    assert budget.peak == 550


def test_account_is_safe_across_threads() -> None:
    budget = MemoryBudget(total=10**12, per_tenant=10**12)
    acc = Account(budget, "t")

    def churn(purpose: str) -> None:
        for _ in range(20_000):
            assert acc.take(purpose, 3) is None
            acc.give_back(purpose, 3)

    threads = [threading.Thread(target=churn, args=(p,)) for p in ("reply", "body")]
    for t in threads:
        t.start()
    churn("input")
    for t in threads:
        t.join()
    assert acc.held == 0
    assert budget.used == 0


# -- connection slots ------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def slots(clock: Clock, **kw: int) -> ConnectionSlots:
    limits = {
        "max_connections": 10,
        "max_unauthenticated": 4,
        "max_unauthenticated_per_peer": 2,
        "max_per_peer": 6,
        "max_per_tenant": 3,
        **kw,
    }
    return ConnectionSlots(SlotLimits(**limits), clock)


def test_unauthenticated_pool_evicts_the_oldest_past_its_grace() -> None:
    clock = Clock()
    s = slots(clock)
    closed: list[str] = []
    held = [s.admit(f"10.0.0.{i}", lambda i=i: closed.append(f"c{i}")) for i in range(4)]
    assert all(not isinstance(h, str) for h in held)
    # Pool full of young connections: the new one is refused, nobody is cut off.
    assert s.admit("10.0.0.9", lambda: None) == "too many unauthenticated connections"
    assert closed == []
    clock.now += UNAUTHENTICATED_GRACE_S + 0.1
    fresh = s.admit("10.0.0.9", lambda: None)
    assert not isinstance(fresh, str)
    assert closed == ["c0"]  # the oldest went
    assert s.unauthenticated == 4
    assert s.evicted == 1


def test_one_peer_cannot_fill_the_unauthenticated_pool() -> None:
    clock = Clock()
    s = slots(clock)
    closed: list[int] = []
    for i in range(2):
        assert not isinstance(s.admit("attacker", lambda i=i: closed.append(i)), str)
    assert s.admit("attacker", lambda: None) == (
        "too many unauthenticated connections from this address"
    )
    clock.now += UNAUTHENTICATED_GRACE_S + 0.1
    assert not isinstance(s.admit("attacker", lambda: None), str)  # its own oldest went
    assert closed == [0]
    assert not isinstance(s.admit("friend", lambda: None), str)  # others still get in


def test_tenant_and_peer_caps_and_the_total() -> None:
    clock = Clock()
    s = slots(clock, max_unauthenticated=10, max_unauthenticated_per_peer=10)
    mine = []
    for _ in range(3):
        slot = s.admit("host-a", lambda: None)
        assert not isinstance(slot, str)
        assert s.authenticate(slot, "tenant-a") is None
        mine.append(slot)
    extra = s.admit("host-a", lambda: None)
    assert not isinstance(extra, str)
    assert s.authenticate(extra, "tenant-a") == "max number of clients reached for this tenant"
    assert s.authenticate(extra, "tenant-b") is None  # another tenant has its own share
    assert s.connections_of("tenant-a") == 3
    assert s.connections_of("tenant-b") == 1
    for _ in range(2):
        assert not isinstance(s.admit("host-a", lambda: None), str)
    assert s.admit("host-a", lambda: None) == "max number of clients reached for this address"
    s.release(mine[0])
    s.release(mine[0])  # idempotent
    assert s.connections_of("tenant-a") == 2
    assert s.open == 5
    s.deauthenticate(extra)  # RESET: back to the small pool
    assert s.connections_of("tenant-b") == 0
    assert s.unauthenticated == 3


def test_full_listener_makes_room_from_stale_unauthenticated_only() -> None:
    clock = Clock()
    s = slots(clock, max_connections=3, max_unauthenticated=3, max_unauthenticated_per_peer=3)
    a = s.admit("p1", lambda: None)
    assert not isinstance(a, str)
    assert s.authenticate(a, "t") is None
    closed: list[str] = []
    for i in range(2):
        assert not isinstance(s.admit("p2", lambda i=i: closed.append(str(i))), str)
    assert s.admit("p3", lambda: None) == "max number of clients reached"
    clock.now += UNAUTHENTICATED_GRACE_S + 0.1
    assert not isinstance(s.admit("p3", lambda: None), str)
    assert closed == ["0"]


# -- SCAN cursors and epoch watches ----------------------------------------------------------


def test_cursors_are_per_tenant_and_fairly_evicted() -> None:
    table = CursorTable(per_tenant=4, total=6)
    mine = table.new("b", "k10")
    for i in range(100):  # tenant a floods
        table.new("a", f"a{i}")
    assert table.held_by("a") == 4  # its own oldest went first
    assert table.position("b", mine) == "k10"  # b's cursor survived the flood
    assert table.position("a", mine) is None  # and is not a's
    b2 = [table.new("b", f"b{i}") for i in range(3)]
    assert table.held_by("a") + table.held_by("b") <= 6
    assert table.position("b", b2[-1]) == "b2"


def test_epoch_watches_are_per_tenant_and_fairly_evicted() -> None:
    n = EpochNotifier(max_watched=6, max_watched_per_tenant=4)
    n.watch("b", "mine", 1)
    for i in range(100):
        n.watch("a", f"s{i}")
    assert n.watched_by("a") == 4
    assert ("b", "mine") in n.known
    for i in range(3):
        n.watch("b", f"b{i}")
    assert len(n.known) <= 6
    assert ("b", "b2") in n.known
    got: list[tuple[str, int]] = []
    n.subscribe("b", lambda scope, epoch: got.append((scope, epoch)))
    assert n.publish("b", "b2", 3)
    assert not n.publish("b", "b2", 3)  # once per epoch
    assert got == [("b2", 3)]


# -- the error table ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "status", "code", "resp_prefix", "private"),
    [
        (InvalidKeyError("bad key"), 400, "bad_key", "ERR bad key", False),
        (BlockTooLargeError("too big"), 413, "block_too_large", "ERR block too large", False),
        (NotFoundError("no snap"), 404, "not_found", "ERR not found", False),
        (QuotaExceededError("keys", resource="keys"), 507, "quota_exceeded", "ERR quota", False),
        (CapacityError("pinned"), 507, "insufficient_storage", "ERR no room", False),
        (DiskFullError("/srv/x"), 507, "insufficient_storage", "ERR disk full", True),
        (StorageIOError("/srv/x EIO"), 503, "storage_io_error", "ERR storage I/O", True),
        (
            ClusterUnavailableError("10.0.0.7:7000 down"),
            503,
            "outcome_unknown",
            "ERR cluster unavailable: the write may or may not",
            True,
        ),
        (StoreFaultError("/srv/x boom"), 503, "store_fault", "ERR store fault", True),
        (StoreClosedError("closed"), 503, "unavailable", "ERR the store is closed", True),
        (StoreError("/srv/x"), 500, "internal", "ERR internal error", True),
        (ForbiddenError("no"), 403, "forbidden", "NOPERM no", False),
        (AuthError("expired"), 401, "unauthorized", "WRONGPASS", True),
        (RemoteProtocolError("bad json"), 400, "bad_request", "ERR bad json", False),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else None,
)
def test_error_table_rows(
    exc: KvCacheError, status: int, code: str, resp_prefix: str, private: bool
) -> None:
    row = row_for(exc)
    assert (row.status, row.code, row.private) == (status, code, private)
    assert resp_text(row, exc).startswith(resp_prefix)
    message = http_message(row, exc)
    assert ("/srv/x" in message) is False or not private
    if private:
        assert "/srv" not in resp_text(row, exc)
    shared = sum(r.code == code for r in ERROR_ROWS) > 1  # disk full shares 507's code
    assert exception_for_code(code) is (row.exc if not shared else exception_for_code(code))
    assert exception_for_code(code) is not None


def test_error_table_order_and_fallback() -> None:
    # every row's class is matched by its own row, not an earlier (more general) one
    for row in ERROR_ROWS:
        probe = row.exc.__new__(row.exc)
        assert row_for(probe).exc is row.exc
    assert row_for(ValueError("x")) is INTERNAL
    assert exception_for_code("quota_exceeded") is QuotaExceededError
    assert exception_for_code("no_such_code") is None
    line = resp_text(row_for(InvalidKeyError("a\r\nb")), InvalidKeyError("a\r\nb"))
    assert "\r" not in line
    assert "\n" not in line
