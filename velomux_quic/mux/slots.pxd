# cython: language_level=3
"""The C declarations of :mod:`velomux_quic.mux.slots` where it is compiled (see
velomux_quic.recordpath): an egress slot's fields, which the compiled batcher's offer and
packing loops (``egress.pxd``) cimport and read and write per record in C."""


cdef class EgressSlot:
    cdef public object anchor_id
    cdef public Py_ssize_t budget
    cdef public long long credit
    cdef public bint exhausted_once
    cdef public bint fenced
    cdef public int generation
    cdef public object guard
    cdef readonly Py_ssize_t index
    cdef public unsigned long long next_seq
    cdef public object owner
    cdef readonly object queue
    cdef public Py_ssize_t queued_bytes
    cdef public int reserve
    cdef public object session_id
    cdef public Py_ssize_t slot_id
    cdef public object state
    cdef bint _in_ready
    cdef object _append
    cdef object _popleft
