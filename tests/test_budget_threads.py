"""The global limits of server/budget.py hold exactly when many threads (event loops)
use them at once: no lost update, no cap exceeded at any observed moment, and a slot
reclaimed by an admission on one loop is closed on the loop its connection runs on."""

from __future__ import annotations

import asyncio
import itertools
import random
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import uvloop
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from epistemic_kvcache.server.budget import (
    RELEASED,
    UNAUTHENTICATED_GRACE_S,
    Account,
    ConnectionSlots,
    MemoryBudget,
    Slot,
    SlotLimits,
)
from epistemic_kvcache.server.oplog import RefusalLog

THREADS = 8


@contextmanager
def fast_switching() -> Iterator[None]:
    """Let the interpreter switch threads every microsecond (instead of 5 ms), so the
    threads interleave inside every compound update, as event loops would."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def run_threads(work: Callable[[int], None], n: int = THREADS) -> None:
    """Run `work(i)` on `n` threads started together; re-raise the first failure."""
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def body(i: int) -> None:
        try:
            start.wait()
            work(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    with fast_switching():
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]


class Watcher:
    """A thread calling `check` over and over until stopped (a failure is kept)."""

    def __init__(self, check: Callable[[], None]) -> None:
        self.check = check
        self.checks = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.check()
            except BaseException as exc:
                self.error = exc
                return
            self.checks += 1

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self.error is not None:
            raise self.error
        assert self.checks > 0


# -- in-flight bytes -------------------------------------------------------------------------


def budget_caps_hold(budget: MemoryBudget) -> Callable[[], None]:
    def check() -> None:
        budget.check()
        with budget._lock:  # one moment: nothing taken (never forced here) is over a cap
            assert budget.used <= budget.total, budget.used
            for tenant, held in budget._by_tenant.items():
                assert tenant is None or held <= budget.per_tenant, (tenant, held)

    return check


def test_memory_budget_takes_are_exact_across_threads(rand: random.Random) -> None:
    budget = MemoryBudget(total=40_000, per_tenant=15_000)
    tenants = ["a", "b", "c", None]
    seeds = [rand.randrange(1 << 30) for _ in range(THREADS)]
    held = [0] * THREADS
    refused = [{"server": 0, "tenant": 0} for _ in range(THREADS)]

    def work(i: int) -> None:
        r = random.Random(seeds[i])
        mine: list[tuple[str | None, int]] = []
        for _ in range(4_000):
            if mine and r.random() < 0.5:
                tenant, n = mine.pop(r.randrange(len(mine)))
                budget.give_back(tenant, n)
                held[i] -= n
            else:
                tenant, n = r.choice(tenants), r.randrange(1, 3_000)
                limit = budget.try_take(tenant, n)
                if limit is None:
                    mine.append((tenant, n))
                    held[i] += n
                else:
                    refused[i][limit] += 1
        # keep half: the totals must add up with something still held
        for tenant, n in mine[: len(mine) // 2]:
            budget.give_back(tenant, n)
            held[i] -= n

    with Watcher(budget_caps_hold(budget)):
        run_threads(work)
    assert budget.used == sum(held)
    assert budget.refusals == {
        "server": sum(r["server"] for r in refused),
        "tenant": sum(r["tenant"] for r in refused),
    }
    assert budget.refusals["server"] > 0
    assert budget.refusals["tenant"] > 0


def test_accounts_on_many_threads_return_everything(rand: random.Random) -> None:
    budget = MemoryBudget(total=1 << 20, per_tenant=1 << 18)
    seeds = [rand.randrange(1 << 30) for _ in range(THREADS)]

    def work(i: int) -> None:
        r = random.Random(seeds[i])
        acc = Account(budget)  # unauthenticated first, like a new connection
        for step in range(3_000):
            purpose = r.choice(("input", "output", "body"))
            op = r.random()
            if op < 0.4:
                acc.take(purpose, r.randrange(1, 4_096))
            elif op < 0.7:
                acc.set(purpose, r.randrange(0, 8_192), force=r.random() < 0.3)
            elif op < 0.95:
                acc.give_back(purpose)
            else:
                acc.move_to(r.choice(("a", "b")))
            if step % 500 == 0:
                with budget._lock:
                    assert budget.used == sum(budget._by_tenant.values())
        acc.close()
        assert acc.held == 0

    with Watcher(budget.check):
        run_threads(work)
    assert budget.used == 0
    assert budget._by_tenant == {}


# -- connection slots ------------------------------------------------------------------------

LIMITS = SlotLimits(40, 10, 3, 12, 8)
"""40 connections, 10 unauthenticated (3 per peer), 12 per peer, 8 per tenant: 5 peers
and 5 tenants reach every one of them."""


def ticking_clock() -> Callable[[], float]:
    """Every reading is a grace period later than the last: every unauthenticated slot
    is old enough to be reclaimed by the next admission that needs room."""
    ticks = itertools.count()
    return lambda: next(ticks) * (UNAUTHENTICATED_GRACE_S + 0.1)


@pytest.mark.parametrize("with_reset", [False, True], ids=["admit-auth-release", "with-RESET"])
def test_connection_slots_are_exact_across_threads(rand: random.Random, with_reset: bool) -> None:
    s = ConnectionSlots(LIMITS, ticking_clock())
    seeds = [rand.randrange(1 << 30) for _ in range(THREADS)]
    evicted: list[object] = []  # evict callbacks called (outside a loop: at once)
    counts = [{"admitted": 0, "refused": 0, "released": 0} for _ in range(THREADS)]

    def work(i: int) -> None:
        r = random.Random(seeds[i])
        mine: list[Slot] = []
        c = counts[i]
        for _ in range(2_500):
            op = r.random()
            if not mine or op < 0.4:
                peer = f"10.0.0.{r.randrange(5)}"
                token = object()  # (another thread may reclaim the slot before we see it)
                got = s.admit(peer, lambda token=token: evicted.append(token))
                if isinstance(got, str):
                    c["refused"] += 1
                else:
                    mine.append(got)
                    c["admitted"] += 1
            elif op < 0.7:
                slot = r.choice(mine)
                answer = s.authenticate(slot, r.choice(("t1", "t2", "t3", "t4", "t5")))
                assert answer != RELEASED or slot.released
            elif op < 0.8 and with_reset:
                s.deauthenticate(r.choice(mine))
            else:
                c["released"] += s.release(mine.pop(r.randrange(len(mine))))
        for slot in mine:
            c["released"] += s.release(slot)

    with Watcher(lambda: s.check(pools=not with_reset)):
        run_threads(work)
    s.check()
    admitted = sum(c["admitted"] for c in counts)
    assert s.open == 0
    assert s.unauthenticated == 0
    assert s._by_peer == {}
    assert s._by_tenant == {}
    # every admitted slot was released exactly once: by its connection or reclaimed
    assert admitted == sum(c["released"] for c in counts) + s.evicted
    assert len(evicted) == s.evicted == len({id(token) for token in evicted})
    assert s.refused >= sum(c["refused"] for c in counts)
    # (reclaims are all but certain with this clock; refusals depend on how the threads
    # interleave, so they are not required here: test_server_budget.py covers each one)
    assert s.evicted > 0


# -- eviction across loops -------------------------------------------------------------------


class LoopThread:
    """An event loop running on a thread of its own (one of the server's loops)."""

    def __init__(self, new_loop: Callable[[], asyncio.AbstractEventLoop]) -> None:
        self.loop = new_loop()
        self.thread = threading.Thread(target=self.loop.run_forever)
        self.thread.start()

    def call(self, fn: Callable[[], object], timeout: float = 10.0) -> object:
        """`fn()` run on this loop's thread (inside the running loop), its result."""

        async def run() -> object:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


@pytest.mark.parametrize(
    "new_loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"]
)
def test_a_slot_reclaimed_from_another_loop_is_evicted_on_its_own_loop(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    now = [0.0]
    s = ConnectionSlots(
        SlotLimits(
            max_connections=10,
            max_unauthenticated=1,
            max_unauthenticated_per_peer=1,
            max_per_peer=10,
            max_per_tenant=10,
        ),
        lambda: now[0],
    )
    a, b = LoopThread(new_loop), LoopThread(new_loop)
    try:
        ran_on: list[int] = []
        done = threading.Event()

        def evict_a() -> None:
            ran_on.append(threading.get_ident())
            done.set()

        slot_a = a.call(lambda: s.admit("10.0.0.1", evict_a))
        assert isinstance(slot_a, Slot)
        assert slot_a.loop is a.loop
        now[0] += UNAUTHENTICATED_GRACE_S + 0.1
        # loop B admits a connection: the pool is full, A's connection is the oldest
        slot_b = b.call(lambda: s.admit("10.0.0.2", lambda: None))
        assert isinstance(slot_b, Slot)
        assert slot_a.released
        assert s.open == 1
        assert s.evicted == 1
        assert done.wait(10.0), "the evict callback never ran"
        assert ran_on == [a.thread.ident]  # on A's thread, not B's
        # A's connection authenticating after it lost its slot is refused, not counted
        assert a.call(lambda: s.authenticate(slot_a, "t")) == RELEASED
        assert s.connections_of("t") == 0
        s.check()
    finally:
        a.close()
        b.close()


def test_a_slot_reclaimed_on_its_own_loop_is_evicted_at_once() -> None:
    now = [0.0]
    s = ConnectionSlots(SlotLimits(10, 1, 1, 10, 10), lambda: now[0])
    a = LoopThread(uvloop.new_event_loop)
    try:
        closed: list[str] = []
        first = a.call(lambda: s.admit("p1", lambda: closed.append("first")))
        assert isinstance(first, Slot)
        now[0] += UNAUTHENTICATED_GRACE_S + 0.1

        def admit_and_look() -> list[str]:
            s.admit("p2", lambda: None)
            return list(closed)  # before the loop ran anything else

        assert a.call(admit_and_look) == ["first"]  # the same loop: no hop, as before
    finally:
        a.close()


def test_a_slot_of_a_closed_loop_is_reclaimed_without_error() -> None:
    now = [0.0]
    s = ConnectionSlots(SlotLimits(10, 1, 1, 10, 10), lambda: now[0])
    gone = LoopThread(asyncio.new_event_loop)
    old = gone.call(lambda: s.admit("p1", lambda: None))
    gone.close()  # that loop stopped and closed (its connections went with it)
    assert isinstance(old, Slot)
    now[0] += UNAUTHENTICATED_GRACE_S + 0.1
    assert isinstance(s.admit("p2", lambda: None), Slot)
    assert old.released
    assert s.open == 1


# -- rate-limited logs -----------------------------------------------------------------------


def test_refusal_log_burst_is_exact_across_threads(caplog: pytest.LogCaptureFixture) -> None:
    log = RefusalLog(burst=20, window_s=1e9)
    per_thread = 500
    with caplog.at_level("WARNING", logger="epistemic_kvcache.limits"):
        run_threads(lambda i: [log.note("resp", f"p{i}", "full") for _ in range(per_thread)])
    assert log.total == THREADS * per_thread
    assert len(caplog.records) == 20  # the burst, not one line more
    assert log._suppressed == THREADS * per_thread - 20


# -- the slots' rules, one step at a time (Hypothesis) ---------------------------------------


class SlotsMachine(RuleBasedStateMachine):
    """Random admissions, logins, RESETs, closes and clock moves: after every step the
    counts agree and every cap holds; a refusal names a limit that is really reached
    with nothing reclaimable; a reclaimed slot's connection was closed exactly once."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.s = ConnectionSlots(SlotLimits(6, 3, 2, 4, 2), lambda: self.now)
        self.live: list[Slot] = []
        self.closed: list[Slot] = []
        self.reset_used = False

    def _reclaimable(self, pool: list[Slot]) -> bool:
        oldest = min(pool, key=lambda x: x.opened, default=None)
        return oldest is not None and self.now - oldest.opened >= UNAUTHENTICATED_GRACE_S

    @rule(peer=st.sampled_from(["p1", "p2", "p3"]))
    def admit(self, peer: str) -> None:
        unauth = [x for x in self.live if x.tenant is None and not x.released]
        mine = [x for x in unauth if x.peer == peer]
        box: list[Slot] = []
        got = self.s.admit(peer, lambda: self.closed.append(box[0]))
        if isinstance(got, Slot):
            box.append(got)
            self.live.append(got)
            return
        lim = self.s.limits
        if got == "max number of clients reached":
            assert self.s.open == lim.max_connections
            assert not self._reclaimable(unauth)
        elif got == "max number of clients reached for this address":
            assert sum(1 for x in self.live if x.peer == peer) >= lim.max_per_peer
        elif got == "too many unauthenticated connections from this address":
            assert len(mine) >= lim.max_unauthenticated_per_peer
        else:
            assert got == "too many unauthenticated connections"
            assert len(unauth) >= lim.max_unauthenticated

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), tenant=st.sampled_from(["t1", "t2"]))
    def login(self, i: int, tenant: str) -> None:
        slot = self.live[i % len(self.live)]
        before = self.s.connections_of(tenant)
        answer = self.s.authenticate(slot, tenant)
        if answer is None:
            assert slot.tenant == tenant
        elif answer == RELEASED:
            assert slot.released
        else:
            assert before >= self.s.limits.max_per_tenant

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def reset(self, i: int) -> None:
        self.reset_used = True
        self.s.deauthenticate(self.live[i % len(self.live)])

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def close(self, i: int) -> None:
        slot = self.live.pop(i % len(self.live))
        assert self.s.release(slot) is (slot not in self.closed)

    @rule(dt=st.sampled_from([0.1, UNAUTHENTICATED_GRACE_S]))
    def tick(self, dt: float) -> None:
        self.now += dt

    @invariant()
    def counts_agree(self) -> None:
        self.s.check(pools=not self.reset_used)
        assert self.s.open == sum(1 for x in self.live if not x.released)
        assert len(self.closed) == len({id(x) for x in self.closed}) == self.s.evicted
        assert all(x.released for x in self.closed)


TestSlotsMachine = SlotsMachine.TestCase
TestSlotsMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
