"""Cost of the global limits on one thread (server/budget.py): microseconds per call.

Every connection on every event loop goes through these: `MemoryBudget.try_take` +
`give_back` (an in-flight byte reservation and its return), `Account.set` up and down
(what the wires call per large request), and one connection's life in
`ConnectionSlots` (`admit` + `authenticate` + `release`). The limits are made exact
across loops with a lock around each check-and-update; this measures what the lock
costs a single loop (run it on the tree before and after a change, side by side).

    PYTHONPATH=src python -m bench.bench_limits [--n 200000] [--repeat 5]

Prints one line per operation: the best of `--repeat` runs, in µs per call.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from epistemic_kvcache.server.budget import Account, ConnectionSlots, MemoryBudget, SlotLimits


def _best(fn: Callable[[int], None], n: int, repeat: int) -> float:
    """The best of `repeat` runs of `fn(n)`, in µs per iteration."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn(n)
        best = min(best, (time.perf_counter_ns() - t0) / n / 1000)
    return best


def budget_take_give(n: int) -> None:
    b = MemoryBudget(1 << 40, 1 << 40)
    take, give = b.try_take, b.give_back
    for _ in range(n):
        take("t", 4096)
        give("t", 4096)


def account_set(n: int) -> None:
    acc = Account(MemoryBudget(1 << 40, 1 << 40), "t")
    s = acc.set
    for _ in range(n):
        s("body", 4096)
        s("body", 0)


def slots_cycle(n: int) -> None:
    s = ConnectionSlots(SlotLimits(10_000, 1_000, 100, 1_000, 1_000))
    admit, auth, release = s.admit, s.authenticate, s.release

    def evict() -> None:
        pass

    for _ in range(n):
        slot = admit("10.0.0.1", evict)
        assert not isinstance(slot, str)
        auth(slot, "t")
        release(slot)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200_000)
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    for name, fn in (
        ("MemoryBudget.try_take+give_back", budget_take_give),
        ("Account.set up+down", account_set),
        ("ConnectionSlots admit+authenticate+release", slots_cycle),
    ):
        print(f"{name:45s} {_best(fn, a.n, a.repeat):7.3f} us")


if __name__ == "__main__":
    main()
