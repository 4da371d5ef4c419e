"""server/writes.py: `KeyWatches` (which connections watch which keys, bounded and shared
fairly (DESIGN.md: watches have per-tenant shares), and never forgotten silently),
`TenantGates` against commands and holders on several event loops at once, and
`start_put`, the one PUT entry every wire and MULTI goes through (on real listeners).

Both are plain thread-safe objects: these tests drive them directly, with shares small
enough to reach. tests/test_server_resp_watch.py drives them through real clients;
tests/test_server_resp_multi.py and tests/test_server_loops.py hold the gate's rules
step by step.
"""

from __future__ import annotations

import ast
import asyncio
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

import epistemic_kvcache
from epistemic_kvcache.server.writes import KeyWatches, TenantGates, Watcher
from epistemic_kvcache.store import SharedKvIndex
from helpers import eventually
from servers import running_listener


def watched(w: Watcher) -> set[str]:
    return {key for _, key in w.keys}


def test_a_write_marks_its_keys_watchers_changed_and_no_others() -> None:
    t = KeyWatches()
    a, b, c = Watcher(), Watcher(), Watcher()
    assert t.watch(a, [("t1", "k"), ("t1", "j")]) is None
    assert t.watch(b, [("t1", "j")]) is None
    assert t.watch(c, [("t2", "k")]) is None  # another tenant's key of the same name
    assert t.count == 4
    t.touch("t1", ["k"])
    assert a.changed
    assert not b.changed
    assert not c.changed
    assert t.count == 2  # a changed watcher needs no keys any more
    t.touch("t1", ["nothing-watched"])
    assert not b.changed
    t.touch_all("t2")
    assert c.changed
    assert not b.changed


def test_forget_makes_a_watcher_unchanged_and_empty() -> None:
    t = KeyWatches()
    w = Watcher()
    t.watch(w, [("t", "a"), ("t", "b"), ("t", "a")])
    assert t.count == 2
    t.touch("t", ["a"])
    assert w.changed
    assert t.watch(w, [("t", "c")]) is None  # already changed: nothing more is watched
    assert t.count == 0
    t.forget(w)
    assert not w.changed
    assert watched(w) == set()
    assert t.watch(w, [("t", "c")]) is None
    assert t.count == 1
    t.forget(w)
    assert t.count == 0
    assert t.watched_by("t") == 0


def test_a_connection_over_its_share_is_refused_whole() -> None:
    t = KeyWatches(per_connection=3)
    w = Watcher()
    assert t.watch(w, [("t", "a"), ("t", "b")]) is None
    refused = t.watch(w, [("t", "c"), ("t", "d")])
    assert refused == "at most 3 keys may be watched per connection (this one watches 2)"
    assert watched(w) == {"a", "b"}
    assert not w.changed
    assert t.watch(w, [("t", "a"), ("t", "c")]) is None  # a key watched again costs nothing


def test_a_tenant_over_its_share_loses_its_own_oldest_watcher() -> None:
    t = KeyWatches(per_connection=10, per_tenant=4, total=100)
    old, mid, new = Watcher(), Watcher(), Watcher()
    other = Watcher()
    t.watch(old, [("t", "a"), ("t", "b")])
    t.watch(mid, [("t", "c"), ("t", "d")])
    t.watch(other, [("u", "x")])
    assert t.watch(new, [("t", "e")]) is None
    assert old.changed  # dropped to make room: its EXEC answers nil, the client retries
    assert not mid.changed
    assert not new.changed
    assert not other.changed
    assert t.watched_by("t") == 3
    assert t.watched_by("u") == 1


def test_the_table_full_takes_from_the_tenant_watching_the_most() -> None:
    t = KeyWatches(per_connection=10, per_tenant=10, total=6)
    big1, big2, small = Watcher(), Watcher(), Watcher()
    t.watch(big1, [("big", f"k{i}") for i in range(3)])
    t.watch(big2, [("big", f"j{i}") for i in range(2)])
    t.watch(small, [("small", "a")])
    assert t.count == 6
    newcomer = Watcher()
    assert t.watch(newcomer, [("small", "b")]) is None
    assert big1.changed  # the oldest watcher of the tenant holding the most
    assert not big2.changed
    assert not small.changed
    assert not newcomer.changed
    assert t.count == 4


def test_a_watcher_is_spared_in_favour_of_older_ones() -> None:
    t = KeyWatches(per_connection=10, per_tenant=3, total=100)
    first, second = Watcher(), Watcher()
    t.watch(second, [("t", "x")])
    t.watch(first, [("t", "a"), ("t", "b")])
    assert t.watch(first, [("t", "c")]) is None  # over the tenant's share: second goes
    assert second.changed
    assert not first.changed
    assert watched(first) == {"a", "b", "c"}


def test_threads_watching_and_writing_keep_the_books() -> None:
    t = KeyWatches(per_connection=64, per_tenant=10_000, total=10_000)
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            for i in range(300):
                w = Watcher()
                t.watch(w, [("t", f"k{(n + i + j) % 50}") for j in range(5)])
                t.touch("t", [f"k{(n * 7 + i) % 50}"])
                if i % 3 == 0:
                    t.touch_all("t")
                t.forget(w)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors
    assert t.count == 0
    assert t.watched_by("t") == 0


# -- TenantGates: entering takes no lock; EXEC's hold still runs alone --------------------------


class SwitchingSet(set[str]):
    """A set whose membership test hands the GIL over before and after it."""

    def __contains__(self, item: object) -> bool:
        time.sleep(0)
        found = super().__contains__(item)
        time.sleep(0)
        return found


def test_gates_hold_alone_against_commands_on_several_loops() -> None:
    """Commands of one tenant on three event loops (their threads) enter and leave the
    gate, without its lock, while EXECs on two more loops hold it over and over: no
    command is ever inside while a holder runs, no holder or waiter is left parked (a
    lost wake-up would hang here), and nothing is left counted.

    CPython switches threads only at some bytecodes (calls, backward jumps), none of
    them between a count and the read of `held`: the gate's `held` is swapped for a
    set whose membership test lets the other threads run before and after it, so every
    interleaving the order must survive happens here. (`enter_nowait` reading `held`
    before counting itself in lets commands in beside the holder; `leave` reading it
    before counting itself out strands the holder.)"""
    gates = TenantGates()
    gates.held = SwitchingSet()
    box = threading.Lock()
    inside = 0
    holding = 0
    violations: list[str] = []
    commands, rounds, holds = 6, 300, 150

    async def command() -> None:
        nonlocal inside
        for i in range(rounds):
            if not gates.enter_nowait("t"):
                await gates.enter("t")
            with box:
                inside += 1
                if holding:
                    violations.append("a command ran beside a holder")
            await asyncio.sleep(0)  # inside, while the loop runs the others
            with box:
                inside -= 1
            gates.leave("t")
            if i % 3 == 0:
                await asyncio.sleep(0)

    async def exec_() -> None:
        nonlocal holding
        for _ in range(holds):
            await gates.hold("t")
            with box:
                if inside or holding:
                    violations.append(f"held with {inside} inside, {holding} holding")
                holding += 1
            await asyncio.sleep(0)
            with box:
                if inside:
                    violations.append(f"{inside} got in while held")
                holding -= 1
            gates.release("t")
            await asyncio.sleep(0)

    async def loop_commands() -> None:
        await asyncio.gather(*(command() for _ in range(commands)))

    loops = [asyncio.new_event_loop() for _ in range(5)]
    runners = [threading.Thread(target=lp.run_forever, daemon=True) for lp in loops]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for t in runners:
            t.start()
        work = [asyncio.run_coroutine_threadsafe(loop_commands(), lp) for lp in loops[:3]]
        work += [asyncio.run_coroutine_threadsafe(exec_(), lp) for lp in loops[3:]]
        for fut in work:
            fut.result(60)  # (a lost wake-up parks a task for good: this fails)
    finally:
        sys.setswitchinterval(interval)
        for lp in loops:
            lp.call_soon_threadsafe(lp.stop)
        for t in runners:
            t.join(10)
        for lp in loops:
            lp.close()
    assert violations == []
    assert gates.active("t") == 0
    assert not gates.held
    assert len(gates) == 0


def test_a_gate_left_on_another_thread_still_counts_right() -> None:
    """Each thread writes only its own counts; a command that leaves on another thread
    than it entered on (not done by the server, allowed) still leaves the sum right."""
    gates = TenantGates()
    assert gates.enter_nowait("t")
    left = threading.Thread(target=gates.leave, args=("t",))
    left.start()
    left.join(10)
    assert gates.active("t") == 0
    assert len(gates) == 0

    async def hold_and_release() -> None:
        await asyncio.wait_for(gates.hold("t"), 10)  # nothing counted inside: at once
        gates.release("t")

    asyncio.run(hold_and_release())


class HoldAfterRead(set[str]):
    """`held`, whose first membership test, once answered, lets an EXEC on `other` run
    `hold` until it either holds the tenant or parks for its running commands: the
    interleaving where a holder comes between a command's read of `held` and what the
    command does next."""

    def __init__(self, gates: TenantGates, other: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.gates, self.other = gates, other
        self.holding: Future[None] | None = None

    def __contains__(self, item: object) -> bool:
        found = super().__contains__(item)
        if self.holding is None:
            gates = self.gates
            self.holding = asyncio.run_coroutine_threadsafe(gates.hold("t"), self.other)
            holding = self.holding

            def settled() -> bool:
                gate = gates._gates.get("t")
                return holding.done() or (gate is not None and gate.drain is not None)

            eventually(settled, what="the holder holds or parks")
        return found


@contextmanager
def other_loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(10)
        loop.close()


def test_enter_counts_itself_in_before_it_reads_held() -> None:
    """A holder between a command's read of `held` (not held) and its return: the
    command was counted first, so the holder parks until the command leaves."""
    gates = TenantGates()
    with other_loop() as other:
        gates.held = held = HoldAfterRead(gates, other)
        assert gates.enter_nowait("t")
        assert held.holding is not None
        assert not held.holding.done(), "the holder ran beside a command inside the gate"
        gates.leave("t")  # counted out, reads held: wakes the holder
        held.holding.result(10)
        other.call_soon_threadsafe(gates.release, "t")
        eventually(lambda: len(gates) == 0, what="released")


def test_leave_counts_itself_out_before_it_reads_held() -> None:
    """A holder between a leaving command's read of `held` (not held) and its return:
    the command was counted out first, so the holder saw none inside and holds at once
    (counted out after the read, it would park with nobody left to wake it)."""
    gates = TenantGates()
    assert gates.enter_nowait("t")
    with other_loop() as other:
        gates.held = held = HoldAfterRead(gates, other)
        gates.leave("t")
        assert held.holding is not None
        held.holding.result(10)  # held: nothing waits for a wake-up
        other.call_soon_threadsafe(gates.release, "t")
        eventually(lambda: len(gates) == 0, what="released")


# -- start_put: the one PUT entry of every wire and MULTI ----------------------------------------

TOKEN = "put-entry-token-0123456789"


class EntryRecordingStore(SharedKvIndex):
    """The memory store, noting at each `put_nowait` the key, the function that called
    it, and the Python functions below that on the stack."""

    calls: list[tuple[str, str, list[str]]]

    def put_nowait(self, ns: str, key: str, data: Any, *, cond: Any = None) -> Any:
        frame = sys._getframe(1)
        below: list[str] = []
        f = frame.f_back
        while f is not None:
            below.append(f.f_code.co_name)
            f = f.f_back
        self.calls.append((key, frame.f_code.co_name, below))
        return super().put_nowait(ns, key, data, cond=cond)


def test_every_wire_and_multi_start_a_put_through_start_put() -> None:
    """The four ways a PUT used to start (the read callback's inline SETs, the
    connection's task, MULTI's transaction job, HTTP's `ServerContext.put`) each
    called the store's `put_nowait` themselves, and drifted (MULTI copied a large
    value): all now reach it through `server.writes.start_put`, on real listeners."""
    calls: list[tuple[str, str, list[str]]] = []
    resp_store, http_store = EntryRecordingStore(), EntryRecordingStore()
    resp_store.calls = http_store.calls = calls

    def by(prefix: str) -> list[tuple[str, list[str]]]:
        return [(caller, below) for key, caller, below in calls if key.startswith(prefix)]

    with (
        running_listener("resp", store=resp_store, tokens={TOKEN: "t"}) as rl,
        running_listener("http", store=http_store, tokens={TOKEN: "t"}) as hl,
        redis.Redis(port=rl.port, password=TOKEN, single_connection_client=True) as r,
    ):
        # the read callback (a loaded machine may leave a read to the task: then again)
        for i in range(50):
            with r.pipeline(transaction=False) as p:
                p.set(f"fast{i}:a", b"v").set(f"fast{i}:b", b"w")
                assert p.execute() == [True, True]
            if any("buffer_updated" in [caller, *below] for caller, below in by(f"fast{i}:")):
                break
        else:
            raise AssertionError("no SET was answered in the read callback")
        # the connection's task: the tenant held, the read callback leaves the SETs to
        # it, and it starts them once let in (the first, then those framed behind it)
        gates = rl.ctx.writes.gates
        asyncio.run_coroutine_threadsafe(gates.hold("t"), rl.loop).result(10)
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(
                lambda: (
                    r.pipeline(transaction=False).set("task:a", b"v").set("task:b", b"w").execute()
                )
            )
            eventually(lambda: gates._gates["t"].waiters, what="the SETs wait at the gate")
            rl.loop.call_soon_threadsafe(gates.release, "t")
            assert sent.result(30) == [True, True]
        # MULTI's transaction job (plain and conditional)
        with r.pipeline() as p:
            p.set("multi:a", b"v").set("multi:b", b"w", nx=True)
            assert p.execute() == [True, True]
        # HTTP PUT (plain and conditional)
        conn = hl.conn(timeout=30)
        for key, extra in (("http:a", {}), ("http:b", {"If-None-Match": "*"})):
            conn.request(
                "PUT",
                f"/kv/{key}",
                body=b"v",
                headers={"Authorization": f"Bearer {TOKEN}", **extra},
            )
            answer = conn.getresponse()
            answer.read()
            assert answer.status == 201
    assert {caller for _, caller, _ in calls} == {"start_put"}, calls
    for prefix, where, count in (
        ("task:", "_execute", 2),
        ("multi:", "_run_transaction_job", 2),
        ("http:", "key_put", 2),
    ):
        seen = by(prefix)
        assert len(seen) == count, (prefix, seen)
        assert all(where in below for _, below in seen), (prefix, seen)


def test_no_module_but_start_put_calls_a_stores_put_nowait() -> None:
    """Outside the store itself, `put_nowait` is called in one place: `start_put`."""
    root = Path(epistemic_kvcache.__file__).parent
    found: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == "store":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "put_nowait"
                ):
                    found.append(f"{path.relative_to(root)}:{node.lineno} in {fn.name}")
    assert found
    assert all(f.startswith("server/writes.py:") and f.endswith(" in start_put") for f in found), (
        found
    )
