"""The group committer (`store/committer.py`) on its own: batching, cancellation,
faults, shutdown. The commit step is the test's: it records each batch and answers."""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest

from epistemic_kvcache.errors import StoreClosedError, StoreFaultError
from epistemic_kvcache.store.committer import Committer, settle
from helpers import eventually


@dataclass
class Item:
    name: str
    nbytes: int = 1
    future: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)


class Log:
    """The commit, idle and release steps, recording what the committer hands them."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.released: list[str] = []
        self.idle_calls = 0
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail_on: str | None = None
        self.more_idle = 0

    def commit(self, batch: list[Item]) -> None:
        self.entered.set()
        assert self.gate.wait(10)
        if any(op.name == self.fail_on for op in batch):
            raise RuntimeError("a bug in commit")
        self.batches.append([op.name for op in batch])
        for op in batch:
            settle(op.future, op.name.upper())

    def idle(self) -> bool:
        self.idle_calls += 1
        if self.more_idle:
            self.more_idle -= 1
            return True
        return False

    def release(self, ops: list[Item]) -> None:
        self.released.extend(op.name for op in ops)


def make(log: Log, max_batch_bytes: int = 1 << 20) -> Committer:
    c = Committer(
        commit=log.commit,
        idle=log.idle,
        release=log.release,
        max_batch_bytes=max_batch_bytes,
        idle_interval_s=0.05,
    )
    c.start()
    return c


def test_writes_queued_during_a_commit_share_the_next_batch() -> None:
    log = Log()
    c = make(log)
    log.gate.clear()
    first = Item("first")
    c.submit(first)
    assert log.entered.wait(10)
    rest = [Item(f"w{i}") for i in range(5)]
    for op in rest:
        c.submit(op)
    log.gate.set()
    assert [op.future.result(10) for op in rest] == ["W0", "W1", "W2", "W3", "W4"]
    assert log.batches == [["first"], ["w0", "w1", "w2", "w3", "w4"]]
    assert c.stop(10)


def test_a_batch_stops_at_max_batch_bytes() -> None:
    log = Log()
    c = make(log, max_batch_bytes=10)
    log.gate.clear()
    c.submit(Item("hold"))
    assert log.entered.wait(10)
    ops = [Item(f"b{i}", nbytes=4) for i in range(5)]
    c.submit_many(ops)
    log.gate.set()
    concurrent.futures.wait([op.future for op in ops], timeout=10)
    assert log.batches[1:] == [["b0", "b1", "b2"], ["b3", "b4"]]  # 12 >= 10: the cut
    assert c.stop(10)


def test_a_cancelled_write_is_dropped_from_its_batch_and_released() -> None:
    log = Log()
    c = make(log)
    log.gate.clear()
    c.submit(Item("hold"))
    assert log.entered.wait(10)
    gone, kept = Item("gone"), Item("kept")
    c.submit_many([gone, kept])
    assert gone.future.cancel()
    log.gate.set()
    assert kept.future.result(10) == "KEPT"
    assert ["gone"] not in log.batches
    assert all("gone" not in b for b in log.batches)
    assert log.released == ["gone"]
    assert c.stop(10)


def test_an_error_in_commit_is_a_loud_read_only_fault() -> None:
    log = Log()
    log.fail_on = "boom"
    c = make(log)
    log.gate.clear()
    c.submit(Item("hold"))
    assert log.entered.wait(10)
    boom, queued = Item("boom"), Item("queued")
    c.submit(boom)
    log.gate.set()
    with pytest.raises(StoreFaultError, match="a bug in commit"):
        boom.future.result(10)
    eventually(lambda: c.fault is not None, what="the fault is recorded")
    assert not c.alive
    with pytest.raises(StoreFaultError):
        c.submit(queued)
    assert "RuntimeError: a bug in commit" in (c.fault or "")
    assert "boom" in log.released
    assert c.stop(10)


def test_stop_fails_what_is_still_queued_and_refuses_more() -> None:
    log = Log()
    c = make(log)
    log.gate.clear()
    c.submit(Item("hold"))
    assert log.entered.wait(10)
    waiting = Item("waiting")
    c.submit(waiting)
    stopper = threading.Thread(target=c.stop, args=(0.2,))
    stopper.start()
    stopper.join(10)
    with pytest.raises(StoreClosedError):
        waiting.future.result(10)
    assert "waiting" in log.released
    with pytest.raises(StoreClosedError):
        c.submit(Item("late"))
    log.gate.set()  # the batch in progress still finishes
    eventually(lambda: log.batches == [["hold"]], what="the held batch commits")


def test_idle_work_runs_between_batches_and_again_while_it_has_more() -> None:
    log = Log()
    log.more_idle = 3
    c = make(log)
    eventually(lambda: log.idle_calls >= 4, what="idle work ran, then came back for more")
    c.kick()
    n = log.idle_calls
    eventually(lambda: log.idle_calls > n, what="a kick runs idle work")
    assert c.stop(10)


def test_settle_ignores_a_future_already_settled() -> None:
    f: concurrent.futures.Future[Any] = concurrent.futures.Future()
    settle(f, 1)
    settle(f, ValueError("late"))
    assert f.result() == 1
    g: concurrent.futures.Future[Any] = concurrent.futures.Future()
    settle(g, KeyError("k"))
    with pytest.raises(KeyError):
        g.result()
