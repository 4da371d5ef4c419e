"""Which `RespParser` runs: the compiled twin when it was built, else the pure one.

How it works
------------
`RespParser` has two twins with one source: proto/resp_parser.py is the pure-Python
reference, and proto/_resp_parser_c is that same file compiled by Cython (setup.py;
proto/_resp_parser_c.pxd adds C types for its hot attributes and locals). At import this
module takes the compiled one when it imports, else the pure one; setting
`EPISTEMIC_GRAPH_KVCACHE_PURE_PYTHON=1` forces the pure one. `IMPLEMENTATION` says which
runs ("compiled" or "pure"), `WHY_PURE` why the compiled one does not ("" when it does).
Both frame the same commands and raise the same errors
(tests/test_proto_resp_twins.py); the events and argument types they hand out
(`NEED_DATA`, `RefusedCommand`) are shared (proto/resp_types.py).
"""

from __future__ import annotations

from epistemic_kvcache.proto import resp_parser as pure
from epistemic_kvcache.twins import PURE_PYTHON_ENV, select

__all__ = ["IMPLEMENTATION", "PURE_PYTHON_ENV", "WHY_PURE", "RespParser", "pure"]


def _select() -> tuple[type[pure.RespParser], str, str]:
    compiled, why = select("resp_framer", "epistemic_kvcache.proto._resp_parser_c", pure.__name__)
    if compiled is None:
        return pure.RespParser, "pure", why
    return compiled.RespParser, "compiled", ""


RespParser, IMPLEMENTATION, WHY_PURE = _select()
