"""Which twin of a compiled module runs: the compiled one when it was built, else the pure one.

How it works
------------
A module with a compiled twin has one source: the pure-Python file is the reference,
and Cython compiles that same file into an extension module (setup.py; a `.pxd` beside it
adds C types). `select` imports the extension when it was built and
`EPISTEMIC_GRAPH_KVCACHE_PURE_PYTHON` does not name the twin; the caller falls back to the
pure module otherwise and says why. Today's twins, by name: `resp_framer`
(proto/resp_framer.py, the RESP framer), `store_core` (store/core.py, the store's
records and hit paths) and `fast_path` (server/resp/fast.py, RESP's inline dispatcher).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Final

__all__ = ["PURE_PYTHON_ENV", "TWIN_NAMES", "forced_pure", "select"]

PURE_PYTHON_ENV: Final = "EPISTEMIC_GRAPH_KVCACHE_PURE_PYTHON"
"""`1` (or anything else but "" or "0") runs every pure-Python twin even when the compiled
ones are built; a comma-separated list of twin names (`resp_framer`, `store_core`,
`fast_path`) runs only those pure."""

TWIN_NAMES: Final = ("resp_framer", "store_core", "fast_path")


def forced_pure(name: str) -> bool:
    """Whether `PURE_PYTHON_ENV` asks for the pure twin `name`."""
    value = os.environ.get(PURE_PYTHON_ENV, "").strip()
    if value in {"", "0"}:
        return False
    names = {n.strip() for n in value.split(",")}
    return name in names or not names & set(TWIN_NAMES)


def select(name: str, compiled: str) -> tuple[ModuleType | None, str]:
    """(the compiled module, "") when it runs; (None, why not) when the pure one does.
    `name`: the twin's name in `PURE_PYTHON_ENV`."""
    if forced_pure(name):
        return None, f"{PURE_PYTHON_ENV} is set"
    try:
        return importlib.import_module(compiled), ""
    except ImportError as exc:  # not built: no C compiler, or a pure wheel
        return None, f"the compiled twin is not built ({exc})"
