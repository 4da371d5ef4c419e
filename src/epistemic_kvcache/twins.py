"""Which twin of a compiled module runs: the compiled one when it was built, else the pure one.

How it works
------------
A module with a compiled twin has one source: the pure-Python file is the reference,
and Cython compiles that same file into an extension module (setup.py; a `.pxd` beside it
adds C types). `select` imports the extension when it was built and
`EPISTEMIC_GRAPH_KVCACHE_PURE_PYTHON` is unset; the caller falls back to the pure module
otherwise and says why. Today's twins: proto/resp_framer.py (the RESP framer) and
store/core.py (the store's records and hit paths).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Final

__all__ = ["PURE_PYTHON_ENV", "select"]

PURE_PYTHON_ENV: Final = "EPISTEMIC_GRAPH_KVCACHE_PURE_PYTHON"
"""Set to anything but "" or "0" to run the pure-Python twins even when the compiled ones
are built."""


def select(compiled: str) -> tuple[ModuleType | None, str]:
    """(the compiled module, "") when it runs; (None, why not) when the pure one does."""
    if os.environ.get(PURE_PYTHON_ENV, "") not in {"", "0"}:
        return None, f"{PURE_PYTHON_ENV} is set"
    try:
        return importlib.import_module(compiled), ""
    except ImportError as exc:  # not built: no C compiler, or a pure wheel
        return None, f"the compiled twin is not built ({exc})"
