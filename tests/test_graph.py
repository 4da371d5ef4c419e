"""Graph-aware paging: PageRank (hand-checked and against networkx) and `page_in_ranked`."""

from __future__ import annotations

import random
from collections.abc import Hashable

import numpy as np
import pytest

from epistemic_kvcache.graph import (
    PageRankConvergenceError,
    page_in_ranked,
    pagerank,
    rank_order,
)
from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.store.memory import SharedKvIndex

NS = "tenant-graph"
KiB = 1024
MiB = 1024 * KiB


# -- pagerank ----------------------------------------------------------------------------
def test_pagerank_three_node_example_solved_by_hand() -> None:
    # A->B, A->C, B->C, C->A with d=0.85, N=3 (teleport 0.05):
    #   a = 0.05 + 0.85 c;  b = 0.05 + 0.425 a;  c = 0.05 + 0.425 a + 0.85 b
    #   => a = 0.128625 / 0.3316875, b = 0.05 + 0.425 a, c = 0.0925 + 0.78625 a
    a = 0.128625 / 0.3316875
    expected = {"A": a, "B": 0.05 + 0.425 * a, "C": 0.0925 + 0.78625 * a}
    got = pagerank([("A", "B"), ("A", "C"), ("B", "C"), ("C", "A")])
    assert list(got) == ["A", "B", "C"]
    for node, value in expected.items():
        assert got[node] == pytest.approx(value, abs=1e-9)
    assert sum(got.values()) == pytest.approx(1.0, abs=1e-12)
    assert rank_order(got) == ["C", "A", "B"]


def test_pagerank_dangling_node_spreads_its_mass_uniformly() -> None:
    # A->B, B dangling: a = 0.075 + 0.425 b, b = 0.075 + 0.85 a + 0.425 b
    #   => b = 0.13875 / 0.21375, a = 0.075 + 0.425 b
    b = 0.13875 / 0.21375
    got = pagerank([("A", "B")])
    assert got["A"] == pytest.approx(0.075 + 0.425 * b, abs=1e-9)
    assert got["B"] == pytest.approx(b, abs=1e-9)


def test_pagerank_isolated_nodes_weights_and_edge_cases() -> None:
    assert pagerank([]) == {}
    only = pagerank([], nodes=["x", "y"])
    assert only == {"x": pytest.approx(0.5), "y": pytest.approx(0.5)}
    # A 2-cycle is symmetric whatever the damping.
    assert pagerank([(1, 2), (2, 1)], damping=0.5) == {1: pytest.approx(0.5), 2: pytest.approx(0.5)}
    # Weights: repeated pairs add up, so these two inputs are the same graph.
    heavy = pagerank([("h", "a", 3.0), ("h", "b", 1.0), ("a", "h"), ("b", "h")])
    split = pagerank([("h", "a", 1.0), ("h", "a", 2.0), ("h", "b"), ("a", "h"), ("b", "h")])
    assert heavy == pytest.approx(split)
    assert heavy["a"] > heavy["b"]
    # `nodes` fixes the order of the result.
    assert list(pagerank([("a", "b")], nodes=["z", "b"])) == ["z", "b", "a"]


@pytest.mark.parametrize(
    ("edges", "kwargs", "match"),
    [
        ([("a", "b")], {"damping": 1.0}, "damping"),
        ([("a", "b")], {"damping": -0.1}, "damping"),
        ([("a", "b")], {"tol": 0.0}, "tol"),
        ([("a", "b", 0.0)], {}, "weight"),
        ([("a", "b", -1.0)], {}, "weight"),
        ([("a", "b", float("nan"))], {}, "weight"),
        ([("a", "b", float("inf"))], {}, "weight"),
        ([("a",)], {}, "expected"),
    ],
)
def test_pagerank_refuses_bad_input(
    edges: list[tuple[object, ...]], kwargs: dict[str, float], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        pagerank(edges, **kwargs)  # type: ignore[arg-type]


def test_pagerank_reports_non_convergence() -> None:
    with pytest.raises(PageRankConvergenceError):
        pagerank([("a", "b"), ("b", "c"), ("c", "a"), ("a", "c")], max_iter=2)


def test_pagerank_matches_networkx_on_random_graphs(rand: random.Random) -> None:
    nx = pytest.importorskip("networkx")
    pytest.importorskip("scipy")
    for _ in range(5):
        n = rand.randint(5, 60)
        g = nx.DiGraph()
        g.add_nodes_from(range(n))  # some stay isolated, many are dangling
        edges: list[tuple[Hashable, Hashable, float]] = []
        for _ in range(rand.randint(0, 4 * n)):
            u, v, w = rand.randrange(n), rand.randrange(n), rand.uniform(0.1, 5.0)
            if g.has_edge(u, v):
                continue
            g.add_edge(u, v, weight=w)
            edges.append((u, v, w))
        damping = rand.choice([0.5, 0.85, 0.95])
        want = nx.pagerank(g, alpha=damping, tol=1e-13, max_iter=10_000, weight="weight")
        got = pagerank(edges, nodes=range(n), damping=damping, tol=1e-13)
        assert set(got) == set(want)
        for node in want:
            assert got[node] == pytest.approx(want[node], abs=1e-9), (n, node)


def test_pagerank_is_deterministic_and_scales(rand: random.Random) -> None:
    n = 20_000
    edges = [(rand.randrange(n), rand.randrange(n)) for _ in range(5 * n)]
    first = pagerank(edges, nodes=range(n))
    assert pagerank(edges, nodes=range(n)) == first
    values = np.fromiter(first.values(), dtype=np.float64)
    assert values.sum() == pytest.approx(1.0)
    assert (values > 0).all()


# -- page_in_ranked ----------------------------------------------------------------------
class RecordingIndex(SharedKvIndex):
    """The real in-process store, recording the paging calls in order."""

    def __init__(self, **kw: int) -> None:
        super().__init__(**kw)
        self.calls: list[tuple[str, str, float | None]] = []

    def promote(self, ns: str, key: str) -> bool:
        self.calls.append(("promote", key, None))
        return super().promote(ns, key)

    def set_importance(self, ns: str, key: str, score: float) -> bool:
        self.calls.append(("importance", key, score))
        return super().set_importance(ns, key, score)


def _block(seed: int, size: int) -> bytes:
    return np.random.default_rng(seed).bytes(size)


def _in_hot(store: SharedKvIndex, key: str) -> bool:
    b = store.ram.lookup_locked(NS, key)
    return b is not None and b.sdig in store.ram.tiers.hot


def test_page_in_follows_pagerank_order_and_respects_the_budget(rand: random.Random) -> None:
    store = RecordingIndex()
    n = 30
    edges = [(rand.randrange(n), rand.randrange(n)) for _ in range(90)]
    node_keys: dict[Hashable, list[str]] = {}
    for node in range(n):
        keys = [f"n{node}-c{c}" for c in range(rand.randint(1, 3))]
        node_keys[node] = keys
        for i, key in enumerate(keys):
            store.put(NS, key, _block(node * 10 + i, rand.choice([1, 2, 4]) * KiB))
    budget = 40 * KiB

    result = page_in_ranked(store, NS, edges, node_keys, budget)

    scores = pagerank(edges, nodes=range(n))
    order = rank_order(scores)
    assert [node for node, _ in result.ranking] == order
    expected_keys = [key for node in order for key in node_keys[node]]
    paged = [b.key for b in result.paged]
    # Paging is a prefix of the rank order; the first block that did not fit ends it.
    assert paged == expected_keys[: len(paged)]
    assert [(b.key, b.reason) for b in result.skipped] == [
        (k, "budget") for k in expected_keys[len(paged) :]
    ]
    sizes = {k: store.size(NS, k) for k in expected_keys}
    assert result.used_bytes == sum(b.bytes for b in result.paged) <= budget
    assert result.used_bytes + (sizes[expected_keys[len(paged)]] or 0) > budget
    # The store saw importance then promotion, block by block, in rank order.
    top = scores[order[0]]
    want_calls: list[tuple[str, str, float | None]] = []
    for b in result.paged:
        assert b.score == pytest.approx(scores[b.node] / top)
        want_calls += [("importance", b.key, b.score), ("promote", b.key, None)]
    assert store.calls == want_calls
    assert result.paged[0].score == 1.0


def test_page_in_skips_absent_keys_without_using_budget() -> None:
    store = RecordingIndex()
    store.put(NS, "hub-0", _block(1, 4 * KiB))
    store.put(NS, "leaf-a", _block(2, 4 * KiB))
    edges = [("a", "hub"), ("b", "hub"), ("hub", "a")]
    node_keys = {"hub": ["hub-0", "hub-missing"], "a": ["leaf-a"], "b": ["gone"]}
    result = page_in_ranked(store, NS, edges, node_keys, 8 * KiB)
    assert [b.key for b in result.paged] == ["hub-0", "leaf-a"]
    assert {(b.key, b.reason) for b in result.skipped} == {
        ("hub-missing", "absent"),
        ("gone", "absent"),
    }
    assert result.used_bytes == 8 * KiB
    doc = result.to_dict()
    assert doc["paged"][0] == {"node": "hub", "key": "hub-0", "bytes": 4 * KiB, "score": 1.0}
    assert doc["ranking"][0][0] == "hub"
    assert page_in_ranked(store, NS, edges, node_keys, 0).paged == []
    with pytest.raises(ValueError, match="budget"):
        page_in_ranked(store, NS, edges, node_keys, -1)


def test_paged_in_blocks_come_hot_and_outlive_recent_ones() -> None:
    store = SharedKvIndex(StoreOptions(hot_capacity_bytes=1 * MiB, warm_capacity_bytes=8 * MiB))
    block = 256 * KiB
    for i in range(8):  # 2 MiB: the first four end up demoted to warm
        store.put(NS, f"k{i}", _block(i, block))
    cold = [f"k{i}" for i in range(8) if not _in_hot(store, f"k{i}")]
    assert len(cold) == 4
    # A star around the first two cold blocks' nodes makes them the most central.
    hub, second = cold[0], cold[1]
    edges = [(f"k{i}", hub) for i in range(8) if f"k{i}" != hub] + [(hub, second)]
    node_keys = {f"k{i}": [f"k{i}"] for i in range(8)}
    before = store.stats(NS).promotions
    result = page_in_ranked(store, NS, edges, node_keys, 2 * block)
    assert [b.key for b in result.paged] == [hub, second]
    assert _in_hot(store, hub)
    assert _in_hot(store, second)
    assert store.stats(NS).promotions == before + 2
    # Touch every other hot block so it is more recent, then push two new blocks in:
    # the importance score keeps the paged-in blocks hot, the recent ones go down.
    others = [f"k{i}" for i in range(8) if _in_hot(store, f"k{i}") and f"k{i}" not in (hub, second)]
    for key in others:
        assert store.get(NS, key) is not None
    store.put(NS, "new-1", _block(101, block))
    store.put(NS, "new-2", _block(102, block))
    assert _in_hot(store, hub)
    assert _in_hot(store, second)
    assert sum(_in_hot(store, k) for k in others) == 0
