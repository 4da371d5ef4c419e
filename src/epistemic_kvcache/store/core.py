"""Which twin of the store's hot core runs: the compiled one when it was built, else the pure.

How it works
------------
store/hotcore.py (the blob and counter records, and `HotCore`, the engine's hit paths)
has two twins with one source: the file itself is the pure-Python reference, and
store/_hotcore_c is that file compiled by Cython (setup.py, with the C types of
store/_hotcore_c.pxd). At import this module takes the compiled one when it imports,
else the pure one; `EPISTEMIC_GRAPH_KVCACHE_PURE_PYTHON=1` forces the pure one (twins.py).
`IMPLEMENTATION` says which runs ("compiled" or "pure"), `WHY_PURE` why the compiled one
does not ("" when it does). Every module of the store takes these names from here, so one
process never mixes the twins' records.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from epistemic_kvcache.store import hotcore as pure
from epistemic_kvcache.twins import select

__all__ = ["DECLINED", "IMPLEMENTATION", "WHY_PURE", "HotCore", "_Blob", "_Counters", "pure"]

_compiled, WHY_PURE = select("store_core", "epistemic_kvcache.store._hotcore_c", pure.__name__)
IMPLEMENTATION = "pure" if _compiled is None else "compiled"
DECLINED = pure.DECLINED

if TYPE_CHECKING:  # both twins have the pure one's API (store/_hotcore_c.pyi)
    from epistemic_kvcache.store.hotcore import HotCore, _Blob, _Counters
else:
    _twin = pure if _compiled is None else _compiled
    HotCore = _twin.HotCore
    _Blob = _twin._Blob
    _Counters = _twin._Counters
