"""The store's hot core: its compiled twin against the pure one, and its hit paths against
the engine's general path (differential, Hypothesis).

store/hotcore.py is the pure-Python reference; store/_hotcore_c is the same source
compiled by Cython (setup.py), picked at import by store/core.py. Two properties:
- **twins**: both twins' `HotCore`, over the same RAM state built from their own records,
  get the same random GETs, EXISTS and PUTs and must give the same answers and leave the
  same books (LRU orders, hit counts, every counter); their records' own methods agree;
- **paths**: an engine whose hit paths run (`get`, `get_nowait`, `exists_nowait`,
  `put_nowait` through the core) and one whose core declines everything (the general
  path alone) get the same random operations, memory and durable backends, epoch scopes
  and a hot tier too small for everything included, and must give the same answers and
  stats, with the same LRU orders and hit counts. CI runs this file on the compiled twin
  and again on the pure one (Makefile `PURE_AGAIN`).

Where the compiled twin is not built the twin tests are skipped; tests/test_twins.py
checks that it is built and selected where it should be (in CI,
`KVCACHE_REQUIRE_COMPILED=1`), and that the store's records are that twin's.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from blake3 import blake3
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.store import SharedKvIndex, SharedKvStoreBackend, core, hotcore
from epistemic_kvcache.store.api import WOULD_BLOCK
from epistemic_kvcache.store.engine import TieredEngine
from helpers import compiled_twin

compiled, needs_compiled = compiled_twin("epistemic_kvcache.store._hotcore_c")


# -- twins: the same RAM state, the same requests -------------------------------------------

NAMESPACES = ["a", "b", "c\x00s\x00x"]  # the last one internal: PUTs into it are declined
KEYS = ["k0", "k1", "k2", "k3", "", "\u00e9"]  # the last two: never the core's
VALUES = [b"x" * 5, b"y" * 5, b"z" * 9, bytearray(b"x" * 5), memoryview(b"x" * 5)]


class _Ram:
    """A RAM state as the engine keeps it, made of one twin's records."""

    def __init__(self, twin: ModuleType, global_dedup: bool) -> None:
        self.twin = twin
        self.index: dict[str, dict[str, Any]] = {}
        self.blobs: dict[bytes, Any] = {}
        self.hot: OrderedDict[bytes, Any] = OrderedDict()
        self.by_ns: dict[str, Any] = {}
        self.total = twin._Counters()
        self.tags: dict[tuple[str, str], tuple[str, int]] = {}
        self.valid_ns: dict[str, bytes] = {}
        self.global_dedup = global_dedup
        self.core = twin.HotCore(
            index=self.index,
            blobs=self.blobs,
            hot=self.hot,
            by_ns=self.by_ns,
            total=self.total,
            lock=threading.Lock(),
            tags=self.tags,
            valid_ns=self.valid_ns,
            global_dedup=global_dedup,
            max_block_bytes=8,
        )

    def add(self, ns: str, key: str, data: bytes, hot: bool) -> None:
        raw = ns.encode()
        digest = blake3(data).digest()
        sdig = digest if self.global_dedup else raw + b"\x00" + digest
        b = self.blobs.get(sdig)
        if b is None:
            b = self.blobs[sdig] = self.twin._Blob(sdig, len(data))
            b.owner = ns
            if hot:
                b.hot = data
                self.hot[sdig] = b
        b.refs += 1
        b.add_keyref((ns, key))
        self.index.setdefault(ns, {})[key] = b
        self.valid_ns[ns] = raw
        self.by_ns.setdefault(ns, self.twin._Counters())

    def books(self) -> tuple[object, ...]:
        return (
            list(self.blobs),
            list(self.hot),
            [(b.sdig, b.hits, b.refs, b.size, b.key_refs()) for b in self.blobs.values()],
            {ns: c.values() for ns, c in self.by_ns.items()},
            self.total.values(),
        )


class _Str(str):
    """A str subclass (numpy.str_ is one): the core leaves such names to the engine."""


def _answer(r: object) -> object:
    if r is WOULD_BLOCK or r is None or isinstance(r, int):
        return r
    if isinstance(r, tuple):  # a PutResult
        return tuple(r)
    return bytes(r)  # type: ignore[call-overload]  # a buffer


setup_st = st.lists(
    st.tuples(
        st.sampled_from(NAMESPACES),
        st.sampled_from(KEYS[:2]),
        st.sampled_from([b"x" * 5, b"y" * 5, b"z" * 9]),
        st.booleans(),
    ),
    max_size=12,
)
op_st = st.lists(
    st.one_of(
        st.tuples(st.just("get"), st.sampled_from(NAMESPACES), st.sampled_from(KEYS)),
        st.tuples(
            st.just("exists"),
            st.sampled_from(NAMESPACES),
            st.lists(st.sampled_from(KEYS), max_size=4),
        ),
        st.tuples(
            st.just("put"),
            st.sampled_from(NAMESPACES),
            st.sampled_from(KEYS),
            st.sampled_from(range(len(VALUES))),
        ),
        st.tuples(
            st.sampled_from(["tag", "untag", "inflight", "landed"]),
            st.sampled_from(NAMESPACES[:2]),
            st.sampled_from(KEYS[:2]),
        ),
        st.tuples(st.just("uncount"), st.sampled_from(NAMESPACES)),
        st.tuples(st.just("str subclass"), st.sampled_from(NAMESPACES[:2])),
    ),
    max_size=40,
)


@needs_compiled
@settings(max_examples=400, deadline=None)
@given(setup=setup_st, ops=op_st, global_dedup=st.booleans())
# (each guard of a duplicate PUT, for certain: an epoch tag, a write in flight)
@example(
    setup=[("a", "k0", b"x" * 5, True)],
    ops=[("tag", "a", "k0"), ("put", "a", "k0", 0)],
    global_dedup=False,
)
@example(
    setup=[("a", "k0", b"x" * 5, False)],
    ops=[
        ("inflight", "a", "k0"),
        ("put", "a", "k0", 0),
        ("landed", "a", "k0"),
        ("put", "a", "k0", 0),
    ],
    global_dedup=False,
)
@example(
    setup=[("a", "k0", b"x" * 5, True)],
    ops=[("inflight", "a", "k0"), ("put", "a", "k0", 3), ("uncount", "a"), ("get", "a", "k0")],
    global_dedup=True,
)
def test_both_twins_answer_and_count_alike(
    setup: list[tuple[str, str, bytes, bool]], ops: list[tuple[Any, ...]], global_dedup: bool
) -> None:
    rams = [_Ram(hotcore, global_dedup), _Ram(compiled, global_dedup)]
    for ram in rams:
        for ns, key, data, hot in setup:
            if key not in ram.index.get(ns, {}):
                ram.add(ns, key, data, hot)
    for op in ops:
        answers = []
        for ram in rams:
            if op[0] == "get":
                answers.append(_answer(ram.core.get(op[1], op[2])))
            elif op[0] == "exists":
                answers.append(ram.core.exists(op[1], op[2]))
            elif op[0] == "put":
                answers.append(_answer(ram.core.put(op[1], op[2], VALUES[op[3]])))
            elif op[0] == "tag":
                ram.tags[(op[1], op[2])] = ("s", 1)
            elif op[0] == "untag":
                ram.tags.pop((op[1], op[2]), None)
            elif op[0] == "inflight":  # a write of the key queued for the committer
                ram.core.inflight[(op[1], op[2])] = 1
            elif op[0] == "landed":
                ram.core.inflight.pop((op[1], op[2]), None)
            elif op[0] == "uncount":  # the namespace's counters not made yet
                ram.by_ns.pop(op[1], None)
            else:  # names of a str subclass: declined, never a TypeError
                ns, key = _Str(op[1]), _Str("k0")
                answers.append(
                    (
                        _answer(ram.core.get(ns, key)),
                        ram.core.exists(ns, [key]),
                        _answer(ram.core.put(ns, key, b"x" * 5)),
                    )
                )
        if answers:
            assert answers[0] == answers[1], op
        assert rams[0].books() == rams[1].books(), op


@needs_compiled
@settings(deadline=None)
@given(
    refs=st.lists(
        st.tuples(st.sampled_from(["a", "b", "a\x00s\x00x"]), st.sampled_from(["k", "l", "m"])),
        max_size=8,
        unique=True,
    ),
    drop=st.lists(st.integers(0, 7), max_size=8),
    owner=st.sampled_from(["a", "b"]),
)
def test_both_twins_records_behave_alike(
    refs: list[tuple[str, str]], drop: list[int], owner: str
) -> None:
    blobs = [hotcore._Blob(b"d" * 33, 10), compiled._Blob(b"d" * 33, 10)]
    for b in blobs:
        b.owner = owner
        for ref in refs:
            b.add_keyref(ref)
    for i in drop:
        if i < len(refs):
            for b in blobs:
                if refs[i] in b.key_refs():
                    b.remove_keyref(refs[i])
        assert blobs[0].key_refs() == blobs[1].key_refs()
        assert blobs[0].keys == blobs[1].keys
    assert blobs[0].digest == blobs[1].digest == b"d" * 32
    assert tuple(blobs[0].owners()) == tuple(blobs[1].owners())
    counters = [hotcore._Counters(), compiled._Counters()]
    for i, name in enumerate(hotcore._Counters.__slots__):
        for c in counters:
            setattr(c, name, i * 7 + len(refs))
    caps = {"hot": 100, "warm": 50, "cold": 1000}
    assert counters[0].stats(caps) == counters[1].stats(caps)
    assert counters[0].values() == counters[1].values()
    assert repr(counters[0]) == repr(counters[1])


# -- paths: the hit paths against the engine's general path ----------------------------------


class _Declining:
    """A hot core that declines everything: the engine then takes its general path."""

    def get(self, ns: str, key: str) -> object:
        return WOULD_BLOCK

    def exists(self, ns: str, keys: object) -> int:
        return core.DECLINED

    def put(self, ns: str, key: str, data: object) -> object:
        return WOULD_BLOCK


ENGINE_KEYS = ["k0", "k1", "k2", "k3"]
ENGINE_VALUES = [
    b"a" * 3000,
    b"b" * 3000,
    b"c" * 5000,
    bytearray(b"a" * 3000),
    memoryview(b"b" * 3000),
]
engine_op_st = st.lists(
    st.one_of(
        st.tuples(
            st.sampled_from(["put", "put_nowait", "put_scoped"]),
            st.sampled_from(ENGINE_KEYS),
            st.sampled_from(range(len(ENGINE_VALUES))),
        ),
        st.tuples(
            st.sampled_from(
                ["get", "get_nowait", "delete", "evict", "promote", "pin", "unpin", "branch_put"]
            ),
            st.sampled_from(ENGINE_KEYS),
        ),
        st.tuples(st.just("exists"), st.lists(st.sampled_from(ENGINE_KEYS), max_size=3)),
        st.tuples(st.sampled_from(["bump", "snapshot", "branch", "drop snapshots"])),
    ),
    max_size=30,
)


def _run(store: TieredEngine, op: tuple[Any, ...]) -> object:
    name = op[0]
    if name in ("put", "put_nowait", "put_scoped"):
        data = ENGINE_VALUES[op[2]]
        if name == "put":
            return tuple(store.put("t", op[1], data))
        if name == "put_scoped":
            return tuple(store.put("t", op[1], data, epoch_scope="s"))
        r = store.put_nowait("t", op[1], data)
        if r is WOULD_BLOCK:
            return "would block"
        return tuple(r if isinstance(r, tuple) else r.result(timeout=60))
    if name == "get":
        got = store.get("t", op[1])
        return None if got is None else bytes(got)
    if name == "get_nowait":
        now = store.get_nowait("t", op[1])
        return now if now is None or now is WOULD_BLOCK else bytes(now)
    if name == "exists":
        return store.exists_nowait("t", op[1])
    if name == "delete":
        return store.delete("t", op[1])
    if name == "evict":
        return store.evict("t", op[1])
    if name == "promote":
        return store.promote("t", op[1])
    if name == "pin":
        return store.pin("t", op[1])
    if name == "unpin":
        return store.unpin("t", op[1])
    if name == "snapshot":  # entries in an internal namespace, sharing the tenant's blobs
        return store.snapshot_create("t", keys=ENGINE_KEYS[:2]).keys
    if name == "branch":
        snaps = store.snapshot_list("t")
        return bool(snaps) and store.branch_create("t", snaps[0].id).snapshot_id == snaps[0].id
    if name == "branch_put":  # a PUT into an internal namespace
        branches = store.branch_list("t")
        if not branches:
            return None
        return tuple(store.branch_put("t", branches[0].id, op[1], ENGINE_VALUES[0]))
    if name == "drop snapshots":
        for branch in store.branch_list("t"):
            store.branch_delete("t", branch.id)
        return [store.snapshot_delete("t", snap.id) for snap in store.snapshot_list("t")]
    return store.epoch_bump("t", "s")


def _books(store: TieredEngine) -> tuple[object, ...]:
    return (
        store.stats("t").to_dict(),
        {k: v for k, v in store.stats().to_dict().items() if k != "extra"},
        [b.sdig for b in store.ram.blob_list_locked()],
        list(store.ram.tiers.hot),
        [(b.hits, b.refs) for b in store.ram.blob_list_locked()],
    )


def _both(make: Any, ops: list[tuple[Any, ...]]) -> None:
    fast, general = make("fast"), make("general")
    general._core = _Declining()
    try:
        for op in ops:
            assert _run(fast, op) == _run(general, op), op
            assert _books(fast) == _books(general), op
    finally:
        fast.close()
        general.close()


# a hot tier for two of the values: the rest are demoted to warm (compressed), read back
RAM = {"hot_capacity_bytes": 8000, "warm_capacity_bytes": 1 << 20}


@pytest.mark.parametrize(
    "options",
    [{}, {"dedup_scope": "global"}, {"first_write_wins": True}],
    ids=["namespace-scope", "global-scope", "first-write-wins"],
)
@settings(max_examples=100, deadline=None)
@given(ops=engine_op_st)
def test_memory_engine_answers_alike_with_and_without_its_hit_paths(
    options: dict[str, Any], ops: list[tuple[Any, ...]]
) -> None:
    _both(lambda _: SharedKvIndex(StoreOptions(**RAM, **options)), ops)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=engine_op_st)
def test_durable_engine_answers_alike_with_and_without_its_hit_paths(
    tmp_path: Path, ops: list[tuple[Any, ...]]
) -> None:
    base = tmp_path / os.urandom(6).hex()

    def make(name: str) -> SharedKvStoreBackend:
        opts = StoreOptions(map_size_bytes=64 << 20, **RAM)  # type: ignore[arg-type]
        return SharedKvStoreBackend(base / name, opts, epoch_dir=base / f"{name}-epochs")

    _both(make, ops)


class _Counting:
    """The engine's own hot core, counting what it answered (so the differential above is
    known to run through it, not around it)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.answered: list[str] = []

    def get(self, ns: str, key: str) -> object:
        r = self.inner.get(ns, key)
        if r is not WOULD_BLOCK:
            self.answered.append("get")
        return r

    def exists(self, ns: str, keys: object) -> int:
        n: int = self.inner.exists(ns, keys)
        if n != core.DECLINED:
            self.answered.append("exists")
        return n

    def put(self, ns: str, key: str, data: object) -> object:
        r = self.inner.put(ns, key, data)
        if r is not WOULD_BLOCK:
            self.answered.append("put")
        return r


@pytest.mark.parametrize("backend", ["memory", "durable"])
def test_the_hit_paths_answer_what_ram_alone_answers(tmp_path: Path, backend: str) -> None:
    if backend == "memory":
        store: TieredEngine = SharedKvIndex(StoreOptions(**RAM))  # type: ignore[arg-type]
    else:
        opts = StoreOptions(map_size_bytes=64 << 20, **RAM)  # type: ignore[arg-type]
        store = SharedKvStoreBackend(tmp_path / "s", opts, epoch_dir=tmp_path / "e")
    counting = _Counting(store._core)
    store._core = counting  # type: ignore[assignment]
    try:
        ops: list[tuple[Any, ...]] = [
            ("put", "k0", 0),  # new: the general path (it validates "t", makes its counters)
            ("get", "k0"),  # hit
            ("get_nowait", "k0"),  # hit
            ("get", "k1"),  # miss
            ("exists", ["k0", "k1", "k0"]),
            ("put_nowait", "k0", 0),  # the same bytes: a duplicate
            ("put_nowait", "k0", 3),  # the same bytes in a bytearray
            ("put_nowait", "k0", 1),  # other bytes of the same size: declined after hashing
            ("put_scoped", "k2", 2),  # an epoch tag: the core declines from now on
            ("get_nowait", "k0"),
        ]
        answers = [_run(store, op) for op in ops]
        assert answers[2] == ENGINE_VALUES[0]
        assert answers[3] is None
        assert answers[4] == 2
        assert counting.answered == ["get", "get", "get", "exists", "put", "put"]
        assert answers[9] == ENGINE_VALUES[1]  # the general path answers it now
        st_t = store.stats("t")
        assert (st_t.get_hits, st_t.get_misses, st_t.dedup_hits) == (3, 1, 2)
    finally:
        store.close()


def test_a_key_with_a_write_in_flight_is_left_to_the_committer(tmp_path: Path) -> None:
    """Durable backend: while a write of the key waits for the committer, a PUT of the
    bytes the key holds in RAM is not a duplicate yet (the queued write may replace them):
    the core leaves it to the committer, which decides in order."""
    opts = StoreOptions(map_size_bytes=64 << 20, **RAM)  # type: ignore[arg-type]
    store = SharedKvStoreBackend(tmp_path / "s", opts, epoch_dir=tmp_path / "e")
    counting = _Counting(store._core)
    store._core = counting  # type: ignore[assignment]
    try:
        store.put("t", "k0", ENGINE_VALUES[0])
        store.ram.enter_flight([("t", "k0")])  # as the committer's queue holds a write of k0
        started = store.put_nowait("t", "k0", ENGINE_VALUES[0])
        assert counting.answered == []
        assert not isinstance(started, tuple)  # queued: a future, not an answer from RAM
        assert started is not WOULD_BLOCK
        assert started.result(timeout=60).outcome.value == "duplicate"
        with store.ram.lock:  # (only the pretend write is left)
            assert store.ram.in_flight_locked("t", "k0")
            store.ram.leave_flight_locked([("t", "k0")])
            assert not store.ram.in_flight_locked("t", "k0")
        assert isinstance(store.put_nowait("t", "k0", ENGINE_VALUES[0]), tuple)
        assert counting.answered == ["put"]
    finally:
        store.close()
