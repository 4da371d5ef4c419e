"""Graph-aware paging: PageRank over a caller's graph, then page the most central KV in.

How it works
- `pagerank` keeps the column-stochastic transition matrix as its edge list (edge
  weights normalised by each source's out-weight; `M x` is one `numpy.bincount` over
  the edges, so numpy alone does it, no scipy) and runs the power iteration
  ``x <- d * (M x + dangling_mass / N) + (1 - d) / N`` until the L1 change is below
  ``N * tol`` (networkx's criterion, so the two agree). Dangling nodes (no out-edges)
  spread their mass uniformly, like networkx's default. Node order is first appearance
  (``nodes`` first, then edge endpoints), so results are deterministic for a given input.
- `page_in_ranked` ranks the nodes, walks them most central first (ties: first
  appearance), and for each node's keys in the given order asks the store for the block
  size, stops at the first block that would overrun the byte budget, promotes the block
  into the hot tier after setting its importance to the node's score divided by the top
  score (so the most central node gets 1.0), which the hot tier blends into eviction.
  Absent keys are skipped and do not use budget.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from epistemic_kvcache.store.api import SharedKvBackend

Edge = tuple[Hashable, Hashable] | tuple[Hashable, Hashable, float]

DEFAULT_DAMPING = 0.85
DEFAULT_TOL = 1e-10
DEFAULT_MAX_ITER = 1000
"""networkx stops at 100 iterations; tol=1e-10 on slowly mixing graphs may need more."""


class PageRankConvergenceError(ArithmeticError):
    """The power iteration did not reach `tol` within `max_iter` iterations."""


def _index_nodes(
    edges: Sequence[Edge], nodes: Iterable[Hashable] | None
) -> tuple[list[Hashable], dict[Hashable, int]]:
    order: list[Hashable] = []
    index: dict[Hashable, int] = {}

    def add(node: Hashable) -> None:
        if node not in index:
            index[node] = len(order)
            order.append(node)

    for node in nodes if nodes is not None else ():
        add(node)
    for i, edge in enumerate(edges):
        if len(edge) not in (2, 3):
            raise ValueError(f"edge {i}: expected (src, dst) or (src, dst, weight)")
        add(edge[0])
        add(edge[1])
    return order, index


def pagerank(
    edges: Iterable[Edge],
    nodes: Iterable[Hashable] | None = None,
    *,
    damping: float = DEFAULT_DAMPING,
    tol: float = DEFAULT_TOL,
    max_iter: int = DEFAULT_MAX_ITER,
) -> dict[Hashable, float]:
    """PageRank of every node (scores sum to 1), by sparse power iteration.

    `edges` are directed `(src, dst)` or `(src, dst, weight)` pairs (weight > 0; repeated
    pairs add their weights); `nodes` adds isolated nodes and fixes the order of the
    result. Raises `ValueError` for a bad damping or weight, `PageRankConvergenceError`
    if the iteration does not converge.
    """
    # Imported here: the client imports this module for its result types only.
    import numpy as np

    if not 0.0 <= damping < 1.0:
        raise ValueError(f"damping must be in [0, 1) (got {damping!r})")
    if tol <= 0.0:
        raise ValueError(f"tol must be positive (got {tol!r})")
    edge_list = list(edges)
    order, index = _index_nodes(edge_list, nodes)
    n = len(order)
    if n == 0:
        return {}
    src = np.empty(len(edge_list), dtype=np.int64)
    dst = np.empty(len(edge_list), dtype=np.int64)
    weight = np.empty(len(edge_list), dtype=np.float64)
    for i, edge in enumerate(edge_list):
        w = float(edge[2]) if len(edge) == 3 else 1.0
        if not w > 0.0 or w == float("inf"):
            raise ValueError(f"edge {i}: weight must be a positive finite number (got {w!r})")
        src[i] = index[edge[0]]
        dst[i] = index[edge[1]]
        weight[i] = w
    out_weight = np.bincount(src, weights=weight, minlength=n)
    # M[dst, src] = w / out_weight[src]: column-stochastic over non-dangling columns.
    share = weight / out_weight[src]  # M[dst, src] per edge; repeated pairs add up
    dangling = out_weight == 0.0
    x = np.full(n, 1.0 / n)
    teleport = (1.0 - damping) / n
    for _ in range(max_iter):
        prev = x
        moved = np.bincount(dst, weights=share * prev[src], minlength=n)  # M @ prev
        x = damping * (moved + prev[dangling].sum() / n) + teleport
        if np.abs(x - prev).sum() < n * tol:
            break
    else:
        raise PageRankConvergenceError(f"PageRank did not converge in {max_iter} iterations")
    x /= x.sum()
    return {node: float(x[i]) for i, node in enumerate(order)}


def rank_order(scores: Mapping[Hashable, float]) -> list[Hashable]:
    """Nodes by descending score; equal scores keep their insertion order."""
    position = {node: i for i, node in enumerate(scores)}
    return sorted(scores, key=lambda node: (-scores[node], position[node]))


@dataclass(frozen=True, slots=True)
class PagedBlock:
    """A block promoted into the hot tier."""

    node: Hashable
    key: str
    bytes: int
    score: float
    """The node's PageRank divided by the top PageRank (the importance set in the store)."""


@dataclass(frozen=True, slots=True)
class SkippedBlock:
    """A block that was not paged in: `reason` is `"absent"` or `"budget"`."""

    node: Hashable
    key: str
    reason: str
    bytes: int | None


@dataclass(slots=True)
class PageInResult:
    """What `page_in_ranked` did, in the order it did it."""

    budget_bytes: int
    used_bytes: int = 0
    ranking: list[tuple[Hashable, float]] = field(default_factory=list)
    """Every node with its raw PageRank, most central first."""
    paged: list[PagedBlock] = field(default_factory=list)
    skipped: list[SkippedBlock] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the `POST /kv/page-in` answer)."""
        return {
            "budget_bytes": self.budget_bytes,
            "used_bytes": self.used_bytes,
            "ranking": [[node, score] for node, score in self.ranking],
            "paged": [
                {"node": b.node, "key": b.key, "bytes": b.bytes, "score": b.score}
                for b in self.paged
            ],
            "skipped": [
                {"node": b.node, "key": b.key, "reason": b.reason, "bytes": b.bytes}
                for b in self.skipped
            ],
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> PageInResult:
        """Inverse of `to_dict` (the client's view). Raises KeyError/TypeError/ValueError."""
        return cls(
            budget_bytes=int(doc["budget_bytes"]),
            used_bytes=int(doc["used_bytes"]),
            ranking=[(node, float(score)) for node, score in doc["ranking"]],
            paged=[
                PagedBlock(b["node"], str(b["key"]), int(b["bytes"]), float(b["score"]))
                for b in doc["paged"]
            ],
            skipped=[
                SkippedBlock(
                    b["node"],
                    str(b["key"]),
                    str(b["reason"]),
                    None if b["bytes"] is None else int(b["bytes"]),
                )
                for b in doc["skipped"]
            ],
        )


def page_in_ranked(
    store: SharedKvBackend,
    ns: str,
    edges: Iterable[Edge],
    node_keys: Mapping[Hashable, Sequence[str]],
    budget_bytes: int,
    *,
    damping: float = DEFAULT_DAMPING,
) -> PageInResult:
    """Promote the blocks of the most central nodes into the hot tier within a byte budget.

    Nodes are ranked by `pagerank(edges, node_keys)`; a node's keys are paged in their
    given order. The walk stops at the first block that does not fit in what is left of
    `budget_bytes`; that block and every later one are reported as skipped (`"budget"`).
    Blocking (store calls): run it on the store's thread pool.
    """
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0 (got {budget_bytes!r})")
    scores = pagerank(edges, node_keys.keys(), damping=damping)
    order = rank_order(scores)
    result = PageInResult(budget_bytes, ranking=[(node, scores[node]) for node in order])
    top = scores[order[0]] if order else 0.0
    full = False
    for node in order:
        importance = min(1.0, scores[node] / top) if top > 0.0 else 0.0
        for key in node_keys.get(node, ()):
            if full:
                result.skipped.append(SkippedBlock(node, key, "budget", store.size(ns, key)))
                continue
            size = store.size(ns, key)
            if size is None:
                result.skipped.append(SkippedBlock(node, key, "absent", None))
                continue
            if result.used_bytes + size > budget_bytes:
                full = True
                result.skipped.append(SkippedBlock(node, key, "budget", size))
                continue
            # Importance first, so the promotion's own evictions already see it.
            if not (store.set_importance(ns, key, importance) and store.promote(ns, key)):
                result.skipped.append(SkippedBlock(node, key, "absent", None))  # deleted since
                continue
            result.used_bytes += size
            result.paged.append(PagedBlock(node, key, size, importance))
    return result
