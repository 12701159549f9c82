# cython: language_level=3
"""The C declarations of :mod:`velomux_quic.mux.arrival` where it is compiled (see
velomux_quic.recordpath): a route's fields as C fields, the loops' counters, record fields
and slots as C variables, and the slot's fields and calls (``credit.pxd``) read in C."""

cimport cython

from velomux_quic.mux.credit cimport DirtySet, IngressSlot

cdef int _DATA
cdef int _OPEN_SLOT
cdef int _CLOSE_SLOT
cdef int _SLOT_HEARTBEAT
cdef int _CREDIT_UPDATE
cdef Py_ssize_t _CREDIT_BODY_SIZE
cdef object _TERMINAL_SENT
cdef frozenset _OWNER_CLOSE_BYTES
cdef bytes _ITEM_PREFIX


@cython.final
cdef class _Route:
    cdef public object close_reason
    cdef public long long close_seq
    cdef public long long expected
    cdef public bint held_terminal
    cdef public dict hold
    cdef public long long hold_bytes
    cdef public Py_ssize_t index
    cdef public object session_id
    cdef public IngressSlot slot
    cdef public Py_ssize_t slot_id
    cdef public long long touched


@cython.locals(
    count=Py_ssize_t, stamp=cython.longlong, touched=list, routes=list, data_type=int,
    item_prefix=bytes, record_type=int, sid=Py_ssize_t, seq=cython.longlong, route=_Route,
    slot=IngressSlot, data=bytes, grants=list,
)
cpdef handle_batch(object table, object header, object records, object now)

@cython.locals(slot=IngressSlot, grant=Py_ssize_t)
cpdef visit(object table, _Route route)

@cython.locals(routes=list, route=_Route, slot=IngressSlot, index=Py_ssize_t)
cpdef reconcile(object table, list touched)

@cython.locals(dirty=DirtySet, listed=list, routes=list, size=Py_ssize_t, index=Py_ssize_t,
               route=_Route)
cpdef Py_ssize_t reconcile_dirty(object table) except -1
