# C types for the compiled twin of proto/resp_parser.py (Cython "pure Python mode").
#
# setup.py compiles resp_parser.py, unchanged, as the extension module
# epistemic_kvcache.proto._resp_parser_c; Cython reads this file beside it and gives the
# parser's hot attributes and the framer's locals C types. Nothing here changes what the
# code does: the pure-Python reference and this twin run the same statements
# (tests/test_proto_resp_twins.py holds them to the same commands and errors). What the
# framer calls off its fast path (Redis' limits and wording, the careful reading of a
# header, inline requests) is plain Python in proto/resp_rules.py and resp_inline.py.

cimport cython

cdef Py_ssize_t _START, _ARG_HEADER, _ARG_BODY, _BIG_BODY, _SKIP_BODY
cdef Py_ssize_t COMMAND_OVERHEAD, ARG_OVERHEAD, FIRST_READ_AFTER_BIG, _COMPACT_AT, _HEAD_DIGITS

cdef class RespParser:
    cdef public Py_ssize_t max_inline_bytes
    cdef public Py_ssize_t max_multibulk_len
    cdef public Py_ssize_t max_bulk_bytes
    cdef public Py_ssize_t unauthenticated_max_multibulk_len
    cdef public Py_ssize_t unauthenticated_max_bulk_bytes
    cdef public Py_ssize_t large_bulk_threshold
    cdef public bint authenticated
    cdef public object reserve
    cdef public Py_ssize_t held_bytes
    cdef public object max_ready
    cdef public Py_ssize_t commands_parsed

    cdef bytearray _buf
    cdef Py_ssize_t _pos
    cdef bint _shared_scratch
    cdef bytearray _scratch
    cdef bint _lent_big
    cdef bint _after_big
    cdef Py_ssize_t _state
    cdef list _args
    cdef Py_ssize_t _args_bytes
    cdef Py_ssize_t _args_left
    cdef Py_ssize_t _bulk_len
    cdef Py_ssize_t _args_held
    cdef Py_ssize_t _args_cost
    cdef object _big
    cdef object _big_room
    cdef Py_ssize_t _big_filled
    cdef bint _refused
    cdef str _refusal
    cdef Py_ssize_t _skip
    cdef object _ready
    cdef Py_ssize_t _ready_bytes
    cdef Py_ssize_t _ready_cost
    cdef object _error

    cpdef object next_command(self)

    @cython.locals(done=Py_ssize_t)
    cpdef buffer_updated(self, Py_ssize_t nbytes)

    @cython.locals(
        state=Py_ssize_t, left=Py_ssize_t, nbytes=Py_ssize_t, held=Py_ssize_t,
        length=Py_ssize_t, start=Py_ssize_t, stop=Py_ssize_t,
        max_line=Py_ssize_t, max_bulk=Py_ssize_t, small_max=Py_ssize_t,
        missing=Py_ssize_t, avail=Py_ssize_t, filled=Py_ssize_t, drop=Py_ssize_t,
        refused=bint, cost=Py_ssize_t, args=list,
        value=Py_ssize_t, after=Py_ssize_t,
    )
    cdef Py_ssize_t _frame(self, bytearray data, Py_ssize_t pos, Py_ssize_t end) except -1

    cdef _advance(self)

@cython.locals(i=Py_ssize_t, stop=Py_ssize_t, value=Py_ssize_t, c=Py_ssize_t, digits=Py_ssize_t)
cdef (Py_ssize_t, Py_ssize_t) _canonical_head(
    bytearray data, Py_ssize_t pos, Py_ssize_t end, Py_ssize_t marker, Py_ssize_t max_line
) except *
