"""The shape of src/epistemic_kvcache, checked on every run: no import circles (issue 25's
measure); no module over 650 lines, and the store's state has one owner: no store module
reads another object's private members (but the hot core's selector), and durable.py
stays under 500 lines (issue 42's measures).

How it works: grimp builds the import graph of the installed package (every import,
also those inside functions and under `if TYPE_CHECKING:`: a circle for the type checker
is still two modules that cannot be understood apart). The circles are the graph's
strongly connected components of more than one module (Tarjan's algorithm, iterative);
for each, the failure message names its modules and one shortest loop through them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import grimp

import epistemic_kvcache

PACKAGE = "epistemic_kvcache"
MAX_MODULE_LINES = 650
"""A module longer than this is split along a seam (h11's longest module is 659 lines)."""
MAX_STORE_PRIVATE_READS = 9
"""Reads of another object's private members in store/ (`x._y`, `x` not self or cls):
the hot core's selector reads its twin's two module-level names; nothing else may."""
MAX_DURABLE_LINES = 500


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the package it imports directly."""
    graph = grimp.build_graph(PACKAGE, cache_dir=None)  # no .grimp_cache left behind
    return {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The components of more than one module (Tarjan, without recursion), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def shortest_loop(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One shortest import loop through the component's first module (breadth first)."""
    start = component[0]
    members = set(component)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    loop = [node]
                    while loop[-1] != start:
                        loop.append(parent[loop[-1]])
                    return [*reversed(loop), start]
                if child not in parent:
                    parent[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{component} is not a circle")


def _short(module: str) -> str:
    return module.removeprefix(PACKAGE + ".")


def test_the_cycle_finder_finds_loops_and_only_loops() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}, "f": {"f"}}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert shortest_loop(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]


def test_no_import_circles_in_the_package() -> None:
    graph = import_graph()
    circles = strongly_connected(graph)
    described = [
        " -> ".join(_short(m) for m in shortest_loop(graph, c))
        + (f"  (component: {', '.join(_short(m) for m in c)})" if len(c) > 2 else "")
        for c in circles
    ]
    assert not circles, f"{len(circles)} import circle(s) in {PACKAGE}:\n" + "\n".join(described)


def test_no_module_over_650_lines() -> None:
    root = Path(epistemic_kvcache.__file__).parent
    sizes = {
        str(p.relative_to(root.parent)): len(p.read_text(encoding="utf-8").splitlines())
        for p in root.rglob("*.py")
    }
    over = sorted(((n, p) for p, n in sizes.items() if n > MAX_MODULE_LINES), reverse=True)
    assert not over, f"{len(over)} module(s) over {MAX_MODULE_LINES} lines:\n" + "\n".join(
        f"{n:6d}  {p}" for n, p in over
    )


def private_reads(source: str) -> list[tuple[int, str]]:
    """(line, expression) of every read of another object's private member: an attribute
    starting with one underscore, on anything but `self` or `cls`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__"):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        found.append((node.lineno, ast.unparse(node)))
    return found


def test_private_reads_are_counted() -> None:
    src = "self._a; cls._b; other._c; self._d._e; mod.__f__; x.y"
    assert [e for _n, e in private_reads(src)] == ["other._c", "self._d._e"]


def test_the_store_reads_no_other_objects_private_members() -> None:
    root = Path(epistemic_kvcache.__file__).parent / "store"
    reads = [
        f"{p.name}:{line}: {expr}"
        for p in sorted(root.glob("*.py"))
        for line, expr in private_reads(p.read_text(encoding="utf-8"))
    ]
    assert len(reads) <= MAX_STORE_PRIVATE_READS, "\n".join(reads)


def test_the_durable_backend_is_a_facade() -> None:
    path = Path(epistemic_kvcache.__file__).parent / "store" / "durable.py"
    n = len(path.read_text(encoding="utf-8").splitlines())
    assert n < MAX_DURABLE_LINES, f"store/durable.py has {n} lines"
