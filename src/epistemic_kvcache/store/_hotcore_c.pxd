# C types for the compiled twin of store/hotcore.py (Cython "pure Python mode").
#
# setup.py compiles hotcore.py, unchanged, as the extension module
# epistemic_kvcache.store._hotcore_c; Cython reads this file beside it: a blob's and a
# counter set's numbers become C fields, and HotCore's locals C types. Nothing here changes
# what the code does: the pure-Python reference and this twin run the same statements
# (tests/test_store_hotcore_twins.py holds them to the same answers and books).

cimport cython

cdef class _Blob:
    cdef public bytes sdig
    cdef public Py_ssize_t size
    cdef public Py_ssize_t refs
    cdef public Py_ssize_t pins
    cdef public Py_ssize_t hits
    cdef public double importance
    cdef public object hot
    cdef public object warm
    cdef public Py_ssize_t seg
    cdef public Py_ssize_t off
    cdef public object owner
    cdef public object keys
    cdef public bint busy

cdef class _Counters:
    cdef public Py_ssize_t cold_blocks
    cdef public Py_ssize_t cold_bytes
    cdef public Py_ssize_t cold_peak
    cdef public Py_ssize_t dedup_hits
    cdef public Py_ssize_t demotions
    cdef public Py_ssize_t evictions
    cdef public Py_ssize_t get_hits
    cdef public Py_ssize_t get_misses
    cdef public Py_ssize_t hot_blocks
    cdef public Py_ssize_t hot_bytes
    cdef public Py_ssize_t hot_peak
    cdef public Py_ssize_t integrity_failures
    cdef public Py_ssize_t logical_bytes
    cdef public Py_ssize_t pinned_blocks
    cdef public Py_ssize_t pinned_bytes
    cdef public Py_ssize_t promotions
    cdef public Py_ssize_t put_conflicts
    cdef public Py_ssize_t put_new
    cdef public Py_ssize_t put_replaced
    cdef public Py_ssize_t resident_bytes
    cdef public Py_ssize_t stale_missed
    cdef public Py_ssize_t total_refs
    cdef public Py_ssize_t unique_blocks
    cdef public Py_ssize_t warm_blocks
    cdef public Py_ssize_t warm_bytes
    cdef public Py_ssize_t warm_logical
    cdef public Py_ssize_t warm_peak

cdef class HotCore:
    cdef public dict index
    cdef public dict blobs
    cdef public object move_hot
    cdef public dict by_ns
    cdef public _Counters total
    cdef public object lock
    cdef public dict tags
    cdef public dict valid_ns
    cdef public bint global_dedup
    cdef public Py_ssize_t max_block_bytes
    cdef public dict inflight

    @cython.locals(c=_Counters, b=_Blob, idx=dict, blobs=dict)
    cpdef object get(self, object ns, object key)

    @cython.locals(idx=dict, found=Py_ssize_t)
    cpdef Py_ssize_t exists(self, object ns, object keys) except? -2

    @cython.locals(c=_Counters, b=_Blob, idx=dict, size=Py_ssize_t, raw=bytes, digest=bytes, sdig=bytes)
    cpdef object put(self, object ns, object key, object data)
