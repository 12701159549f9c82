# cython: language_level=3
"""The C declarations of :mod:`velomux_quic.mux.batch_codec` where it is compiled (see
velomux_quic.recordpath): the builder's fields, the walk's positions as C integers, and
``at`` as a pointer into the batch. The compiled batcher (``egress.pxd``) cimports the
builder and :func:`_append_data` from here; the append is ``cpdef`` so that the batcher's
source imports it by name as well, where either module runs as plain Python."""

cimport cython
from libc.stdint cimport uint32_t

# A received batch's bytes, read in place; a batch being built, written in place.
ctypedef const unsigned char* batch_bytes
ctypedef unsigned char* batch_buffer

cdef Py_ssize_t _batch_header_size
cdef Py_ssize_t _record_header_size
cdef Py_ssize_t _max_records
cdef long long _u32_max
cdef bytes _DATA_HEADER
cdef bytes _CREDIT_TEMPLATE
cdef int _CREDIT_RECORD_TYPE
cdef Py_ssize_t _CREDIT_BODY_SIZE


@cython.locals(high=uint32_t)
cdef uint32_t _u32_at(batch_bytes at, Py_ssize_t index) noexcept

cdef void _put_u32(batch_buffer at, Py_ssize_t index, uint32_t value) noexcept

@cython.locals(data=bytes, length=Py_ssize_t, start=Py_ssize_t, at=batch_buffer)
cpdef int _append_data(bytearray buf, long long slot, long long seq, object body) except -1

@cython.locals(start=Py_ssize_t, at=batch_buffer)
cdef int _append_credit(bytearray buf, uint32_t slot, uint32_t delta) except -1

@cython.locals(
    at=batch_bytes, end=Py_ssize_t, pos=Py_ssize_t, _index=Py_ssize_t, start=Py_ssize_t,
    stop=Py_ssize_t, record_type=int, records=list,
)
cpdef list _owned_records(bytes raw, Py_ssize_t count)


cdef class BatchBuilder:
    cdef bytearray _buf
    cdef Py_ssize_t _cap
    cdef Py_ssize_t _count

    # The calls the batcher makes for a record off its common path (a terminal, a full
    # batch, a singleton), as C calls from the compiled batcher.
    cpdef bint fits(self, Py_ssize_t body_len)
    @cython.locals(length=Py_ssize_t, start=Py_ssize_t, buf=bytearray)
    cpdef add(self, object record_type, object slot, object frame_seq, object body)
    cpdef add_data(self, object slot, object frame_seq, object body)
