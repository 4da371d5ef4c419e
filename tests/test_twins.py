"""Every compiled twin is selected where it should be (twins.py), for each twin alike: the
RESP framer (proto/resp_framer.py), the store's hot core (store/core.py) and RESP's inline
dispatcher (server/resp/fast.py).

Where a compiled twin is not built the checks that need it are skipped, except in CI,
which builds the twins and sets `KVCACHE_REQUIRE_COMPILED=1`: there a missing twin fails
`test_the_compiled_twin_runs_where_required`. CI runs this file again with
`EPISTEMIC_GRAPH_KVCACHE_PURE_PYTHON=1` (Makefile `PURE_AGAIN`): then the pure twins must
run, though the compiled ones are built. The differential tests of each pair are
tests/test_proto_resp_twins.py, tests/test_store_hotcore_twins.py and
tests/test_server_resp_fastpath_twins.py.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from epistemic_kvcache.twins import PURE_PYTHON_ENV, TWIN_NAMES, source_stamp, stale

REQUIRED = os.environ.get("KVCACHE_REQUIRE_COMPILED", "") == "1"

# (selector module, what it picks, pure source module, compiled module, its .pxd)
TWINS = [
    (
        "epistemic_kvcache.proto.resp_framer",
        "RespParser",
        "epistemic_kvcache.proto.resp_parser",
        "epistemic_kvcache.proto._resp_parser_c",
        "_resp_parser_c.pxd",
    ),
    (
        "epistemic_kvcache.store.core",
        "HotCore",
        "epistemic_kvcache.store.hotcore",
        "epistemic_kvcache.store._hotcore_c",
        "_hotcore_c.pxd",
    ),
    (
        "epistemic_kvcache.server.resp.fast",
        "run_fast",
        "epistemic_kvcache.server.resp.fastpath",
        "epistemic_kvcache.server.resp._fastpath_c",
        "_fastpath_c.pxd",
    ),
]
each_twin = pytest.mark.parametrize(
    ("selector", "name", "pure", "compiled", "pxd"), TWINS, ids=list(TWIN_NAMES)
)


def _compiled(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


@each_twin
def test_the_compiled_twin_runs_where_required(
    selector: str, name: str, pure: str, compiled: str, pxd: str
) -> None:
    """A silently missing or unselected compiled twin fails here in CI instead of passing
    the suite on the pure one."""
    if not REQUIRED:
        pytest.skip("KVCACHE_REQUIRE_COMPILED is not set")
    sel = importlib.import_module(selector)
    if os.environ.get(PURE_PYTHON_ENV, "") not in {"", "0"}:  # CI's pure pass
        assert sel.IMPLEMENTATION == "pure"
        assert getattr(sel, name) is getattr(importlib.import_module(pure), name)
        assert _compiled(compiled) is not None, "the compiled twin is not built"
        return
    assert sel.WHY_PURE == ""
    assert sel.IMPLEMENTATION == "compiled"
    assert getattr(sel, name).__module__ == compiled


def test_the_store_keeps_the_selected_twins_records() -> None:
    """Every blob and counter set the store makes is of the twin `store.core` picked."""
    from epistemic_kvcache.store import SharedKvIndex, core

    s = SharedKvIndex()
    s.put("t", "k", b"v")
    module = core.HotCore.__module__
    assert type(next(iter(s.ram.blob_list_locked()))).__module__ == module
    assert type(s.ram.total).__module__ == type(s.ram.counters_of("t")).__module__ == module


@each_twin
def test_the_environment_forces_the_pure_twin(
    selector: str, name: str, pure: str, compiled: str, pxd: str
) -> None:
    def implementation_in_child(value: str) -> str:
        code = f"import {selector} as s; print(s.IMPLEMENTATION)"
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, PURE_PYTHON_ENV: value},
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        return out.stdout.strip()

    assert implementation_in_child("1") == "pure"
    expected = "pure" if _compiled(compiled) is None else "compiled"
    assert implementation_in_child("0") == expected
    # by name: only the twins named run pure
    twin_name = TWIN_NAMES[[t[0] for t in TWINS].index(selector)]
    other = next(n for n in TWIN_NAMES if n != twin_name)
    assert implementation_in_child(twin_name) == "pure"
    assert implementation_in_child(f" {other} , {twin_name}") == "pure"
    assert implementation_in_child(other) == expected


@each_twin
def test_the_compiled_twin_is_stamped_with_the_current_sources(
    selector: str, name: str, pure: str, compiled: str, pxd: str
) -> None:
    """An extension carries the SHA-256 of the `.py` and `.pxd` it was built from
    (setup.py); it must be that of the sources installed beside it, else it runs old code
    (and `select` does not use it)."""
    mod = _compiled(compiled)
    if mod is None:
        pytest.skip("the compiled twin is not built (setup.py build_ext --inplace)")
    source = Path(str(importlib.import_module(pure).__file__))
    want = source_stamp(source.read_bytes(), source.with_name(pxd).read_bytes())
    assert getattr(mod, "__twin_stamp__", None) == want, (
        f"{compiled} was built from other sources: rebuild it (make compiled)"
    )
    assert stale(mod, pure) == ""


@each_twin
def test_a_stale_compiled_twin_is_not_used(
    selector: str, name: str, pure: str, compiled: str, pxd: str
) -> None:
    """An extension stamped with other sources' hash (built before its source or its
    `.pxd` changed), or with none (built before stamps), is stale: `stale` says so and
    names the rebuild. (A timestamp would not do: a stale build copied or checked out
    after its source has the newer mtime.)"""
    for stamp in ("0" * 64, None):
        old = ModuleType(compiled)
        if stamp is not None:
            old.__twin_stamp__ = stamp  # type: ignore[attr-defined]
        why = stale(old, pure)
        assert "the compiled twin is stale" in why
        assert "make compiled" in why
