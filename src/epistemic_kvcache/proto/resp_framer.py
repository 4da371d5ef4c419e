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

import os
from typing import Final

from epistemic_kvcache.proto import resp_parser as pure

__all__ = ["IMPLEMENTATION", "PURE_PYTHON_ENV", "WHY_PURE", "RespParser", "pure"]

PURE_PYTHON_ENV: Final = "EPISTEMIC_GRAPH_KVCACHE_PURE_PYTHON"
"""Set to anything but "" or "0" to run the pure-Python twin even when the compiled one
is built."""


def _select() -> tuple[type[pure.RespParser], str, str]:
    if os.environ.get(PURE_PYTHON_ENV, "") not in {"", "0"}:
        return pure.RespParser, "pure", f"{PURE_PYTHON_ENV} is set"
    try:
        from epistemic_kvcache.proto import _resp_parser_c as compiled
    except ImportError as exc:  # not built: no C compiler, or a pure wheel
        return pure.RespParser, "pure", f"the compiled twin is not built ({exc})"
    return compiled.RespParser, "compiled", ""


RespParser, IMPLEMENTATION, WHY_PURE = _select()
