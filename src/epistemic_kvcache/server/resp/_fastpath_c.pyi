# The compiled twin (Cython) of server/resp/fastpath.py has exactly the API of the pure
# one: it is the same source compiled (setup.py). mypy and the tests see that one API.
from epistemic_kvcache.server.resp.fastpath import FAST_FLUSH_BYTES as FAST_FLUSH_BYTES
from epistemic_kvcache.server.resp.fastpath import FAST_NAMES as FAST_NAMES
from epistemic_kvcache.server.resp.fastpath import INLINE_MAX_COMMANDS as INLINE_MAX_COMMANDS
from epistemic_kvcache.server.resp.fastpath import MAX_PIPELINED_SETS as MAX_PIPELINED_SETS
from epistemic_kvcache.server.resp.fastpath import SMALL_REPLY as SMALL_REPLY
from epistemic_kvcache.server.resp.fastpath import fast_name as fast_name
from epistemic_kvcache.server.resp.fastpath import run_fast as run_fast
