"""Which twin of the RESP fast path (`run_fast`) runs: the compiled one when it was built,
else the pure one.

How it works
------------
server/resp/fastpath.py (`run_fast`, the one inline dispatcher of GET, SET, EXISTS and
STRLEN) has two twins with one source: the file itself is the pure-Python reference, and
server/resp/_fastpath_c is that file compiled by Cython (setup.py, with the C types of
server/resp/_fastpath_c.pxd). At import this module takes the compiled one when it
imports, else the pure one; `EPISTEMIC_GRAPH_KVCACHE_PURE_PYTHON=1` (or `=fast_path`)
forces the pure one (twins.py). `IMPLEMENTATION` says which runs ("compiled" or "pure"),
`WHY_PURE` why the compiled one does not ("" when it does). `Dispatcher.run_fast` is the
`run_fast` picked here.
"""

from __future__ import annotations

from epistemic_kvcache.server.resp import fastpath as pure
from epistemic_kvcache.twins import select

__all__ = ["IMPLEMENTATION", "WHY_PURE", "pure", "run_fast"]

_compiled, WHY_PURE = select(
    "fast_path", "epistemic_kvcache.server.resp._fastpath_c", pure.__name__
)
IMPLEMENTATION = "pure" if _compiled is None else "compiled"
run_fast = pure.run_fast if _compiled is None else _compiled.run_fast
