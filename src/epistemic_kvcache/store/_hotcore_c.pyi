# The compiled twin (Cython) of store/hotcore.py has exactly the API of the pure one: it
# is the same source compiled (setup.py). mypy and the tests see that one API.
from epistemic_kvcache.store.hotcore import DECLINED as DECLINED
from epistemic_kvcache.store.hotcore import DIGEST_BYTES as DIGEST_BYTES
from epistemic_kvcache.store.hotcore import HotCore as HotCore
from epistemic_kvcache.store.hotcore import _Blob as _Blob
from epistemic_kvcache.store.hotcore import _Counters as _Counters
