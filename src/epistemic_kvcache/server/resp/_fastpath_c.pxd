# C types for the compiled twin of server/resp/fastpath.py (Cython "pure Python mode").
#
# setup.py compiles fastpath.py, unchanged, as the extension module
# epistemic_kvcache.server.resp._fastpath_c; Cython reads this file beside it and gives
# `run_fast`'s counters, clock readings and flags C types. Nothing here changes what the
# code does: the pure-Python reference and this twin run the same statements
# (tests/test_server_resp_fastpath_twins.py holds them to the same replies and books).

cimport cython

@cython.locals(
    taken=Py_ssize_t, queued=Py_ssize_t, calls=Py_ssize_t, failures=Py_ssize_t,
    total=Py_ssize_t, argc=Py_ssize_t, seconds=double, mark=double, t1=double,
    plain=bint, failed=bint, more=bint, out=list, started=list, series=dict,
    route=str, route_now=str, head=bytes,
)
cpdef Py_ssize_t run_fast(self, write, Py_ssize_t limit=*, t0=*) except? -1
