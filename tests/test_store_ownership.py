"""The store owns its bytes (issue 22 item 3).

What a caller passes to a PUT may be changed by the caller afterwards, and what a GET
returns may be written into: neither may change what the store holds. The store copies
mutable input at its edge (or takes a buffer whose owner gives it up explicitly, a
`Handover`) and hands out read-only views. Every case runs on the memory and the
durable backend; the durable one is also reopened, so RAM and disk are compared.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from epistemic_kvcache import buffers
from epistemic_kvcache.buffers import Handover
from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.store import Buffer, SharedKvIndex, SharedKvStoreBackend
from epistemic_kvcache.store.api import owned_buffer
from epistemic_kvcache.store.engine import WOULD_BLOCK, TieredEngine

KiB, MiB = 1 << 10, 1 << 20
NS = "tenant"
A = b"A" * (4 * KiB)
B = b"B" * (4 * KiB)

Opener = Callable[[], TieredEngine]


@pytest.fixture(params=["memory", "durable"])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opener]:
    """Opens the backend under test; the durable one on the same directory each time
    (the previous instance closed first), so a reopen reads what reached the disk."""
    opened: list[TieredEngine] = []

    def open_store() -> TieredEngine:
        if request.param == "memory":
            if opened:
                return opened[0]
            store: TieredEngine = SharedKvIndex(
                StoreOptions(hot_capacity_bytes=64 * MiB, warm_capacity_bytes=64 * MiB)
            )
        else:
            for s in opened:
                s.close()
            store = SharedKvStoreBackend(
                tmp_path / "store",
                StoreOptions(
                    map_size_bytes=64 * MiB,
                    hot_capacity_bytes=64 * MiB,
                    warm_capacity_bytes=64 * MiB,
                ),
            )
        opened.append(store)
        return store

    yield open_store
    for s in opened:
        s.close()


def reopen(opener: Opener, store: TieredEngine) -> TieredEngine:
    """The durable backend reopened from disk (RAM copies gone); the memory one as is."""
    return opener() if isinstance(store, SharedKvStoreBackend) else store


def assert_read_only(data: Buffer | None) -> None:
    """Nothing can be written through what a read returned."""
    assert data is not None
    with pytest.raises(TypeError):
        data[0] = 0  # type: ignore[index]
    with pytest.raises(TypeError):
        memoryview(data)[0] = 0
    with pytest.raises(ValueError, match="read-only"):
        np.frombuffer(data, dtype=np.uint8)[0] = 0


def mutable_inputs() -> list[tuple[str, Callable[[bytes], Any]]]:
    return [
        ("bytearray", bytearray),
        ("memoryview of a bytearray", lambda b: memoryview(bytearray(b))),
        ("read-only view of a bytearray", lambda b: memoryview(bytearray(b)).toreadonly()),
        ("numpy array", lambda b: np.frombuffer(bytearray(b), dtype=np.uint8)),
        ("receive buffer not handed over", _receive_buffer),
    ]


def _receive_buffer(b: bytes) -> memoryview:
    buf = buffers.alloc_block(len(b))
    buf[:] = b
    return buf


def _mutate(buf: Any) -> None:
    """Overwrite the memory under `buf` (through its owner for a read-only view)."""
    target = buf.obj if isinstance(buf, memoryview) else buf
    memoryview(target).cast("B")[: len(B)] = B


@pytest.mark.parametrize(("kind", "make"), mutable_inputs(), ids=[k for k, _ in mutable_inputs()])
def test_mutating_a_buffer_after_put_leaves_the_stored_block(
    opener: Opener, kind: str, make: Callable[[bytes], Any]
) -> None:
    """The issue's repro: PUT a bytearray, change it, PUT the original bytes under another
    key. Both keys read back the original bytes (the second deduplicated onto the first
    correctly), `check(deep=True)` is clean because nothing is wrong, and after a
    reopen the durable store reads the same bytes from disk."""
    store = opener()
    buf = make(A)
    assert store.put(NS, "k1", buf).created
    _mutate(buf)  # the caller reuses its buffer
    assert store.get(NS, "k1") == A
    store.put(NS, "k2", A)  # the original bytes: deduplicated onto k1's block
    assert store.get(NS, "k2") == A
    assert store.stats(NS).dedup_hits == 1
    assert store.stats(NS).unique_blocks == 1
    assert store.check(deep=True).ok
    store = reopen(opener, store)
    assert (store.get(NS, "k1"), store.get(NS, "k2")) == (A, A)
    assert store.check(deep=True).ok


def test_every_put_path_copies_mutable_input(opener: Opener) -> None:
    store = opener()
    bufs: list[bytearray] = []

    def mine(seed: int) -> bytearray:
        b = bytearray(A)
        b[0] = seed
        bufs.append(b)
        return b

    store.put(NS, "plain", mine(1))
    store.put(NS, "scoped", mine(2), epoch_scope="s")
    store.put_many(NS, [("many-1", mine(3)), ("many-2", mine(4))])
    started = store.put_nowait(NS, "nowait", mine(5))
    assert started is not WOULD_BLOCK
    if isinstance(started, concurrent.futures.Future):
        started.result()  # the durable backend: on disk once resolved
    store.put(NS, "base", A)
    sid = store.snapshot_create(NS).id
    bid = store.branch_create(NS, sid).id
    store.branch_put(NS, bid, "branch", mine(6))
    for b in bufs:
        b[:] = B
    expect = {"plain": 1, "scoped": 2, "many-1": 3, "many-2": 4, "nowait": 5}
    for _ in range(2):  # RAM, then (durable) what reached the disk
        for key, seed in expect.items():
            assert store.get(NS, key) == bytes([seed]) + A[1:], key
        assert store.branch_get(NS, bid, "branch") == bytes([6]) + A[1:]
        assert store.check(deep=True).ok
        store = reopen(opener, store)


def _evict_to_disk(store: TieredEngine, key: str) -> None:
    assert store.evict(NS, key)


def test_no_read_path_hands_out_writable_bytes(opener: Opener) -> None:
    """Hot hits, batch reads, snapshot and branch reads, a warm-tier decompression and a
    cold page-in all return bytes nobody can write into; trying changes nothing."""
    store = opener()
    comp = (np.arange(64 * KiB, dtype=np.uint16) % 7).tobytes()  # compresses in warm
    store.put(NS, "k", A)
    store.put(NS, "handed", Handover(_receive_buffer(B)))
    sid = store.snapshot_create(NS).id  # (pins k and handed)
    bid = store.branch_create(NS, sid).id
    store.put(NS, "comp", comp)
    store.put(NS, "cold", bytearray(A[:-1]))
    store.put(NS, "cold-rx", Handover(_receive_buffer(B[:-1])))
    reads: list[tuple[str, Callable[[], Buffer | None]]] = [
        ("get", lambda: store.get(NS, "k")),
        ("get handed over", lambda: store.get(NS, "handed")),
        ("get_nowait", lambda: store.get_nowait(NS, "k")),  # type: ignore[arg-type, return-value]
        ("get_many", lambda: store.get_many(NS, ["k", "handed"])[1]),
        ("snapshot_get", lambda: store.snapshot_get(NS, sid, "k")),
        ("branch_get", lambda: store.branch_get(NS, bid, "handed")),
    ]
    for what, read in reads:
        data = read()
        assert data is not None, what
        assert_read_only(data)
    # the warm tier: demoted, decompressed (and promoted again) on a read
    with store.ram.lock:
        b = store.ram.lookup_locked(NS, "comp")
        assert b is not None
        assert b.hot is not None
    store.ram.tiers.rebalance(hot_target=0)
    with store.ram.lock:
        assert b.hot is None
        assert b.warm is not None
        assert len(b.warm) < len(comp)
    data = store.get(NS, "comp")
    assert data == comp
    assert_read_only(data)
    assert_read_only(store.get(NS, "comp"))  # the promoted copy
    if isinstance(store, SharedKvStoreBackend):
        # the cold tier: paged in from disk (and promoted to hot)
        for key in ("comp", "cold", "cold-rx"):  # (the snapshot pins k and handed)
            _evict_to_disk(store, key)
            assert_read_only(store.get(NS, key))
            assert_read_only(store.get(NS, key))  # the promoted copy
        store = reopen(opener, store)
        assert_read_only(store.get_many(NS, ["k"])[0])
    assert [store.get(NS, k) for k in ("k", "handed", "comp", "cold", "cold-rx")] == [
        A,
        B,
        comp,
        A[:-1],
        B[:-1],
    ]
    assert store.check(deep=True).ok


def test_handover_gives_the_store_a_buffer_without_a_copy(opener: Opener) -> None:
    """The wires' zero-copy path, explicit: a `Handover` of a whole receive buffer (or
    of a whole bytearray) is kept as it is, read-only; anything else is refused."""
    store = opener()
    received = _receive_buffer(A)
    kept = owned_buffer(Handover(received))
    assert isinstance(kept, memoryview)
    assert kept.readonly
    assert kept.obj is received.obj  # the same memory, not a copy
    store.put(NS, "rx", Handover(received))
    got = store.get(NS, "rx")
    assert isinstance(got, memoryview)
    assert got.obj is received.obj
    assert got.readonly
    mine = bytearray(B)
    store.put(NS, "ba", Handover(mine))
    got = store.get(NS, "ba")
    assert isinstance(got, memoryview)
    assert got.obj is mine
    roomy = buffers.alloc_block(len(A), slack=buffers.MAX_SLACK)
    roomy[: len(A)] = A
    assert owned_buffer(Handover(roomy[: len(A)])).obj is roomy.obj
    assert len(Handover(roomy[: len(A)])) == len(A)
    for bad in (
        received[1:],  # a part of a receive buffer: the rest stays its owner's
        roomy[1 : len(A) + 1],
        memoryview(bytearray(8))[2:],
        memoryview(np.zeros(8, dtype=np.uint8)),  # someone else's array
        memoryview(np.zeros((2, 4), dtype=np.uint8)),  # (2-D too)
    ):
        with pytest.raises(ValueError, match="Handover"):
            Handover(bad)
    with pytest.raises(TypeError, match="Handover"):
        Handover("text")  # type: ignore[arg-type]
    store = reopen(opener, store)
    assert (store.get(NS, "rx"), store.get(NS, "ba")) == (A, B)


def test_immutable_input_is_kept_without_a_copy() -> None:
    """bytes, and a whole read-only view of bytes, cannot change: the store keeps them."""
    data = bytes(A)
    assert owned_buffer(data) is data
    view = memoryview(data)
    assert owned_buffer(view) is view
    assert isinstance(owned_buffer(view[1:]), bytes)  # a part: the whole would stay alive
    ba = bytearray(A)
    copied = owned_buffer(ba)
    assert isinstance(copied, bytes)
    assert copied == A
