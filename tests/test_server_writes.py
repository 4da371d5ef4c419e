"""server/writes.py's `KeyWatches`: which connections watch which keys, bounded and
shared fairly (DESIGN.md: watches have per-tenant shares), and never forgotten silently.

The table is a plain thread-safe object: these tests drive it directly, with shares small
enough to reach. tests/test_server_resp_watch.py drives it through real clients.
"""

from __future__ import annotations

import threading

from epistemic_kvcache.server.writes import KeyWatches, Watcher


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
