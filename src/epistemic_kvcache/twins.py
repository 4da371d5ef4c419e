"""Which twin of a compiled module runs: the compiled one when it was built, else the pure one.

How it works
------------
A module with a compiled twin has one source: the pure-Python file is the reference,
and Cython compiles that same file into an extension module (setup.py; a `.pxd` beside it
adds C types). `select` imports the extension when it was built and
`EPISTEMIC_GRAPH_KVCACHE_PURE_PYTHON` does not name the twin; the caller falls back to the
pure module otherwise and says why. An extension carries the stamp of the sources it was
built from (`__twin_stamp__`, the SHA-256 of the `.py` and the `.pxd`, set by setup.py);
one whose stamp is not that of the sources installed beside it is stale (built from an
older source: it would run old code) and is not used. Today's twins, by name: `resp_framer`
(proto/resp_framer.py, the RESP framer), `store_core` (store/core.py, the store's
records and hit paths) and `fast_path` (server/resp/fast.py, RESP's inline dispatcher).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
from pathlib import Path
from types import ModuleType
from typing import Final

__all__ = [
    "PURE_BUILD_ENV",
    "PURE_PYTHON_ENV",
    "TWIN_NAMES",
    "forced_pure",
    "select",
    "source_stamp",
    "stale",
]

PURE_PYTHON_ENV: Final = "EPISTEMIC_GRAPH_KVCACHE_PURE_PYTHON"
"""`1` (or anything else but "" or "0") runs every pure-Python twin even when the compiled
ones are built; a comma-separated list of twin names (`resp_framer`, `store_core`,
`fast_path`) runs only those pure."""

TWIN_NAMES: Final = ("resp_framer", "store_core", "fast_path")

PURE_BUILD_ENV: Final = "EPISTEMIC_GRAPH_KVCACHE_PURE_BUILD"
"""Read by setup.py when the package is built: `1` builds no compiled twin (a pure wheel)."""


def forced_pure(name: str) -> bool:
    """Whether `PURE_PYTHON_ENV` asks for the pure twin `name`."""
    value = os.environ.get(PURE_PYTHON_ENV, "").strip()
    if value in {"", "0"}:
        return False
    names = {n.strip() for n in value.split(",")}
    return name in names or not names & set(TWIN_NAMES)


def source_stamp(source: bytes, pxd: bytes) -> str:
    """The stamp of a twin's sources: SHA-256 of the pure module's bytes, a NUL, and its
    `.pxd`'s bytes (setup.py computes the same when it builds the extension)."""
    return hashlib.sha256(source + b"\0" + pxd).hexdigest()


def sources_of(compiled: str, pure: str) -> tuple[Path, Path] | None:
    """The pure module's file and the `.pxd` beside it that the extension `compiled` is
    built from, or None when either is not installed."""
    spec = importlib.util.find_spec(pure)
    if spec is None or spec.origin is None:
        return None
    source = Path(spec.origin)
    pxd = source.with_name(compiled.rpartition(".")[2] + ".pxd")
    return (source, pxd) if source.is_file() and pxd.is_file() else None


def stale(module: ModuleType, pure: str) -> str:
    """Why the compiled `module` was not built from the sources of `pure` installed beside
    it ("" when it was, or when they are not there to compare)."""
    files = sources_of(module.__name__, pure)
    if files is None:
        return ""
    stamp = getattr(module, "__twin_stamp__", None)
    want = source_stamp(files[0].read_bytes(), files[1].read_bytes())
    if stamp == want:
        return ""
    return (
        f"the compiled twin is stale: built from other sources than {files[0].name} and "
        f"{files[1].name} (rebuild it: make compiled)"
    )


def select(name: str, compiled: str, pure: str) -> tuple[ModuleType | None, str]:
    """(the compiled module, "") when it runs; (None, why not) when the pure one does.
    `name`: the twin's name in `PURE_PYTHON_ENV`; `pure`: the module it is compiled
    from (its stamp is checked against that module's sources)."""
    if forced_pure(name):
        return None, f"{PURE_PYTHON_ENV} is set"
    try:
        module = importlib.import_module(compiled)
    except ImportError as exc:  # not built: no C compiler, or a pure wheel
        return None, f"the compiled twin is not built ({exc})"
    why = stale(module, pure)
    return (None, why) if why else (module, "")
