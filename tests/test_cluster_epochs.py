"""store/cluster_epochs.py on its own, against a real Redis Cluster: bumps, the scope
quota, and notices delivered to every subscriber's listener."""

from __future__ import annotations

import threading

import pytest

import redis_cluster as rc
from epistemic_kvcache.errors import QuotaExceededError
from epistemic_kvcache.store import cluster_epochs as E
from helpers import eventually

pytestmark = rc.redis_marks()


cluster = rc.module_cluster()
parts = rc.parts_fixture("p")


def test_bump_and_quota(parts: rc.Parts) -> None:
    conn, prefix = parts.conn, parts.prefix
    assert E.current(conn, prefix, "t", "doc") == 0
    assert E.bump(conn, prefix, "t", "doc", 2) == 1
    assert E.bump(conn, prefix, "t", "doc", 2) == 2
    assert E.bump(conn, prefix, "t", "other", 2) == 1
    with pytest.raises(QuotaExceededError, match="2 scopes"):
        E.bump(conn, prefix, "t", "third", 2)
    assert E.bump(conn, prefix, "t", "doc", 2) == 3  # an existing scope: no quota
    assert E.current(conn, prefix, "t", "doc") == 3
    assert E.current(conn, prefix, "u", "doc") == 0  # tenants apart


def test_notices_reach_every_subscriber(parts: rc.Parts) -> None:
    stop = threading.Event()
    seen: list[list[tuple[str, str, int]]] = [[], []]
    subscribers = [E.EpochNotices(parts.conn, parts.prefix, stop) for _ in seen]
    for sub, got in zip(subscribers, seen, strict=True):
        sub.listener = lambda t, s, n, got=got: got.append((t, s, n))
        sub.start()
    try:
        # a subscription may still be starting: bump until both listeners heard one
        eventually(
            lambda: E.bump(parts.conn, parts.prefix, "a b", "s 1", 10) and all(seen),
            timeout=30,
            interval=0.2,
            what="a notice on both subscribers",
        )
        assert all(got[-1][:2] == ("a b", "s 1") for got in seen)
    finally:
        stop.set()
        for sub in subscribers:
            sub.join(5)


def test_malformed_notices_and_failing_listeners_are_survived(parts: rc.Parts) -> None:
    notices = E.EpochNotices(parts.conn, parts.prefix, threading.Event())
    got: list[tuple[str, str, int]] = []

    def failing(t: str, s: str, n: int) -> None:
        got.append((t, s, n))
        raise RuntimeError("listener bug")

    notices.listener = failing
    for bad in (b"", b"zz 1 s", b"74 x s", b"74 1"):
        notices.deliver(bad)
    assert got == []
    notices.deliver(b"74 5 my scope")
    notices.deliver(b"74 6 my scope")
    assert got == [("t", "my scope", 5), ("t", "my scope", 6)]
